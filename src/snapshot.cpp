#include "trainmem/snapshot.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include <c10/util/Exception.h>

namespace trainmem {
namespace {

// A streaming reader of the plain-data pickle subset: LibTorch's unpickler
// wants tensors and IValues and rejects what Python's pickle.dump writes for
// dicts of frames. Every object costs at least one opcode byte, so the object
// count is bounded by the input; containers share memoised children
// (frames are referenced thousands of times) through shared_ptr.
struct PValue;
using PRef = std::shared_ptr<PValue>;
struct PValue {
  enum Kind { kNone, kBool, kInt, kFloat, kStr, kList, kDict, kTuple } kind = kNone;
  int64_t i = 0;
  double f = 0.0;
  std::string s;
  std::vector<PRef> items;  // list/tuple items; dict: key, value, key, value...
};

constexpr size_t kMaxDepth = 1000;

class Unpickler {
 public:
  explicit Unpickler(const std::string& b) : b_(b) {}

  PRef run() {
    while (true) {
      TORCH_CHECK(pos_ < b_.size(), "snapshot: truncated pickle at byte ", pos_, " (no STOP opcode)");
      const size_t at = pos_;
      const auto op = static_cast<unsigned char>(b_[pos_++]);
      switch (op) {
        case 0x80: take(1); break;   // PROTO
        case 0x95: take(8); break;   // FRAME
        case '.':                    // STOP
          TORCH_CHECK(stack_.size() == 1 && marks_.empty(), "snapshot: STOP at byte ", at, " with ",
                      stack_.size(), " objects on the stack, expected 1");
          return stack_.back();
        case '(':
          TORCH_CHECK(marks_.size() < kMaxDepth, "snapshot: nesting deeper than ", kMaxDepth, " at byte ", at);
          marks_.push_back(stack_.size());
          break;
        case '}': push(make(PValue::kDict)); break;
        case ']': push(make(PValue::kList)); break;
        case ')': push(make(PValue::kTuple)); break;
        case 'N': push(make(PValue::kNone)); break;
        case 0x88: case 0x89: { auto v = make(PValue::kBool); v->i = op == 0x88; push(v); break; }
        case 'K': push_int(u8(take(1))); break;
        case 'M': push_int(static_cast<int64_t>(le(take(2), 2))); break;
        case 'J': push_int(static_cast<int32_t>(le(take(4), 4))); break;
        case 0x8a: case 0x8b: {  // LONG1, LONG4
          const uint64_t n = op == 0x8a ? u8(take(1)) : le(take(4), 4);
          // Python writes unsigned 64-bit values of 2^63 and more (CUDA
          // stream handles) in 9 bytes, the last one a 0 sign byte.
          TORCH_CHECK(n <= 8 || n == 9, "snapshot: integer of ", n, " bytes at byte ", at,
                      " does not fit in 64 bits");
          const char* p = take(n);
          if (n == 9) {
            TORCH_CHECK(u8(p + 8) == 0, "snapshot: negative integer of 9 bytes at byte ", at,
                        " does not fit in 64 bits");
            push_int(static_cast<int64_t>(le(p, 8)));
            break;
          }
          uint64_t v = le(p, n);
          if (n > 0 && n < 8 && (u8(p + n - 1) & 0x80)) v |= ~uint64_t{0} << (8 * n);  // sign-extend
          push_int(static_cast<int64_t>(v));
          break;
        }
        case 'G': {
          const char* p = take(8);
          uint64_t bits = 0;
          for (int k = 0; k < 8; ++k) bits = (bits << 8) | u8(p + k);
          auto v = make(PValue::kFloat);
          std::memcpy(&v->f, &bits, 8);
          push(v);
          break;
        }
        case 0x8c: case 'U': case 'C': str(u8(take(1)), at); break;
        case 'X': case 'T': case 'B': str(le(take(4), 4), at); break;
        case 0x8d: case 0x8e: str(le(take(8), 8), at); break;
        case 0x94: memo_put(memo_.size(), at); break;
        case 'q': memo_put(u8(take(1)), at); break;
        case 'r': memo_put(le(take(4), 4), at); break;
        case 'h': memo_get(u8(take(1)), at); break;
        case 'j': memo_get(le(take(4), 4), at); break;
        case '0': pop(at); break;
        case '2': { auto v = top(at); push(v); break; }
        case '1': pop_mark(at); break;
        case 'a': { auto v = pop(at); append(top(at), {v}, at); break; }
        case 'e': { auto items = pop_mark(at); append(top(at), items, at); break; }
        case 's': {
          auto v = pop(at);
          auto k = pop(at);
          set_items(top(at), {k, v}, at);
          break;
        }
        case 'u': { auto items = pop_mark(at); set_items(top(at), items, at); break; }
        case 't': { auto v = make(PValue::kTuple); v->items = pop_mark(at); push(v); break; }
        case 0x85: case 0x86: case 0x87: {
          const size_t n = op - 0x84;
          TORCH_CHECK(stack_.size() >= base() + n, "snapshot: TUPLE", n, " at byte ", at, " on a short stack");
          auto v = make(PValue::kTuple);
          v->items.assign(stack_.end() - n, stack_.end());
          stack_.resize(stack_.size() - n);
          push(v);
          break;
        }
        default:
          TORCH_CHECK(false, "snapshot: unsupported pickle opcode 0x", std::hex, int(op), std::dec, " at byte ", at,
                      " (not a memory snapshot: only plain dicts, lists, strings and numbers are read)");
      }
    }
  }

