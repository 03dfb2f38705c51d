// Reads of values from meta tensors inside a prediction (Note [Scalar reads
// inside a prediction]): the PredictionScope that counts them, the Meta
// kernel of aten::_local_scalar_dense, and the copies of meta tensors to the
// CPU.
#include "core/detail/prediction_scope.h"

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/zeros.h>
#include <c10/core/ScalarType.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "detail/intercept.h"

// Note [Scalar reads inside a prediction]
// A PPO update logs `loss.item()` and stops early on `if
// (approx_kl.item<double>() > target)`; on meta such reads threw, so the step
// could not be predicted at all. A meta tensor holds no values, so inside a
// prediction (and only there: a PredictionScope is open on the thread) each
// read returns a documented one: aten::_local_scalar_dense, which `.item()`
// and `is_nonzero` (a tensor in an `if`) reach, returns 0, or false for a bool
// tensor; a meta tensor copied to the CPU (`.to(kCPU)`: aten::_to_copy;
// aten::copy_ into a CPU tensor) gives zeros, made there below the
// interception key. Each read is counted by op and value, and the prediction
// lists them (scalar_reads): where a real run's control flow may have taken
// another branch, the prediction is of the branch the documented values take.
// Outside a prediction a meta `.item()` throws a c10::NotImplementedError, as
// LibTorch does and in the generic meta path's words ("trainmem:
// aten::_local_scalar_dense has no meta kernel and its output shape depends
// on values"), which find_missing_meta_kernel() names.

namespace trainmem::detail {

struct PredictionScope::Impl : InterceptHandler {
  void handle(const InterceptScope& scope, const c10::OperatorHandle& op, c10::DispatchKeySet ks,
              torch::jit::Stack* stack) override;
  void count(const std::string& op, const std::string& value) {
    for (auto& r : reads) {
      if (r.op == op && r.value == value) {
        ++r.num_reads;
        return;
      }
    }
    reads.push_back(ScalarRead{op, value, 1});
  }
  InitRecordPause not_a_construction;
  std::vector<ScalarRead> reads;
  Impl* previous = nullptr;
  std::optional<InterceptScope> scope;
};

namespace {

thread_local PredictionScope::Impl* tls_prediction = nullptr;

void count_read(const std::string& op, const std::string& value) {
  if (tls_prediction != nullptr) {
    tls_prediction->count(op, value);
  }
}

} // namespace

// A meta tensor copied to the CPU: zeros there.
void PredictionScope::Impl::handle(const InterceptScope& scope, const c10::OperatorHandle& op,
                                   c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  static const c10::OperatorHandle to_copy = c10::Dispatcher::singleton().findSchemaOrThrow("aten::_to_copy", "");
  static const c10::OperatorHandle copy = c10::Dispatcher::singleton().findSchemaOrThrow("aten::copy_", "");
  const size_t n = op.schema().arguments().size();
  if (op == to_copy) {
    // _to_copy(Tensor self, *, dtype, layout, device, pin_memory, non_blocking, memory_format)
    const auto& self = (*stack)[stack->size() - n];
    const auto& device = (*stack)[stack->size() - n + 3];
    if (self.isTensor() && self.toTensor().is_meta() && device.isDevice() && device.toDevice().is_cpu()) {
      const at::Tensor src = self.toTensor();
      const auto& dtype = (*stack)[stack->size() - n + 1];
      const auto type = dtype.isNone() ? src.scalar_type() : dtype.toScalarType();
      const c10::Device where = device.toDevice();
      torch::jit::drop(*stack, n);
      c10::impl::ExcludeDispatchKeyGuard below(kInterceptKey);
      stack->emplace_back(at::zeros(src.sizes(), at::TensorOptions().dtype(type).device(where)));
      count("aten::_to_copy", "zeros");
      return;
    }
  } else if (op == copy) {
    // copy_(Tensor(a!) self, Tensor src, bool non_blocking=False)
    const auto& self = (*stack)[stack->size() - n];
    const auto& src = (*stack)[stack->size() - n + 1];
    if (self.isTensor() && self.toTensor().is_cpu() && src.isTensor() && src.toTensor().is_meta()) {
      at::Tensor dst = self.toTensor();
      torch::jit::drop(*stack, n);
      {
        c10::impl::ExcludeDispatchKeyGuard below(kInterceptKey);
        dst.zero_();
      }
      stack->emplace_back(std::move(dst));
      count("aten::copy_", "zeros");
      return;
    }
  }
  scope.call_next(op, ks, stack);
}

PredictionScope::PredictionScope() : impl_(std::make_unique<Impl>()) {
  register_intercept_fallback();
  impl_->previous = tls_prediction;
  tls_prediction = impl_.get();
  impl_->scope.emplace(*impl_);
}

PredictionScope::~PredictionScope() {
  impl_->scope.reset();
  tls_prediction = impl_->previous;
  if (impl_->previous != nullptr) {
    for (const auto& r : impl_->reads) {
      for (int64_t i = 0; i < r.num_reads; ++i) {
        impl_->previous->count(r.op, r.value);
      }
    }
  }
}

bool PredictionScope::active() {
  return tls_prediction != nullptr;
}

std::string scalar_reads_line(const std::vector<ScalarRead>& reads) {
  if (reads.empty()) {
    return "";
  }
  std::vector<std::string> each;
  for (const auto& r : reads) {
    each.push_back(fmt::format("{} x {} -> {}", r.num_reads, r.op, r.value));
  }
  return fmt::format("  values read from meta (a real run's control flow may differ): {}\n",
                     fmt::join(each, "; "));
}

std::vector<ScalarRead> PredictionScope::scalar_reads() const {
  return impl_->reads;
}

at::Scalar local_scalar_dense_meta(const at::Tensor& self) {
  TORCH_CHECK_NOT_IMPLEMENTED(PredictionScope::active(),
                              "trainmem: aten::_local_scalar_dense has no meta kernel and its output shape depends "
                              "on values (.item() reads a value, and a meta tensor holds none; inside a trainmem "
                              "prediction it reads 0: Note [Scalar reads inside a prediction])");
  const auto type = self.scalar_type();
  if (type == at::kBool) {
    count_read("aten::_local_scalar_dense", "false");
    return at::Scalar(false);
  }
  count_read("aten::_local_scalar_dense", "0");
  if (c10::isComplexType(type)) {
    return at::Scalar(c10::complex<double>(0.0, 0.0));
  }
  if (c10::isIntegralType(type, /*includeBool=*/false)) {
    return at::Scalar(static_cast<int64_t>(0));
  }
  return at::Scalar(0.0);
}

} // namespace trainmem::detail
