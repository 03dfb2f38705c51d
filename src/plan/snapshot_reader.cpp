#include "trainmem/snapshot.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string_view>
#include <unordered_map>
#include <unordered_set>

#include <c10/util/Exception.h>

namespace trainmem {

const std::vector<SnapshotFrame>& Snapshot::frames(const TraceEntry& e) const {
  static const std::vector<SnapshotFrame> kNone;
  return e.stack >= 0 && static_cast<size_t>(e.stack) < stacks.size() ? stacks[static_cast<size_t>(e.stack)] : kNone;
}

namespace {

// Note [The snapshot reader]
// LibTorch's unpickler wants tensors and IValues and rejects what Python's
// pickle.dump writes for dicts of frames, so this is a reader of the
// plain-data subset. A snapshot is mostly its trace: a million entries,
// each a dict with a list of a dozen frame dicts. No tree of them is kept:
//  - A dict becomes what the snapshot keeps as soon as its SETITEM(S) lands
//    (the pickler fills a dict right after making it, before it goes into a
//    container): a frame dict an interned frame, a dict with an "action" a
//    TraceEntry, and that entry's frames list an interned stack of the
//    frames kept (kSnapshotFrames).
//  - Strings are views into the input (a file is mapped, and the pages
//    already read are handed back as the reader moves on).
//  - The memo keeps only what a later BINGET reads: a first pass over the
//    opcodes finds those indices, so a pickle that memoises every object
//    (protocol 4 does) costs no more than one that memoises none.
//  - A container placed in another is closed: nothing is added to it after.
//    No cycle can form, a depth is final once known, and every container
//    is freed as soon as nothing refers to it.
// Every object costs at least one opcode byte, so memory is bounded by the
// input, and by far less for a snapshot.
constexpr int32_t kMaxDepth = 1000;
constexpr size_t kTellEvery = size_t{64} << 20;  // how often the reader says how far it has read

struct Node;
struct Val {
  enum Kind : uint8_t { kNone, kBool, kInt, kFloat, kStr, kFrame, kEntry, kNode } kind = kNone;
  int64_t i = 0;  // bool, int, float bits; string: offset into the input; frame id; entry index
  int64_t n = 0;  // string: length
  std::shared_ptr<Node> node;
};
// A list, dict or tuple; or, once read, what it became (its items dropped).
struct Node {
  enum Kind : uint8_t { kList, kDict, kTuple, kFrame, kEntry, kStack } kind = kList;
  bool closed = false;
  int32_t depth = 1;
  int64_t id = -1;         // kFrame: frame id; kEntry: entry index; kStack: stack id
  std::vector<Val> items;  // list, tuple; dict: key, value, key, value...
};

// One opcode and its argument, decoded.
struct Op {
  unsigned char code = 0;
  size_t at = 0;              // byte offset of the opcode
  uint64_t n = 0;             // integer argument, memo index, or length of `arg`
  const char* arg = nullptr;  // the argument's bytes
};

class OpDecoder {
 public:
  explicit OpDecoder(std::string_view b) : b_(b) {}
  size_t pos() const { return pos_; }

