#pragma once
/// \file format.h
/// Byte counts as people read them, for reports, plans and predictions alike
/// (a core header: every layer may print bytes without the report's types).
///
/// Example:
/// ```
/// trainmem::with_commas(51052544);   // "51,052,544"
/// trainmem::human_bytes(51052544);   // "48.7 MiB"
/// ```

#include <cstdint>
#include <string>

#include "trainmem/export.h"

namespace trainmem {

/// "1,234,567": bytes with thousands separators (INT64_MIN included).
TRAINMEM_API std::string with_commas(int64_t value);

/// "48.7 MiB": bytes in binary units with one decimal.
TRAINMEM_API std::string human_bytes(int64_t bytes);

} // namespace trainmem
