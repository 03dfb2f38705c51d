#include "trainmem/allocator.h"

#include <memory>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

namespace {

TEST(AllocatorTest, CountsAKnownAllocationExactly) {
  auto& tracker = trainmem::CpuMemoryTracker::install();
  ASSERT_TRUE(trainmem::CpuMemoryTracker::installed());
  const auto before = tracker.stats();
  {
    auto t = at::empty({1000, 250}, at::kFloat);  // 1,000,000 B
    const auto during = tracker.stats();
    EXPECT_EQ(during.allocated_bytes - before.allocated_bytes, 1000000);
    EXPECT_EQ(during.num_allocs - before.num_allocs, 1);
  }
  const auto after = tracker.stats();
  EXPECT_EQ(after.allocated_bytes, before.allocated_bytes);
  EXPECT_EQ(after.num_frees - before.num_frees, 1);
}

TEST(AllocatorTest, PeakWindowsAreIndependent) {
  auto& tracker = trainmem::CpuMemoryTracker::install();
  trainmem::PeakWindow outer(tracker);
  {
    auto a = at::empty({1 << 20}, at::kByte);  // 1 MiB, freed at once
  }
  trainmem::PeakWindow inner(tracker);
  {
    auto b = at::empty({1 << 18}, at::kByte);  // 256 KiB
  }
  EXPECT_EQ(outer.peak_bytes() - outer.start_bytes(), 1 << 20);
  EXPECT_EQ(inner.peak_bytes() - inner.start_bytes(), 1 << 18);
  tracker.reset_peak();
  EXPECT_EQ(tracker.stats().peak_allocated_bytes, tracker.stats().allocated_bytes);
}

// All 64 slots open at once each see an allocation made while they are open;
// a 65th is refused by name; a slot closed is handed out again, reset.
TEST(AllocatorTest, SixtyFourPeakWindowsAndNoMore) {
  auto& tracker = trainmem::CpuMemoryTracker::install();
  std::vector<std::unique_ptr<trainmem::PeakWindow>> windows;
  for (int i = 0; i < 64; ++i) {
    windows.push_back(std::make_unique<trainmem::PeakWindow>(tracker));
    auto t = at::empty({1024 * (i + 1)}, at::kByte);  // window i sees i + 1 KiB, and every later one
  }
  for (int i = 0; i < 64; ++i) {
    EXPECT_EQ(windows[i]->peak_bytes() - windows[i]->start_bytes(), 1024 * 64) << "window " << i;
  }
  try {
    trainmem::PeakWindow extra(tracker);
    FAIL() << "a 65th window opened";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("more than 64 peak windows"), std::string::npos) << e.what();
  }
  windows[17].reset();
  trainmem::PeakWindow again(tracker);
  {
    auto t = at::empty({512}, at::kByte);
  }
  EXPECT_EQ(again.peak_bytes() - again.start_bytes(), 512);
}

TEST(AllocatorTest, FreesFromAnotherThreadAreCounted) {
  auto& tracker = trainmem::CpuMemoryTracker::install();
  const auto before = tracker.stats();
  auto t = at::empty({4096}, at::kDouble);  // 32 KiB
  std::thread other([moved = std::move(t)]() mutable { moved.reset(); });
  other.join();
  const auto after = tracker.stats();
  EXPECT_EQ(after.allocated_bytes, before.allocated_bytes);
  EXPECT_EQ(after.num_frees - before.num_frees, 1);
}

// The sawtooth: live bytes grow through forward, shrink in backward.
TEST(AllocatorTest, EventLogShowsTheSawtooth) {
  auto& tracker = trainmem::CpuMemoryTracker::install();
  auto w = at::randn({256, 256}).requires_grad_();
  auto x = at::randn({64, 256});
  tracker.take_events();
  tracker.record_events(true);
  const int64_t start = tracker.stats().allocated_bytes;
  auto h = x;
  for (int i = 0; i < 4; ++i) h = at::tanh(at::mm(h, w));  // tanh saves its output
  const int64_t after_forward = tracker.stats().allocated_bytes;
  h.sum().backward();
  h = at::Tensor();
  tracker.record_events(false);
  const auto events = tracker.take_events();
  ASSERT_GT(events.size(), 8u);
  int64_t peak = 0;
  for (const auto& e : events) peak = std::max(peak, e.allocated_bytes);
  // Four (64, 256) fp32 activations at least were alive at the end of forward.
  EXPECT_GE(after_forward - start, 4 * 64 * 256 * 4);
  EXPECT_GE(peak, after_forward);
  // ... and shrank by at least two activations after its peak (backward
  // frees what forward saved).
  size_t top = 0;
  for (size_t i = 0; i < events.size(); ++i) {
    if (events[i].allocated_bytes > events[top].allocated_bytes) top = i;
  }
  int64_t low_after = events[top].allocated_bytes;
  for (size_t i = top; i < events.size(); ++i) low_after = std::min(low_after, events[i].allocated_bytes);
  EXPECT_LE(low_after, events[top].allocated_bytes - 2 * 64 * 256 * 4);
  for (size_t i = 1; i < events.size(); ++i) {
    EXPECT_EQ(events[i].allocated_bytes, events[i - 1].allocated_bytes + events[i].bytes);
    EXPECT_GE(events[i].time_ns, events[i - 1].time_ns);
  }
  EXPECT_TRUE(tracker.take_events().empty());
}

} // namespace
