#pragma once
// The arguments that trainmem's own boxed fallbacks above autograd hold while
// the op they pass on runs further down: Note [References held above the
// interceptor] in intercept.cpp.
#include <cstddef>
#include <cstdint>

#include <ATen/core/Tensor.h>
#include <ATen/core/stack.h>

namespace trainmem::detail {

// Thread-local RAII: while alive, the last `n` values of `stack` (an op's
// arguments, as the fallback got them) are counted by held_references().
// Frames end in reverse order of construction on their thread.
class HeldArguments {
 public:
  HeldArguments(const torch::jit::Stack* stack, size_t n);
  ~HeldArguments();
  HeldArguments(const HeldArguments&) = delete;
  HeldArguments& operator=(const HeldArguments&) = delete;

 private:
  HeldArguments* previous_;
  const torch::jit::Stack* stack_;
  size_t begin_;
  size_t n_;
  friend int64_t held_references(const at::Tensor& t, const torch::jit::Stack* except);
};

// How many references to `t` (its TensorImpl) the HeldArguments frames alive
// on this thread hold, not counting the frames of `except` (the caller's own
// stack, when a fallback passed it down as it was).
int64_t held_references(const at::Tensor& t, const torch::jit::Stack* except);

} // namespace trainmem::detail