 private:
  static uint64_t u8(const char* p) { return static_cast<unsigned char>(*p); }
  static uint64_t le(const char* p, uint64_t n) {
    uint64_t v = 0;
    for (uint64_t k = 0; k < n; ++k) v |= u8(p + k) << (8 * k);
    return v;
  }
  const char* take(uint64_t n) {
    TORCH_CHECK(n <= b_.size() - pos_, "snapshot: truncated pickle at byte ", pos_, ": expected ", n,
                " more bytes, but the input has ", b_.size() - pos_);
    const char* p = b_.data() + pos_;
    pos_ += n;
    return p;
  }
  static PRef make(PValue::Kind k) {
    auto v = std::make_shared<PValue>();
    v->kind = k;
    return v;
  }
  void push(PRef v) { stack_.push_back(std::move(v)); }
  void push_int(int64_t i) {
    auto v = make(PValue::kInt);
    v->i = i;
    push(v);
  }
  void str(uint64_t n, size_t at) {
    TORCH_CHECK(n <= b_.size() - pos_, "snapshot: string of ", n, " bytes at byte ", at, " runs past the end (",
                b_.size(), " bytes)");
    auto v = make(PValue::kStr);
    v->s.assign(take(n), n);
    push(v);
  }
  size_t base() const { return marks_.empty() ? 0 : marks_.back(); }
  PRef top(size_t at) {
    TORCH_CHECK(stack_.size() > base(), "snapshot: empty stack at byte ", at);
    return stack_.back();
  }
  PRef pop(size_t at) {
    auto v = top(at);
    stack_.pop_back();
    return v;
  }
  std::vector<PRef> pop_mark(size_t at) {
    TORCH_CHECK(!marks_.empty(), "snapshot: no MARK before byte ", at);
    const size_t m = marks_.back();
    marks_.pop_back();
    std::vector<PRef> items(stack_.begin() + static_cast<std::ptrdiff_t>(m), stack_.end());
    stack_.resize(m);
    return items;
  }
  void append(const PRef& c, const std::vector<PRef>& items, size_t at) {
    TORCH_CHECK(c->kind == PValue::kList, "snapshot: APPEND(S) to a non-list at byte ", at);
    c->items.insert(c->items.end(), items.begin(), items.end());
  }
  void set_items(const PRef& c, const std::vector<PRef>& items, size_t at) {
    TORCH_CHECK(c->kind == PValue::kDict, "snapshot: SETITEM(S) on a non-dict at byte ", at);
    TORCH_CHECK(items.size() % 2 == 0, "snapshot: odd number of SETITEMS items at byte ", at);
    c->items.insert(c->items.end(), items.begin(), items.end());
  }
  void memo_put(uint64_t idx, size_t at) {
    TORCH_CHECK(idx <= b_.size(), "snapshot: memo index ", idx, " at byte ", at, " beyond the input's size");
    if (idx >= memo_.size()) memo_.resize(idx + 1);
    memo_[idx] = top(at);
  }
  void memo_get(uint64_t idx, size_t at) {
    TORCH_CHECK(idx < memo_.size() && memo_[idx], "snapshot: memo index ", idx, " at byte ", at, " was never stored");
    push(memo_[idx]);
  }

