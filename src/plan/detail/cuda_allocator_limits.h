#pragma once
// What the CUDA caching allocator's config parser (cuda_allocator_config.cpp)
// and its model (cuda_allocator_model.cpp) share (never installed).
#include <cstdint>

namespace trainmem::detail {

// roundup_power2_divisions has one entry per power-of-two interval.
inline constexpr int64_t kRoundUpPowerOfTwoIntervals = 16;  // from 1 MiB to 64 GiB

} // namespace trainmem::detail
