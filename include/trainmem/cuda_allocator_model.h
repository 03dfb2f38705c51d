#pragma once
/// \file cuda_allocator_model.h
/// A model of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp)
/// that runs on any machine: feed it allocations and frees, read back what
/// `torch.cuda.max_memory_allocated()` and `max_memory_reserved()` would say.
///
/// The rules it follows, as LibTorch 2.13 implements them:
/// - every request is rounded up to a multiple of 512 B (or, with
///   `roundup_power2_divisions`, to the next of N equal divisions of its
///   power-of-two interval, for sizes above 512 B x N);
/// - requests of at most 1 MiB come from the small pool, whose segments are
///   2 MiB; larger ones from the large pool, whose new segments are 20 MiB
///   for requests under 10 MiB and the request rounded up to 2 MiB above;
/// - a request takes the smallest free block of its pool and stream that fits
///   (ties: the lowest address), split when the rest is at least 512 B (small
///   pool) or more than 1 MiB (large pool, and only for requests below
///   `max_split_size`); a freed block merges with free neighbours;
/// - blocks of `max_split_size` or more are never split and serve only
///   requests within `max_non_split_rounding` (20 MiB) of their size;
/// - `expandable_segments`: one segment per stream and pool that grows by
///   mapping 2 MiB (small) or 20 MiB (large) pages, and splits freely;
/// - `garbage_collection_threshold` with a device capacity: old whole free
///   segments are returned before a cudaMalloc above the threshold;
/// - with a device capacity, a request that does not fit frees the cached
///   blocks that are not split (oversize ones first) and retries, then fails
///   (`num_ooms`).
///
/// Example:
/// ```
/// trainmem::CudaCachingAllocatorModel cuda;
/// auto a = cuda.malloc(4 << 20);      // a 20 MiB segment, split: 4 MiB allocated
/// auto b = cuda.malloc(1000);         // a 2 MiB small segment, 1,024 B allocated
/// cuda.free(a);
/// cuda.stats().peak_allocated_bytes;  // 4,195,328
/// cuda.stats().reserved_bytes;        // 23,068,672 (cached, not returned)
/// ```

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <torch/arg.h>

#include "trainmem/export.h"

namespace trainmem {

/// The caching allocator's settings (`PYTORCH_CUDA_ALLOC_CONF`), with
/// LibTorch 2.13's defaults.
///
/// Example:
/// ```
/// auto c = trainmem::CudaAllocatorConfig::parse("expandable_segments:True,max_split_size_mb:128");
/// ```
struct TRAINMEM_API CudaAllocatorConfig {
  /// Blocks of this many bytes or more are never split (`max_split_size_mb`);
  /// the default is unlimited.
  TORCH_ARG(int64_t, max_split_size_bytes) = std::numeric_limits<int64_t>::max();
  /// How much larger than a request of `max_split_size` or more an unsplit
  /// cached block may be and still serve it (`max_non_split_rounding_mb`), in bytes.
  TORCH_ARG(int64_t, max_non_split_rounding_bytes) = 20LL << 20;
  /// `roundup_power2_divisions`: 16 entries, one per power-of-two interval
  /// of request sizes from 1 MiB (entry 0: below 2 MiB; entry 15: 32 GiB and
  /// more); 0 or 1 means plain 512 B rounding. Empty: off everywhere.
  TORCH_ARG(std::vector<int64_t>, roundup_power2_divisions) = {};
  /// `expandable_segments`: one growing segment per stream and pool.
  TORCH_ARG(bool, expandable_segments) = false;
  /// Size of a new large-pool segment for requests under 10 MiB, and the page
  /// of a large expandable segment (`large_segment_size_mb`), in bytes.
  TORCH_ARG(int64_t, large_segment_bytes) = 20LL << 20;
  /// The device's memory the allocator may reserve, in bytes; 0: unlimited.
  /// (A device's capacity times `set_per_process_memory_fraction`.)
  TORCH_ARG(int64_t, device_bytes) = 0;
  /// `garbage_collection_threshold`: with a device size, before a cudaMalloc
  /// with more than this fraction of it reserved, whole free large segments
  /// at least as old as the average (get_free_block calls since freed) are
  /// returned, until reserved is back at the fraction. 0: off.
  TORCH_ARG(double, garbage_collection_threshold) = 0.0;