  const std::string& b_;
  size_t pos_ = 0;
  std::vector<PRef> stack_;
  std::vector<size_t> marks_;
  std::vector<PRef> memo_;
};

const PValue* get(const PValue& d, const char* key) {
  if (d.kind != PValue::kDict) return nullptr;
  for (size_t k = 0; k + 1 < d.items.size(); k += 2) {
    if (d.items[k]->kind == PValue::kStr && d.items[k]->s == key) return d.items[k + 1].get();
  }
  return nullptr;
}
int64_t get_int(const PValue& d, const char* key, int64_t fallback = 0) {
  const PValue* v = get(d, key);
  return v && (v->kind == PValue::kInt || v->kind == PValue::kBool) ? v->i : fallback;
}
std::string get_str(const PValue& d, const char* key) {
  const PValue* v = get(d, key);
  return v && v->kind == PValue::kStr ? v->s : std::string();
}
const std::vector<PRef>& get_list(const PValue& d, const char* key, const char* what) {
  const PValue* v = get(d, key);
  TORCH_CHECK(v && v->kind == PValue::kList, "snapshot: expected ", what, " to have a list '", key,
              "' (not a memory snapshot)");
  return v->items;
}

// C++ frames every allocation shares (the unwinder, the caching allocator,
// the empty-tensor factories, dispatcher glue): they name no op.
bool plumbing_frame(const std::string& name) {
  static const char* const kPlumbing[] = {
      "torch::unwind", "CapturedTraceback", "gather_with_cpp", "CUDACachingAllocator", "empty_generic",
      "empty_cuda", "create_out", "set_output_raw_strided", "wrap_kernel_functor", "c10::Dispatcher",
      "c10::OperatorHandle", "_ops::"};
  for (const char* p : kPlumbing) {
    if (name.find(p) != std::string::npos) return true;
  }
  return false;
}

// The Python frames say where an allocation came from; the C++ ones above
// them (unwind, the allocator) are the same for all, so they go last, and
// the plumbing among them is skipped: an allocation made in backward (on
// the autograd engine's thread, no Python frame) is named by its op.
std::vector<SnapshotFrame> frames_of(const PValue& d) {
  std::vector<SnapshotFrame> py, cxx;
  const PValue* f = get(d, "frames");
  if (!f || f->kind != PValue::kList) return {};
  for (const auto& e : f->items) {
    SnapshotFrame fr{get_str(*e, "name"), get_str(*e, "filename"), get_int(*e, "line")};
    const bool is_py = fr.filename.size() > 3 && fr.filename.compare(fr.filename.size() - 3, 3, ".py") == 0;
    if (!is_py && plumbing_frame(fr.name)) continue;
    auto& dst = is_py ? py : cxx;
    if (static_cast<int>(dst.size()) < kSnapshotFrames) dst.push_back(std::move(fr));
  }
  for (auto& fr : cxx) {
    if (static_cast<int>(py.size()) >= kSnapshotFrames) break;
    py.push_back(std::move(fr));
  }
  return py;
}

} // namespace

Snapshot parse_snapshot(const std::string& bytes) {
  PRef root = Unpickler(bytes).run();
  TORCH_CHECK(root->kind == PValue::kDict, "snapshot: expected a dict at the top, but got kind ", int(root->kind),
              " (not a memory snapshot)");
  Snapshot snap;
  for (const auto& s : get_list(*root, "segments", "the snapshot")) {
    SnapshotSegment seg;
    seg.address = static_cast<uint64_t>(get_int(*s, "address"));
    seg.total_bytes = get_int(*s, "total_size");
    seg.allocated_bytes = get_int(*s, "allocated_size");
    seg.requested_bytes = get_int(*s, "requested_size");
    seg.stream = get_int(*s, "stream");
    seg.device = get_int(*s, "device");
    seg.segment_type = get_str(*s, "segment_type");
    seg.expandable = get_int(*s, "is_expandable") != 0;
    TORCH_CHECK(seg.total_bytes >= 0, "snapshot: segment at ", seg.address, " has negative total_size ",
                seg.total_bytes);
    for (const auto& b : get_list(*s, "blocks", "a segment")) {
      SnapshotBlock blk;
      blk.address = static_cast<uint64_t>(get_int(*b, "address"));
      blk.size_bytes = get_int(*b, "size");
      blk.requested_bytes = get_int(*b, "requested_size");
      blk.state = get_str(*b, "state");
      blk.frames = frames_of(*b);
      seg.blocks.push_back(std::move(blk));
    }
    snap.segments.push_back(std::move(seg));
  }
  if (const PValue* dt = get(*root, "device_traces"); dt && dt->kind == PValue::kList) {
    for (size_t dev = 0; dev < dt->items.size(); ++dev) {
      const PValue& t = *dt->items[dev];
      if (t.kind != PValue::kList || t.items.empty()) continue;
      for (const auto& e : t.items) {
        TraceEntry te;
        te.action = get_str(*e, "action");
        te.addr = static_cast<uint64_t>(get_int(*e, "addr"));
        te.size_bytes = get_int(*e, "size");
        te.stream = get_int(*e, "stream");
        te.device = static_cast<int64_t>(dev);
        te.time_us = get_int(*e, "time_us");
        te.frames = frames_of(*e);
        snap.traces.push_back(std::move(te));
      }
      break;
    }
  }
  if (const PValue* st = get(*root, "allocator_settings")) {
    if (const PValue* c = get(*st, "PYTORCH_CUDA_ALLOC_CONF"); c && c->kind == PValue::kStr) snap.alloc_conf = c->s;
  }
  return snap;
}

Snapshot read_snapshot(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  TORCH_CHECK(in, "snapshot: cannot open ", path);
  const auto size = static_cast<int64_t>(in.tellg());
  TORCH_CHECK(size >= 0 && size <= (int64_t{4} << 30), "snapshot: ", path, " has ", size,
              " bytes, expected at most 4 GiB");
  std::string bytes(static_cast<size_t>(size), '\0');
  in.seekg(0);
  in.read(bytes.data(), size);
  TORCH_CHECK(in, "snapshot: cannot read ", path);
  try {
    return parse_snapshot(bytes);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, path, ": ", e.what_without_backtrace());
  }
}

