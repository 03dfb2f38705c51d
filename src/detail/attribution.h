#pragma once
// Internal links between trainmem features that save or hold tensors for
// backward and the meters that count them (never installed).
#include <ATen/core/Tensor.h>

namespace trainmem::detail {

// Names the saves made while alive outside any ATen op (a custom autograd
// Function's save_for_backward), e.g. "CheckpointInputs". Thread-local, LIFO.
class SaveLabelGuard {
 public:
  explicit SaveLabelGuard(const char* label);
  ~SaveLabelGuard();
  SaveLabelGuard(const SaveLabelGuard&) = delete;
  SaveLabelGuard& operator=(const SaveLabelGuard&) = delete;

 private:
  const char* previous_;
};

// Tells every meter active on this thread that trainmem holds `tensor` for
// backward outside autograd's saved variables (the selective-checkpoint
// cache), under `label`. Deduplicated by storage like a saved tensor.
void record_held_tensor(const char* label, const at::Tensor& tensor) noexcept;

} // namespace trainmem::detail
