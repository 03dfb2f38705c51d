// The CPU probes of the meta kernels (core/detail/cpu_probe.h): an op run
// once on zero-filled CPU tensors under the CPU tracker, its scratch and its
// outputs kept for the process, per distinct call; and the switch that
// turns them off on a thread (detail/conv_scratch.h).
#include "core/detail/cpu_probe.h"

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/TensorOptions.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "detail/conv_scratch.h"
#include "detail/intercept.h"
#include "trainmem/allocator.h"

namespace trainmem {
namespace detail {

// Note [CPU convolution scratch]: how probes work.
namespace {
constexpr int64_t kMaxProbeBytes = int64_t{1} << 30;
} // namespace

bool probing_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("TRAINMEM_CONV_SCRATCH");
    return v == nullptr || std::string(v) != "0";
  }();
  return on && conv_scratch_on_meta();
}

std::string probe_key(const at::Tensor& t) {
  if (!t.defined()) {
    return "-";
  }
  return fmt::format("{}[{}/{}]", c10::toString(t.scalar_type()), fmt::join(t.sizes(), ","),
                     fmt::join(t.strides(), ","));
}

at::Tensor cpu_twin(const at::Tensor& t) {
  if (!t.defined()) {
    return t;
  }
  return at::empty_strided(t.sizes(), t.strides(), t.options().device(at::kCPU)).zero_();
}

int64_t probe_storage_bytes(const at::Tensor& t) {
  return t.defined() && t.has_storage() ? static_cast<int64_t>(t.storage().nbytes()) : 0;
}

std::optional<CpuProbe> cpu_probe(const std::string& key, int64_t probe_bytes, const ProbeRun& run) {
  static std::mutex mu;
  static std::unordered_map<std::string, std::optional<CpuProbe>> cache;
  const std::string full = fmt::format("{}|threads {}|mkldnn {}", key, at::get_num_threads(),
                                       at::globalContext().userEnabledMkldnn());
  {
    std::lock_guard<std::mutex> lock(mu);
    if (auto it = cache.find(full); it != cache.end()) {
      return it->second;
    }
  }
  std::optional<CpuProbe> probe;
  if (probe_bytes <= kMaxProbeBytes) {
    auto& tracker = CpuMemoryTracker::install();
    std::optional<PeakWindow> window;
    // The probe is trainmem's own CPU work: no handler (a MetaInitGuard
    // around the user's step would make its twins meta) may see its ops.
    c10::impl::ExcludeDispatchKeyGuard unseen(detail::kInterceptKey);
    const auto outs = run([&] { window.emplace(tracker); });
    TORCH_INTERNAL_ASSERT(window.has_value());
    probe.emplace();
    int64_t out_bytes = 0;
    for (const auto& o : outs) {
      out_bytes += probe_storage_bytes(o);
      probe->outputs.push_back(o.defined() ? ProbedTensor{true, o.sizes().vec(), o.strides().vec(), o.scalar_type()}
                                           : ProbedTensor{});
    }
    probe->scratch_bytes = std::max<int64_t>(0, window->peak_bytes() - window->start_bytes() - out_bytes);
  }
  std::lock_guard<std::mutex> lock(mu);
  cache.emplace(full, probe);
  return probe;
}

int64_t cpu_scratch(const std::string& key, int64_t probe_bytes, const ProbeRun& run) {
  const auto probe = cpu_probe(key, probe_bytes, run);
  if (!probe) {
    TORCH_WARN_ONCE("trainmem: an op's CPU scratch (a convolution's, a batch norm's, a bf16 matmul's) was not "
                    "measured (its probe ",
                    "would take ", probe_bytes, " B, above ", kMaxProbeBytes,
                    " B): predicted peaks leave it out (Note [CPU convolution scratch])");
    return 0;
  }
  return probe->scratch_bytes;
}

at::Tensor hold_meta_bytes(int64_t bytes) {
  return bytes > 0 ? at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(at::kMeta)) : at::Tensor();
}

at::Tensor meta_like(const ProbedTensor& t, const at::TensorOptions& options) {
  if (!t.defined) {
    return at::Tensor();
  }
  return at::empty_strided(t.sizes, t.strides, options.dtype(t.dtype).device(at::kMeta));
}

bool& conv_scratch_on_meta() {
  thread_local bool on = true;
  return on;
}

} // namespace detail
} // namespace trainmem