namespace {

// One request of the trace, paired with its free.
struct Request {
  int64_t requested_bytes = 0;
  int64_t stream = 0;
  uint64_t addr = 0;
};

// The requests live before recording began: freed in the trace without an
// alloc there, or live at the end without one.
std::vector<Request> preexisting(const Snapshot& snap) {
  std::unordered_set<uint64_t> live;
  std::map<uint64_t, Request> before;
  for (const auto& e : snap.traces) {
    if (e.action == "alloc") {
      live.insert(e.addr);
    } else if (e.action == "free_completed") {
      if (!live.erase(e.addr)) before[e.addr] = {e.size_bytes, e.stream, e.addr};
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
  std::vector<std::pair<int64_t, int64_t>> device_calls;  // (event, +size alloc / -size free)
  int64_t num_ooms = 0;  // requests the model could not serve (a device size set)
  std::vector<int64_t> reserved_after;  // per event: reserved after an alloc or free (-1: other events)
};

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
bool continues_free_run(const Snapshot& snap, size_t i) {
  return i > 0 && snap.traces[i].action == "segment_free" && snap.traces[i - 1].action == "segment_free";
}

} // namespace

std::string frame_label(const std::vector<SnapshotFrame>& frames) {
  for (const auto& fr : frames) {
    if (fr.line > 0) return fr.filename + ":" + std::to_string(fr.line) + " " + fr.name;
  }
  return frames.empty() ? std::string("(no frames)") : frames.front().name;
}

namespace {

std::vector<Request> seed_segments(const Snapshot& snap, const std::vector<Request>& before,
                                   CudaCachingAllocatorModel& m, std::unordered_map<uint64_t, uint64_t>& addr) {
  std::unordered_set<uint64_t> created;
  for (const auto& e : snap.traces) {
    if (e.action == "segment_alloc") created.insert(e.addr);
  }
  std::unordered_map<uint64_t, int64_t> final_size;
  for (const auto& sg : snap.segments) {
    for (const auto& b : sg.blocks) final_size[b.address] = b.size_bytes;
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
      auto fs = final_size.find(r.addr);
      int64_t size = fs != final_size.end() ? fs->second : m.round_size(r.requested_bytes);
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
  std::vector<Request> rest;
  for (size_t k = 0; k < before.size(); ++k) {
    if (!placed[k]) rest.push_back(before[k]);
  }
  return rest;
}

ModelRun run_model(const Snapshot& snap, const std::vector<Request>& before, CudaAllocatorConfig config,
                   bool seeded = false) {
  CudaCachingAllocatorModel m(std::move(config));
  std::unordered_map<uint64_t, uint64_t> addr;   // recorded -> model
  std::unordered_map<uint64_t, int64_t> event_of;  // model -> alloc event (-1: before recording)
  const auto unplaced = seeded ? seed_segments(snap, before, m, addr) : before;
  for (const auto& r : unplaced) {
    addr[r.addr] = m.malloc(r.requested_bytes, r.stream);
    event_of[addr[r.addr]] = -1;
  }
  std::vector<CudaSegmentInfo> at_peak = m.segments();
  m.reset_peak();
  ModelRun run;
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
    if (seeded && e.action == "segment_alloc") {
      m.set_next_segment_address(e.addr);
      continue;
    }
    if (e.action == "segment_free") {
      // Note [cudaFree in a recording]: every wholly free segment goes.
      if (continues_free_run(snap, i)) continue;
      m.empty_cache();
    } else if (e.action == "alloc") {
      addr[e.addr] = m.malloc(e.size_bytes, e.stream);
      if (seeded) m.set_next_segment_address(0);
      if (seeded && addr[e.addr] != e.addr && run.first_address_mismatch < 0) {
        run.first_address_mismatch = static_cast<int64_t>(i);
      }
      event_of[addr[e.addr]] = static_cast<int64_t>(i);
    } else if (e.action == "free_completed") {
      auto it = addr.find(e.addr);
      if (it == addr.end()) continue;
      if (it->second != 0) m.free(it->second);
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
  // Where the free bytes sat when reserved peaked.
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
        st.frames = it != event_of.end() && it->second >= 0 ? snap.traces[static_cast<size_t>(it->second)].frames
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
  return run;
}

} // namespace

SnapshotReplay replay_snapshot(const Snapshot& snap, const CudaAllocatorConfig& config) {
  SnapshotReplay r;
  r.num_events = static_cast<int64_t>(snap.traces.size());
  const auto before = preexisting(snap);
  r.num_preexisting_blocks = static_cast<int64_t>(before.size());

  // Recorded series: reserved from the segment events, walked back from the
  // final segments; requested and allocated (rounded as the model rounds)
  // from the allocs and completed frees.
  int64_t reserved = 0;
  for (const auto& s : snap.segments) reserved += s.total_bytes;
  for (const auto& e : snap.traces) {
    if (e.action == "segment_alloc" || e.action == "segment_map") reserved -= e.size_bytes;
    if (e.action == "segment_free" || e.action == "segment_unmap") reserved += e.size_bytes;
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
  std::vector<std::pair<int64_t, int64_t>> rec_calls;
  std::vector<int64_t> rec_reserved_after(snap.traces.size(), 0);
  const auto live_before = live;
  int64_t peak_requested_event = -1;  // the last event of the requested peak's first reach (-1: before the trace)
  for (size_t i = 0; i < snap.traces.size(); ++i) {
    const auto& e = snap.traces[i];
    const auto idx = static_cast<int64_t>(i);
    if (e.action == "segment_alloc" || e.action == "segment_map") {
      reserved += e.size_bytes;
      ++rec.num_segment_allocs;
      rec_calls.push_back({idx, 1});
    } else if (e.action == "segment_free" || e.action == "segment_unmap") {
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
  // What was live at the requested peak: a second pass up to it (copying
  // the live set at each new peak cost time quadratic in a growing trace).
  auto live_at_peak = live_before;
  for (int64_t i = 0; i <= peak_requested_event; ++i) {
    const auto& e = snap.traces[static_cast<size_t>(i)];
    if (e.action == "alloc") {
      live_at_peak[e.addr] = {e.size_bytes, i};
    } else if (e.action == "free_completed") {
      live_at_peak.erase(e.addr);
    }
  }
  // The same bytes by where they were allocated (snapshot --diff).
  {
    std::unordered_map<std::string, std::pair<int64_t, int64_t>> by;
    for (const auto& [a, v] : live_at_peak) {
      const std::string where =
          v.second < 0 ? std::string("(before recording)") : frame_label(snap.traces[static_cast<size_t>(v.second)].frames);
      by[where].first += v.first;
      by[where].second += 1;
    }
    for (auto& [where, bc] : by) r.live_at_peak_by_frame.push_back({where, bc.first, bc.second});
    std::sort(r.live_at_peak_by_frame.begin(), r.live_at_peak_by_frame.end(),
              [](const auto& x, const auto& y) { return x.requested_bytes > y.requested_bytes; });
  }
  // The allocations live when requested bytes peaked, largest first.
  std::unordered_map<int64_t, const TraceEntry*> alloc_at;
  std::vector<std::pair<int64_t, int64_t>> sorted;
  for (const auto& [a, v] : live_at_peak) sorted.push_back(v);
  std::sort(sorted.begin(), sorted.end(), [](auto& x, auto& y) { return x.first > y.first; });
  for (size_t k = 0; k < sorted.size() && k < 10; ++k) {
    LiveAllocation la{sorted[k].first, sorted[k].second, {}};
    if (la.event >= 0) la.frames = snap.traces[static_cast<size_t>(la.event)].frames;
    r.top_live_at_peak.push_back(std::move(la));
  }

  auto run = run_model(snap, before, config, /*seeded=*/true);
  r.model = run.fig;
  r.model_free_at_peak_bytes = run.free_at_peak_bytes;
  r.stranded_at_peak = run.stranded;
  r.model_free_in_unused_segments_bytes = run.free_in_unused_bytes;
  // The model's device calls happen during the alloc/free that caused them;
  // the recording logs segment_alloc just before its alloc, segment_free
  // before the event that follows. Compare them by order and size direction,
  // and by the alloc they belong to.
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
  // The reserved series: after every alloc and completed free (a run of
  // recorded segment_frees ends before the event that follows it).
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
  if (run.first_address_mismatch >= 0 && (r.matches || run.first_address_mismatch < *r.first_mismatch)) {
    const auto& e = snap.traces[static_cast<size_t>(run.first_address_mismatch)];
    r.matches = false;
    r.first_mismatch = run.first_address_mismatch;
    r.mismatch = "alloc of " + std::to_string(e.size_bytes) + " B at event " +
                 std::to_string(run.first_address_mismatch) + ": recorded at address " + std::to_string(e.addr) +
                 ", model elsewhere";
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
