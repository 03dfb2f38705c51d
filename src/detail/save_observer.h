#pragma once
// Observers of saved tensors (never installed): what a meter uses to count
// every tensor autograd saves on a thread whatever hooks pack it (see
// docs/design.md, Note [Meters observe, hooks pack]).
#include <cstdint>
#include <memory>

#include <ATen/core/Tensor.h>

namespace trainmem::detail {

class SaveObserver {
 public:
  virtual ~SaveObserver() = default;
  // Called on the saving thread after the hooks in charge packed `saved`;
  // `kept` is what holds its bytes now (`saved` itself, a host copy, or an
  // undefined tensor when nothing is kept, as with checkpointing). Must not
  // throw.
  virtual void on_save(const at::Tensor& saved, const at::Tensor& kept) noexcept = 0;
};

// Makes `observer` the innermost observer of this thread's saves while alive.
// Observers do not pack: the innermost SavedTensorHooksGuard (or nothing)
// still does, so an observer never changes what a scope keeps. The innermost
// observer alone is told (nested meters count their own scopes). Thread-local;
// destruction from another thread is safe (the frame is dropped lazily).
class SaveObserverGuard {
 public:
  explicit SaveObserverGuard(std::shared_ptr<SaveObserver> observer);
  ~SaveObserverGuard();
  SaveObserverGuard(const SaveObserverGuard&) = delete;
  SaveObserverGuard& operator=(const SaveObserverGuard&) = delete;

 private:
  uint64_t id_;
  uint64_t thread_;
};

} // namespace trainmem::detail
