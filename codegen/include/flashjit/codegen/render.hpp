// render(spec) -> CUDA source: a short generated prologue (a Config struct of constexpr values and
// the family's fixed extern "C" entries) that includes the family template. The templates
// themselves are embedded into the library at build time, with a content hash that is part of
// every cache key.
#pragma once

#include <string>
#include <string_view>
#include <utility>
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
  std::vector<std::string> entry_names;  // extern "C" kernels, in the family's order
  // The user's modifier bodies under the names #line gives them (kMaskModFile, kScoreModFile), so
  // that a compile error quotes the user's own lines.
  std::vector<std::pair<std::string, std::string>> user_files;
};

// Throws Error(invalid_argument) quoting validate() when the spec is illegal.
Source render(const KernelSpec& spec);

// A fact the host computes for a spec once: rendered into the kernel's Config as
// `static constexpr int <name>` (the template static_asserts its own layout against it) and read by
// the runtime when it launches the spec.
struct KernelConstant {
  std::string_view name;  // kSmemBytes, kConsumerRegisters, ...
  int value;
};

struct KernelEntry {
  std::string_view name;   // what the runtime launches it by: "forward", "dkdv_atomic_dq", ...
  std::string symbol;      // its extern "C" name: flashjit_<family>_<name>
  int dynamic_smem_bytes;  // what it is launched with
  int max_cluster_ctas = 0;  // the most CTAs along x of a thread-block cluster it may be launched in (0, 1: none)
};

// Everything the host needs to launch a spec's kernels, from the same rules that rendered them.
struct KernelLayout {
  int threads = 0;  // per block, every entry
  int min_blocks_per_sm = 1;  // the CTAs per SM its registers leave room for (__launch_bounds__)
  std::vector<KernelEntry> entries;  // in Source::entry_names order
  std::vector<KernelConstant> constants;

  // Throws Error(internal) naming the spec's family when it has no such entry or constant: a
  // runtime family asking for what its codegen rules do not render is a bug.
  const KernelEntry& entry(std::string_view name) const;
  size_t entry_index(std::string_view name) const;
  int constant(std::string_view name) const;
  int max_dynamic_smem_bytes() const;  // the most any entry uses
  std::string_view family;
};

// Throws Error(invalid_argument) quoting validate() when the spec is illegal.
KernelLayout kernel_layout(const KernelSpec& spec);

// Shorthands: a launch's threads, and the most shared memory any entry of the spec uses.
int threads_per_block(const KernelSpec& spec);
int dynamic_smem_bytes(const KernelSpec& spec);

// The most shared memory one block may use on an arch (after raising its dynamic limit).
int max_smem_per_block(const Arch& arch);
// Shared memory per SM: a block's maximum plus the 1 KB the driver reserves for each resident CTA.
int max_smem_per_sm(const Arch& arch);

}  // namespace flashjit
