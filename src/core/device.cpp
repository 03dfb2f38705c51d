#include "trainmem/device.h"

#include <ATen/Context.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <torch/cuda.h>

#include "trainmem/allocator.h"
#include "trainmem/format.h"

#ifdef TRAINMEM_WITH_CUDA
#include <torch/csrc/cuda/memory_snapshot.h>
#endif

namespace trainmem {
namespace {

void check_cuda_device(const c10::Device& device) {
  TORCH_CHECK(
      torch::cuda::is_available(),
      "device_memory_stats: expected a CUDA device to be available for ", device,
      ", but this LibTorch has no CUDA or sees no GPU");
  const auto count = static_cast<int64_t>(torch::cuda::device_count());
  const int64_t index = device.has_index() ? device.index() : 0;
  TORCH_CHECK(
      index >= 0 && index < count,
      "device_memory_stats: expected a CUDA index in [0, ", count, "), but got ", device);
}

c10::DeviceIndex cuda_index(const c10::Device& device) {
  return device.has_index() ? device.index() : 0;
}

// Note [Initialise CUDA before reading its allocator]
// The CUDA caching allocator sizes its per-device tables when CUDA is first
// initialised (the first CUDA tensor, or lazyInitDevice). Before that,
// getDeviceStats(i) and resetPeakStats(i) index an empty table, and memory
// history has no allocator to attach to: a profiler that starts before the
// model is moved to the GPU must initialise CUDA itself.
c10::DeviceAllocator* cuda_allocator() {
  at::globalContext().lazyInitDevice(c10::kCUDA);
  auto* allocator = c10::getDeviceAllocator(c10::kCUDA);
  TORCH_CHECK(allocator != nullptr && allocator->initialized(),
              "device_memory_stats: LibTorch's CUDA caching allocator is not initialised after CUDA "
              "initialisation (is PYTORCH_NO_CUDA_MEMORY_CACHING set?)");
  return allocator;
}

void check_supported(const c10::Device& device) {
  TORCH_CHECK(
      device.is_cpu() || device.is_cuda(),
      "device_memory_stats: expected a cpu or cuda device, but got ", device);
}

} // namespace

DeviceMemoryStats device_memory_stats(const c10::Device& device) {
  check_supported(device);
  DeviceMemoryStats out;
  if (device.is_cpu()) {
    TORCH_CHECK(
        CpuMemoryTracker::installed(),
        "device_memory_stats(cpu): the counting CPU allocator is not installed; "
        "call trainmem::CpuMemoryTracker::install() first thing in main");
    const auto s = CpuMemoryTracker::install().stats();
    out.device = "cpu";
    out.allocated_bytes = out.reserved_bytes = out.active_bytes = out.requested_bytes =
        s.allocated_bytes;
    out.peak_allocated_bytes = out.peak_reserved_bytes = out.peak_active_bytes =
        s.peak_allocated_bytes;
    out.num_allocs = s.num_allocs;
    out.num_frees = s.num_frees;
    return out;
  }
  check_cuda_device(device);
  const auto index = cuda_index(device);
  const auto s = cuda_allocator()->getDeviceStats(index);
  constexpr auto kAll = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  out.device = fmt::format("cuda:{}", index);
  out.allocated_bytes = s.allocated_bytes[kAll].current;
  out.peak_allocated_bytes = s.allocated_bytes[kAll].peak;
  out.reserved_bytes = s.reserved_bytes[kAll].current;
  out.peak_reserved_bytes = s.reserved_bytes[kAll].peak;
  out.active_bytes = s.active_bytes[kAll].current;
  out.peak_active_bytes = s.active_bytes[kAll].peak;
  out.inactive_split_bytes = s.inactive_split_bytes[kAll].current;
  out.peak_inactive_split_bytes = s.inactive_split_bytes[kAll].peak;
  out.requested_bytes = s.requested_bytes[kAll].current;
  out.num_allocs = s.allocation[kAll].allocated;
  out.num_frees = s.allocation[kAll].freed;
  out.num_alloc_retries = s.num_alloc_retries;
  out.num_ooms = s.num_ooms;
  return out;
}

void reset_peak(const c10::Device& device) {
  check_supported(device);
  if (device.is_cpu()) {
    TORCH_CHECK(
        CpuMemoryTracker::installed(),
        "reset_peak(cpu): the counting CPU allocator is not installed; "
        "call trainmem::CpuMemoryTracker::install() first thing in main");
    CpuMemoryTracker::install().reset_peak();
    return;
  }
  check_cuda_device(device);
  cuda_allocator()->resetPeakStats(cuda_index(device));
}

// Note [Fragmentation hints]
// Slack is what the caching allocator holds but no tensor uses. Two causes
// dominate in training: many differently sized blocks (variable
// sequence lengths) that split segments, and a growing batch that keeps
// asking for larger segments. expandable_segments maps pages into one
// growing segment instead of splitting; warming up on the longest batch
// makes the first segments the largest ones.
Fragmentation fragmentation(
    const DeviceMemoryStats& stats, double threshold_fraction, int64_t floor_bytes) {
  TORCH_CHECK(
      threshold_fraction >= 0.0 && threshold_fraction <= 1.0,
      "fragmentation: expected threshold_fraction in [0, 1], but got ", threshold_fraction);
  Fragmentation f;
  f.slack_bytes = stats.reserved_bytes - stats.allocated_bytes;
  f.inactive_split_bytes = stats.inactive_split_bytes;
  f.slack_fraction = stats.reserved_bytes > 0
      ? static_cast<double>(f.slack_bytes) / static_cast<double>(stats.reserved_bytes)
      : 0.0;
  if (f.slack_bytes < floor_bytes || f.slack_fraction < threshold_fraction) {
    return f;
  }
  f.hints.push_back(fmt::format(
      "{} of {} reserved is not in use ({:.0f} %)", human_bytes(f.slack_bytes),
      human_bytes(stats.reserved_bytes), 100.0 * f.slack_fraction));
  if (stats.inactive_split_bytes * 2 >= f.slack_bytes) {
    f.hints.push_back(
        "most of it is free fragments inside split blocks: try "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True");
  }
  f.hints.push_back(
      "if batch shapes vary, run the longest batch first so the first segments are the largest");
  if (stats.num_alloc_retries > 0) {
    f.hints.push_back(fmt::format(
        "the allocator flushed its cache {} times to satisfy requests: each is a device "
        "synchronization; lower the peak or set expandable_segments",
        stats.num_alloc_retries));
  }
  return f;
}

bool cuda_memory_history_available() {
#ifdef TRAINMEM_WITH_CUDA
  return torch::cuda::is_available();
#else
  return false;
#endif
}

namespace {
void check_history() {
  TORCH_CHECK(
      cuda_memory_history_available(),
      "CUDA memory history: ",
#ifdef TRAINMEM_WITH_CUDA
      "no CUDA device is available",
#else
      "trainmem was built against a LibTorch without CUDA",
#endif
      "; on CPU use Audit's timeline and to_memory_viz_pickle()");
}
} // namespace

void start_cuda_memory_history(int64_t max_entries) {
  TORCH_CHECK(
      max_entries > 0,
      "start_cuda_memory_history: expected max_entries > 0, but got ", max_entries);
  check_history();
#ifdef TRAINMEM_WITH_CUDA
  // Note [Initialise CUDA before reading its allocator]. Stacks: LibTorch
  // accepts "python" or "all" only ("cpp" throws); "all" records C++ frames,
  // and Python frames when there is an interpreter.
  cuda_allocator();
  torch::cuda::_record_memory_history(
      std::optional<std::string>("all"), std::optional<std::string>("all"), "all",
      static_cast<size_t>(max_entries));
#endif
}

void stop_cuda_memory_history() {
  check_history();
#ifdef TRAINMEM_WITH_CUDA
  cuda_allocator();
  torch::cuda::_record_memory_history(std::optional<std::string>(), std::optional<std::string>(), "all");
#endif
}

std::string cuda_memory_snapshot() {
  check_history();
#ifdef TRAINMEM_WITH_CUDA
  cuda_allocator();
  return torch::cuda::_memory_snapshot_pickled();
#else
  return {};
#endif
}

} // namespace trainmem
