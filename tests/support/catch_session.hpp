// The test executables' Catch2 session: a test spec that selects no test case is a failure (a
// renamed tag must not pass as "No tests ran", which Catch2 reports with exit status 0).
#pragma once

#include <catch2/catch.hpp>

#include <cstdio>

namespace flashjit::test {

// Parses the command line into `session`; returns -1 to go on and run it, else the exit status.
inline int parse_or_refuse(Catch::Session& session, int argc, char** argv) {
  if (int rc = session.applyCommandLine(argc, argv); rc != 0) return rc;
  const Catch::ConfigData& data = session.configData();
  if (data.showHelp || data.listTests || data.listTags || data.listTestNamesOnly || data.listReporters) return -1;
  const Catch::Config& config = session.config();
  if (Catch::filterTests(Catch::getAllTestCasesSorted(config), config.testSpec(), config).empty()) {
    std::fprintf(stderr, "%s: no test case matches the test spec", argv[0]);
    for (const auto& arg : data.testsOrTags) std::fprintf(stderr, " '%s'", arg.c_str());
    std::fprintf(stderr, " (a renamed tag or test name?)\n");
    return 1;
  }
  return -1;
}

}  // namespace flashjit::test