  Op next() {
    TORCH_CHECK(pos_ < b_.size(), "snapshot: truncated pickle at byte ", pos_, " (no STOP opcode)");
    Op op;
    op.at = pos_;
    op.code = static_cast<unsigned char>(b_[pos_++]);
    switch (op.code) {
      case 0x80: case 'K': case 'q': case 'h': op.n = u8(take(1)); break;  // PROTO, BININT1, BINPUT, BINGET
      case 'M': op.n = le(take(2), 2); break;
      case 'J': case 'r': case 'j': op.n = le(take(4), 4); break;  // BININT, LONG_BINPUT, LONG_BINGET
      case 0x95: take(8); break;                                   // FRAME
      case 'G': op.arg = take(8); break;
      case 0x8a: case 0x8b: {  // LONG1, LONG4
        op.n = op.code == 0x8a ? u8(take(1)) : le(take(4), 4);
        // Python writes unsigned 64-bit values of 2^63 and more (CUDA
        // stream handles) in 9 bytes, the last one a 0 sign byte.
        TORCH_CHECK(op.n <= 8 || op.n == 9, "snapshot: integer of ", op.n, " bytes at byte ", op.at,
                    " does not fit in 64 bits");
        op.arg = take(op.n);
        break;
      }
      case 0x8c: case 'U': case 'C': bytes(u8(take(1)), op); break;  // SHORT_BINUNICODE, SHORT_BINSTRING/BYTES
      case 'X': case 'T': case 'B': bytes(le(take(4), 4), op); break;
      case 0x8d: case 0x8e: bytes(le(take(8), 8), op); break;
      case '.': case '(': case '}': case ']': case ')': case 'N': case 0x88: case 0x89: case 0x94: case '0':
      case '2': case '1': case 'a': case 'e': case 's': case 'u': case 't': case 0x85: case 0x86: case 0x87:
        break;
      default:
        TORCH_CHECK(false, "snapshot: unsupported pickle opcode 0x", std::hex, int(op.code), std::dec, " at byte ",
                    op.at, " (not a memory snapshot: only plain dicts, lists, strings and numbers are read)");
    }
    return op;
  }

  static uint64_t u8(const char* p) { return static_cast<unsigned char>(*p); }
  static uint64_t le(const char* p, uint64_t n) {
    uint64_t v = 0;
    for (uint64_t k = 0; k < n; ++k) v |= u8(p + k) << (8 * k);
    return v;
  }

 private:
  const char* take(uint64_t n) {
    TORCH_CHECK(n <= b_.size() - pos_, "snapshot: truncated pickle at byte ", pos_, ": expected ", n,
                " more bytes, but the input has ", b_.size() - pos_);
    const char* p = b_.data() + pos_;
    pos_ += n;
    return p;
  }
  void bytes(uint64_t n, Op& op) {
    TORCH_CHECK(n <= b_.size() - pos_, "snapshot: string of ", n, " bytes at byte ", op.at, " runs past the end (",
                b_.size(), " bytes)");
    op.n = n;
    op.arg = take(n);
  }

  std::string_view b_;
  size_t pos_ = 0;
};

// The memo indices some BINGET reads: the first pass. An input it cannot
// decode stops it; the second pass then reports the error.
std::vector<bool> memo_reads(std::string_view b, const std::function<void(size_t)>& consumed) {
  std::vector<bool> read;
  OpDecoder d(b);
  size_t told = 0;
  try {
    for (Op op = d.next(); op.code != '.'; op = d.next()) {
      if (consumed && d.pos() - told >= kTellEvery) consumed(told = d.pos());
      if ((op.code == 'h' || op.code == 'j') && op.n <= b.size()) {
        if (op.n >= read.size()) read.resize(op.n + 1);
        read[op.n] = true;
      }
    }
  } catch (const c10::Error&) {
  }
  return read;
}

bool ends_with_py(const std::string& f) { return f.size() > 3 && f.compare(f.size() - 3, 3, ".py") == 0; }

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

size_t combine(size_t h, size_t v) { return h ^ (v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2)); }

class Reader {
 public:
  // `consumed(pos)` is told, every 64 MiB, that the bytes before `pos` are read.
  Reader(std::string_view b, std::function<void(size_t)> consumed)
      : b_(b), d_(b), consumed_(std::move(consumed)), memo_read_(memo_reads(b, consumed_)) {}

