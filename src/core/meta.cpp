// The meta device's entry points: MetaInitGuard (Note [Construction on the
// meta device]), the registration of the core layer's meta kernels, and
// find_missing_meta_kernel(). The kernels are meta_kernels.cpp's and
// meta_rnn.cpp's, their CPU probes cpu_probe.cpp's; materialize.cpp moves a
// module's tensors to meta and back.
#include "trainmem/meta.h"

#include <algorithm>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "core/detail/cpu_probe.h"
#include "core/detail/init_record.h"
#include "core/detail/meta_fallback.h"
#include "core/detail/meta_internal.h"
#include "core/detail/prediction_scope.h"
#include "detail/intercept.h"
#include "detail/process_library.h"

// Note [Construction on the meta device]
// LibTorch modules allocate in reset(), with no device argument. Python's
// `with torch.device("meta")` is a TorchFunctionMode; torchdistx fakes every
// op. We rewrite at the one op interceptor below autograd (Note [One
// interception key]): while a MetaInitGuard is alive, an op whose schema has a
// `device` argument and no tensor argument is a factory, and its device
// becomes Meta before it runs further down (BackendSelect then picks the meta
// kernel). Factory ops have no tensor to take a dispatch key from, so their
// key set is the thread-local included set plus BackendSelect: the interceptor
// key, which sits above BackendSelect, sees them. Every other op runs
// unchanged: in-place initializers on meta tensors are meta kernels that do
// nothing (and draw no random numbers), ops on real tensors stay real.

