// KernelSpec: every compile-time choice of one kernel. It is the content of the cache key, so two
// equal specs always render the same source, and anything that changes the source is a field here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "flashjit/codegen/modifier.hpp"

namespace flashjit {

// One template file in templates/ per family.
enum class Family {
  reference_fwd,  // fp32-math oracle: one query row per warp, for shapes too big for the CPU
  fa2_fwd,        // FlashAttention-2 forward, mma.sync, sm_80+
  fa2_bwd,        // FlashAttention-2 backward (dQ, dK, dV), mma.sync, sm_80+
  sm90_fwd,       // Hopper forward: TMA, mbarriers, wgmma, warp specialisation (sm_90a)
  sm90_bwd,       // Hopper backward: fa2_bwd's algorithm on TMA and wgmma (sm_90a)
  kvcache_fwd,    // attention over a (paged) KV cache, split over keys: decode, mma.sync, sm_80+
  block_mask,     // a block mask (FlexAttention's lists) from a mask modifier or a dense tile map, sm_80+
};

// e4m3: FP8 inputs (q, k, v as PyTorch's float8_e4m3fn) with descale factors and a bf16 output,
// on families that take FP8 (sm90_fwd).
enum class DType { fp16, bf16, e4m3 };

// Which keys a query may see. `window` covers any (left, right) band, causal-with-window included;
// the band's widths are runtime values. Bottom-right aligned when seqlen_q != seqlen_k.
enum class MaskKind { none, causal, window };

// A compile target: sm_80, sm_86, sm_89, sm_90, sm_90a, ... `arch_specific` is the `a` suffix that
// unlocks wgmma and setmaxnreg on sm_90a.
struct Arch {
  int sm = 80;
  bool arch_specific = false;

  static Arch parse(std::string_view text);  // "sm_90a"; throws Error(invalid_argument)
  std::string name() const;                  // "sm_90a"
  int major() const { return sm / 10; }
  bool operator==(const Arch& o) const { return sm == o.sm && arch_specific == o.arch_specific; }
  bool operator!=(const Arch& o) const { return !(*this == o); }
};

struct KernelSpec {
  Family family = Family::reference_fwd;
  Arch arch;
  DType dtype = DType::bf16;
  int head_dim = 128;  // the kernel's head dim; a problem's head dim is rounded up to it
  int block_m = 4;     // query rows per CTA
  int block_n = 32;    // keys per inner-loop tile
  int num_warps = 4;
  int num_stages = 1;  // K/V shared-memory pipeline depth
  MaskKind mask = MaskKind::none;
  bool has_softcap = false;
  // User mask/score code compiled in (null: none); shared, as specs are copied on every call.
  std::shared_ptr<const AttentionModifier> modifier;
  // The key tiles come from a block mask's lists (FlexAttention's kv_num_blocks/kv_indices and their
  // full_* twins) instead of the whole key range.
  bool block_sparse = false;
  // The forward continues a running result (ring attention's steps): it merges its rows' O and LSE
  // into an fp32 state by the logsumexp rule, and writes the state or, on the last step, the output.
  bool continues = false;
  // The backward adds each query block's dQ in a fixed order of key tiles (sm90_bwd's deterministic
  // mode), compiled in so that the atomic kernels keep their code.
  bool ordered_dq = false;
  // The persistent forward may split its last round's tiles over keys and merge the items
  // (AttentionOptions::num_splits). Dispatch splits unmasked tails by itself, so a spec of a family
  // that splits has them where its mask is none and no block mask (default_tail_splits); a masked
  // call asks for them with num_splits > 1. Without them sm90_fwd is a quarter less code to compile.
  bool tail_splits = false;
  // FP8 sm90_fwd: V comes transposed from global memory (a pass before the forward writes V^T with
  // the keys permuted as P's registers hold them, and TMA loads it), instead of being transposed in
  // shared memory by the producer warpgroup's three spare warps.
  bool v_pretransposed = false;

  bool has_mask_modifier() const { return modifier != nullptr && modifier->has_mask(); }
  bool has_score_modifier() const { return modifier != nullptr && modifier->has_score(); }

  // The reason this spec cannot be compiled, or nullopt when it is legal.
  std::optional<std::string> validate() const;
  // Readable, unique and stable across versions: fa2_fwd_bf16_d128_m128n64w4s2_causal_sm80 (a
  // modifier adds _mod<its hash>, a block mask _sparse, a continuation _cont, ordered dQ adds
  // _ordered, tail splits other than the default _split or _nosplit, V transposed beforehand _vt).
  std::string name() const;

  nlohmann::json to_json() const;
  // Strict: every field required (but "modifier", "block_sparse", "continues", "ordered_dq",
  // "tail_splits" and "v_pretransposed", absent in plain specs: tail_splits is then its default),
  // unknown fields and bad values rejected with Error(invalid_argument).
  static KernelSpec from_json(const nlohmann::json& j);

  bool operator==(const KernelSpec& o) const;
  bool operator!=(const KernelSpec& o) const { return !(*this == o); }
};

struct KernelSpecHash {
  size_t operator()(const KernelSpec& s) const noexcept;
};

// The spec a family uses when nothing better is known (no tuning DB entry, no heuristic rule).
KernelSpec default_spec(Family family, Arch arch, DType dtype, int head_dim,
                        MaskKind mask = MaskKind::none, bool has_softcap = false,
                        std::shared_ptr<const AttentionModifier> modifier = nullptr, bool block_sparse = false);

// Enum <-> text, used by names, JSON and the CLIs. The parsers throw Error(invalid_argument).
std::string_view to_string(Family f);
std::string_view to_string(DType d);
// Bytes of one q, k or v element of `d` (the output is 16-bit for every dtype).
int element_bytes(DType d);
std::string_view to_string(MaskKind m);
Family parse_family(std::string_view text);
DType parse_dtype(std::string_view text);
MaskKind parse_mask(std::string_view text);
const std::vector<Family>& all_families();
// Forward families compute O (and LSE); fa2_bwd computes gradients.
bool is_forward_family(Family family);
// Whether `family` compiles user modifiers in, and walks block-mask lists.
bool family_takes_modifiers(Family family);
bool family_takes_block_mask(Family family);
// Whether `family` continues running results (KernelSpec::continues).
bool family_takes_continuation(Family family);
// Whether `family` orders its dQ adds where the spec asks (KernelSpec::ordered_dq).
bool family_takes_ordered_dq(Family family);
// Whether `family` splits tails (KernelSpec::tail_splits), and whether a spec of it does by default.
bool family_takes_tail_splits(Family family);
bool default_tail_splits(Family family, MaskKind mask, bool block_sparse);
// Whether `family` has FP8 (DType::e4m3) kernels.
bool family_takes_fp8(Family family);
// Whether `family`'s kernels read a varlen batch's seqused_q/seqused_k.
bool family_takes_seqused(Family family);
// Whether `family` has kernels for this arch and kernel head dim (its arch floor, the 'a' suffix
// where it needs one, and its list of head dims); tile fields aside.
bool family_covers(Family family, const Arch& arch, int head_dim);
// The smallest kernel head dim of `family` that holds a problem's `head_dim`; none above its largest.
std::optional<int> family_kernel_head_dim(Family family, int head_dim);

}  // namespace flashjit
