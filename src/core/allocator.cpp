#include "trainmem/allocator.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include "core/detail/alloc_recorder.h"

// Note [Allocations belong to a recorder]
// Besides the process-wide counters, each block's header carries a tag: the
// AllocRecorder attached to the allocating thread (0 when none). A free,
// from any thread, goes to the recorder its block was made for, if that
// recorder still exists (the tag holds the slot and its generation; the
// slot's lock re-checks it). So an audit counts its own thread's work and
// the frees of its blocks wherever they happen, and two audits on two
// threads never see each other's bytes. Each slot caps its own event log:
// a step with millions of allocations costs at most max_events events.

// Note [Counting CPU allocator]
// We wrap the CPU allocator that is current when install() runs. Each block
// gets a 64-byte header (keeping the 64-byte alignment LibTorch's allocator
// guarantees) that records its size, so the free path knows what to subtract
// without a lookup; the DataPtr's context is the data pointer itself, which
// keeps Allocator::raw_allocate/raw_deallocate working. Counters are atomics;
// peak windows are a fixed array of slots updated with an atomic max, so the
// hot path takes no lock unless the event log is on.

namespace trainmem {
namespace {

constexpr size_t kHeader = 64;
constexpr int kMaxWindows = 64;  // one bit each in Counters' window masks
constexpr int kMaxRecorders = 64;
// Header layout: size (int64), recorder tag (uint64), allocation time
// (int64), epoch (uint64; Note [Blocks inherited through fork]), the
// allocation's number in its recorder's log (int64, kNotLogged if not logged;
// detail::RecordedEvent).
constexpr size_t kTagOffset = 8;
constexpr size_t kTimeOffset = 16;
constexpr size_t kEpochOffset = 24;
constexpr size_t kSeqOffset = 32;
using detail::kNotLogged;

// Note [Blocks inherited through fork]
// A child made by fork() inherits the parent's live blocks and the counters
// that count them. train_distributed() forks its ranks from the caller's
// process: the caller's live tensors (a previous run's results, a data set)
// would count in every rank's live bytes and peaks, which then depended on
// what the caller happened to hold (a DistributedTest run after others saw
// one gradient copy, 399,872 B, more than run alone). forget_inherited_blocks()
// starts a new epoch: the counters restart from zero, and a free whose block
// carries an older epoch is not counted.
std::atomic<uint64_t> g_epoch{0};

// A recorder slot's lock. It is taken once per allocation and free of the
// audited thread and held for a few dozen instructions; another thread
// takes it only for a free of the recorder's block or to read the recorder.
// A pthread mutex's lock and unlock cost about 60 instructions an event
// (callgrind, the LSTMCell decoder of docs/benchmarks.md); this costs one
// exchange and one store. A waiter yields (the holder may be descheduled).
class SlotLock {
 public:
  void lock() noexcept {
    while (held_.exchange(true, std::memory_order_acquire)) {
      while (held_.load(std::memory_order_relaxed)) {
        std::this_thread::yield();
      }
    }
  }
  void unlock() noexcept {
    held_.store(false, std::memory_order_release);
  }

 private:
  std::atomic<bool> held_{false};
};

struct RecorderSlot {
  SlotLock mutex;
  std::atomic<uint64_t> tag{0};  // 0: free slot
  bool logging = false;
  int64_t max_events = 0;
  int64_t dropped = 0;
  int64_t next_seq = 0;  // of the next logged allocation
  detail::AllocationShape shape;  // of the allocations since take_shape(), logged or not
  std::vector<detail::RecordedEvent> events;
  int64_t live = 0;
  int64_t window_peak = 0;  // of live + baseline
  // Note [A recorder's baseline]: bytes live when begin_baseline() ran that
  // are not this recorder's blocks, less those freed or adopted since.
  std::atomic<bool> baseline_on{false};
  int64_t baseline = 0;
  // When the baseline began; set before baseline_on, so a free can skip the
  // lock for the blocks made since (most of them).
  std::atomic<int64_t> baseline_ns{0};
  // A time taken just after the baseline read the live bytes (under `mutex`):
  // a free whose clock read came before it may have come before that read
  // too (Note [A recorder's baseline]).
  int64_t counted_ns = 0;
  std::vector<uint64_t> baseline_excluded;  // recorders live when the baseline began: their blocks are theirs
  std::vector<detail::AllocRecorder::BaselineFree> baseline_frees;