  Snapshot run() {
    Val root = parse();
    TORCH_CHECK(root.kind == Val::kNode && root.node->kind == Node::kDict,
                "snapshot: expected a dict at the top, but got kind ", int(root.kind), " (not a memory snapshot)");
    const Node& top = *root.node;
    for (const auto& s : list(top, "segments", "the snapshot")) {
      TORCH_CHECK(is(s, Node::kDict), "snapshot: a segment is not a dict (not a memory snapshot)");
      const Node& sd = *s.node;
      SnapshotSegment seg;
      seg.address = static_cast<uint64_t>(get_int(sd, "address"));
      seg.total_bytes = get_int(sd, "total_size");
      seg.allocated_bytes = get_int(sd, "allocated_size");
      seg.requested_bytes = get_int(sd, "requested_size");
      seg.stream = get_int(sd, "stream");
      seg.device = get_int(sd, "device");
      seg.segment_type = get_str(sd, "segment_type");
      seg.expandable = get_int(sd, "is_expandable") != 0;
      const Val* pool = get(sd, "segment_pool_id");
      if (pool && is(*pool, Node::kTuple) && pool->node->items.size() == 2) {
        seg.pool_id = {int_of(&pool->node->items[0]), int_of(&pool->node->items[1])};
      }
      TORCH_CHECK(seg.total_bytes >= 0, "snapshot: segment at ", seg.address, " has negative total_size ",
                  seg.total_bytes);
      // Blocks of 2.0-era snapshots carry no address: they tile the segment.
      uint64_t at = seg.address;
      for (const auto& b : list(sd, "blocks", "a segment")) {
        SnapshotBlock blk;
        if (is(b, Node::kDict)) {
          const Node& bd = *b.node;
          const Val* address = get(bd, "address");
          blk.address = address ? static_cast<uint64_t>(int_of(address)) : at;
          blk.size_bytes = get_int(bd, "size");
          blk.requested_bytes = get_int(bd, "requested_size");
          blk.state = get_str(bd, "state");
          at = blk.address + static_cast<uint64_t>(std::max<int64_t>(blk.size_bytes, 0));
          if (const Val* f = get(bd, "frames")) {
            const int32_t st = stack_of(*f);
            if (st >= 0) blk.frames = snap_.stacks[static_cast<size_t>(st)];
          }
        }
        seg.blocks.push_back(std::move(blk));
      }
      snap_.segments.push_back(std::move(seg));
    }
    // Every device's trace, in order: device_traces[d] is device d's.
    if (const Val* dt = get(top, "device_traces"); dt && is(*dt, Node::kList)) {
      snap_.traces.reserve(entries_.size());
      for (size_t dev = 0; dev < dt->node->items.size(); ++dev) {
        const Val& t = dt->node->items[dev];
        if (!is(t, Node::kList)) continue;
        for (const auto& e : t.node->items) {
          const int64_t k = entry_of(e);
          snap_.traces.push_back(k >= 0 ? entries_[static_cast<size_t>(k)] : TraceEntry{});
          snap_.traces.back().device = static_cast<int64_t>(dev);
        }
      }
    }
    if (const Val* st = get(top, "allocator_settings"); st && is(*st, Node::kDict)) {
      if (const Val* c = get(*st->node, "PYTORCH_CUDA_ALLOC_CONF"); c && c->kind == Val::kStr) {
        snap_.alloc_conf = std::string(view(*c));
      }
    }
    return std::move(snap_);
  }

