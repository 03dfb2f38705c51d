#pragma once
// The one JSON reader for every JSON input (never installed): report files,
// rank reports, config.json. nlohmann's parser recurses once per nesting
// level, so a config nested 100,000 deep overflowed the stack (SIGSEGV in
// `trainmem estimate --model`). The nesting is measured first, without
// recursion, and anything deeper than the caller's bound is refused by name.
#include <algorithm>
#include <string>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

namespace trainmem::detail {

// The deepest nesting of arrays and objects in `text` (strings skipped).
inline int json_depth(const std::string& text) {
  int depth = 0, deepest = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return deepest;
}

// Parses `text`, nested at most `max_depth` deep, into the caller's JSON
// type (an ordered_json keeps the file's key order). Throws c10::Error
// starting with `who`: "<who>: expected JSON nested at most N deep, but got
// M" or "<who>: not JSON: <the parser's message>".
template <class Json = nlohmann::json>
Json parse_bounded_json(const std::string& text, int max_depth, const std::string& who) {
  const int depth = json_depth(text);
  TORCH_CHECK(depth <= max_depth, who, ": expected JSON nested at most ", max_depth, " deep, but got ", depth);
  try {
    return Json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    // parse_error, and out_of_range for a number beyond a double (2e607)
    TORCH_CHECK(false, who, ": not JSON: ", e.what());
  }
}

} // namespace trainmem::detail
