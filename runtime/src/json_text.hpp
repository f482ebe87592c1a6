// Parsing JSON documents users write (tuning databases, shape lists): a malformed one is reported
// as "<origin>:<line>:<column>: malformed JSON: <reason>".
#pragma once

#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "flashjit/error.hpp"

namespace flashjit::detail {

// Throws Error(invalid_argument, where, ...) naming the line and column of the first syntax error.
inline nlohmann::json parse_json_text(const std::string& text, const std::string& origin, const char* where) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    // nlohmann's byte offset is one past the offending character.
    const size_t offset = e.byte > 0 ? e.byte - 1 : 0;
    size_t line = 1, column = 1;
    for (size_t i = 0; i < offset && i < text.size(); ++i) {
      if (text[i] == '\n') {
        ++line;
        column = 1;
      } else {
        ++column;
      }
    }
    std::string reason = e.what();
    if (auto at = reason.find("syntax error"); at != std::string::npos) reason = reason.substr(at);
    throw Error(ErrorCode::invalid_argument, where,
                fmt::format("{}:{}:{}: malformed JSON: {}", origin, line, column, reason));
  } catch (const nlohmann::json::exception& e) {  // a number out of range (1e309), say (found by fuzzing)
    throw Error(ErrorCode::invalid_argument, where, fmt::format("{}: malformed JSON: {}", origin, e.what()));
  }
}

}  // namespace flashjit::detail