 private:
  Val parse() {
    size_t told = 0;
    while (true) {
      if (consumed_ && d_.pos() - told >= kTellEvery) consumed_(told = d_.pos());
      const Op op = d_.next();
      const size_t at = op.at;
      switch (op.code) {
        case 0x80: case 0x95: break;  // PROTO, FRAME
        case '.':                     // STOP
          TORCH_CHECK(stack_.size() == 1 && marks_.empty(), "snapshot: STOP at byte ", at, " with ",
                      stack_.size(), " objects on the stack, expected 1");
          return std::move(stack_.back());
        case '(':
          TORCH_CHECK(marks_.size() < static_cast<size_t>(kMaxDepth), "snapshot: nesting deeper than ", kMaxDepth,
                      " at byte ", at);
          marks_.push_back(stack_.size());
          break;
        case '}': push_node(Node::kDict); break;
        case ']': push_node(Node::kList); break;
        case ')': push_node(Node::kTuple); break;
        case 'N': stack_.push_back(Val{}); break;
        case 0x88: case 0x89: push_scalar(Val::kBool, op.code == 0x88); break;
        case 'K': case 'M': push_scalar(Val::kInt, static_cast<int64_t>(op.n)); break;
        case 'J': push_scalar(Val::kInt, static_cast<int32_t>(op.n)); break;
        case 0x8a: case 0x8b: {
          if (op.n == 9) {
            TORCH_CHECK(OpDecoder::u8(op.arg + 8) == 0, "snapshot: negative integer of 9 bytes at byte ", at,
                        " does not fit in 64 bits");
            push_scalar(Val::kInt, static_cast<int64_t>(OpDecoder::le(op.arg, 8)));
            break;
          }
          uint64_t v = OpDecoder::le(op.arg, op.n);
          if (op.n > 0 && op.n < 8 && (OpDecoder::u8(op.arg + op.n - 1) & 0x80)) v |= ~uint64_t{0} << (8 * op.n);
          push_scalar(Val::kInt, static_cast<int64_t>(v));
          break;
        }
        case 'G': {
          uint64_t bits = 0;
          for (int k = 0; k < 8; ++k) bits = (bits << 8) | OpDecoder::u8(op.arg + k);
          push_scalar(Val::kFloat, static_cast<int64_t>(bits));
          break;
        }
        case 0x8c: case 'U': case 'C': case 'X': case 'T': case 'B': case 0x8d: case 0x8e: {
          Val v;
          v.kind = Val::kStr;
          v.i = op.arg - b_.data();
          v.n = static_cast<int64_t>(op.n);
          stack_.push_back(std::move(v));
          break;
        }
        case 0x94: memo_put(memo_size_, at); break;
        case 'q': case 'r': memo_put(op.n, at); break;
        case 'h': case 'j': {
          auto it = memo_.find(op.n);
          TORCH_CHECK(it != memo_.end(), "snapshot: memo index ", op.n, " at byte ", at, " was never stored");
          stack_.push_back(it->second);
          break;
        }
        case '0': pop(at); break;
        case '2': stack_.push_back(top(at)); break;
        case '1': pop_mark(at); break;
        case 'a': insert(stack_.size() - 1, Node::kList, "APPEND", at); break;
        case 'e': insert(pop_mark(at), Node::kList, "APPENDS", at); break;
        case 's': insert(stack_.size() - 2, Node::kDict, "SETITEM", at); break;
        case 'u': insert(pop_mark(at), Node::kDict, "SETITEMS", at); break;
        case 't': case 0x85: case 0x86: case 0x87: {
          size_t from = 0;
          if (op.code == 't') {
            from = pop_mark(at);
          } else {
            const size_t n = op.code - 0x84;
            TORCH_CHECK(stack_.size() >= base() + n, "snapshot: TUPLE", n, " at byte ", at, " on a short stack");
            from = stack_.size() - n;
          }
          Val t = make_node(Node::kTuple);
          fill(*t.node, from, at);
          stack_.push_back(std::move(t));
          break;
        }
      }
    }
  }

