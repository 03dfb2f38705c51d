#pragma once
/// \file device.h
/// Device memory statistics with one shape for CUDA and CPU, fragmentation in
/// plain words, and CUDA memory history for pytorch.org/memory_viz.
///
/// CUDA figures come from LibTorch's caching allocator through c10's
/// device-generic interface, so this header and the library need no CUDA
/// headers and still report CUDA when the LibTorch they run with has it. CPU
/// figures come from trainmem's counting allocator (allocator.h), which must
/// be installed first.
///
/// Example:
/// ```
/// trainmem::CpuMemoryTracker::install();          // for CPU figures
/// auto dev = torch::cuda::is_available() ? torch::Device("cuda:0") : torch::Device("cpu");
/// trainmem::reset_peak(dev);
/// train_step();
/// auto s = trainmem::device_memory_stats(dev);
/// std::cout << s.peak_allocated_bytes << " B at peak\n";
/// for (const auto& hint : trainmem::fragmentation(s).hints) std::cout << hint << "\n";
/// ```

#include <cstdint>
#include <string>
#include <vector>

#include <c10/core/Device.h>

#include "trainmem/export.h"

namespace trainmem {

/// Memory counters of one device. On CPU the allocator caches nothing, so
/// reserved, active and allocated are the same bytes and split bytes are 0.
struct DeviceMemoryStats {
  std::string device;                  ///< "cpu", "cuda:0", ...
  int64_t allocated_bytes = 0;         ///< bytes in live tensors now
  int64_t peak_allocated_bytes = 0;    ///< highest allocated_bytes since reset_peak()
  int64_t reserved_bytes = 0;          ///< bytes the allocator holds from the device
  int64_t peak_reserved_bytes = 0;     ///< highest reserved_bytes since reset_peak()
  int64_t active_bytes = 0;            ///< allocated plus blocks waiting on streams
  int64_t peak_active_bytes = 0;       ///< highest active_bytes since reset_peak()
  int64_t inactive_split_bytes = 0;    ///< free bytes inside split blocks (fragments)
  int64_t peak_inactive_split_bytes = 0; ///< highest inactive_split_bytes
  int64_t requested_bytes = 0;         ///< bytes asked for (before rounding)
  int64_t num_allocs = 0;              ///< allocations since start (CUDA: since reset of accumulated stats)
  int64_t num_frees = 0;               ///< frees since start
  int64_t num_alloc_retries = 0;       ///< CUDA: cache flushes to satisfy a request
  int64_t num_ooms = 0;                ///< CUDA: out-of-memory errors raised
};

/// The counters of `device` now. CUDA: any visible device of a LibTorch built
/// with CUDA. CPU: needs CpuMemoryTracker::install(). Throws c10::Error naming
/// the device when it cannot be read (no CUDA, index out of range, tracker
/// not installed).
TRAINMEM_API DeviceMemoryStats device_memory_stats(const c10::Device& device);

/// Restarts the peaks of `device` at the current values (CUDA: the caching
/// allocator's peak stats; CPU: the tracker's global peak).
TRAINMEM_API void reset_peak(const c10::Device& device);

/// Allocator slack of a DeviceMemoryStats, with hints when it is large.
struct Fragmentation {
  int64_t slack_bytes = 0;           ///< reserved - allocated, in bytes
  int64_t inactive_split_bytes = 0;  ///< free fragments inside split blocks, in bytes
  double slack_fraction = 0.0;       ///< slack_bytes / reserved_bytes (0 when nothing is reserved)
  std::vector<std::string> hints;    ///< what to try, in plain words; empty when slack is small
};

/// Reads slack off `stats`. Hints name the allocator settings that help
/// (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, warming up on the
/// longest batch, emptying the cache between phases) when slack exceeds
/// `threshold_fraction` of reserved bytes and `floor_bytes`.
TRAINMEM_API Fragmentation fragmentation(
    const DeviceMemoryStats& stats,
    double threshold_fraction = 0.2,
    int64_t floor_bytes = 64LL << 20);

/// True when this build can record CUDA memory history (LibTorch with CUDA at
/// build time and a CUDA device now).
TRAINMEM_API bool cuda_memory_history_available();

/// Starts recording CUDA allocator history with C++ stack context, keeping the
/// last `max_entries` events. Throws c10::Error when unavailable.
TRAINMEM_API void start_cuda_memory_history(int64_t max_entries = 100000);

/// Stops recording (keeps what was recorded for the next snapshot).
TRAINMEM_API void stop_cuda_memory_history();

/// LibTorch's own pickled snapshot of the CUDA caching allocator (segments
/// and the recorded history): the file pytorch.org/memory_viz opens. Throws
/// c10::Error when unavailable.
TRAINMEM_API std::string cuda_memory_snapshot();

} // namespace trainmem
