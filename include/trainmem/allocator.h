#pragma once
/// \file allocator.h
/// Real CPU memory peaks: a counting wrapper over LibTorch's CPU allocator,
/// with current and peak live bytes, allocation counts, several independent
/// peak windows at once, and an optional event log (the "sawtooth").
///
/// What it cannot see, by construction: storages allocated before it was
/// installed (their frees are not counted either), tensors made with
/// `from_blob` over your own memory, mmap'd storages (`torch::load` with
/// mmap), pinned host memory (CUDA's host allocator), and scratch memory that
/// oneDNN or BLAS allocate outside LibTorch's allocator. Install it first
/// thing in `main` to see the most.
///
/// Example:
/// ```
/// auto& tracker = trainmem::CpuMemoryTracker::install();
/// trainmem::PeakWindow step(tracker);          // a peak for this step only
/// loss = model->forward(x).sum(); loss.backward(); opt.step();
/// std::cout << step.peak_bytes() << " B at peak\n";
/// ```

#include <cstdint>
#include <vector>

#include "trainmem/export.h"

namespace trainmem {

/// Counters of the CPU allocator wrapper. Bytes are requested sizes.
struct CpuMemoryStats {
  int64_t allocated_bytes = 0;      ///< live bytes now
  int64_t peak_allocated_bytes = 0; ///< highest live bytes since install or reset_peak()
  int64_t num_allocs = 0;           ///< allocations since install
  int64_t num_frees = 0;            ///< frees of tracked allocations since install
};

/// One allocation (bytes > 0) or free (bytes < 0), when events are on.
struct CpuMemoryEvent {
  int64_t time_ns = 0;         ///< steady-clock nanoseconds since install
  int64_t bytes = 0;           ///< + allocated, - freed, in bytes
  int64_t allocated_bytes = 0; ///< live bytes just after the event
  uint64_t address = 0;        ///< the block's address (for pairing)
};

/// The process-wide counting CPU allocator. Installed once, never destroyed
/// (storages it made may outlive everything else). Thread-safe: frees may
/// come from any thread. Never throws from the allocation path.
class TRAINMEM_API CpuMemoryTracker {
 public:
  /// Installs the wrapper (first call) and returns it. Throws if another
  /// allocator with a higher priority is installed.
  static CpuMemoryTracker& install();
  /// True once install() has run.
  static bool installed();

  /// The counters now.
  CpuMemoryStats stats() const;
  /// Sets the peak to the live bytes now.
  void reset_peak();

  /// In a child made by fork(): forgets the blocks inherited from the
  /// parent. The counters (live and peak bytes, allocation counts, open peak
  /// windows' peaks, the event log) restart from zero and those blocks' frees
  /// are not counted, so the child's figures are its own, as in a fresh
  /// process. train_distributed() calls it first thing in each rank. Call it
  /// before the child starts threads that allocate.
  void forget_inherited_blocks();

  /// Starts (or stops) logging events. Logging costs a lock per allocation.
  void record_events(bool on);
  /// The events logged so far, oldest first; clears the log.
  std::vector<CpuMemoryEvent> take_events();
  /// Steady-clock nanoseconds since install, the time base of the events.
  int64_t now_ns() const;

  CpuMemoryTracker(const CpuMemoryTracker&) = delete;
  CpuMemoryTracker& operator=(const CpuMemoryTracker&) = delete;

 private:
  CpuMemoryTracker() = default;
};

/// An independent peak window: the highest live bytes seen between its
/// construction and now. Any number may be open at once (up to 64), nested or
/// overlapping; each costs one atomic max per allocation while open.
///
/// Example:
/// ```
/// trainmem::PeakWindow fwd(tracker);
/// auto loss = model->forward(x).sum();
/// int64_t forward_peak = fwd.peak_bytes();
/// ```
class TRAINMEM_API PeakWindow {
 public:
  explicit PeakWindow(CpuMemoryTracker& tracker);
  ~PeakWindow();
  /// Highest live bytes since construction, in bytes.
  int64_t peak_bytes() const;
  /// Live bytes when the window opened, in bytes.
  int64_t start_bytes() const { return start_bytes_; }

  PeakWindow(const PeakWindow&) = delete;
  PeakWindow& operator=(const PeakWindow&) = delete;

 private:
  int slot_;
  int64_t start_bytes_;
};

} // namespace trainmem