  static Val make_node(Node::Kind k) {
    Val v;
    v.kind = Val::kNode;
    v.node = std::make_shared<Node>();
    v.node->kind = k;
    return v;
  }
  void push_node(Node::Kind k) { stack_.push_back(make_node(k)); }
  void push_scalar(Val::Kind k, int64_t i) {
    Val v;
    v.kind = k;
    v.i = i;
    stack_.push_back(std::move(v));
  }
  size_t base() const { return marks_.empty() ? 0 : marks_.back(); }
  const Val& top(size_t at) const {
    TORCH_CHECK(stack_.size() > base(), "snapshot: empty stack at byte ", at);
    return stack_.back();
  }
  void pop(size_t at) {
    top(at);
    stack_.pop_back();
  }
  // Pops the innermost MARK; returns where its items start on the stack.
  size_t pop_mark(size_t at) {
    TORCH_CHECK(!marks_.empty(), "snapshot: no MARK before byte ", at);
    const size_t m = marks_.back();
    marks_.pop_back();
    return m;
  }
  // Moves stack_[from, end) into `c`, closing every container among them.
  void fill(Node& c, size_t from, size_t at) {
    for (size_t k = from; k < stack_.size(); ++k) {
      Val& v = stack_[k];
      if (v.kind == Val::kNode) {
        TORCH_CHECK(v.node.get() != &c, "snapshot: an object is put inside itself at byte ", at,
                    " (not a memory snapshot)");
        v.node->closed = true;
        c.depth = std::max(c.depth, v.node->depth + 1);
        TORCH_CHECK(c.depth <= kMaxDepth, "snapshot: nesting deeper than ", kMaxDepth, " at byte ", at);
      }
      c.items.push_back(std::move(v));
    }
    stack_.resize(from);
  }
  // APPEND(S), SETITEM(S): stack_[from, end) go into the container below them.
  void insert(size_t from, Node::Kind want, const char* what, size_t at) {
    TORCH_CHECK(from <= stack_.size() && from > base() && from >= 1, "snapshot: ", what, " at byte ", at,
                " on a short stack");
    Val& c = stack_[from - 1];
    TORCH_CHECK(c.kind == Val::kNode && c.node->kind == want, "snapshot: ", what, " to a non-",
                want == Node::kList ? "list" : "dict", " at byte ", at);
    TORCH_CHECK(!c.node->closed, "snapshot: ", what, " at byte ", at,
                " changes an object already placed in another (not a memory snapshot)");
    TORCH_CHECK(want != Node::kDict || (stack_.size() - from) % 2 == 0, "snapshot: odd number of ", what,
                " items at byte ", at);
    fill(*c.node, from, at);
    if (want == Node::kDict) read_dict(stack_.back());
  }
  void memo_put(uint64_t idx, size_t at) {
    TORCH_CHECK(idx <= b_.size(), "snapshot: memo index ", idx, " at byte ", at, " beyond the input's size");
    const Val& v = top(at);
    memo_size_ = std::max(memo_size_, idx + 1);
    if (idx < memo_read_.size() && memo_read_[idx]) memo_[idx] = v;
  }

  std::string_view view(const Val& v) const {
    return std::string_view(b_.data() + v.i, static_cast<size_t>(v.n));
  }
  static bool is(const Val& v, Node::Kind k) { return v.kind == Val::kNode && v.node->kind == k; }
  const Val* get(const Node& d, std::string_view key) const {
    if (d.kind != Node::kDict) return nullptr;
    for (size_t k = 0; k + 1 < d.items.size(); k += 2) {
      if (d.items[k].kind == Val::kStr && view(d.items[k]) == key) return &d.items[k + 1];
    }
    return nullptr;
  }
  static int64_t int_of(const Val* v) { return v && (v->kind == Val::kInt || v->kind == Val::kBool) ? v->i : 0; }
  int64_t get_int(const Node& d, std::string_view key) const { return int_of(get(d, key)); }
  std::string_view sv_of(const Val* v) const { return v && v->kind == Val::kStr ? view(*v) : std::string_view(); }
  std::string str_of(const Val* v) const { return std::string(sv_of(v)); }
  std::string get_str(const Node& d, std::string_view key) const { return str_of(get(d, key)); }
  const std::vector<Val>& list(const Node& d, std::string_view key, const char* what) const {
    const Val* v = get(d, key);
    TORCH_CHECK(v && is(*v, Node::kList), "snapshot: expected ", what, " to have a list '", key,
                "' (not a memory snapshot)");
    return v->node->items;
  }
  static int64_t entry_of(const Val& v) {
    if (v.kind == Val::kEntry) return v.i;
    return is(v, Node::kEntry) ? v.node->id : -1;
  }

