// The message of the c10::Error that `f` throws, without its backtrace, or
// "no error" when it throws none: for tests that assert what a refusal says
// (EXPECT_NE(error_of(...).find("..."), npos) << message).
#pragma once

#include <functional>
#include <string>

#include <c10/util/Exception.h>

namespace trainmem::testing {

inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "no error";
}

} // namespace trainmem::testing
