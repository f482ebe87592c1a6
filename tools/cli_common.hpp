// What the three CLIs share: exit codes, error reporting, list parsing.
#pragma once

#include <cstdio>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "flashjit/codegen/kernel_spec.hpp"
#include "flashjit/error.hpp"
#include "flashjit/flashjit.h"

namespace flashjit::cli {

// Exit codes, the same for every tool.
constexpr int kExitOk = 0;
constexpr int kExitFailed = 1;  // the work ran and something failed (a compile, a check)
constexpr int kExitUsage = 2;   // bad arguments or input files: nothing was done

// Runs `body` and maps every failure to a message on stderr and an exit code.
// (Every tool takes --version: the library's version, as flashjit_version() gives it.)
template <class Body>
int run_tool(const char* tool, CLI::App& app, int argc, char** argv, Body&& body) {
  app.set_version_flag("--version", fmt::format("{} {}", tool, flashjit_version()));
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::fputs(app.help().c_str(), stdout);
    return kExitOk;
  } catch (const CLI::CallForVersion& e) {
    std::puts(e.what());
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

// An arch flashjit compiles for: sm_80 or newer, the 'a' suffix only from sm_90 (before it, NVRTC
// has no arch-specific targets). `flag` names the option in the error.
inline Arch parse_arch(const std::string& name, const char* flag = "--arch") {
  Arch arch;
  try {
    arch = Arch::parse(name);
  } catch (const Error& e) {
    throw Error(ErrorCode::invalid_argument, flag, e.message());
  }
  if (arch.sm < 80)
    throw Error(ErrorCode::invalid_argument, flag, fmt::format("{}: flashjit compiles for sm_80 or newer", name));
  if (arch.arch_specific && arch.sm < 90)
    throw Error(ErrorCode::invalid_argument, flag,
                fmt::format("{}: there is no arch-specific ('a') target before sm_90", name));
  return arch;
}

inline std::vector<Arch> parse_archs(const std::vector<std::string>& names) {
  std::vector<Arch> archs;
  for (const auto& n : names) archs.push_back(parse_arch(n));
  return archs;
}

// The checks of numeric options, applied by CLI11 before any work (exit 2, naming the option).
// Parallel jobs: at least one, and not more threads than a machine can start.
inline const CLI::Range kJobsRange(1, 1024);
// A head dim as the problems take it: a multiple of 8 up to 256.
inline const CLI::Validator kHeadDimCheck(
    [](std::string& text) -> std::string {
      try {
        size_t used = 0;
        const long long v = std::stoll(text, &used);
        if (used == text.size() && v >= 8 && v <= 256 && v % 8 == 0) return "";
      } catch (const std::exception&) {
      }
      return fmt::format("head dim {} is not a multiple of 8 from 8 to 256", text);
    },
    "HEAD_DIM");

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