  // A dict just filled: a frame or a trace entry becomes what is kept of it.
  void read_dict(Val& v) {
    Node& d = *v.node;
    const Val *name = nullptr, *file = nullptr, *line = nullptr, *action = nullptr, *frames = nullptr;
    for (size_t k = 0; k + 1 < d.items.size(); k += 2) {
      const Val& key = d.items[k];
      if (key.kind != Val::kStr) continue;
      const auto s = view(key);
      const Val* val = &d.items[k + 1];
      if (s == "name") name = val;
      else if (s == "filename") file = val;
      else if (s == "line") line = val;
      else if (s == "action") action = val;
      else if (s == "frames") frames = val;
    }
    if (action && action->kind == Val::kStr) {
      TraceEntry te;
      te.action = std::string(view(*action));
      te.addr = static_cast<uint64_t>(get_int(d, "addr"));
      te.size_bytes = get_int(d, "size");
      te.stream = get_int(d, "stream");
      te.time_us = get_int(d, "time_us");
      te.device_free = get_int(d, "device_free");
      if (frames) te.stack = stack_of(*frames);
      entries_.push_back(std::move(te));
      become(v, Node::kEntry, Val::kEntry, static_cast<int64_t>(entries_.size() - 1));
    } else if (name && file && !frames) {
      become(v, Node::kFrame, Val::kFrame, frame_id(sv_of(name), sv_of(file), int_of(line)));
    }
  }
  // `v` (and its node, for whoever else holds it) is now what was read from it.
  static void become(Val& v, Node::Kind nk, Val::Kind vk, int64_t id) {
    if (v.node.use_count() > 1) {
      v.node->kind = nk;
      v.node->id = id;
      std::vector<Val>().swap(v.node->items);
    }
    v.node.reset();
    v.kind = vk;
    v.i = id;
  }

  int32_t frame_id(std::string_view name, std::string_view file, int64_t line) {
    if (auto it = frame_ids_.find(FrameKey{name, file, line}); it != frame_ids_.end()) return it->second;
    frames_.push_back({std::string(name), std::string(file), line});
    const auto& f = frames_.back();
    const auto id = static_cast<int32_t>(frames_.size() - 1);
    frame_ids_.emplace(FrameKey{f.name, f.filename, f.line}, id);
    const bool py = ends_with_py(f.filename);
    frame_kind_.push_back(py ? kPython : plumbing_frame(f.name) ? kPlumbing : kCxx);
    return id;
  }
  int32_t frame_of(const Val& v) {
    if (v.kind == Val::kFrame) return static_cast<int32_t>(v.i);
    if (is(v, Node::kFrame)) return static_cast<int32_t>(v.node->id);
    if (is(v, Node::kDict)) {
      const Node& d = *v.node;
      return frame_id(sv_of(get(d, "name")), sv_of(get(d, "filename")), get_int(d, "line"));
    }
    return frame_id("", "", 0);
  }

  // The frames kept of a frames list (Python frames first, then C++ ones
  // past the allocator's plumbing: an allocation made in backward, on the
  // autograd engine's thread, has no Python frame and is named by its op),
  // interned. -1 when `v` is not a list.
  int32_t stack_of(const Val& v) {
    if (is(v, Node::kStack)) return static_cast<int32_t>(v.node->id);
    if (!is(v, Node::kList)) return -1;
    StackKey key;
    std::array<int32_t, kSnapshotFrames> cxx{};
    int ncxx = 0;
    for (const auto& f : v.node->items) {
      const int32_t id = frame_of(f);
      const auto kind = frame_kind_[static_cast<size_t>(id)];
      if (kind == kPython && key.n < kSnapshotFrames) key.ids[static_cast<size_t>(key.n++)] = id;
      if (kind == kCxx && ncxx < kSnapshotFrames) cxx[static_cast<size_t>(ncxx++)] = id;
    }
    for (int k = 0; k < ncxx && key.n < kSnapshotFrames; ++k) key.ids[static_cast<size_t>(key.n++)] = cxx[static_cast<size_t>(k)];
    auto [it, fresh] = stack_ids_.emplace(key, static_cast<int32_t>(snap_.stacks.size()));
    if (fresh) {
      std::vector<SnapshotFrame> st;
      for (int k = 0; k < key.n; ++k) st.push_back(frames_[static_cast<size_t>(key.ids[static_cast<size_t>(k)])]);
      snap_.stacks.push_back(std::move(st));
    }
    v.node->kind = Node::kStack;  // whoever shares this list shares its stack
    v.node->id = it->second;
    std::vector<Val>().swap(v.node->items);
    return it->second;
  }

