// NVRTC: rendered source + arch -> cubin, with the ptxas report parsed into EntryStats.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "flashjit/codegen/render.hpp"
#include "flashjit/kernel_cache.hpp"

namespace flashjit::detail {

struct CompileOutput {
  std::string cubin;
  std::string log;
  std::vector<EntryStats> entries;
  double compile_ms = 0;
};

// The NVRTC options, identical for every spec of an arch (part of the cache key).
std::vector<std::string> compile_options(const Arch& arch);

// Throws Error(compile_failed) with the log, numbered source lines around each error, and the
// spec name.
CompileOutput compile_source(const Source& source, const Arch& arch);

// Constructs the process-wide objects a compile uses (the template bundle, the environment, the log
// patterns). An owner of background compiles calls it before it exists itself: objects with static
// storage are destroyed in the reverse order of their construction, so these outlive it, and a
// compile its destructor waits for at exit still finds them.
void construct_compiler_statics();

// Parses ptxas --verbose output: one EntryStats per "Compiling entry function" block.
std::vector<EntryStats> parse_ptxas_stats(std::string_view log);

// The compile_failed message: log excerpt plus numbered lines around each reported error.
std::string describe_compile_failure(const Source& source, const Arch& arch, std::string_view log);

}  // namespace flashjit::detail
