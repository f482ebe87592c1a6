// render(spec) -> CUDA source: a short generated prologue (a Config struct of constexpr values and
// the family's fixed extern "C" entries) that includes the family template. The templates
// themselves are embedded into the library at build time, with a content hash that is part of
// every cache key.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "flashjit/codegen/kernel_spec.hpp"

namespace flashjit {

struct TemplateFile {
  std::string_view path;  // relative to templates/, as written in #include "..."
  std::string_view text;
};

struct TemplateBundle {
  std::vector<TemplateFile> files;
  std::string_view hash;  // SHA-256 (hex, truncated) over every path and text
};

// Every file of templates/, as it was when the library was built.
const TemplateBundle& template_bundle();

struct Source {
  std::string spec_name;
  std::string file_name;  // "<spec name>.cu": how NVRTC names it in diagnostics
  std::string text;
  std::vector<std::string> entry_names;  // extern "C" kernels, in the family's fixed order
};

// Throws Error(invalid_argument) quoting validate() when the spec is illegal.
Source render(const KernelSpec& spec);

// Resource formulas: what a launch of the spec's main entry needs.
int threads_per_block(const KernelSpec& spec);
int dynamic_smem_bytes(const KernelSpec& spec);  // the most any entry uses
int entry_dynamic_smem_bytes(const KernelSpec& spec, int entry);  // entry in Source::entry_names order

// The most shared memory one block may use on an arch (after raising its dynamic limit).
int max_smem_per_block(const Arch& arch);

}  // namespace flashjit
