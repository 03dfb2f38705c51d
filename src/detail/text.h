#pragma once
// Small text helpers shared by the report writers and the trainers.
#include <string>

namespace trainmem::detail {

// `s` with &, <, >, " and ' as HTML entities (html.cpp, distributed_report.cpp).
inline std::string html_escape(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

} // namespace trainmem::detail
