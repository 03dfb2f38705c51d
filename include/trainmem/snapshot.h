#pragma once
/// \file snapshot.h
/// Reads the memory snapshots `torch.cuda.memory._dump_snapshot()` writes on
/// a GPU (and those trainmem writes, report.h's to_memory_viz_pickle) and
/// replays their trace through CudaCachingAllocatorModel, so the model is
/// checked against what a real device did.
///
/// Example:
/// ```
/// auto snap = trainmem::read_snapshot("memory_ctx128_fullstep.pickle");
/// auto r = trainmem::replay_snapshot(snap);
/// r.recorded.peak_reserved_bytes;  // what the GPU reserved at most
/// r.model.peak_reserved_bytes;     // what the model reserves for the same trace
/// r.matches;                       // every cudaMalloc/cudaFree at the same event, same size
/// ```

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "trainmem/export.h"
#include "trainmem/cuda_allocator_model.h"

namespace trainmem {

/// One frame of a recorded stack.
struct SnapshotFrame {
  std::string name;
  std::string filename;
  int64_t line = 0;
};

/// One event of `device_traces`: `action` is alloc, free_requested,
/// free_completed, segment_alloc, segment_free, segment_map, segment_unmap,
/// snapshot or oom.
struct TraceEntry {
  std::string action;
  uint64_t addr = 0;
  int64_t size_bytes = 0;  ///< requested bytes (alloc/free), segment bytes (segment_*)
  int64_t stream = 0;
  int64_t device = 0;
  int64_t time_us = 0;
  /// Index into Snapshot::stacks of the frames kept (-1: none recorded);
  /// read them with Snapshot::frames(entry).
  int32_t stack = -1;
  /// `oom`: the device's free bytes when the request failed, as recorded
  /// (cudaMemGetInfo; the pickle's `device_free`). 0 for other actions.
  int64_t device_free = 0;
};

/// One block of a recorded segment.
struct SnapshotBlock {
  uint64_t address = 0;
  int64_t size_bytes = 0;       ///< in bytes
  int64_t requested_bytes = 0;  ///< in bytes
  std::string state;            ///< active_allocated, active_pending_free, inactive
  std::vector<SnapshotFrame> frames;
};

/// One segment of the final `segments`.
struct SnapshotSegment {
  uint64_t address = 0;
  int64_t total_bytes = 0;      ///< in bytes
  int64_t allocated_bytes = 0;  ///< in bytes
  int64_t requested_bytes = 0;  ///< in bytes
  int64_t stream = 0;
  int64_t device = 0;
  std::string segment_type;  ///< "large" or "small"
  bool expandable = false;
  /// `segment_pool_id`: (0, 0) for the default pools; another id for a
  /// private pool (a CUDA graph's or a `MemPool`'s).
  std::pair<int64_t, int64_t> pool_id{0, 0};
  std::vector<SnapshotBlock> blocks;
};

/// A whole snapshot file, as plain data.
struct TRAINMEM_API Snapshot {
  std::vector<SnapshotSegment> segments;  ///< every device's (SnapshotSegment::device)
  /// Every device's trace, device by device in `device_traces` order
  /// (TraceEntry::device says which); a recording of one GPU has one.
  std::vector<TraceEntry> traces;
  /// The distinct stacks of the trace, each the Python frames first, then
  /// C++ frames past the allocator's plumbing, at most kSnapshotFrames: a
  /// training loop repeats its stacks, so a million entries share a few.
  std::vector<std::vector<SnapshotFrame>> stacks;
  /// `allocator_settings["PYTORCH_CUDA_ALLOC_CONF"]` when recorded.
  std::optional<std::string> alloc_conf;

