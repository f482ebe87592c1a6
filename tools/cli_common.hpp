// What the three CLIs share: exit codes, error reporting, list parsing.
#pragma once

#include <cstdio>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "flashjit/codegen/kernel_spec.hpp"
#include "flashjit/error.hpp"

namespace flashjit::cli {

// Exit codes, the same for every tool.
constexpr int kExitOk = 0;
constexpr int kExitFailed = 1;  // the work ran and something failed (a compile, a check)
constexpr int kExitUsage = 2;   // bad arguments or input files: nothing was done

// Runs `body` and maps every failure to a message on stderr and an exit code.
template <class Body>
int run_tool(const char* tool, CLI::App& app, int argc, char** argv, Body&& body) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::fputs(app.help().c_str(), stdout);
    return kExitOk;
  } catch (const CLI::ParseError& e) {
    fmt::print(stderr, "{}: {}\nRun '{} --help' for usage.\n", tool, e.what(), tool);
    return kExitUsage;
  }
  try {
    return body();
  } catch (const Error& e) {
    fmt::print(stderr, "{}: {}\n", tool, e.what());
    return e.code() == ErrorCode::invalid_argument ? kExitUsage : kExitFailed;
  } catch (const std::exception& e) {
    fmt::print(stderr, "{}: {}\n", tool, e.what());
    return kExitFailed;
  }
}

inline std::vector<Arch> parse_archs(const std::vector<std::string>& names) {
  std::vector<Arch> archs;
  for (const auto& n : names) archs.push_back(Arch::parse(n));
  return archs;
}

inline std::vector<DType> parse_dtypes(const std::vector<std::string>& names) {
  std::vector<DType> dtypes;
  for (const auto& n : names) dtypes.push_back(parse_dtype(n));
  return dtypes;
}

inline std::vector<MaskKind> parse_masks(const std::vector<std::string>& names) {
  std::vector<MaskKind> masks;
  for (const auto& n : names) masks.push_back(parse_mask(n));
  return masks;
}

}  // namespace flashjit::cli
