// Per-family rules behind KernelSpec::validate(), default_spec(), render() and kernel_layout(). One
// rules object per family, defined in src/families/<family>.cpp and listed in render.cpp's table.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "flashjit/codegen/kernel_spec.hpp"
#include "flashjit/codegen/render.hpp"

namespace flashjit::codegen_detail {

struct EntryPoint {
  std::string_view name;             // the runtime launches it by this name; symbol flashjit_<family>_<name>
  std::string_view params_type;      // C++ type of its single by-value parameter
  std::string_view device_function;  // template function in the family header, over Config
  bool grid_constant = false;        // parameter declared __grid_constant__ (holds TMA maps)
  // The Config constant (one of the rules' constants) holding its dynamic shared memory; "": none.
  std::string_view smem_constant = {};
  // The Config constant holding the most CTAs along x one thread-block cluster of it may hold (the
  // runtime may launch it in clusters of up to that many); "": never launched in clusters.
  std::string_view cluster_constant = {};
};

struct FamilyRules {
  Family family;
  std::string_view name;
  std::string_view template_include;  // path inside templates/
  bool computes_gradients = false;    // a backward family (dQ, dK, dV); else a forward one (O, LSE)
  std::vector<EntryPoint> entries;
  int min_sm = 80;
  bool needs_arch_specific = false;   // sm_90a-only instructions
  std::vector<int> head_dims;         // kernel head dims this family is written for

  // Checks of the tile fields (block_m, block_n, warps, stages) beyond the generic ones.
  std::optional<std::string> (*validate_tiles)(const KernelSpec&);
  // Fills the tile fields of a spec whose family, arch, dtype, head_dim and mask are set.
  void (*set_default_tiles)(KernelSpec&);
  int (*threads)(const KernelSpec&);
  // The facts the host computes for a spec (shared-memory bytes, register split, tile shapes of
  // secondary entries, workspace strides), rendered into Config, where the template checks its own
  // layout against them with static_assert, and read by the runtime to launch the spec.
  std::vector<KernelConstant> (*constants)(const KernelSpec&);
  // Extra members of the rendered Config that are not integers (the wgmma wrappers of the spec's
  // shapes); null: none.
  std::string (*config_members)(const KernelSpec&) = nullptr;
  // The CTAs per SM the registers must leave room for (__launch_bounds__' second argument); null: 1.
  int (*min_blocks_per_sm)(const KernelSpec&) = nullptr;
  bool takes_modifiers = false;   // renders a spec's AttentionModifier into its Config
  bool takes_block_mask = false;  // walks block-mask lists where the spec is block_sparse
  bool takes_continuation = false;  // merges into a running fp32 (O, LSE) where the spec continues
  bool takes_seqused = false;       // reads VarlenBatch::seqused_q/k (the other families' kernels skip
                                    // that load: a register more spilled fa2's widest)
  bool takes_tail_splits = false;   // splits its schedule's last tiles over keys where the spec has tail_splits
  bool takes_fp8 = false;           // has kernels for DType::e4m3 (FP8 inputs, bf16 output)
  bool takes_ordered_dq = false;    // adds dQ in a fixed order of key tiles where the spec has ordered_dq
};

// The family table, in the order of the Family enum (src/render.cpp).
const std::vector<const FamilyRules*>& all_family_rules();
const FamilyRules& family_rules(Family family);

}  // namespace flashjit::codegen_detail