  // Under `mutex`: a block tagged `owner` made at `made_ns` is counted in
  // this baseline.
  bool in_baseline(uint64_t owner, int64_t made_ns) const {
    return baseline_on.load(std::memory_order_relaxed) && owner != tag.load(std::memory_order_relaxed) &&
        made_ns < baseline_ns.load(std::memory_order_relaxed) &&
        std::find(baseline_excluded.begin(), baseline_excluded.end(), owner) == baseline_excluded.end();
  }
};

// Recorders with a baseline: while none has one, a free costs no slot walk.
std::atomic<int> g_num_baselines{0};
// The latest time a baseline began (never lowered): a block made at or after
// it is in no baseline, so its free (most frees) skips the slot walk too.
std::atomic<int64_t> g_latest_baseline_ns{0};

RecorderSlot* recorder_slots() {
  static auto* slots = new RecorderSlot[kMaxRecorders];  // never destroyed
  return slots;
}
std::atomic<uint64_t> next_generation{1};
thread_local uint64_t tls_recorder_tag = 0;
// detail::set_allocation_alarm(): fires at most once.
thread_local void (*tls_alarm)() noexcept = nullptr;
thread_local bool tls_alarm_grad = false;

int slot_of(uint64_t tag) {
  return static_cast<int>(tag & 0x7f) - 1;
}

// Never throws (allocation and free paths). `block` is the header: an
// allocation that is logged writes its number there, a free reads it.
void to_recorder(uint64_t tag, int64_t bytes, int64_t time_ns, const void* ptr, char* block) noexcept {
  const int slot = slot_of(tag);
  if (slot < 0 || slot >= kMaxRecorders) {
    return;
  }
  auto& r = recorder_slots()[slot];
  if (r.tag.load(std::memory_order_relaxed) != tag) {
    return;
  }
  try {
    std::lock_guard<SlotLock> lock(r.mutex);
    if (r.tag.load(std::memory_order_relaxed) != tag) {
      return;
    }
    r.live += bytes;
    r.window_peak = std::max(r.window_peak, r.live + r.baseline);
    if (bytes > 0) {
      r.shape.add(bytes);
    }
    if (!r.logging) {
      return;
    }
    if (static_cast<int64_t>(r.events.size()) >= r.max_events) {
      ++r.dropped;
      return;
    }
    int64_t seq = kNotLogged;
    if (bytes > 0) {
      seq = r.next_seq++;
      std::memcpy(block + kSeqOffset, &seq, sizeof(seq));
    } else {
      std::memcpy(&seq, block + kSeqOffset, sizeof(seq));
    }
    r.events.push_back({time_ns, bytes, reinterpret_cast<uint64_t>(ptr), seq});
  } catch (...) {
    // losing an event is acceptable; failing an allocation is not
  }
}

// A free of a block made before some recorder's baseline began and not that
// recorder's own: its baseline shrinks (Note [A recorder's baseline]).
// Never throws (free path).
void to_baselines(uint64_t tag, int64_t bytes, int64_t alloc_ns, int64_t time_ns, const void* /*ptr*/) noexcept {
  auto* slots = recorder_slots();
  for (int i = 0; i < kMaxRecorders; ++i) {
    auto& r = slots[i];
    if (!r.baseline_on.load(std::memory_order_acquire) || alloc_ns >= r.baseline_ns.load(std::memory_order_relaxed)) {
      continue;  // no baseline, or a block made since it began
    }
    try {
      std::lock_guard<SlotLock> lock(r.mutex);
      if (!r.in_baseline(tag, alloc_ns) || time_ns < r.counted_ns) {
        continue;  // not its block, or freed perhaps before the baseline counted it
      }
      r.baseline -= bytes;
      if (r.logging && static_cast<int64_t>(r.baseline_frees.size()) < std::max<int64_t>(r.max_events, 1)) {
        r.baseline_frees.push_back({time_ns, -bytes, alloc_ns});
      }
    } catch (...) {
      // losing an event is acceptable; failing a free is not
    }
  }
}

struct Counters {
  std::atomic<int64_t> allocated{0};
  std::atomic<int64_t> peak{0};
  std::atomic<int64_t> num_allocs{0};
  std::atomic<int64_t> num_frees{0};
  std::array<std::atomic<int64_t>, kMaxWindows> window_peak{};
  // PeakWindow slots, one bit each (kMaxWindows == 64): `claimed` hands out
  // slots, `open` is what an allocation reads, set once the slot's peak is
  // reset. An allocation visits the open bits alone: a loop over every slot
  // cost about 1 % of a step of small tensors (docs/benchmarks.md).
  std::atomic<uint64_t> claimed_windows{0};
  std::atomic<uint64_t> open_windows{0};
  std::atomic<bool> events_on{false};
  std::mutex events_mutex;
  std::vector<CpuMemoryEvent> events;
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
};

Counters& counters() {
  static auto* c = new Counters();  // never destroyed: frees may come at exit
  return *c;
}

c10::Allocator* base_allocator = nullptr;

void atomic_max(std::atomic<int64_t>& a, int64_t v) {
  int64_t cur = a.load(std::memory_order_relaxed);
  while (v > cur && !a.compare_exchange_weak(cur, v, std::memory_order_relaxed)) {
  }
}

void log_event(Counters& c, int64_t bytes, int64_t now, const void* ptr) {
  if (!c.events_on.load(std::memory_order_relaxed)) {
    return;
  }
  try {
    // The time is read under the lock, so the log is in time order even when
    // several threads allocate at once (timelines rely on it).
    std::lock_guard<std::mutex> lock(c.events_mutex);
    const auto t = std::chrono::duration_cast<std::chrono::nanoseconds>(
                       std::chrono::steady_clock::now() - c.t0).count();
    c.events.push_back({t, bytes, now, reinterpret_cast<uint64_t>(ptr)});
  } catch (...) {
    // losing an event is acceptable; failing an allocation is not
  }
}

int64_t now_since(const Counters& c) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now() - c.t0).count();
}