 public:  // TORCH_ARG leaves the section private
  /// Parses a `PYTORCH_CUDA_ALLOC_CONF` string: `max_split_size_mb:N`,
  /// `max_non_split_rounding_mb:N`, `roundup_power2_divisions:N` or
  /// `roundup_power2_divisions:[256:1,512:2,>:4]` (keys in MiB, powers of
  /// two), `expandable_segments:True|False`, `large_segment_size_mb:N`,
  /// `garbage_collection_threshold:F` (0 < F < 1; acts with device_bytes).
  /// Keys the model ignores (pinned-memory and backend settings) are
  /// accepted. Throws c10::Error naming a bad key
  /// or value.
  static CudaAllocatorConfig parse(const std::string& conf);
};

/// The model's counters, named as `torch.cuda.memory_stats()` names them
/// ("allocated_bytes.all.current" is allocated_bytes). All in bytes.
struct CudaAllocatorStats {
  int64_t allocated_bytes = 0;            ///< blocks handed out (rounded sizes)
  int64_t peak_allocated_bytes = 0;       ///< max_memory_allocated()
  int64_t reserved_bytes = 0;             ///< segments held from the device
  int64_t peak_reserved_bytes = 0;        ///< max_memory_reserved()
  int64_t requested_bytes = 0;            ///< sizes asked for, before rounding
  int64_t peak_requested_bytes = 0;       ///< highest requested_bytes
  int64_t inactive_split_bytes = 0;       ///< free blocks inside partly used segments
  int64_t peak_inactive_split_bytes = 0;  ///< highest inactive_split_bytes
  int64_t num_allocs = 0;                 ///< malloc calls served
  int64_t num_frees = 0;                  ///< free calls
  int64_t num_segments = 0;               ///< segments (expandable: mapped ranges) now
  int64_t num_device_allocs = 0;          ///< cudaMalloc calls (expandable: page maps)
  int64_t num_device_frees = 0;           ///< cudaFree calls (expandable: page unmaps)
  int64_t num_alloc_retries = 0;          ///< cache flushes to satisfy a request
  int64_t num_ooms = 0;                   ///< requests that failed
};

/// One block of a segment, lowest address first.
struct CudaBlockInfo {
  uint64_t address = 0;
  int64_t size_bytes = 0;       ///< in bytes
  int64_t requested_bytes = 0;  ///< what the caller asked for (0 when free), in bytes
  bool allocated = false;
};

/// A segment: one cudaMalloc, or the mapped part of an expandable segment.
struct CudaSegmentInfo {
  uint64_t address = 0;
  int64_t total_bytes = 0;      ///< in bytes
  int64_t allocated_bytes = 0;  ///< in bytes
  bool large_pool = false;
  bool expandable = false;
  int64_t stream = 0;
  std::vector<CudaBlockInfo> blocks;  ///< tile the segment
};

/// The caching allocator of one device, simulated: no memory is touched and
/// addresses are made up (segments never overlap; their order among equal
/// sizes decides ties, as cudaMalloc's addresses do on a device). Not
/// thread-safe.
class TRAINMEM_API CudaCachingAllocatorModel {
 public:
  explicit CudaCachingAllocatorModel(CudaAllocatorConfig config = {});
  ~CudaCachingAllocatorModel();
  CudaCachingAllocatorModel(CudaCachingAllocatorModel&&) noexcept;
  CudaCachingAllocatorModel& operator=(CudaCachingAllocatorModel&&) noexcept;
  CudaCachingAllocatorModel(const CudaCachingAllocatorModel&) = delete;
  CudaCachingAllocatorModel& operator=(const CudaCachingAllocatorModel&) = delete;

