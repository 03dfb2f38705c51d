#include "trainmem/snapshot.h"

#include <algorithm>
#include <limits>
#include <map>
#include <string>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

#include <c10/util/Exception.h>

namespace trainmem {

namespace {

// One request of the trace, paired with its free.
struct Request {
  int64_t requested_bytes = 0;
  int64_t stream = 0;
  uint64_t addr = 0;
  int64_t free_event = -1;  // trace index of its free_completed (-1: live at the end)
};

// The requests live before recording began: freed in the trace without an
// alloc there, or live at the end without one.
std::vector<Request> preexisting(const Snapshot& snap) {
  std::unordered_set<uint64_t> live;
  std::map<uint64_t, Request> before;
  for (size_t i = 0; i < snap.traces.size(); ++i) {
    const auto& e = snap.traces[i];
    if (e.action == "alloc") {
      live.insert(e.addr);
    } else if (e.action == "free_completed") {
      if (!live.erase(e.addr)) before[e.addr] = {e.size_bytes, e.stream, e.addr, static_cast<int64_t>(i)};
    }
  }
  for (const auto& s : snap.segments) {
    for (const auto& b : s.blocks) {
      if (b.state.rfind("active", 0) == 0 && !live.count(b.address) && !before.count(b.address)) {
        before[b.address] = {b.requested_bytes, s.stream, b.address};
      }
    }
  }
  std::vector<Request> out;
  for (auto& [a, r] : before) out.push_back(r);
  return out;
}

struct ModelRun {
  SnapshotFigures fig;
  int64_t free_at_peak_bytes = 0;
  int64_t free_in_unused_bytes = 0;
  std::vector<StrandedSegment> stranded;
  int64_t first_address_mismatch = -1;  // seeded: first alloc the model placed elsewhere
  uint64_t first_mismatch_model_address = 0;  // where the model placed it
  std::vector<std::pair<int64_t, int64_t>> device_calls;  // (event, +size alloc / -size free)
  int64_t num_ooms = 0;  // requests the model could not serve (a device size set)
  std::vector<int64_t> reserved_after;  // per event: reserved after an alloc or free (-1: other events)
  int64_t unseeded_expandable_bytes = 0;  // expandable pages mapped before recording, not seeded
  int64_t first_free_mismatch = -1;  // a free whose block the model does not hold allocated
  uint64_t first_free_mismatch_model_address = 0;
  // At the first oom (seeded, no device size): free bytes inside segments
  // and the largest free block (-1: no oom).
  int64_t oom_free_bytes = -1;
  int64_t oom_largest_free_bytes = 0;
};

// The free bytes in `segments` and the largest free block.
std::pair<int64_t, int64_t> free_blocks(const std::vector<CudaSegmentInfo>& segments) {
  int64_t free = 0, largest = 0;
  for (const auto& seg : segments) {
    for (const auto& b : seg.blocks) {
      if (b.allocated) continue;
      free += b.size_bytes;
      largest = std::max(largest, b.size_bytes);
    }
  }
  return {free, largest};
}

// Seeds `m` with the segments that existed when recording began, at their
// recorded addresses: each holds the blocks live then (their recorded block
// size when still live at the end, else the request rounded), with the gaps
// free. A gap of 1 MiB or less after a large-pool block cannot have been
// split off (the allocator splits only larger remainders), so it belongs to
// that block. Returns the requests it could not place.
constexpr int64_t kSmallSegmentBytes = 2 << 20;

// Note [cudaFree in a recording]: a run of recorded segment_frees the model
// did not make is the program releasing its cache (torch.cuda.empty_cache(),
// or release_cached_blocks() before a retry); the replay empties the model's
// cache at the run's first event, and matches each free to it. True when
// event `i` is a segment_free after another.
//
// Note [An oom in a recording]: a request that does not fit first makes the
// allocator release its cache (a run of segment_free or segment_unmap, seen
// above as the program emptying its cache), then retry; when the retry fails
// too, the trace gets an `oom` entry (its size, and the device's free bytes
// as cudaMemGetInfo gave them) and no alloc. The replay, on a device of no
// set size, skips it: the model would serve it, and the program did not go
// on with it. A what-if on a device of known size (the recording's: reserved
// then plus the device's free bytes) asks for it again, so each setting
// says whether the same request would have failed.
//
// An expandable segment's segment_unmap is such a release too (empty_cache()
// unmaps the free pages; so does a request that does not fit, before it
// retries or fails with an `oom`).
bool is_device_free(const TraceEntry& e) { return e.action == "segment_free" || e.action == "segment_unmap"; }
bool is_device_alloc(const TraceEntry& e) { return e.action == "segment_alloc" || e.action == "segment_map"; }
bool continues_free_run(const Snapshot& snap, size_t i) {
  return i > 0 && is_device_free(snap.traces[i]) && is_device_free(snap.traces[i - 1]);
}

} // namespace


namespace {

// Note [A block's size before recording]: a block live before recording
// keeps its final size only while it is the same block: live at the end and
// never allocated in the trace. A block freed in the trace may end merged
// into a larger free one at its address (an inactive block of the final
// segments), or its address be reused by a later alloc of another size;
// either size overlapped the next block, and the whole segment went unseeded
// (a torch.compile'd CS336 step diverged at event 0, 157,286,400 B short).
// Such a block gets its request rounded, and more: an alloc takes the front
// of a free block and free neighbours merge, so when the trace allocates
// within 1 MiB past that end while the block is still live, the block ends
// there (a large-pool remainder of 1 MiB or less is never split off; a
// CS336 training step put an 8 MiB alloc into another segment without this).
int64_t size_before(const Request& r, bool large, uint64_t segment_end,
                    const std::unordered_map<uint64_t, int64_t>& final_size,
                    const std::map<uint64_t, int64_t>& first_alloc, const CudaCachingAllocatorModel& m) {
  if (auto fs = final_size.find(r.addr); fs != final_size.end()) return fs->second;
  const int64_t rounded = m.round_size(r.requested_bytes);
  if (!large) return rounded;
  const uint64_t end = r.addr + static_cast<uint64_t>(rounded);
  const uint64_t last = std::min(end + (uint64_t{1} << 20), segment_end);
  for (auto it = first_alloc.lower_bound(end); it != first_alloc.end() && it->first <= last; ++it) {
    if (r.free_event < 0 || it->second < r.free_event) return static_cast<int64_t>(it->first - r.addr);
  }
  return rounded;
}

// Note [Expandable segments mapped before recording]
// With expandable_segments:True a pool's segment is one address space per
// stream (1 1/8 of the device) whose pages are mapped as requests need them;
// a snapshot lists each run of mapped pages as a segment (is_expandable).
// Those mapped when recording began are the final runs less what the trace
// mapped, plus what it unmapped: walked back from the end, a segment_map's
// pages come off and a segment_unmap's go back. The allocator reserves one
// space per stream and pool, large enough for every page of the device, so a
// trace event belongs to the space of its stream and of the pool its size
// allows (a large map is whole large pages; a small one, 2 MiB pages). Each
// space is seeded from its lowest known address
// (the allocator maps pages from the front, so it is the space's base unless
// pages there were unmapped before recording), its runs mapped then holding
// the blocks live then, each its request rounded (an expandable segment
// splits off any remainder of 512 B or more, in both pools) or its final
// size, with the gaps free; the rest of the space unmapped, for the model to
// map as the allocator did. Before this (skipped, their blocks allocated
// anew), a recording with two GPUs and only such segments replayed 20 MiB
// short on each (albi2's dump_snapshot.pickle at b4c280e: 44,040,192 B
// recorded on device 0, 23,068,672 B modelled).
struct ExpandableSpace {
  bool large = true;
  int64_t stream = 0;
  uint64_t lowest = std::numeric_limits<uint64_t>::max();  // the lowest address known in it
  std::map<uint64_t, uint64_t> mapped;  // start -> end
  void add(uint64_t from, uint64_t to) {
    lowest = std::min(lowest, from);
    auto it = mapped.lower_bound(from);
    if (it != mapped.begin() && std::prev(it)->second >= from) --it;
    while (it != mapped.end() && it->first <= to) {
      from = std::min(from, it->first);
      to = std::max(to, it->second);
      it = mapped.erase(it);
    }
    mapped[from] = to;
  }
  void remove(uint64_t from, uint64_t to) {
    lowest = std::min(lowest, from);
    auto it = mapped.lower_bound(from);
    if (it != mapped.begin() && std::prev(it)->second > from) --it;
    std::vector<std::pair<uint64_t, uint64_t>> keep;
    while (it != mapped.end() && it->first < to) {
      if (it->first < from) keep.emplace_back(it->first, from);
      if (it->second > to) keep.emplace_back(to, it->second);
      it = mapped.erase(it);
    }
    for (const auto& [a, b] : keep) mapped[a] = b;
  }
};

std::vector<ExpandableSpace> expandable_at_start(const Snapshot& snap, int64_t large_page) {
  std::map<std::pair<bool, int64_t>, ExpandableSpace> spaces;  // by (large pool, stream)
  const auto space_of = [&](bool large, int64_t stream) -> ExpandableSpace& {
    auto& sp = spaces[{large, stream}];
    sp.large = large;
    sp.stream = stream;
    return sp;
  };
  for (const auto& sg : snap.segments) {
    if (sg.expandable) {
      space_of(sg.segment_type != "small", sg.stream)
          .add(sg.address, sg.address + static_cast<uint64_t>(sg.total_bytes));
    }
  }
  std::vector<ExpandableSpace> out;
  if (spaces.empty()) return out;  // no expandable segments at the end: none before recording either
  const bool any_large = std::any_of(spaces.begin(), spaces.end(), [](const auto& kv) { return kv.first.first; });
  for (size_t i = snap.traces.size(); i-- > 0;) {
    const auto& e = snap.traces[i];
    if (e.action != "segment_map" && e.action != "segment_unmap") continue;
    auto& sp = space_of(any_large && e.size_bytes % large_page == 0, e.stream);
    const uint64_t to = e.addr + static_cast<uint64_t>(e.size_bytes);
    if (e.action == "segment_map") {
      sp.remove(e.addr, to);
    } else {
      sp.add(e.addr, to);
    }
  }
  for (auto& [key, sp] : spaces) out.push_back(std::move(sp));
  return out;
}

// Seeds each space's runs mapped when recording began (Note [Expandable
// segments mapped before recording]) with the blocks of `before` inside
// them, marking those `placed`. Returns the bytes of the runs it could not
// seed (blocks overlapping, or runs not whole pages from the base).
int64_t seed_expandable(const Snapshot& snap, const std::vector<Request>& before,
                        const std::unordered_map<uint64_t, int64_t>& final_size,
                        const std::map<uint64_t, int64_t>& first_alloc, CudaCachingAllocatorModel& m,
                        std::unordered_map<uint64_t, uint64_t>& addr, std::vector<bool>& placed) {
  int64_t unseeded = 0;
  for (const auto& sp : expandable_at_start(snap, m.config().large_segment_bytes())) {
    if (sp.mapped.empty()) continue;
    int64_t bytes = 0;
    for (const auto& [from, to] : sp.mapped) bytes += static_cast<int64_t>(to - from);
    std::vector<std::vector<CudaBlockInfo>> ranges;
    std::vector<size_t> mine;
    bool ok = true;
    for (const auto& [from, to] : sp.mapped) {
      std::vector<CudaBlockInfo> blocks;
      uint64_t at = from;
      for (size_t k = 0; k < before.size() && ok; ++k) {  // `before` is sorted by address
        const auto& r = before[k];
        if (r.addr < from || r.addr >= to) continue;
        const int64_t size = size_before(r, /*large=*/false, to, final_size, first_alloc, m);
        // A block a segment seeded already holds is a run over that segment.
        ok = !placed[k] && r.addr >= at && r.addr + static_cast<uint64_t>(size) <= to;
        if (!ok) break;
        if (r.addr > at) blocks.push_back({at, static_cast<int64_t>(r.addr - at), 0, false});
        blocks.push_back({r.addr, size, r.requested_bytes, true});
        mine.push_back(k);
        at = r.addr + static_cast<uint64_t>(size);
      }
      if (!ok) break;
      if (at < to) blocks.push_back({at, static_cast<int64_t>(to - at), 0, false});
      ranges.push_back(std::move(blocks));
    }
    if (ok) {
      try {
        m.add_expandable_segment(sp.lowest, sp.large, sp.stream, ranges);
      } catch (const c10::Error&) {
        ok = false;  // runs not whole pages from the base
      }
    }
    if (!ok) {  // its blocks are left to the replay, which then diverges and says why
      unseeded += bytes;
      continue;
    }
    for (size_t k : mine) {
      placed[k] = true;
      addr[before[k].addr] = before[k].addr;
    }
  }
  return unseeded;
}

std::vector<Request> seed_segments(const Snapshot& snap, const std::vector<Request>& before,
                                   CudaCachingAllocatorModel& m, std::unordered_map<uint64_t, uint64_t>& addr,
                                   int64_t& unseeded_expandable) {
  std::unordered_set<uint64_t> created, allocated;
  for (const auto& e : snap.traces) {
    if (e.action == "segment_alloc") created.insert(e.addr);
    if (e.action == "alloc") allocated.insert(e.addr);
  }
  // Note [A block's size before recording] (size_before()).
  std::unordered_map<uint64_t, int64_t> final_size;
  for (const auto& sg : snap.segments) {
    for (const auto& b : sg.blocks) {
      if (b.state.rfind("active", 0) == 0 && !allocated.count(b.address)) final_size[b.address] = b.size_bytes;
    }
  }
  std::map<uint64_t, int64_t> first_alloc;  // address -> first alloc event there
  for (size_t i = 0; i < snap.traces.size(); ++i) {
    if (snap.traces[i].action == "alloc") first_alloc.emplace(snap.traces[i].addr, static_cast<int64_t>(i));
  }
  // The segments live when recording began: those at the end that the trace
  // did not create, and those the trace frees without having created them
  // (a cudaFree releases a wholly free segment: empty_cache(), or a retry).
  std::vector<SnapshotSegment> segments;
  for (const auto& sg : snap.segments) {
    if (!created.count(sg.address)) segments.push_back(sg);
  }
  std::unordered_set<uint64_t> seen;  // addresses the trace has allocated or freed so far
  for (const auto& e : snap.traces) {
    if (e.action == "segment_alloc") {
      seen.insert(e.addr);
    } else if (e.action == "segment_free" && seen.insert(e.addr).second) {
      SnapshotSegment sg;
      sg.address = e.addr;
      sg.total_bytes = e.size_bytes;
      sg.stream = e.stream;
      sg.segment_type = e.size_bytes == kSmallSegmentBytes ? "small" : "large";  // small segments are 2 MiB
      segments.push_back(std::move(sg));
    }
  }
  std::vector<bool> placed(before.size(), false);
  for (const auto& sg : segments) {
    if (sg.expandable) continue;
    const bool large = sg.segment_type != "small";
    const uint64_t end = sg.address + static_cast<uint64_t>(sg.total_bytes);
    std::vector<CudaBlockInfo> blocks;
    uint64_t at = sg.address;
    bool ok = true;
    std::vector<size_t> mine;
    for (size_t k = 0; k < before.size(); ++k) {  // `before` is sorted by address
      const auto& r = before[k];
      if (r.addr < sg.address || r.addr >= end) continue;
      const int64_t size = size_before(r, large, end, final_size, first_alloc, m);
      if (r.addr < at || r.addr + static_cast<uint64_t>(size) > end) {
        ok = false;
        break;
      }
      if (r.addr > at) {
        const int64_t gap = static_cast<int64_t>(r.addr - at);
        if (large && !blocks.empty() && blocks.back().allocated && gap <= (int64_t{1} << 20)) {
          blocks.back().size_bytes += gap;
        } else {
          blocks.push_back({at, gap, 0, false});
        }
      }
      blocks.push_back({r.addr, size, r.requested_bytes, true});
      mine.push_back(k);
      at = r.addr + static_cast<uint64_t>(size);
    }
    if (!ok) continue;
    if (at < end) {
      const int64_t gap = static_cast<int64_t>(end - at);
      if (large && !blocks.empty() && blocks.back().allocated && gap <= (int64_t{1} << 20)) {
        blocks.back().size_bytes += gap;
      } else {
        blocks.push_back({at, gap, 0, false});
      }
    }
    m.add_segment(sg.address, sg.total_bytes, large, sg.stream, blocks);
    for (size_t k : mine) {
      placed[k] = true;
      addr[before[k].addr] = before[k].addr;
    }
  }
  unseeded_expandable = seed_expandable(snap, before, final_size, first_alloc, m, addr, placed);
  std::vector<Request> rest;
  for (size_t k = 0; k < before.size(); ++k) {
    if (!placed[k]) rest.push_back(before[k]);
  }
  return rest;
}

// Where the free bytes sat when reserved peaked (`at_peak`, the model's
// segments then): run's free and stranded figures, the ten segments that
// strand most first, each named by its largest block's allocation
// (`event_of`: model address -> alloc event, -1 before recording).
void stranded_at_peak(const Snapshot& snap, const std::vector<CudaSegmentInfo>& at_peak,
                      const std::unordered_map<uint64_t, int64_t>& event_of, ModelRun& run) {
  for (const auto& seg : at_peak) {
    StrandedSegment st;
    st.total_bytes = seg.total_bytes;
    st.large_pool = seg.large_pool;
    int64_t largest = 0;
    for (const auto& b : seg.blocks) {
      if (!b.allocated) {
        st.free_bytes += b.size_bytes;
        continue;
      }
      ++st.num_allocated_blocks;
      if (b.size_bytes > largest) {
        largest = b.size_bytes;
        auto it = event_of.find(b.address);
        st.frames = it != event_of.end() && it->second >= 0 ? snap.frames(snap.traces[static_cast<size_t>(it->second)])
                                                            : std::vector<SnapshotFrame>{};
      }
    }
    run.free_at_peak_bytes += st.free_bytes;
    if (st.num_allocated_blocks == 0) run.free_in_unused_bytes += st.free_bytes;
    if (st.free_bytes > 0 && st.num_allocated_blocks > 0) run.stranded.push_back(std::move(st));
  }
  std::stable_sort(run.stranded.begin(), run.stranded.end(),
                   [](const auto& a, const auto& b) { return a.free_bytes > b.free_bytes; });
  if (run.stranded.size() > 10) run.stranded.resize(10);
}

ModelRun run_model(const Snapshot& snap, const std::vector<Request>& before, CudaAllocatorConfig config,
                   bool seeded = false) {
  CudaCachingAllocatorModel m(std::move(config));
  std::unordered_map<uint64_t, uint64_t> addr;   // recorded -> model
  std::unordered_map<uint64_t, int64_t> event_of;  // model -> alloc event (-1: before recording)
  int64_t unseeded_expandable = 0;
  const auto unplaced = seeded ? seed_segments(snap, before, m, addr, unseeded_expandable) : before;
  for (const auto& r : unplaced) {
    addr[r.addr] = m.malloc(r.requested_bytes, r.stream);
    event_of[addr[r.addr]] = -1;
  }
  std::vector<CudaSegmentInfo> at_peak = m.segments();
  m.reset_peak();
  ModelRun run;
  run.unseeded_expandable_bytes = unseeded_expandable;
  auto s0 = m.stats();
  int64_t peak_reserved = s0.reserved_bytes;
  run.fig.allocated_at_peak_reserved_bytes = s0.allocated_bytes;
  run.reserved_after.assign(snap.traces.size(), -1);
  auto track = [&](int64_t event, const CudaAllocatorStats& before_s) {
    const auto s = m.stats();
    run.reserved_after[static_cast<size_t>(event)] = s.reserved_bytes;
    for (int64_t k = before_s.num_device_allocs; k < s.num_device_allocs; ++k) run.device_calls.push_back({event, 1});
    for (int64_t k = before_s.num_device_frees; k < s.num_device_frees; ++k) run.device_calls.push_back({event, -1});
    if (s.reserved_bytes > peak_reserved) {
      peak_reserved = s.reserved_bytes;
      run.fig.peak_event = event;
      run.fig.allocated_at_peak_reserved_bytes = s.allocated_bytes;
      at_peak = m.segments();
    }
  };
  for (size_t i = 0; i < snap.traces.size(); ++i) {
    const auto& e = snap.traces[i];
    const auto s = m.stats();
    if (seeded && is_device_alloc(e)) {
      m.set_next_segment_address(e.addr);
      continue;
    }
    if (e.action == "oom") {
      // Note [An oom in a recording]: the request that failed has no alloc
      // event. A device of known size tries it again; else it is skipped.
      if (m.config().device_bytes() <= 0) {
        if (run.oom_free_bytes < 0) {
          std::tie(run.oom_free_bytes, run.oom_largest_free_bytes) = free_blocks(m.segments());
        }
        continue;
      }
      const uint64_t a = m.malloc(e.size_bytes, e.stream);
      if (a != 0) event_of[a] = static_cast<int64_t>(i);
    } else if (is_device_free(e)) {
      // Note [cudaFree in a recording]: every wholly free segment goes.
      if (continues_free_run(snap, i)) continue;
      m.empty_cache();
    } else if (e.action == "alloc") {
      addr[e.addr] = m.malloc(e.size_bytes, e.stream);
      if (seeded) m.set_next_segment_address(0);
      if (seeded && addr[e.addr] != e.addr && run.first_address_mismatch < 0) {
        run.first_address_mismatch = static_cast<int64_t>(i);
        run.first_mismatch_model_address = addr[e.addr];
      }
      event_of[addr[e.addr]] = static_cast<int64_t>(i);
    } else if (e.action == "free_completed") {
      auto it = addr.find(e.addr);
      if (it == addr.end()) continue;
      if (it->second != 0 && m.is_allocated(it->second)) {
        m.free(it->second);
      } else if (it->second != 0 && run.first_free_mismatch < 0) {
        // The model's state is not the recording's (a recording of another
        // allocator, or one the seeding misread): a divergence, never an error.
        run.first_free_mismatch = static_cast<int64_t>(i);
        run.first_free_mismatch_model_address = it->second;
      }
      addr.erase(it);
    } else {
      continue;
    }
    track(static_cast<int64_t>(i), s);
  }
  const auto s = m.stats();
  run.fig.peak_reserved_bytes = s.peak_reserved_bytes;
  run.fig.peak_requested_bytes = s.peak_requested_bytes;
  run.fig.peak_allocated_bytes = s.peak_allocated_bytes;
  run.fig.num_segment_allocs = s.num_device_allocs - s0.num_device_allocs;
  run.fig.num_segment_frees = s.num_device_frees - s0.num_device_frees;
  run.num_ooms = s.num_ooms - s0.num_ooms;
  stranded_at_peak(snap, at_peak, event_of, run);
  return run;
}

} // namespace

namespace {

// The recorded figures' walk over the trace (SnapshotReplay::recorded), and
// what the comparison with the model needs: the recorded device calls
// (event, +1 segment_alloc/map, -1 free/unmap), the reserved bytes after
// every event, the live set before the trace and the requested peak's event.
struct RecordedWalk {
  std::vector<std::pair<int64_t, int64_t>> rec_calls;
  std::vector<int64_t> rec_reserved_after;
  std::unordered_map<uint64_t, std::pair<int64_t, int64_t>> live_before;  // addr -> (requested, alloc event)
  int64_t peak_requested_event = -1;  // the last event of the requested peak's first reach (-1: before the trace)
};

RecordedWalk walk_recorded(const Snapshot& snap, const std::vector<Request>& before,
                           const CudaAllocatorConfig& config, SnapshotReplay& r) {
  RecordedWalk w;
  auto& rec_calls = w.rec_calls;
  auto& rec_reserved_after = w.rec_reserved_after;
  int64_t& peak_requested_event = w.peak_requested_event;
  // Recorded series: reserved from the segment events, walked back from the
  // final segments; requested and allocated (rounded as the model rounds)
  // from the allocs and completed frees.
  int64_t reserved = 0;
  for (const auto& s : snap.segments) reserved += s.total_bytes;
  for (const auto& e : snap.traces) {
    if (is_device_alloc(e)) reserved -= e.size_bytes;
    if (is_device_free(e)) reserved += e.size_bytes;
  }
  r.preexisting_reserved_bytes = reserved;
  CudaCachingAllocatorModel rounding(config);
  int64_t requested = 0, allocated = 0;
  std::unordered_map<uint64_t, std::pair<int64_t, int64_t>> live;  // addr -> (requested, alloc event)
  for (const auto& b : before) {
    requested += b.requested_bytes;
    allocated += rounding.round_size(b.requested_bytes);
    live[b.addr] = {b.requested_bytes, -1};
  }
  auto& rec = r.recorded;
  rec.peak_reserved_bytes = reserved;
  rec.peak_requested_bytes = requested;
  rec.peak_allocated_bytes = allocated;
  rec.allocated_at_peak_reserved_bytes = allocated;
  rec_reserved_after.assign(snap.traces.size(), 0);
  w.live_before = live;
  for (size_t i = 0; i < snap.traces.size(); ++i) {
    const auto& e = snap.traces[i];
    const auto idx = static_cast<int64_t>(i);
    if (is_device_alloc(e)) {
      reserved += e.size_bytes;
      ++rec.num_segment_allocs;
      rec_calls.push_back({idx, 1});
    } else if (is_device_free(e)) {
      reserved -= e.size_bytes;
      ++rec.num_segment_frees;
      rec_calls.push_back({idx, -1});
    } else if (e.action == "alloc") {
      requested += e.size_bytes;
      allocated += rounding.round_size(e.size_bytes);
      live[e.addr] = {e.size_bytes, idx};
    } else if (e.action == "free_completed") {
      requested -= e.size_bytes;
      allocated -= rounding.round_size(e.size_bytes);
      live.erase(e.addr);
    }
    rec_reserved_after[i] = reserved;
    if (reserved > rec.peak_reserved_bytes) {
      rec.peak_reserved_bytes = reserved;
      rec.peak_event = idx;
      rec.allocated_at_peak_reserved_bytes = allocated;
    }
    rec.peak_allocated_bytes = std::max(rec.peak_allocated_bytes, allocated);
    if (requested > rec.peak_requested_bytes) {
      rec.peak_requested_bytes = requested;
      peak_requested_event = idx;
    }
  }
  return w;
}

using LiveSet = std::unordered_map<uint64_t, std::pair<int64_t, int64_t>>;  // addr -> (requested, alloc event)

// What was live after event `last` (-1: when recording began): a pass from
// the start (copying the live set at each new peak cost time quadratic in a
// growing trace).
LiveSet live_after(const Snapshot& snap, const RecordedWalk& w, int64_t last) {
  LiveSet live = w.live_before;
  for (int64_t i = 0; i <= last; ++i) {
    const auto& e = snap.traces[static_cast<size_t>(i)];
    if (e.action == "alloc") {
      live[e.addr] = {e.size_bytes, i};
    } else if (e.action == "free_completed") {
      live.erase(e.addr);
    }
  }
  return live;
}

// The bytes of `live` by where they were allocated, most first.
std::vector<LiveByFrame> by_frame(const Snapshot& snap, const LiveSet& live) {
  std::unordered_map<std::string, std::pair<int64_t, int64_t>> by;
  for (const auto& [a, v] : live) {
    const std::string where = v.second < 0 ? std::string("(before recording)")
                                           : frame_label(snap.frames(snap.traces[static_cast<size_t>(v.second)]));
    by[where].first += v.first;
    by[where].second += 1;
  }
  std::vector<LiveByFrame> out;
  for (auto& [where, bc] : by) out.push_back({where, bc.first, bc.second});
  std::sort(out.begin(), out.end(), [](const auto& x, const auto& y) {
    return x.requested_bytes != y.requested_bytes ? x.requested_bytes > y.requested_bytes : x.frame < y.frame;
  });
  return out;
}

// The live set at the requested peak, by frame and its largest ten.
void attribute_peak(const Snapshot& snap, const RecordedWalk& w, SnapshotReplay& r) {
  const auto live_at_peak = live_after(snap, w, w.peak_requested_event);
  r.live_at_peak_by_frame = by_frame(snap, live_at_peak);
  // The allocations live when requested bytes peaked, largest first.
  std::vector<std::pair<int64_t, int64_t>> sorted;
  for (const auto& [a, v] : live_at_peak) sorted.push_back(v);
  std::sort(sorted.begin(), sorted.end(), [](auto& x, auto& y) { return x.first > y.first; });
  for (size_t k = 0; k < sorted.size() && k < 10; ++k) {
    LiveAllocation la{sorted[k].first, sorted[k].second, {}};
    if (la.event >= 0) la.frames = snap.frames(snap.traces[static_cast<size_t>(la.event)]);
    r.top_live_at_peak.push_back(std::move(la));
  }
}

// The model's device calls against the recorded ones.
void compare_device_calls(const Snapshot& snap, const RecordedWalk& w, const ModelRun& run, SnapshotReplay& r) {
  const auto& rec_calls = w.rec_calls;
  const size_t n = std::max(rec_calls.size(), run.device_calls.size());
  r.matches = true;
  for (size_t k = 0; k < n; ++k) {
    const bool have_rec = k < rec_calls.size(), have_model = k < run.device_calls.size();
    bool same = have_rec && have_model && rec_calls[k].second == run.device_calls[k].second;
    if (same) {
      // A recorded segment_alloc belongs to the next alloc event.
      int64_t owner = rec_calls[k].first;
      if (rec_calls[k].second > 0) {
        while (owner < r.num_events && snap.traces[static_cast<size_t>(owner)].action != "alloc") ++owner;
      }
      // A recorded segment_free belongs to the first of its run of frees.
      if (rec_calls[k].second < 0) {
        while (continues_free_run(snap, static_cast<size_t>(owner))) --owner;
      }
      same = owner == run.device_calls[k].first;
    }
    if (!same) {
      r.matches = false;
      r.first_mismatch = have_rec ? rec_calls[k].first : run.device_calls[k].first;
      const auto what = [](const std::pair<int64_t, int64_t>& c) {
        return std::string(c.second > 0 ? "cudaMalloc" : "cudaFree") + " at event " + std::to_string(c.first);
      };
      r.mismatch = "device call #" + std::to_string(k) + ": recorded " +
                   (have_rec ? what(rec_calls[k]) : std::string("nothing")) + ", model " +
                   (have_model ? what(run.device_calls[k]) : std::string("nothing"));
      break;
    }
  }
}

// The reserved series: after every alloc and completed free (a run of
// recorded segment_frees ends before the event that follows it).
void compare_reserved(const Snapshot& snap, const RecordedWalk& w, const ModelRun& run, SnapshotReplay& r) {
  const auto& rec_reserved_after = w.rec_reserved_after;
  for (size_t i = 0; i < snap.traces.size(); ++i) {
    const auto& a = snap.traces[i].action;
    if ((a != "alloc" && a != "free_completed") || run.reserved_after[i] < 0) continue;
    if (run.reserved_after[i] != rec_reserved_after[i]) {
      if (r.matches || static_cast<int64_t>(i) < *r.first_mismatch) {
        r.matches = false;
        r.first_mismatch = static_cast<int64_t>(i);
        r.mismatch = "reserved after event " + std::to_string(i) + " (" + a + "): recorded " +
                     std::to_string(rec_reserved_after[i]) + " B, model " + std::to_string(run.reserved_after[i]) +
                     " B";
      }
      break;
    }
  }
}

// The trace's first oom: what was asked, what the device and the
// allocator held, and who held it.
void explain_oom(const Snapshot& snap, const RecordedWalk& w, const ModelRun& run, const CudaAllocatorConfig& config,
                 SnapshotReplay& r) {
  const auto it = std::find_if(snap.traces.begin(), snap.traces.end(), [](const auto& e) { return e.action == "oom"; });
  if (it == snap.traces.end()) return;
  SnapshotOom o;
  o.event = it - snap.traces.begin();
  o.requested_bytes = it->size_bytes;
  o.device_free_bytes = it->device_free;
  o.reserved_bytes =
      o.event > 0 ? w.rec_reserved_after[static_cast<size_t>(o.event - 1)] : r.preexisting_reserved_bytes;
  o.device_total_bytes = o.reserved_bytes + o.device_free_bytes;
  o.free_in_segments_bytes = std::max<int64_t>(run.oom_free_bytes, 0);
  o.largest_free_block_bytes = run.oom_largest_free_bytes;
  const auto live = live_after(snap, w, o.event);
  CudaCachingAllocatorModel rounding(config);
  for (const auto& [a, v] : live) o.allocated_bytes += rounding.round_size(v.first);
  o.live_by_frame = by_frame(snap, live);
  r.oom = std::move(o);
}

} // namespace

SnapshotReplay replay_snapshot(const Snapshot& snap, const CudaAllocatorConfig& config) {
  if (const auto devices = snapshot_devices(snap); devices.size() > 1) {
    return replay_snapshot(device_snapshot(snap, devices.front()), config);
  }
  SnapshotReplay r;
  r.num_events = static_cast<int64_t>(snap.traces.size());
  const auto before = preexisting(snap);
  r.num_preexisting_blocks = static_cast<int64_t>(before.size());
  const RecordedWalk walk = walk_recorded(snap, before, config, r);
  attribute_peak(snap, walk, r);
  auto run = run_model(snap, before, config, /*seeded=*/true);
  r.model = run.fig;
  r.model_free_at_peak_bytes = run.free_at_peak_bytes;
  r.stranded_at_peak = run.stranded;
  r.model_free_in_unused_segments_bytes = run.free_in_unused_bytes;
  // The model's device calls happen during the alloc/free that caused them;
  // the recording logs segment_alloc just before its alloc, segment_free
  // before the event that follows. Compare them by order and size direction,
  // and by the alloc they belong to.
  compare_device_calls(snap, walk, run, r);
  compare_reserved(snap, walk, run, r);
  explain_oom(snap, walk, run, config, r);
  const auto& rec = r.recorded;
  if (run.first_address_mismatch >= 0 && (r.matches || run.first_address_mismatch < *r.first_mismatch)) {
    const auto& e = snap.traces[static_cast<size_t>(run.first_address_mismatch)];
    r.matches = false;
    r.first_mismatch = run.first_address_mismatch;
    r.mismatch = "alloc of " + std::to_string(e.size_bytes) + " B at event " +
                 std::to_string(run.first_address_mismatch) + ": recorded at address " + std::to_string(e.addr) +
                 ", model at " + std::to_string(run.first_mismatch_model_address);
  }
  if (run.first_free_mismatch >= 0 && (r.matches || run.first_free_mismatch < *r.first_mismatch)) {
    const auto& e = snap.traces[static_cast<size_t>(run.first_free_mismatch)];
    r.matches = false;
    r.first_mismatch = run.first_free_mismatch;
    r.mismatch = "free of " + std::to_string(e.size_bytes) + " B at event " + std::to_string(run.first_free_mismatch) +
                 ": recorded at address " + std::to_string(e.addr) + ", where the model holds no allocated block (at " +
                 std::to_string(run.first_free_mismatch_model_address) + ")";
  }
  // Expandable pages mapped before recording that could not be seeded
  // (Note [Expandable segments mapped before recording]): their blocks map
  // new pages in the model. Say so where that may be why the replay diverges.
  if (!r.matches && run.unseeded_expandable_bytes > 0) {
    r.mismatch += " (expandable segments mapped before recording began could not be seeded: " +
                  std::to_string(run.unseeded_expandable_bytes) + " B of their pages)";
  }
  if (r.matches && rec.peak_reserved_bytes != r.model.peak_reserved_bytes) {
    r.matches = false;
    r.mismatch = "same device calls, but peak reserved differs: recorded " +
                 std::to_string(rec.peak_reserved_bytes) + " B, model " +
                 std::to_string(r.model.peak_reserved_bytes) + " B";
  }
  return r;
}

std::vector<SnapshotWhatIf> what_if_snapshot(const Snapshot& snap, const std::vector<std::string>& confs,
                                             int64_t device_bytes) {
  TORCH_CHECK(device_bytes >= 0, "what_if_snapshot: expected a device size >= 0, but got ", device_bytes);
  if (const auto devices = snapshot_devices(snap); devices.size() > 1) {
    return what_if_snapshot(device_snapshot(snap, devices.front()), confs, device_bytes);
  }
  const auto before = preexisting(snap);
  std::vector<SnapshotWhatIf> out;
  for (const auto& c : confs) {
    auto config = CudaAllocatorConfig::parse(c);
    config.device_bytes(device_bytes);
    auto run = run_model(snap, before, config);
    // Counted from an empty allocator: the blocks live before recording are
    // allocated too, so their segments count.
    CudaCachingAllocatorModel base(config);
    for (const auto& r : before) base.malloc(r.requested_bytes, r.stream);
    out.push_back({c, run.fig.peak_reserved_bytes, run.fig.allocated_at_peak_reserved_bytes,
                   run.fig.num_segment_allocs + base.stats().num_device_allocs, run.num_ooms});
  }
  return out;
}

} // namespace trainmem
