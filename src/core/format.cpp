#include "trainmem/format.h"

#include <cmath>

#include <fmt/format.h>

namespace trainmem {

std::string with_commas(int64_t value) {
  // The magnitude as unsigned: -INT64_MIN does not fit in int64_t.
  const uint64_t magnitude = value < 0 ? 0 - static_cast<uint64_t>(value) : static_cast<uint64_t>(value);
  std::string digits = std::to_string(magnitude);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) {
      out += ',';
    }
    out += digits[i];
  }
  return value < 0 ? "-" + out : out;
}

std::string human_bytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  const double a = std::abs(b);
  if (a >= 1024.0 * 1024 * 1024) {
    return fmt::format("{:.1f} GiB", b / (1024.0 * 1024 * 1024));
  }
  if (a >= 1024.0 * 1024) {
    return fmt::format("{:.1f} MiB", b / (1024.0 * 1024));
  }
  if (a >= 1024.0) {
    return fmt::format("{:.1f} KiB", b / 1024.0);
  }
  return fmt::format("{} B", bytes);
}

} // namespace trainmem
