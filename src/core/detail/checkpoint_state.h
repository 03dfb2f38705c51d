#pragma once
// State a checkpointed region captures in forward and re-applies while it is
// recomputed: RNG states and autocast settings (never installed).
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include "trainmem/export.h"

namespace trainmem::detail {

// Note [Checkpoint RNG copies]
// A checkpoint that preserves RNG state holds copies of generator states: its
// stash (RngState::capture_stash, made in forward, kept until the region's
// backward is done) and, while the region is recomputed, ForkRng's copy of
// the current state. Both are CPU tensors whatever device the region runs
// on. A tool that counts another device's bytes, and wants these too, sets
// an RngCopyObserver on the thread for a scope: the checkpoint tells it of
// each copy and its bytes, and keeps the token it returns exactly as long as
// it keeps the copy. The checkpoint knows nothing of what the token is (the
// planner's holds a meta tensor of those bytes: Note [Checkpoint RNG copies
// on meta] in src/plan/detail/meta_step.h).

// Which copy a checkpoint holds.
enum class RngCopy {
  kStash,  // made in forward, kept until the region's backward is done
  kFork,   // the current state, kept while the region is recomputed
};

// Told of each RNG copy a checkpoint holds (Note [Checkpoint RNG copies]).
class TRAINMEM_API RngCopyObserver {
 public:
  virtual ~RngCopyObserver();
  // The checkpoint holds a copy of `bytes` bytes for as long as it keeps the
  // returned token (null: nothing to keep). Must not throw.
  virtual std::shared_ptr<void> hold(RngCopy copy, int64_t bytes) = 0;
};

// Sets this thread's RngCopyObserver (nullptr: none) for the scope, and
// restores the previous one after. Thread-local, RAII.
class TRAINMEM_API RngCopyObserverGuard {
 public:
  explicit RngCopyObserverGuard(RngCopyObserver* observer);
  ~RngCopyObserverGuard();
  RngCopyObserverGuard(const RngCopyObserverGuard&) = delete;
  RngCopyObserverGuard& operator=(const RngCopyObserverGuard&) = delete;
  // This thread's observer, or nullptr.
  static RngCopyObserver* current();

 private:
  RngCopyObserver* previous_;
};

// The CPU generator's state and those of the CUDA devices of `tensors`.
struct TRAINMEM_API RngState {
  at::Tensor cpu;
  std::vector<std::pair<c10::Device, at::Tensor>> devices;
  std::shared_ptr<void> observed;  // a stash's RngCopyObserver token
  static RngState capture(const std::vector<at::Tensor>& tensors);
  // capture() for a checkpoint's stash: tells this thread's RngCopyObserver.
  static RngState capture_stash(const std::vector<at::Tensor>& tensors);
  void restore() const;
  // The bytes of the states.
  int64_t nbytes() const;
};

// Sets `stashed` (when not null) for the scope, restores the current state
// after, like torch.random.fork_rng. Tells this thread's RngCopyObserver of
// its copy of the current state.
class TRAINMEM_API ForkRng {
 public:
  ForkRng(const RngState* stashed, const std::vector<at::Tensor>& tensors);
  ~ForkRng();
  ForkRng(const ForkRng&) = delete;
  ForkRng& operator=(const ForkRng&) = delete;

 private:
  std::optional<RngState> current_;
  std::shared_ptr<void> observed_;  // the RngCopyObserver's token for current_
};

struct TRAINMEM_API AutocastState {
  struct Entry {
    c10::DeviceType type;
    bool enabled;
    at::ScalarType dtype;
  };
  std::vector<Entry> entries;
  bool cache_enabled = true;
  // Captured inside a prediction's forward on meta: the device whose
  // autocast its AutocastOnMeta preferred, so that the recompute, in
  // backward, casts as the forward did (Note [Autocast on meta]).
  std::optional<c10::DeviceType> on_meta;
  static AutocastState capture();
  void apply() const;
};

class AutocastOnMeta;

// Applies `state` for the scope (thread-local, like autocast itself).
class TRAINMEM_API AutocastGuard {
 public:
  explicit AutocastGuard(const AutocastState& state);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  AutocastState previous_;
  std::unique_ptr<AutocastOnMeta> on_meta_;
};

} // namespace trainmem::detail