void counting_delete(void* data) {
  if (data == nullptr) {
    return;
  }
  auto* block = static_cast<char*>(data) - kHeader;
  uint64_t epoch = 0;
  std::memcpy(&epoch, block + kEpochOffset, sizeof(epoch));
  if (epoch != g_epoch.load(std::memory_order_relaxed)) {
    base_allocator->raw_deallocate(block);  // inherited through fork: never counted here
    return;
  }
  int64_t size = 0;
  std::memcpy(&size, block, sizeof(size));
  auto& c = counters();
  const uint64_t tag = std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(block + kTagOffset)).load();
  int64_t alloc_ns = 0;
  std::memcpy(&alloc_ns, block + kTimeOffset, sizeof(alloc_ns));
  // Read before the count drops (Note [A recorder's baseline]): a baseline
  // that began after this clock read counts the block or not, and takes
  // nothing for it either way.
  const bool baselines = g_num_baselines.load(std::memory_order_relaxed) > 0 &&
      alloc_ns < g_latest_baseline_ns.load(std::memory_order_relaxed);
  const int64_t t = tag != 0 || baselines ? now_since(c) : 0;  // one clock read for both
  const int64_t now = c.allocated.fetch_sub(size, std::memory_order_relaxed) - size;
  c.num_frees.fetch_add(1, std::memory_order_relaxed);
  log_event(c, -size, now, data);
  if (tag != 0) {
    to_recorder(tag, -size, t, data, block);
  }
  if (baselines) {
    to_baselines(tag, size, alloc_ns, t, data);
  }
  base_allocator->raw_deallocate(block);
}

class CountingAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    void* block = base_allocator->raw_allocate(n + kHeader);
    const auto size = static_cast<int64_t>(n);
    std::memcpy(block, &size, sizeof(size));
    const uint64_t tag = tls_recorder_tag;
    new (static_cast<char*>(block) + kTagOffset) uint64_t(tag);
    const uint64_t epoch = g_epoch.load(std::memory_order_relaxed);
    std::memcpy(static_cast<char*>(block) + kEpochOffset, &epoch, sizeof(epoch));
    std::memcpy(static_cast<char*>(block) + kSeqOffset, &kNotLogged, sizeof(kNotLogged));
    void* data = static_cast<char*>(block) + kHeader;
    auto& c = counters();
    const int64_t now = c.allocated.fetch_add(size, std::memory_order_relaxed) + size;
    // Stamped after the count rose (Note [A recorder's baseline]): a block
    // made before a baseline began is in the bytes it counted.
    const int64_t t = now_since(c);
    std::memcpy(static_cast<char*>(block) + kTimeOffset, &t, sizeof(t));
    c.num_allocs.fetch_add(1, std::memory_order_relaxed);
    atomic_max(c.peak, now);
    for (uint64_t open = c.open_windows.load(std::memory_order_relaxed); open != 0; open &= open - 1) {
      atomic_max(c.window_peak[std::countr_zero(open)], now);
    }
    log_event(c, size, now, data);
    if (tag != 0) {
      to_recorder(tag, size, t, data, static_cast<char*>(block));
    }
    if (tls_alarm != nullptr && c10::GradMode::is_enabled() == tls_alarm_grad) {
      auto* alarm = tls_alarm;
      tls_alarm = nullptr;
      alarm();
    }
    return {data, data, &counting_delete, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return &counting_delete;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

std::atomic<bool> g_installed{false};

} // namespace

CpuMemoryTracker& CpuMemoryTracker::install() {
  static auto* tracker = new CpuMemoryTracker();
  static auto* allocator = new CountingAllocator();
  static std::once_flag once;
  std::call_once(once, [] {
    base_allocator = c10::GetCPUAllocator();
    counters();
    c10::SetCPUAllocator(allocator, /*priority=*/UINT8_MAX);
    g_installed.store(true);
  });
  TORCH_CHECK(
      c10::GetCPUAllocator() == allocator,
      "trainmem::CpuMemoryTracker: another CPU allocator replaced the counting one; "
      "install the tracker last (or the other allocator first)");
  return *tracker;
}

bool CpuMemoryTracker::installed() {
  return g_installed.load();
}

CpuMemoryStats CpuMemoryTracker::stats() const {
  auto& c = counters();
  return {c.allocated.load(), c.peak.load(), c.num_allocs.load(), c.num_frees.load()};
}

void CpuMemoryTracker::reset_peak() {
  auto& c = counters();
  c.peak.store(c.allocated.load());
}

void CpuMemoryTracker::forget_inherited_blocks() {
  auto& c = counters();
  g_epoch.fetch_add(1);
  c.allocated.store(0);
  c.peak.store(0);
  c.num_allocs.store(0);
  c.num_frees.store(0);
  for (int i = 0; i < kMaxWindows; ++i) {
    c.window_peak[i].store(0);
  }
  std::lock_guard<std::mutex> lock(c.events_mutex);
  c.events.clear();
}

void CpuMemoryTracker::record_events(bool on) {
  counters().events_on.store(on);
}

int64_t CpuMemoryTracker::now_ns() const {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now() - counters().t0).count();
}

std::vector<CpuMemoryEvent> CpuMemoryTracker::take_events() {
  auto& c = counters();
  std::lock_guard<std::mutex> lock(c.events_mutex);
  std::vector<CpuMemoryEvent> out;
  out.swap(c.events);
  return out;
}

PeakWindow::PeakWindow(CpuMemoryTracker&) : slot_(-1), start_bytes_(0) {
  auto& c = counters();
  uint64_t claimed = c.claimed_windows.load();
  do {
    TORCH_CHECK(~claimed != 0, "trainmem::PeakWindow: more than ", kMaxWindows,
                " peak windows are open at once");
    slot_ = std::countr_one(claimed);
  } while (!c.claimed_windows.compare_exchange_weak(claimed, claimed | (uint64_t{1} << slot_)));
  start_bytes_ = c.allocated.load();
  c.window_peak[slot_].store(start_bytes_);
  c.open_windows.fetch_or(uint64_t{1} << slot_);
}

PeakWindow::~PeakWindow() {
  auto& c = counters();
  c.open_windows.fetch_and(~(uint64_t{1} << slot_));
  c.claimed_windows.fetch_and(~(uint64_t{1} << slot_));
}

int64_t PeakWindow::peak_bytes() const {
  auto& c = counters();
  return std::max(c.window_peak[slot_].load(), c.allocated.load());
}

} // namespace trainmem