  /// The frames kept of `entry` (empty when none were recorded).
  const std::vector<SnapshotFrame>& frames(const TraceEntry& entry) const;
};

/// How many frames each trace entry keeps.
inline constexpr int kSnapshotFrames = 4;

/// Parses snapshot pickle bytes (protocols 2 to 5, the plain-data subset:
/// dicts, lists, tuples, strings, ints, floats, bools, None). Throws
/// c10::Error naming the problem and its byte offset for a truncated,
/// corrupted, too deeply nested or non-snapshot input; memory stays bounded
/// by the input's size.
TRAINMEM_API Snapshot parse_snapshot(const std::string& bytes);

/// Reads and parses the file at `path` (at most 4 GiB). Throws c10::Error
/// naming the path.
TRAINMEM_API Snapshot read_snapshot(const std::string& path);

/// The devices `snap` records, lowest first: those with a trace entry or a
/// segment (a recording of one GPU gives {0}; an empty one gives {}).
TRAINMEM_API std::vector<int64_t> snapshot_devices(const Snapshot& snap);

/// The part of `snap` on `device`: its segments and its trace, with the
/// stacks and allocator settings. Each device has its own allocator, so
/// each is replayed on its own.
TRAINMEM_API Snapshot device_snapshot(const Snapshot& snap, int64_t device);

/// Figures of one run, recorded or modelled. All in bytes.
struct SnapshotFigures {
  int64_t peak_reserved_bytes = 0;
  int64_t peak_requested_bytes = 0;   ///< highest sum of live requested sizes
  /// Highest sum of live blocks. Recorded: the requests rounded to 512 B (the
  /// trace holds requested sizes, so a block's unsplit remainder is not
  /// seen); model: the blocks it handed out, remainders included.
  int64_t peak_allocated_bytes = 0;
  int64_t num_segment_allocs = 0;     ///< cudaMalloc calls during the trace
  int64_t num_segment_frees = 0;      ///< cudaFree calls during the trace
  int64_t peak_event = -1;            ///< trace index where reserved first peaked (-1: before the trace)
  int64_t allocated_at_peak_reserved_bytes = 0;  ///< allocated when reserved peaked
};

/// One allocation live at the peak.
struct LiveAllocation {
  int64_t requested_bytes = 0;
  int64_t event = -1;  ///< trace index of its alloc (-1: allocated before recording)
  std::vector<SnapshotFrame> frames;
};

/// A segment of the model, when reserved peaked, that holds both allocated
/// and free blocks: its free bytes are reserved but cannot serve requests
/// of other pools or larger sizes.
struct StrandedSegment {
  int64_t total_bytes = 0;      ///< in bytes
  int64_t free_bytes = 0;       ///< free blocks inside it, in bytes
  bool large_pool = false;
  int64_t num_allocated_blocks = 0;
  /// Frames of the largest allocation in it (the one that split it, most often).
  std::vector<SnapshotFrame> frames;
};

/// The bytes live at the recorded requested peak that were allocated at one
/// place (frame_label() of their alloc's frames).
struct LiveByFrame {
  std::string frame;
  int64_t requested_bytes = 0;
  int64_t num_allocations = 0;
};

/// Where an allocation was made, in one line: the first frame with a line
/// number ("model.py:22 forward"), else the first frame's name.
TRAINMEM_API std::string frame_label(const std::vector<SnapshotFrame>& frames);

/// A request the device could not serve (the trace's first `oom` entry),
/// explained. All in bytes.
struct SnapshotOom {
  int64_t event = -1;            ///< trace index of the oom
  int64_t requested_bytes = 0;   ///< the request that failed
  int64_t device_free_bytes = 0; ///< the device's free memory then, as recorded
  int64_t reserved_bytes = 0;    ///< reserved by the allocator then, as recorded
  /// reserved_bytes + device_free_bytes: the device memory the allocator
  /// could hold. The recording gives no total (the CUDA context and other
  /// processes hold the rest); the what-ifs are replayed on a device of this size.
  int64_t device_total_bytes = 0;
  int64_t allocated_bytes = 0;   ///< live requests then, rounded to 512 B (recorded)
  /// Free blocks inside the segments then, and the largest of them (the
  /// model's, replayed to that event): a request larger than the largest
  /// fails even when the free bytes would hold it.
  int64_t free_in_segments_bytes = 0;
  int64_t largest_free_block_bytes = 0;
  /// Everything live then, grouped by frame_label(), most bytes first.
  std::vector<LiveByFrame> live_by_frame;
};

/// What replay_snapshot() finds.
struct SnapshotReplay {
  int64_t num_events = 0;
  int64_t num_preexisting_blocks = 0;     ///< live when recording began
  int64_t preexisting_reserved_bytes = 0; ///< reserved when recording began
  SnapshotFigures recorded;  ///< from the trace itself
  SnapshotFigures model;     ///< CudaCachingAllocatorModel on the same requests
  bool matches = false;      ///< every segment_alloc/free at the same event with the same size
  std::optional<int64_t> first_mismatch;  ///< trace index of the first divergence
  std::string mismatch;                   ///< what the recording did and what the model did
  std::vector<LiveAllocation> top_live_at_peak;  ///< recorded, largest first (at most 10)
  /// Everything live at the recorded requested peak, grouped by frame_label(), most bytes first.
  std::vector<LiveByFrame> live_at_peak_by_frame;
  /// Model's reserved minus allocated when reserved peaked, in bytes: the
  /// sum of free blocks in all its segments then.
  int64_t model_free_at_peak_bytes = 0;
  /// The part of model_free_at_peak_bytes in segments with no allocated block (cached whole), in bytes.
  int64_t model_free_in_unused_segments_bytes = 0;
  /// The model's partly used segments at its reserved peak, most free bytes first (at most 10).
  std::vector<StrandedSegment> stranded_at_peak;
  /// The trace's first `oom`, when it has one.
  std::optional<SnapshotOom> oom;
};

/// Replays `snap`'s trace. The segments that existed when recording began
/// (in the final `segments` without a segment_alloc in the trace) are added
/// to a CudaCachingAllocatorModel with `config` at their recorded addresses
/// (CudaCachingAllocatorModel::add_segment), holding the blocks live then:
/// live at the end and not allocated in the trace, or freed in the trace
/// without an alloc there. Each recorded segment_alloc gives the next
/// cudaMalloc its address. Then every alloc and free_completed goes to the
/// model, and its cudaMalloc/cudaFree calls and block addresses are compared
/// event by event with the recording.
TRAINMEM_API SnapshotReplay replay_snapshot(const Snapshot& snap, const CudaAllocatorConfig& config = {});

/// One row of what_if_snapshot().
struct SnapshotWhatIf {
  std::string alloc_conf;
  int64_t peak_reserved_bytes = 0;
  int64_t allocated_at_peak_reserved_bytes = 0;
  int64_t num_segment_allocs = 0;
  /// Requests that did not fit in `device_bytes` (0 without a device size),
  /// the recorded `oom` requests among them: the what-if tries each again.
  int64_t num_ooms = 0;
};

/// Replays the same requests from an empty allocator under each
/// `PYTORCH_CUDA_ALLOC_CONF` string (CudaAllocatorConfig::parse), on a device
/// of `device_bytes` (0: unlimited). A device size is what makes
/// `garbage_collection_threshold` act, as a memory fraction does on a GPU,
/// and what makes a request fail (counted in num_ooms).
TRAINMEM_API std::vector<SnapshotWhatIf> what_if_snapshot(const Snapshot& snap, const std::vector<std::string>& confs,
                                             int64_t device_bytes = 0);

} // namespace trainmem
