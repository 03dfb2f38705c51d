#include "trainmem/device.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include "trainmem/allocator.h"

namespace {

TEST(DeviceTest, CpuStatsCountAKnownTensorExactly) {
  trainmem::CpuMemoryTracker::install();
  const c10::Device cpu(c10::kCPU);
  trainmem::reset_peak(cpu);
  const auto before = trainmem::device_memory_stats(cpu);
  EXPECT_EQ(before.device, "cpu");
  EXPECT_EQ(before.peak_allocated_bytes, before.allocated_bytes);
  {
    auto t = at::empty({1 << 20}, at::kFloat);  // 4 MiB
    const auto during = trainmem::device_memory_stats(cpu);
    EXPECT_EQ(during.allocated_bytes - before.allocated_bytes, 4 << 20);
    EXPECT_EQ(during.reserved_bytes, during.allocated_bytes);  // the CPU allocator caches nothing
    EXPECT_EQ(during.num_allocs - before.num_allocs, 1);
  }
  const auto after = trainmem::device_memory_stats(cpu);
  EXPECT_EQ(after.allocated_bytes, before.allocated_bytes);
  EXPECT_EQ(after.peak_allocated_bytes - before.allocated_bytes, 4 << 20);
  trainmem::reset_peak(cpu);
  EXPECT_EQ(trainmem::device_memory_stats(cpu).peak_allocated_bytes, after.allocated_bytes);
}

TEST(DeviceTest, UnsupportedDevicesAreNamed) {
  try {
    trainmem::device_memory_stats(c10::Device(c10::kMeta));
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("but got meta"), std::string::npos) << e.what();
  }
  if (!torch::cuda::is_available()) {
    try {
      trainmem::device_memory_stats(c10::Device("cuda:0"));
      FAIL() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("cuda:0"), std::string::npos) << e.what();
    }
    EXPECT_FALSE(trainmem::cuda_memory_history_available());
    EXPECT_THROW(trainmem::start_cuda_memory_history(), c10::Error);
    EXPECT_THROW(trainmem::cuda_memory_snapshot(), c10::Error);
  }
}

TEST(DeviceTest, FragmentationHintsOnlyWhenSlackIsLarge) {
  trainmem::DeviceMemoryStats s;
  s.device = "cuda:0";
  s.reserved_bytes = 1LL << 30;
  s.allocated_bytes = 512LL << 20;
  s.inactive_split_bytes = 400LL << 20;
  s.num_alloc_retries = 3;
  auto f = trainmem::fragmentation(s);
  EXPECT_EQ(f.slack_bytes, 512LL << 20);
  EXPECT_EQ(f.inactive_split_bytes, 400LL << 20);
  EXPECT_DOUBLE_EQ(f.slack_fraction, 0.5);
  ASSERT_EQ(f.hints.size(), 4u);
  EXPECT_NE(f.hints[0].find("512.0 MiB of 1.0 GiB reserved is not in use (50 %)"), std::string::npos) << f.hints[0];
  EXPECT_NE(f.hints[1].find("expandable_segments:True"), std::string::npos) << f.hints[1];
  EXPECT_NE(f.hints[2].find("longest batch"), std::string::npos) << f.hints[2];
  EXPECT_NE(f.hints[3].find("flushed its cache 3 times"), std::string::npos) << f.hints[3];

  s.allocated_bytes = (1LL << 30) - (32LL << 20);  // 32 MiB slack: under the floor
  EXPECT_TRUE(trainmem::fragmentation(s).hints.empty());
  EXPECT_THROW(trainmem::fragmentation(s, 1.5), c10::Error);
}

TEST(DeviceCudaTest, CountsAKnownTensorAndRecordsHistory) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device";
  }
  const c10::Device dev("cuda:0");
  trainmem::reset_peak(dev);
  const auto before = trainmem::device_memory_stats(dev);
  ASSERT_TRUE(trainmem::cuda_memory_history_available());
  trainmem::start_cuda_memory_history();
  {
    auto t = at::empty({1 << 20}, at::TensorOptions().dtype(at::kFloat).device(dev));  // 4 MiB
    const auto during = trainmem::device_memory_stats(dev);
    EXPECT_EQ(during.allocated_bytes - before.allocated_bytes, 4 << 20);
    EXPECT_GE(during.reserved_bytes, during.allocated_bytes);
  }
  const auto snapshot = trainmem::cuda_memory_snapshot();
  trainmem::stop_cuda_memory_history();
  ASSERT_GT(snapshot.size(), 2u);
  EXPECT_EQ(static_cast<unsigned char>(snapshot[0]), 0x80);  // a raw pickle
  EXPECT_EQ(trainmem::device_memory_stats(dev).peak_allocated_bytes - before.allocated_bytes, 4 << 20);
}

// Each ctest is its own process (gtest_discover_tests), so this runs before
// anything has touched CUDA: stats, peak reset and history must initialise it
// themselves (Note [Initialise CUDA before reading its allocator]), and the
// history must be accepted by LibTorch (stacks "all", not "cpp").
TEST(DeviceCudaTest, SnapshotFromAFreshProcessHasTheAllocation) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device";
  }
  const c10::Device dev("cuda:0");
  const auto before = trainmem::device_memory_stats(dev);  // first CUDA call of the process
  trainmem::reset_peak(dev);
  trainmem::start_cuda_memory_history();
  const int64_t bytes = 6 << 20;  // 6 MiB: a multiple of the allocator's 2 MiB rounding
  {
    auto t = at::empty({bytes / 4}, at::TensorOptions().dtype(at::kFloat).device(dev));
    EXPECT_EQ(trainmem::device_memory_stats(dev).allocated_bytes - before.allocated_bytes, bytes);
  }
  const auto snapshot = trainmem::cuda_memory_snapshot();
  trainmem::stop_cuda_memory_history();
  const auto d = torch::jit::unpickle(snapshot.data(), snapshot.size()).toGenericDict();
  ASSERT_TRUE(d.contains("segments"));
  const auto traces = d.at("device_traces").toList();
  ASSERT_GE(traces.size(), 1u);
  int num_allocs = 0;
  int num_frees = 0;
  const auto trace = traces.get(0).toList();
  for (size_t i = 0; i < trace.size(); ++i) {
    const auto entry = trace.get(i).toGenericDict();
    if (entry.at("size").toInt() != bytes) {
      continue;
    }
    const auto action = entry.at("action").toStringRef();
    num_allocs += action == "alloc" ? 1 : 0;
    num_frees += action == "free_completed" ? 1 : 0;
  }
  EXPECT_EQ(num_allocs, 1);
  EXPECT_EQ(num_frees, 1);
  EXPECT_EQ(trainmem::device_memory_stats(dev).peak_allocated_bytes - before.allocated_bytes, bytes);
}

} // namespace
