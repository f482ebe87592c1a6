// Per-family rules behind KernelSpec::validate(), default_spec(), render() and the resource
// formulas. One rules object per family, defined in src/families/<family>.cpp.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "flashjit/codegen/kernel_spec.hpp"

namespace flashjit::codegen_detail {

struct EntryPoint {
  std::string_view name;             // extern "C" symbol, fixed per family
  std::string_view params_type;      // C++ type of its single by-value parameter
  std::string_view device_function;  // template function in the family header, over Config
  bool grid_constant = false;        // parameter declared __grid_constant__ (holds TMA maps)
};

struct FamilyRules {
  Family family;
  std::string_view name;
  std::string_view template_include;  // path inside templates/
  std::vector<EntryPoint> entries;
  int min_sm = 80;
  bool needs_arch_specific = false;   // sm_90a-only instructions
  std::vector<int> head_dims;         // kernel head dims this family is written for
  int min_blocks_per_sm = 1;          // second __launch_bounds__ argument

  // Checks of the tile fields (block_m, block_n, warps, stages) beyond the generic ones.
  std::optional<std::string> (*validate_tiles)(const KernelSpec&);
  // Fills the tile fields of a spec whose family, arch, dtype, head_dim and mask are set.
  void (*set_default_tiles)(KernelSpec&);
  int (*threads)(const KernelSpec&);
  int (*dynamic_smem_bytes)(const KernelSpec&);  // the most any entry needs (the smem attribute)
  // What entry `index` is launched with; null: every entry uses dynamic_smem_bytes.
  int (*entry_smem_bytes)(const KernelSpec&, int index) = nullptr;
  // Extra members of the rendered Config (e.g. the wgmma wrappers of the spec's shapes); null: none.
  std::string (*config_members)(const KernelSpec&) = nullptr;
};

const FamilyRules& family_rules(Family family);

}  // namespace flashjit::codegen_detail
