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
      TORCH_CHECK(seg.total_bytes >= 0, "snapshot: segment at ", seg.address, " has negative total_size ",
                  seg.total_bytes);
      for (const auto& b : list(sd, "blocks", "a segment")) {
        SnapshotBlock blk;
        if (is(b, Node::kDict)) {
          const Node& bd = *b.node;
          blk.address = static_cast<uint64_t>(get_int(bd, "address"));
          blk.size_bytes = get_int(bd, "size");
          blk.requested_bytes = get_int(bd, "requested_size");
          blk.state = get_str(bd, "state");
          if (const Val* f = get(bd, "frames")) {
            const int32_t st = stack_of(*f);
            if (st >= 0) blk.frames = snap_.stacks[static_cast<size_t>(st)];
          }
        }
        seg.blocks.push_back(std::move(blk));
      }
      snap_.segments.push_back(std::move(seg));
    }
    if (const Val* dt = get(top, "device_traces"); dt && is(*dt, Node::kList)) {
      for (size_t dev = 0; dev < dt->node->items.size(); ++dev) {
        const Val& t = dt->node->items[dev];
        if (!is(t, Node::kList) || t.node->items.empty()) continue;
        snap_.traces.reserve(t.node->items.size());
        for (const auto& e : t.node->items) {
          const int64_t k = entry_of(e);
          snap_.traces.push_back(k >= 0 ? entries_[static_cast<size_t>(k)] : TraceEntry{});
          snap_.traces.back().device = static_cast<int64_t>(dev);
        }
        break;
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
  rec_reserved_after.assign(snap.traces.size(), 0);
  w.live_before = live;
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
  return w;
}

// The live set at the requested peak, by frame and its largest ten.
void attribute_peak(const Snapshot& snap, const RecordedWalk& w, SnapshotReplay& r) {
  const auto& live_before = w.live_before;
  const int64_t peak_requested_event = w.peak_requested_event;
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
          v.second < 0 ? std::string("(before recording)") : frame_label(snap.frames(snap.traces[static_cast<size_t>(v.second)]));
      by[where].first += v.first;
      by[where].second += 1;
    }
    for (auto& [where, bc] : by) r.live_at_peak_by_frame.push_back({where, bc.first, bc.second});
    std::sort(r.live_at_peak_by_frame.begin(), r.live_at_peak_by_frame.end(),
              [](const auto& x, const auto& y) { return x.requested_bytes > y.requested_bytes; });
  }
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

} // namespace

SnapshotReplay replay_snapshot(const Snapshot& snap, const CudaAllocatorConfig& config) {
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
  const auto& rec = r.recorded;
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
