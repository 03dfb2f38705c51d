#pragma once
// State a checkpointed region captures in forward and re-applies while it is
// recomputed: RNG states and autocast settings (never installed).
#include <optional>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include "trainmem/export.h"

namespace trainmem::detail {

// The CPU generator's state and those of the CUDA devices of `tensors`.
struct TRAINMEM_API RngState {
  at::Tensor cpu;
  std::vector<std::pair<c10::Device, at::Tensor>> devices;
  at::Tensor meta_mirror;  // see mirror_rng_stash_on_meta()
  static RngState capture(const std::vector<at::Tensor>& tensors);
  // capture() for a checkpoint's stash: with mirror_rng_stash_on_meta() on,
  // also holds a meta tensor of the stash's bytes.
  static RngState capture_stash(const std::vector<at::Tensor>& tensors);
  void restore() const;
};

// Sets `stashed` (when not null) for the scope, restores the current state
// after, like torch.random.fork_rng.
class TRAINMEM_API ForkRng {
 public:
  ForkRng(const RngState* stashed, const std::vector<at::Tensor>& tensors);
  ~ForkRng();
  ForkRng(const ForkRng&) = delete;
  ForkRng& operator=(const ForkRng&) = delete;

 private:
  std::optional<RngState> current_;
  at::Tensor meta_mirror_;  // see mirror_rng_fork_on_meta()
};

// While true on this thread, a ForkRng also holds a meta tensor of its copy's
// bytes: the planner, profiling a checkpointed region on meta, then sees the
// recompute's CPU generator copy in the meta counter when it is live, not
// only the stash it adds itself (Note [Checkpoint planner]).
TRAINMEM_API bool& mirror_rng_fork_on_meta();

// While true on this thread, a checkpoint's RNG stash (RngState made in
// forward, alive until the region's backward is done) also holds a meta
// tensor of its bytes: predict_step_peak then counts, on meta, the CPU
// generator states a real CPU run keeps (5,056 B per checkpointed region
// with LibTorch's mt19937 CPU generator).
TRAINMEM_API bool& mirror_rng_stash_on_meta();

struct TRAINMEM_API AutocastState {
  struct Entry {
    c10::DeviceType type;
    bool enabled;
    at::ScalarType dtype;
  };
  std::vector<Entry> entries;
  bool cache_enabled = true;
  static AutocastState capture();
  void apply() const;
};

// Applies `state` for the scope (thread-local, like autocast itself).
class TRAINMEM_API AutocastGuard {
 public:
  explicit AutocastGuard(const AutocastState& state);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  AutocastState previous_;
};

} // namespace trainmem::detail
