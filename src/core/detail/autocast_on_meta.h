#pragma once
// Autocast on meta tensors: the casts the installed LibTorch's own autocast
// kernels make, applied to the ops a prediction runs on meta (core layer: the
// predictions open it for their forward, a checkpoint's recompute again for
// its own; not installed). See docs/design.md, Note [Autocast on meta].
#include <unordered_map>

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

namespace trainmem::detail {

// Thread-local RAII, alive while a prediction runs the user's code on meta:
// an op on meta tensors, while autocast is enabled on this thread for CUDA or
// the CPU (at::autocast::set_autocast_enabled), runs through that device's
// registered autocast kernel, so its arguments are cast exactly as on the
// device, and the casts are real ops on meta (autograd records them, the
// meta allocator counts them). `preferred` names the device whose autocast
// applies when both are enabled (the prediction's device). Weights (leaves
// that require grad) keep one stand-in each, so autocast's own cast cache
// holds one cast per weight, as on the device. On destruction, if any
// weight was cast, autocast's cast cache is cleared (the casts are meta
// tensors of this prediction; a region's end on the device clears it too).
// Guards nest: the innermost one's device wins.
class AutocastOnMeta {
 public:
  explicit AutocastOnMeta(c10::DeviceType preferred);
  ~AutocastOnMeta();
  AutocastOnMeta(const AutocastOnMeta&) = delete;
  AutocastOnMeta& operator=(const AutocastOnMeta&) = delete;

  c10::DeviceType preferred() const { return preferred_; }
  // The innermost guard alive on this thread, or null (a checkpoint's
  // forward notes it, and its recompute in backward opens one alike).
  static const AutocastOnMeta* active();
  // The stand-in of a weight (made once per guard).
  at::Tensor& weight_proxy(const c10::TensorImpl* weight) { return proxies_[weight]; }

 private:
  c10::DeviceType preferred_;
  std::unordered_map<const c10::TensorImpl*, at::Tensor> proxies_;
  AutocastOnMeta* previous_;
  c10::impl::IncludeDispatchKeyGuard include_;
};

} // namespace trainmem::detail