  struct FrameKey {
    std::string_view name, file;
    int64_t line;
    bool operator==(const FrameKey& o) const { return line == o.line && name == o.name && file == o.file; }
  };
  struct FrameHash {
    size_t operator()(const FrameKey& k) const {
      return combine(combine(std::hash<std::string_view>()(k.name), std::hash<std::string_view>()(k.file)),
                     std::hash<int64_t>()(k.line));
    }
  };
  struct StackKey {
    std::array<int32_t, kSnapshotFrames> ids{};
    int n = 0;
    bool operator==(const StackKey& o) const { return n == o.n && ids == o.ids; }
  };
  struct StackHash {
    size_t operator()(const StackKey& k) const {
      size_t h = std::hash<int>()(k.n);
      for (int32_t id : k.ids) h = combine(h, std::hash<int32_t>()(id));
      return h;
    }
  };
  enum FrameKind : uint8_t { kPython, kCxx, kPlumbing };

  std::string_view b_;
  OpDecoder d_;
  std::function<void(size_t)> consumed_;
  std::vector<bool> memo_read_;
  std::unordered_map<uint64_t, Val> memo_;
  uint64_t memo_size_ = 0;
  std::vector<Val> stack_;
  std::vector<size_t> marks_;
  std::deque<SnapshotFrame> frames_;  // a deque: FrameKey views its strings
  std::vector<FrameKind> frame_kind_;
  std::unordered_map<FrameKey, int32_t, FrameHash> frame_ids_;
  std::unordered_map<StackKey, int32_t, StackHash> stack_ids_;
  std::vector<TraceEntry> entries_;
  Snapshot snap_;
};

} // namespace

Snapshot parse_snapshot(const std::string& bytes) { return Reader(bytes, nullptr).run(); }

Snapshot read_snapshot(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  TORCH_CHECK(fd >= 0, "snapshot: cannot open ", path, ": ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    TORCH_CHECK(false, "snapshot: ", path, " is not a regular file");
  }
  const auto size = static_cast<int64_t>(st.st_size);
  if (size > (int64_t{4} << 30)) {
    ::close(fd);
    TORCH_CHECK(false, "snapshot: ", path, " has ", size, " bytes, expected at most 4 GiB");
  }
  if (size == 0) {
    ::close(fd);
    try {
      return parse_snapshot(std::string());
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, path, ": ", e.what_without_backtrace());
    }
  }
  void* map = ::mmap(nullptr, static_cast<size_t>(size), PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  TORCH_CHECK(map != MAP_FAILED, "snapshot: cannot map ", path, ": ", std::strerror(errno));
  std::unique_ptr<void, std::function<void(void*)>> unmap(map, [size](void* p) { ::munmap(p, static_cast<size_t>(size)); });
  ::madvise(map, static_cast<size_t>(size), MADV_SEQUENTIAL);
  // The pages read are handed back (they come again from the page cache if
  // a memoised string is read later): resident memory stays what is kept.
  const long page = ::sysconf(_SC_PAGESIZE);
  auto consumed = [map, page](size_t pos) {
    const size_t n = pos / static_cast<size_t>(page) * static_cast<size_t>(page);
    if (n > 0) ::madvise(map, n, MADV_DONTNEED);
  };
  try {
    return Reader(std::string_view(static_cast<const char*>(map), static_cast<size_t>(size)), consumed).run();
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, path, ": ", e.what_without_backtrace());
  }
}

std::vector<int64_t> snapshot_devices(const Snapshot& snap) {
  std::set<int64_t> devices;
  for (const auto& s : snap.segments) devices.insert(s.device);
  for (const auto& e : snap.traces) devices.insert(e.device);
  return {devices.begin(), devices.end()};
}

Snapshot device_snapshot(const Snapshot& snap, int64_t device) {
  Snapshot out;
  out.stacks = snap.stacks;
  out.alloc_conf = snap.alloc_conf;
  for (const auto& s : snap.segments) {
    if (s.device == device) out.segments.push_back(s);
  }
  for (const auto& e : snap.traces) {
    if (e.device == device) out.traces.push_back(e);
  }
  return out;
}

std::string frame_label(const std::vector<SnapshotFrame>& frames) {
  for (const auto& fr : frames) {
    if (fr.line > 0) return fr.filename + ":" + std::to_string(fr.line) + " " + fr.name;
  }
  return frames.empty() ? std::string("(no frames)") : frames.front().name;
}

} // namespace trainmem
