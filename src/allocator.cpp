#include "trainmem/allocator.h"

#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

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
constexpr int kMaxWindows = 64;

struct Counters {
  std::atomic<int64_t> allocated{0};
  std::atomic<int64_t> peak{0};
  std::atomic<int64_t> num_allocs{0};
  std::atomic<int64_t> num_frees{0};
  std::array<std::atomic<int64_t>, kMaxWindows> window_peak{};
  std::array<std::atomic<bool>, kMaxWindows> window_open{};
  std::atomic<int> num_windows{0};
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

void counting_delete(void* data) {
  if (data == nullptr) {
    return;
  }
  auto* block = static_cast<char*>(data) - kHeader;
  int64_t size = 0;
  std::memcpy(&size, block, sizeof(size));
  auto& c = counters();
  const int64_t now = c.allocated.fetch_sub(size, std::memory_order_relaxed) - size;
  c.num_frees.fetch_add(1, std::memory_order_relaxed);
  log_event(c, -size, now, data);
  base_allocator->raw_deallocate(block);
}

class CountingAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    void* block = base_allocator->raw_allocate(n + kHeader);
    const auto size = static_cast<int64_t>(n);
    std::memcpy(block, &size, sizeof(size));
    void* data = static_cast<char*>(block) + kHeader;
    auto& c = counters();
    const int64_t now = c.allocated.fetch_add(size, std::memory_order_relaxed) + size;
    c.num_allocs.fetch_add(1, std::memory_order_relaxed);
    atomic_max(c.peak, now);
    if (c.num_windows.load(std::memory_order_relaxed) > 0) {
      for (int i = 0; i < kMaxWindows; ++i) {
        if (c.window_open[i].load(std::memory_order_relaxed)) {
          atomic_max(c.window_peak[i], now);
        }
      }
    }
    log_event(c, size, now, data);
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
  for (int i = 0; i < kMaxWindows; ++i) {
    bool expected = false;
    if (!c.window_open[i].load() &&
        c.window_open[i].compare_exchange_strong(expected, true)) {
      slot_ = i;
      break;
    }
  }
  TORCH_CHECK(slot_ >= 0, "trainmem::PeakWindow: more than ", kMaxWindows,
              " peak windows are open at once");
  start_bytes_ = c.allocated.load();
  c.window_peak[slot_].store(start_bytes_);
  c.num_windows.fetch_add(1);
}

PeakWindow::~PeakWindow() {
  auto& c = counters();
  c.window_open[slot_].store(false);
  c.num_windows.fetch_sub(1);
}

int64_t PeakWindow::peak_bytes() const {
  auto& c = counters();
  return std::max(c.window_peak[slot_].load(), c.allocated.load());
}

} // namespace trainmem
