"""FlashAttention-4's masked path for bench/masks.py: the same masks as CuTe-DSL mask_mod functions
with block sparsity from FlexAttention's block mask. Imported only where flash-attn-4 is installed
(../shared/peers/fa4); its mask_mod signature is (batch, head, q_idx, kv_idx, seqlen_info,
aux_tensors), each index a one-element TensorSSA."""
import cutlass
import cutlass.cute as cute
from flash_attn.cute import flash_attn_func as fa4_attention
from flash_attn.cute import utils
from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch


def _constant(value):
    return utils.scalar_to_ssa(value, cutlass.Int32)


@cute.jit
def _causal(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
    return q_idx >= kv_idx


@cute.jit
def _document(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
    doc = aux_tensors[0]
    q_doc = utils.scalar_to_ssa(doc[q_idx[0]], cutlass.Int32)
    kv_doc = utils.scalar_to_ssa(doc[kv_idx[0]], cutlass.Int32)
    return (q_doc == kv_doc) & (q_idx >= kv_idx)


def _prefix_lm(prefix):
    @cute.jit
    def mask(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
        return (kv_idx < _constant(prefix)) | (q_idx >= kv_idx)
    return mask


def _sliding_window(window):
    @cute.jit
    def mask(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < _constant(window))
    return mask


def mask_mod(name, prefix, window):
    return {"causal": _causal, "document": _document, "prefix_lm": _prefix_lm(prefix),
            "sliding_window": _sliding_window(window)}[name]


def sparse_tensors(flex_mask):
    """FlexAttention's block mask as FA4's forward and backward block-sparse tensors."""
    block = tuple(flex_mask.BLOCK_SIZE) if not isinstance(flex_mask.BLOCK_SIZE, int) else (flex_mask.BLOCK_SIZE,) * 2
    forward = BlockSparseTensorsTorch(flex_mask.kv_num_blocks, flex_mask.kv_indices, flex_mask.full_kv_num_blocks,
                                      flex_mask.full_kv_indices, block_size=block)
    backward = BlockSparseTensorsTorch(flex_mask.q_num_blocks, flex_mask.q_indices, flex_mask.full_q_num_blocks,
                                       flex_mask.full_q_indices, block_size=block)
    return forward, backward


def attention(q, k, v, name, flex_mask, doc, prefix, window):
    """(batch, seqlen, heads, head_dim) tensors; returns out."""
    forward, backward = sparse_tensors(flex_mask)
    out = fa4_attention(q, k, v, mask_mod=mask_mod(name, prefix, window), aux_tensors=[doc] if name == "document" else None,
                        block_sparse_tensors=forward, block_sparse_tensors_bwd=backward)
    return out[0] if isinstance(out, tuple) else out