namespace trainmem {
namespace {

bool mentions_tensor(const c10::TypePtr& type) {
  if (type->kind() == c10::TypeKind::TensorType) {
    return true;
  }
  for (const auto& inner : type->containedTypes()) {
    if (mentions_tensor(inner)) {
      return true;
    }
  }
  return false;
}

// A factory op's device argument becomes Meta (and pin_memory false).
// Returns whether the op is a factory.
bool rewrite_factory(const c10::FunctionSchema& schema, torch::jit::Stack* stack) {
  const auto& args = schema.arguments();
  const size_t base = stack->size() - args.size();
  int64_t device_at = -1;
  int64_t pin_at = -1;
  for (size_t i = 0; i < args.size(); ++i) {
    if (mentions_tensor(args[i].real_type())) {
      return false;
    }
    if (args[i].name() == "device") {
      device_at = static_cast<int64_t>(i);
    } else if (args[i].name() == "pin_memory") {
      pin_at = static_cast<int64_t>(i);
    }
  }
  if (device_at < 0) {
    return false;
  }
  (*stack)[base + device_at] = c10::IValue(c10::Device(c10::kMeta));
  if (pin_at >= 0 && (*stack)[base + pin_at].isBool()) {
    (*stack)[base + pin_at] = c10::IValue(false);
  }
  return true;
}

// The kernels (meta_kernels.cpp) that register_missing_meta_kernels() adds.
using detail::index_select_meta;
using detail::relu_meta;
using detail::randperm_out_meta;
using detail::convolution_meta;
using detail::convolution_backward_meta;
using detail::native_batch_norm_meta;
using detail::native_batch_norm_backward_meta;
using detail::max_pool3d_with_indices_meta;
using detail::max_pool3d_with_indices_backward_meta;
using detail::adaptive_avg_pool2d_meta;
using detail::adaptive_avg_pool3d_meta;
using detail::adaptive_avg_pool_backward_meta;
using detail::embedding_dense_backward_meta;
using detail::nll_loss2d_forward_meta;
using detail::nll_loss2d_backward_meta;
using detail::amp_unscale_meta;
using detail::amp_update_scale_meta;
using detail::mse_loss_backward_meta;
using detail::binary_cross_entropy_meta;
using detail::binary_cross_entropy_backward_meta;

void register_missing_meta_kernels() {
  static std::once_flag once;
  std::call_once(once, [] {
    auto missing = [](const char* name, const char* overload) {
      auto op = c10::Dispatcher::singleton().findOp({name, overload});
      return op.has_value() && !op->hasKernelForDispatchKey(c10::DispatchKey::Meta);
    };
    try {
      // Never destroyed: the kernels live as long as the process.
      auto* lib = &detail::keep_for_process(std::make_unique<torch::Library>(
          torch::Library::IMPL, "aten", c10::DispatchKey::Meta, __FILE__, __LINE__));
      if (missing("aten::index_select", "")) {
        lib->impl("index_select", TORCH_FN(index_select_meta));
      }
      if (missing("aten::relu", "")) {
        lib->impl("relu", TORCH_FN(relu_meta));
      }
      if (missing("aten::randperm", "generator_out")) {
        lib->impl("randperm.generator_out", TORCH_FN(randperm_out_meta));
      }
      // Note [Meta kernels for conv nets]
      auto add = [&](const char* name, const char* overload, auto fn) {
        if (missing(name, overload)) {
          std::string qualified = std::string(name).substr(6);  // without "aten::"
          if (overload[0] != '\0') {
            qualified += std::string(".") + overload;
          }
          lib->impl(qualified.c_str(), std::move(fn));
        }
      };
      detail::register_rnn_meta_kernels(*lib);  // Note [Meta RNNs follow the CPU's kernel]
      add("aten::convolution", "", TORCH_FN(convolution_meta));
      add("aten::convolution_backward", "", TORCH_FN(convolution_backward_meta));
      add("aten::native_batch_norm", "", TORCH_FN(native_batch_norm_meta));
      add("aten::native_batch_norm_backward", "", TORCH_FN(native_batch_norm_backward_meta));
      add("aten::max_pool3d_with_indices", "", TORCH_FN(max_pool3d_with_indices_meta));
      add("aten::max_pool3d_with_indices_backward", "",
          TORCH_FN(max_pool3d_with_indices_backward_meta));
      add("aten::_adaptive_avg_pool2d", "", TORCH_FN(adaptive_avg_pool2d_meta));
      add("aten::_adaptive_avg_pool2d_backward", "", TORCH_FN(adaptive_avg_pool_backward_meta));
      add("aten::_adaptive_avg_pool3d", "", TORCH_FN(adaptive_avg_pool3d_meta));
      add("aten::_adaptive_avg_pool3d_backward", "", TORCH_FN(adaptive_avg_pool_backward_meta));
      add("aten::embedding_dense_backward", "", TORCH_FN(embedding_dense_backward_meta));
      add("aten::nll_loss2d_forward", "", TORCH_FN(nll_loss2d_forward_meta));
      add("aten::nll_loss2d_backward", "", TORCH_FN(nll_loss2d_backward_meta));
      add("aten::mse_loss_backward", "", TORCH_FN(mse_loss_backward_meta));
      add("aten::binary_cross_entropy", "", TORCH_FN(binary_cross_entropy_meta));
      add("aten::binary_cross_entropy_backward", "", TORCH_FN(binary_cross_entropy_backward_meta));
      add("aten::_amp_foreach_non_finite_check_and_unscale_", "", TORCH_FN(amp_unscale_meta));
      add("aten::_amp_update_scale_", "", TORCH_FN(amp_update_scale_meta));
      add("aten::_local_scalar_dense", "", TORCH_FN(detail::local_scalar_dense_meta));  // Note [Scalar reads inside a prediction]
      // Last: every other op with a CPU kernel (Note [A meta path for ops without a meta kernel]).
      detail::register_meta_fallback();
    } catch (const std::exception& e) {
      TORCH_WARN("trainmem: could not add meta kernels (", e.what(), "); ops without one throw on meta");
    }
  });
}

} // namespace

void register_meta_kernels() {
  register_missing_meta_kernels();
}

namespace detail {

int& meta_init_guards() {
  thread_local int guards = 0;
  return guards;
}

} // namespace detail

namespace {

// The op a "no meta kernel" error names, or "" if it is not one. LibTorch
// words it three ways: the dispatcher's "Could not run 'aten::x.overload'
// with arguments from the 'Meta' backend", the fake-impl check's "aten::x:
// attempted to run this operator with Meta tensors, but there was no fake
// impl or Meta kernel registered", and a composite kernel's
// "x_overrideable not implemented" (convolution before ours).
std::string op_without_meta_kernel(const std::string& m) {
  if (auto refused = detail::meta_fallback_refused_op(m); !refused.empty()) {
    return refused;  // Note [A meta path for ops without a meta kernel]
  }
  const std::string quoted = "Could not run '";
  if (auto at = m.find(quoted); at != std::string::npos && m.find("'Meta' backend") != std::string::npos) {
    const auto start = at + quoted.size();
    const auto end = m.find('\'', start);
    if (end != std::string::npos) {
      return m.substr(start, end - start);
    }
  }
  if (auto at = m.find(": attempted to run this operator with Meta tensors"); at != std::string::npos) {
    auto start = m.find_last_of(" \n", at);
    start = start == std::string::npos ? 0 : start + 1;
    return m.substr(start, at - start);
  }
  if (auto over = m.find("_overrideable not implemented"); over != std::string::npos) {
    auto start = m.find_last_of(" \n", over);
    start = start == std::string::npos ? 0 : start + 1;
    return "aten::" + m.substr(start, over - start);
  }
  return "";
}

} // namespace

namespace {

// Note [Predictions leave no trace], for a probe given no module: the
// leaves that require grad (parameters, optimized inputs) met by the ops the
// probe runs keep the gradient they had before it (its backward would leave
// meta gradients on them).
struct LeafGradKeeper : detail::InterceptHandler {
  std::unordered_map<const c10::TensorImpl*, std::pair<at::Tensor, at::Tensor>> leaves;
  void handle(const detail::InterceptScope& scope, const c10::OperatorHandle& op, c10::DispatchKeySet ks,
              torch::jit::Stack* stack) override {
    const auto n = op.schema().arguments().size();
    const at::Tensor* on_meta = nullptr;
    const at::Tensor* on_cpu = nullptr;
    size_t cpu_arg = 0;
    for (size_t i = stack->size() - std::min(n, stack->size()); i < stack->size(); ++i) {
      const auto& v = (*stack)[i];
      auto see = [&](const at::Tensor& t) {
        keep(t);
        if (!t.defined() || t.dim() == 0) return;  // CPU scalars mix with any device
        if (t.is_meta()) on_meta = &t;
        if (t.is_cpu() && on_cpu == nullptr) {
          on_cpu = &t;
          cpu_arg = i - (stack->size() - std::min(n, stack->size()));
        }
      };
      if (v.isTensor()) {
        see(v.toTensor());
      } else if (v.isTensorList()) {
        for (const at::Tensor& t : v.toTensorList().vec()) {
          see(t);
        }
      }
    }
    // A module left on CPU meeting a meta input: the meta kernels would run
    // it silently (or blame the op), and the prediction would be of nothing.
    const auto& name = op.schema().name();
    TORCH_CHECK(on_meta == nullptr || on_cpu == nullptr || name == "aten::copy_" || name == "aten::_to_copy" ||
                    name == "aten::set_",
                "find_missing_meta_kernel: ", name, " got a meta tensor and a cpu tensor (argument ", cpu_arg,
                ", of size ", on_cpu ? on_cpu->sizes() : at::IntArrayRef{},
                "): the module is not on the meta device. Move it with trainmem::to_meta(module); load a "
                "TorchScript module onto meta with torch::jit::load(path, c10::Device(c10::kMeta))");
    scope.call_next(op, ks, stack);
  }
  void keep(const at::Tensor& t) {
    if (t.defined() && t.requires_grad() && t.is_leaf() && !leaves.count(t.unsafeGetTensorImpl())) {
      leaves.emplace(t.unsafeGetTensorImpl(), std::make_pair(t, t.grad()));
    }
  }
  void restore() {
    for (auto& [impl, tg] : leaves) {
      tg.first.mutable_grad() = tg.second;
    }
  }
};

} // namespace

std::optional<MissingMetaKernel> find_missing_meta_kernel(const std::function<void()>& run) {
  TORCH_CHECK(static_cast<bool>(run), "find_missing_meta_kernel: the function is empty");
  register_missing_meta_kernels();
  detail::register_intercept_fallback();
  LeafGradKeeper keeper;
  detail::InitRecordPause not_a_construction;  // Note [Init replayed on materialize]
  struct Restore {
    LeafGradKeeper& k;
    ~Restore() { k.restore(); }
  } restore{keeper};
  try {
    detail::InterceptScope scope(keeper);
    run();
  } catch (const c10::Error& e) {
    MissingMetaKernel missing{"", e.what_without_backtrace()};
    missing.op = op_without_meta_kernel(missing.message);
    if (missing.op.empty() && dynamic_cast<const c10::NotImplementedError*>(&e) == nullptr) {
      throw;  // not about a missing kernel
    }
    return missing;
  }
  return std::nullopt;
}

struct MetaInitGuard::Impl : detail::InterceptHandler {
  void handle(const detail::InterceptScope& scope, const c10::OperatorHandle& op,
              c10::DispatchKeySet ks, torch::jit::Stack* stack) override {
    const bool factory = rewrite_factory(op.schema(), stack);
    // torch::jit::load reads each storage on CPU and sets it into a tensor
    // the guard made on meta; LibTorch refuses that with a message about
    // devices that does not say what to do.
    if (op.schema().name() == "aten::set_") {
      const auto& args = op.schema().arguments();
      const size_t base = stack->size() - args.size();
      for (size_t i = 1; i < args.size(); ++i) {
        const auto& v = (*stack)[base + i];
        const bool cpu_storage = (v.isStorage() && v.toStorage().device().is_cpu()) ||
            (v.isTensor() && v.toTensor().defined() && v.toTensor().is_cpu());
        TORCH_CHECK(!cpu_storage || !(*stack)[base].isTensor() || !(*stack)[base].toTensor().is_meta(),
                    "MetaInitGuard: a CPU storage is being set into a tensor made on meta (torch::jit::load "
                    "builds its tensors this way, and cannot run under the guard): load a TorchScript module "
                    "onto meta with torch::jit::load(path, c10::Device(c10::kMeta)) outside the guard");
      }
    }
    if (records) {
      detail::call_recorded(scope, op, ks, stack, factory);  // Note [Init replayed on materialize]
    } else {
      scope.call_next(op, ks, stack);
    }
  }
  std::optional<detail::InterceptScope> scope;
  bool records = false;  // the outermost guard records what its thread runs
};

MetaInitGuard::MetaInitGuard() : impl_(std::make_unique<Impl>()) {
  detail::register_intercept_fallback();
  register_missing_meta_kernels();
  impl_->records = detail::begin_init_record();
  impl_->scope.emplace(*impl_);
  ++detail::meta_init_guards();
}

MetaInitGuard::~MetaInitGuard() {
  --detail::meta_init_guards();
  impl_->scope.reset();
  if (impl_->records) {
    detail::end_init_record();
  }
}

} // namespace trainmem
