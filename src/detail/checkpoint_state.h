#pragma once
// State a checkpointed region captures in forward and re-applies while it is
// recomputed: RNG states and autocast settings (never installed).
#include <optional>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

namespace trainmem::detail {

// The CPU generator's state and those of the CUDA devices of `tensors`.
struct RngState {
  at::Tensor cpu;
  std::vector<std::pair<c10::Device, at::Tensor>> devices;
  static RngState capture(const std::vector<at::Tensor>& tensors);
  void restore() const;
};

// Sets `stashed` (when not null) for the scope, restores the current state
// after, like torch.random.fork_rng.
class ForkRng {
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
bool& mirror_rng_fork_on_meta();

struct AutocastState {
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
class AutocastGuard {
 public:
  explicit AutocastGuard(const AutocastState& state);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  AutocastState previous_;
};

} // namespace trainmem::detail
