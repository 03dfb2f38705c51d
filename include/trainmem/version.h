#pragma once
/// \file version.h
/// trainmem's version.

#define TRAINMEM_VERSION_MAJOR 0
#define TRAINMEM_VERSION_MINOR 1
#define TRAINMEM_VERSION_PATCH 0

namespace trainmem {
/// "0.1.0"
inline constexpr const char* kVersion = "0.1.0";
} // namespace trainmem
