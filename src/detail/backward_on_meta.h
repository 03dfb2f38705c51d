#pragma once
// A meta backward that accumulates gradients as the real device's engine
// does (in place where it would): Note [Gradient accumulation on meta] in
// backward_on_meta.cpp. Used by predict_step_peak and the region planner
// (predict.cpp) and by predict_cuda_step_peak (cuda_predict.cpp).
#include <ATen/core/Tensor.h>
#include <ATen/record_function.h>

#include "detail/intercept.h"

namespace trainmem::detail {

// While alive on a thread: a meta backward run on that thread adds two
// gradients in place where the CPU's (and CUDA's) engine would. Pushes an
// InterceptScope, so it nests like one (construct it inside any scope whose
// handler should still see the adds it lets run).
class BackwardOnMeta final : public InterceptHandler {
 public:
  BackwardOnMeta();
  ~BackwardOnMeta() override;
  BackwardOnMeta(const BackwardOnMeta&) = delete;
  BackwardOnMeta& operator=(const BackwardOnMeta&) = delete;

  // loss.backward() under a BackwardOnMeta.
  static void run(const at::Tensor& loss);

  void handle(const InterceptScope& scope, const c10::OperatorHandle& op, c10::DispatchKeySet ks,
              torch::jit::Stack* stack) override;

 private:
  at::CallbackHandle handle_;
  InterceptScope scope_;
};

} // namespace trainmem::detail