  /// Allocates `bytes` on `stream` and returns the block's address, or 0 when
  /// the device capacity is exhausted (counted in num_ooms; a real device
  /// raises OutOfMemoryError). A request of 0 bytes returns 0 and allocates
  /// nothing, as LibTorch does. Throws c10::Error for a negative size.
  uint64_t malloc(int64_t bytes, int64_t stream = 0);
  /// Frees the block at `address`. Throws c10::Error naming an address that
  /// is not allocated.
  void free(uint64_t address);
  /// Whether a block returned by malloc() (or added allocated) is allocated
  /// at `address` now.
  bool is_allocated(uint64_t address) const;
  /// Gives the next cudaMalloc (not an expandable page map) the segment
  /// address `address`, as recorded in a snapshot's segment_alloc; later ones
  /// get made-up addresses again. Must not overlap another segment.
  void set_next_segment_address(uint64_t address);
  /// Adds a segment of `total_bytes` at `address` that existed before the
  /// model started (snapshot.h's replay), tiled by `blocks` (allocated ones
  /// can be freed by address). Counts in reserved and allocated, not as a
  /// cudaMalloc. Throws c10::Error when the blocks do not tile it.
  void add_segment(uint64_t address, int64_t total_bytes, bool large_pool, int64_t stream,
                   const std::vector<CudaBlockInfo>& blocks);
  /// Adds an expandable segment (`expandable_segments:True`) whose pages were
  /// mapped before the model started: its address space from `base` (1 1/8
  /// of the device, or 1 TiB without a device size), the pages of each of
  /// `ranges` mapped (each range tiled by its blocks, lowest address first,
  /// starting and ending on whole pages from `base`: 2 MiB small, the large
  /// segment size large), the rest unmapped, for later maps to grow into.
  /// Counts the mapped pages in reserved, not as maps. Throws c10::Error,
  /// naming the range, when a range is not whole pages in order.
  void add_expandable_segment(uint64_t base, bool large_pool, int64_t stream,
                              const std::vector<std::vector<CudaBlockInfo>>& ranges);
  /// Returns every cached segment with no allocated block to the device
  /// (`torch.cuda.empty_cache()`); expandable segments unmap their free pages.
  void empty_cache();
  /// Sets the peaks to the current values (`reset_peak_memory_stats()`).
  void reset_peak();

  /// The counters now.
  CudaAllocatorStats stats() const;
  /// The segments now, lowest address first (`torch.cuda.memory_snapshot()`).
  std::vector<CudaSegmentInfo> segments() const;
  /// The settings.
  const CudaAllocatorConfig& config() const;

  /// The block size a request of `bytes` gets (512 B rounding or
  /// roundup_power2_divisions), in bytes.
  int64_t round_size(int64_t bytes) const;
  /// The size of the segment a new cudaMalloc gets for a rounded request:
  /// 2 MiB (<= 1 MiB), large_segment_bytes (< 10 MiB), else rounded up to 2 MiB.
  int64_t allocation_size(int64_t rounded_bytes) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// One allocation (bytes > 0) or free (bytes < 0) of an allocation trace.
struct AllocationEvent {
  int64_t bytes = 0;   ///< + requested bytes of an allocation, - those of its free
  uint64_t id = 0;     ///< pairs a free with its allocation (unique while live)
  int64_t stream = 0;  ///< the stream it is allocated on
};

/// What replaying a trace through the model gives. All in bytes.
struct CudaReplay {
  CudaAllocatorStats stats;           ///< the model's counters at the end
  int64_t peak_allocated_bytes = 0;   ///< max_memory_allocated over the trace
  int64_t peak_reserved_bytes = 0;    ///< max_memory_reserved over the trace
  int64_t peak_event = -1;            ///< index of the event that set peak_allocated_bytes (-1: before any)
  /// Reserved but not allocated when reserved peaked: the allocator's slack.
  int64_t slack_at_peak_reserved_bytes = 0;
  /// 1 - peak_allocated / peak_reserved (0 when nothing was reserved).
  double fragmentation = 0.0;
};

/// Replays `events` through `model` (which may already hold blocks: they
/// count in the peaks) after resetting its peaks. Frees of ids the trace did
/// not allocate are ignored (storages allocated before recording began).
TRAINMEM_API CudaReplay replay(const std::vector<AllocationEvent>& events, CudaCachingAllocatorModel& model);

} // namespace trainmem
