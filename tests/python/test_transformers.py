"""flashjit as a Transformers attention implementation ("fjit", flashjit.integrations.transformers)
on small models built from configs (random weights, nothing downloaded): logits, loss and gradients
against an fp32 reference, no further from it than the better bf16 peer (SDPA, eager) is, and greedy
generation through the KV cache. Padded batches run through the varlen kernels."""
import copy
import math
import os
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
import flashjit.integrations.transformers as flashjit_transformers  # noqa: E402

flashjit_transformers.register()

VOCAB = 512
# (Weights at 0.1 rather than 0.02 spread the logits (std about 1.6), so that greedy choices are clear
# beside bf16's error.)


def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1))


def mistral():  # a sliding window of 24 keys, shorter than the sequences
    return transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=256, sliding_window=24, initializer_range=0.1))


def gemma2():  # softcap, and sliding and full layers alternating
    return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=256, sliding_window=24,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=64,
        initializer_range=0.1))


PEERS = ("sdpa", "eager")


def variants(build):
    """The fp32 reference, the bf16 peers and bf16 flashjit: one set of random weights."""
    torch.manual_seed(0)
    base = build().eval()
    models = {}
    for name, attn, dtype in (("reference", "eager", torch.float32), ("sdpa", "sdpa", torch.bfloat16),
                              ("eager", "eager", torch.bfloat16),
                              ("flashjit", flashjit_transformers.NAME, torch.bfloat16)):
        model = copy.deepcopy(base).to("cuda", dtype)
        model.set_attn_implementation(attn)
        models[name] = model
    return models


def peer_error(errors):
    """The better bf16 peer's error, of those that are finite (SDPA's gradients are NaN wherever a
    padding row sees no key; it has no softcap either)."""
    finite = [e for e in errors if math.isfinite(e)]
    assert finite, "no bf16 peer gave a finite result"
    return min(finite)


def batch(lengths, total, left_padding=True):
    torch.manual_seed(1)
    ids = torch.randint(1, VOCAB, (len(lengths), total), device="cuda")
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        if left_padding:
            mask[row, total - n:] = 1
        else:
            mask[row, :n] = 1
    ids = ids * mask  # (padding token 0)
    return ids, mask


def error(got, want, where):
    return (got.float() - want.float())[where].abs().max().item()


@pytest.mark.parametrize("build", [llama, mistral, gemma2], ids=["llama", "mistral", "gemma2"])
@pytest.mark.parametrize("padding", ["none", "left", "right"])
def test_logits_loss_and_gradients(build, padding):
    models = variants(build)
    lengths = [64, 64, 64] if padding == "none" else [64, 41, 7]
    ids, mask = batch(lengths, 64, left_padding=padding == "left")
    # Labels on real tokens whose predecessor is real too: with left padding the first token's label
    # would otherwise score a padding row's output, which FlashAttention leaves 0 and SDPA does not.
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 1:].masked_fill_(mask[:, :-1] == 0, -100)
    real = mask.bool()
    out = {}
    for name, model in models.items():
        model.zero_grad()
        result = model(input_ids=ids, attention_mask=None if padding == "none" else mask, labels=labels)
        result.loss.backward()
        grads = {n: p.grad.float().clone() for n, p in model.named_parameters()
                 if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"))}
        out[name] = (result.logits.detach(), result.loss.item(), grads)
    ref_logits, ref_loss, ref_grads = out["reference"]
    fj_logits, fj_loss, fj_grads = out["flashjit"]
    assert torch.isfinite(fj_logits[real]).all()
    # As close to fp32 as the better bf16 peer is (twice its error, and a floor where it is exact).
    logits_bound = 2 * peer_error([error(out[p][0], ref_logits, real) for p in PEERS]) + 2e-2
    assert error(fj_logits, ref_logits, real) <= logits_bound
    assert abs(fj_loss - ref_loss) <= 2 * peer_error([abs(out[p][1] - ref_loss) for p in PEERS]) + 2e-3
    for n, want in ref_grads.items():
        scale = want.norm().item()
        fj_err = (fj_grads[n] - want).norm().item() / scale
        peer_err = peer_error([(out[p][2][n] - want).norm().item() / scale for p in PEERS])
        assert fj_err <= 2 * peer_err + 1e-2, f"{n}: relative error {fj_err:.4f}, the better peer's {peer_err:.4f}"


@pytest.mark.parametrize("build", [llama, gemma2], ids=["llama", "gemma2"])
def test_greedy_generation_through_the_kv_cache(build):
    models = variants(build)
    ids, mask = batch([20, 33, 9], 33, left_padding=True)
    new = 10
    generated = {}
    with torch.no_grad():
        for name in ("sdpa", "flashjit"):
            generated[name] = models[name].generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                                                    do_sample=False, pad_token_id=0)
        # Each token flashjit chose is the fp32 model's choice there, but for near-ties: teacher-forced
        # over flashjit's own sequences, its logit is within 0.1 of the best.
        sequences = generated["flashjit"]
        full_mask = torch.cat([mask, torch.ones_like(sequences[:, ids.shape[1]:])], dim=1)
        logits = models["reference"](input_ids=sequences, attention_mask=full_mask).logits.float()
    steps = logits[:, ids.shape[1] - 1:-1]  # the logits that chose each new token
    chosen = steps.gather(-1, sequences[:, ids.shape[1]:, None])[..., 0]
    best = steps.max(dim=-1).values
    assert (chosen >= best - 0.1).all()
    # The first new token is SDPA's wherever the choice is clear (fp32 top two 0.2 apart).
    top2 = steps[:, 0].topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 0.2
    first = ids.shape[1]
    assert clear.any()
    assert torch.equal(generated["flashjit"][clear, first], generated["sdpa"][clear, first])


def test_register_makes_the_name_known_and_refuses_what_it_lacks():
    model = llama().to("cuda", torch.bfloat16)
    model.set_attn_implementation("fjit")
    assert model.config._attn_implementation == "fjit"
    module = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 8, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="dropout"):
        flashjit_transformers.attention_forward(module, q, q[:, :2], q[:, :2], None, dropout=0.1)
    with pytest.raises(NotImplementedError, match="sinks"):
        flashjit_transformers.attention_forward(module, q, q[:, :2], q[:, :2], None, s_aux=torch.zeros(4))


def test_packed_sequences_match_separate_calls():
    # Padding-free training: three sequences in one row, delimited by position_ids that restart at 0,
    # attend within themselves only.
    torch.manual_seed(2)
    module = llama().model.layers[0].self_attn
    lengths = [30, 5, 29]
    q, k, v = (torch.randn(1, heads, 64, 64, device="cuda", dtype=torch.bfloat16) for heads in (4, 2, 2))
    position_ids = torch.cat([torch.arange(n, device="cuda") for n in lengths])[None]
    packed, _ = flashjit_transformers.attention_forward(module, q, k, v, None, position_ids=position_ids)
    start = 0
    for n in lengths:
        part, _ = flashjit_transformers.attention_forward(module, q[:, :, start:start + n], k[:, :, start:start + n],
                                                          v[:, :, start:start + n], None)
        torch.testing.assert_close(packed[:, start:start + n], part, atol=1e-2, rtol=0)
        start += n