namespace trainmem::detail {

AllocRecorder::AllocRecorder(int64_t max_events) : slot_(-1), tag_(0) {
  TORCH_CHECK(max_events >= 0, "AllocRecorder: expected max_events >= 0, but got ", max_events);
  auto* slots = recorder_slots();
  for (int i = 0; i < kMaxRecorders; ++i) {
    std::lock_guard<SlotLock> lock(slots[i].mutex);
    if (slots[i].tag.load() == 0) {
      slot_ = i;
      tag_ = (next_generation.fetch_add(1) << 7) | static_cast<uint64_t>(i + 1);
      slots[i].logging = false;
      slots[i].max_events = max_events;
      slots[i].dropped = 0;
      slots[i].next_seq = 0;
      slots[i].shape = {};
      slots[i].events.clear();
      slots[i].live = 0;
      slots[i].window_peak = 0;
      slots[i].baseline_on.store(false);
      slots[i].baseline = 0;
      slots[i].baseline_ns = 0;
      slots[i].counted_ns = 0;
      slots[i].baseline_frees.clear();
      slots[i].baseline_excluded.clear();
      slots[i].tag.store(tag_);
      break;
    }
  }
  TORCH_CHECK(slot_ >= 0, "trainmem: more than ", kMaxRecorders,
              " audits record CPU allocations at once; end some first");
}

AllocRecorder::~AllocRecorder() {
  auto& r = recorder_slots()[slot_];
  try {
    std::lock_guard<SlotLock> lock(r.mutex);
    r.tag.store(0);
    if (r.baseline_on.exchange(false)) {
      g_num_baselines.fetch_sub(1);
    }
    std::vector<detail::RecordedEvent>().swap(r.events);
    std::vector<detail::AllocRecorder::BaselineFree>().swap(r.baseline_frees);
  } catch (...) {
  }
  if (tls_recorder_tag == tag_) {
    tls_recorder_tag = 0;
  }
}

void AllocRecorder::attach_this_thread() {
  tls_recorder_tag = tag_;
}

void AllocRecorder::set_logging(bool on) {
  auto& r = recorder_slots()[slot_];
  std::lock_guard<SlotLock> lock(r.mutex);
  r.logging = on;
}

std::vector<RecordedEvent> AllocRecorder::take_events(std::vector<RecordedEvent> spare) {
  auto& r = recorder_slots()[slot_];
  std::vector<RecordedEvent> out;
  spare.clear();
  std::lock_guard<SlotLock> lock(r.mutex);
  out.swap(r.events);
  r.events.swap(spare);
  // A loop's steps log about as many events each: room for as many again,
  // so the next step's allocations (which log under the slot's lock) do not
  // regrow the log from empty (std::allocator: never the counting one).
  if (r.logging) {
    r.events.reserve(std::min<size_t>(out.size(), static_cast<size_t>(std::max<int64_t>(r.max_events, 0))));
  }
  return out;
}

int64_t AllocRecorder::take_num_dropped() {
  auto& r = recorder_slots()[slot_];
  std::lock_guard<SlotLock> lock(r.mutex);
  const int64_t d = r.dropped;
  r.dropped = 0;
  return d;
}

void AllocRecorder::set_max_events(int64_t max_events) {
  auto& r = recorder_slots()[slot_];
  std::lock_guard<SlotLock> lock(r.mutex);
  r.max_events = std::max<int64_t>(max_events, 0);
}

detail::AllocationShape AllocRecorder::take_shape() {
  auto& r = recorder_slots()[slot_];
  std::lock_guard<SlotLock> lock(r.mutex);
  const auto shape = r.shape;
  r.shape = {};
  return shape;
}

int64_t AllocRecorder::live_bytes() const {
  auto& r = recorder_slots()[slot_];
  std::lock_guard<SlotLock> lock(r.mutex);
  return r.live;
}

void AllocRecorder::open_window() {
  auto& r = recorder_slots()[slot_];
  std::lock_guard<SlotLock> lock(r.mutex);
  r.window_peak = r.live + r.baseline;
}

int64_t AllocRecorder::window_peak() const {
  auto& r = recorder_slots()[slot_];
  std::lock_guard<SlotLock> lock(r.mutex);
  return std::max(r.window_peak, r.live + r.baseline);
}

int64_t AllocRecorder::begin_baseline() {
  // The other recorders live now own their blocks (another audit's, on
  // another thread): not this one's baseline. Gathered before taking this
  // slot's lock, never holding two.
  auto* slots = recorder_slots();
  std::vector<uint64_t> excluded;
  int64_t theirs = 0;
  for (int i = 0; i < kMaxRecorders; ++i) {
    if (i == slot_) {
      continue;
    }
    std::lock_guard<SlotLock> lock(slots[i].mutex);
    if (const uint64_t t = slots[i].tag.load(); t != 0) {
      excluded.push_back(t);
      theirs += slots[i].live;
    }
  }
  auto& r = slots[slot_];
  std::lock_guard<SlotLock> lock(r.mutex);
  auto& c = counters();
  // Note [A recorder's baseline]: the time a block must be made before to be
  // in the baseline, then the live bytes, then the time a free must come after
  // to be taken from it.
  r.baseline_ns.store(now_since(c));
  r.baseline = c.allocated.load(std::memory_order_seq_cst) - r.live - theirs;
  r.counted_ns = now_since(c);
  atomic_max(g_latest_baseline_ns, r.baseline_ns.load());
  r.baseline_excluded = std::move(excluded);
  r.window_peak = std::max(r.window_peak, r.live + r.baseline);
  if (!r.baseline_on.exchange(true)) {
    g_num_baselines.fetch_add(1);
  }
  return r.baseline_ns.load();
}

int64_t AllocRecorder::baseline_bytes() const {
  auto& r = recorder_slots()[slot_];
  std::lock_guard<SlotLock> lock(r.mutex);
  return r.baseline;
}

std::vector<AllocRecorder::BaselineFree> AllocRecorder::take_baseline_frees() {
  auto& r = recorder_slots()[slot_];
  std::vector<BaselineFree> out;
  std::lock_guard<SlotLock> lock(r.mutex);
  out.swap(r.baseline_frees);
  return out;
}

int64_t AllocRecorder::adopt(const c10::Storage& storage, int64_t* alloc_ns) {
  if (!storage || storage.device_type() != c10::DeviceType::CPU) {
    return 0;
  }
  const auto& dp = storage.data_ptr();
  if (dp.get() == nullptr || dp.get_deleter() != &counting_delete) {
    return 0;  // not made by the counting allocator (from_blob, mmap, before install)
  }
  char* block = static_cast<char*>(dp.get()) - kHeader;
  uint64_t epoch = 0;
  std::memcpy(&epoch, block + kEpochOffset, sizeof(epoch));
  if (epoch != g_epoch.load(std::memory_order_relaxed)) {
    return 0;  // inherited through fork: not counted in this process
  }
  int64_t size = 0;
  std::memcpy(&size, block, sizeof(size));
  int64_t made_ns = 0;
  std::memcpy(&made_ns, block + kTimeOffset, sizeof(made_ns));
  if (alloc_ns != nullptr) {
    *alloc_ns = made_ns;
  }
  std::atomic_ref<uint64_t> tag(*reinterpret_cast<uint64_t*>(block + kTagOffset));
  const uint64_t owner = tag.load();
  if (owner == tag_) {
    return 0;
  }
  if (owner != 0) {
    const int other = slot_of(owner);
    if (other >= 0 && other < kMaxRecorders && recorder_slots()[other].tag.load() == owner) {
      return 0;  // another live recorder's block (another audit's): not ours to take
    }
  }
  auto& r = recorder_slots()[slot_];
  std::lock_guard<SlotLock> lock(r.mutex);
  // The storage is alive (we hold it), so its block cannot be freed meanwhile.
  tag.store(tag_);
  // A number from another recorder's log would mislead this one's.
  std::memcpy(block + kSeqOffset, &kNotLogged, sizeof(kNotLogged));
  r.live += size;
  if (r.in_baseline(owner, made_ns)) {
    r.baseline -= size;  // it was counted in the baseline; now it is ours
  }
  r.window_peak = std::max(r.window_peak, r.live + r.baseline);
  return size;
}

void set_allocation_alarm(void (*alarm)() noexcept, bool grad_enabled) {
  tls_alarm = alarm;
  tls_alarm_grad = grad_enabled;
}

} // namespace trainmem::detail
