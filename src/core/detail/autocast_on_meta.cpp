#include "core/detail/autocast_on_meta.h"

#include <mutex>
#include <string>

#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "detail/held_arguments.h"
#include "detail/process_library.h"

// Note [Autocast on meta]
// Autocast is a dispatch key that CPU and CUDA tensors carry (AutocastCPU,
// AutocastCUDA); meta tensors carry none, so a loss function written for the
// GPU, with autocast enabled, runs every op in fp32 on meta. LibTorch has no
// query for autocast's policy (which ops run in the lower precision, in fp32,
// or at the widest input type), but its kernels are registered in
// libtorch_cpu for both devices. So the prediction calls them:
//  - kMode, a key the AutocastOnMeta guard includes in the thread's dispatch
//    set (above every autocast key): its fallback sees each op. While
//    autocast is enabled for the guard's device (or the other one) and the
//    op has a kernel for that device's autocast key, each meta tensor
//    argument is replaced by a proxy: a storage-less tensor that says it is
//    on that device (so autocast's is_eligible takes it) and carries kProxy.
//    The op is then sent to the autocast kernel itself.
//  - kProxy, the proxies' key: every op the autocast kernel runs on a proxy
//    (the casts of its cached_cast, then the op in the chosen types) lands in
//    its fallback, which puts the meta tensors back and runs the op from the
//    top. So the casts and the op run on meta, through autograd (a cast is a
//    ToCopyBackward0 node, its output what the op's node saves), in the
//    order the device runs them, and the meta allocator counts each cast.
//  - A weight (a leaf that requires grad, not a view) has one proxy per
//    guard, a leaf that requires grad too: autocast's own cast cache, keyed
//    by the tensor, then holds one cast per weight for as long as the device
//    would (until at::autocast::clear_cache()).
// Inside the autocast kernel its key is excluded, so the ops it runs are not
// cast again; with autocast disabled (a nested region) ops go straight down.
// The keys are LibTorch's two TESTING_ONLY generic keys, which nothing in
// LibTorch registers; a library that claims them first makes the guard
// throw, naming the key.

namespace trainmem::detail {
namespace {

constexpr c10::DispatchKey kMode = c10::DispatchKey::TESTING_ONLY_GenericMode;
constexpr c10::DispatchKey kProxy = c10::DispatchKey::TESTING_ONLY_GenericWrapper;

thread_local AutocastOnMeta* tls_top = nullptr;

// A tensor standing for a meta tensor, on the autocast device.
struct ProxyImpl final : c10::TensorImpl {
  ProxyImpl(const at::Tensor& meta, c10::Device device)
      : c10::TensorImpl(c10::DispatchKeySet(kProxy) |
                            c10::DispatchKeySet(device.is_cuda() ? c10::BackendComponent::CUDABit
                                                                 : c10::BackendComponent::CPUBit),
                        meta.dtype(), device),
        meta_(meta) {
    set_sizes_and_strides(meta.sizes(), meta.strides(), meta.storage_offset());
  }
  at::Tensor meta_;
};

bool is_proxy(const at::Tensor& t) {
  return t.defined() && t.key_set().has(kProxy);
}

at::Tensor unwrap(const at::Tensor& t) {
  return is_proxy(t) ? static_cast<const ProxyImpl*>(t.unsafeGetTensorImpl())->meta_ : t;
}

at::Tensor make_proxy(AutocastOnMeta& guard, const at::Tensor& t, c10::Device device) {
  const bool weight = t.requires_grad() && t.is_leaf() && !t.is_view();
  if (!weight) {
    return at::Tensor(c10::make_intrusive<ProxyImpl>(t, device));
  }
  at::Tensor& p = guard.weight_proxy(t.unsafeGetTensorImpl());
  if (!p.defined() || p.device() != device) {
    p = at::Tensor(c10::make_intrusive<ProxyImpl>(t, device));
    p.unsafeGetTensorImpl()->set_requires_grad(true);  // a leaf that requires grad: autocast caches its cast
  }
  return p;
}

// Applies `f` to every tensor among the stack's last `n` values (tensors,
// tensor lists, lists of optional tensors).
template <typename F>
void map_tensors(torch::jit::Stack* stack, size_t n, F&& f) {
  for (size_t i = stack->size() - n; i < stack->size(); ++i) {
    c10::IValue& v = (*stack)[i];
    if (v.isTensor()) {
      v = f(v.toTensor());
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> out;
      for (const at::Tensor& t : v.toTensorList()) {
        out.push_back(f(t));
      }
      v = out;
    } else if (v.isList()) {
      const auto list = v.toList();
      bool tensors = false;
      for (const c10::IValue& e : list) {
        tensors = tensors || e.isTensor();
      }
      if (tensors) {
        c10::List<std::optional<at::Tensor>> out;
        for (const c10::IValue& e : list) {
          out.push_back(e.isTensor() ? std::optional<at::Tensor>(f(e.toTensor())) : std::nullopt);
        }
        v = out;
      }
    }
  }
}

// Note [References held above the interceptor]: the arguments this stack
// holds while the op runs below.
void run_below_mode(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const HeldArguments held(stack, op.schema().arguments().size());
  op.redispatchBoxed(ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kMode), stack);
}

// The device whose autocast applies now, if any.
std::optional<c10::DeviceType> autocast_device(const AutocastOnMeta& guard) {
  const c10::DeviceType first = guard.preferred();
  const c10::DeviceType second = first == c10::kCUDA ? c10::kCPU : c10::kCUDA;
  for (const c10::DeviceType d : {first, second}) {
    if (at::autocast::is_autocast_enabled(d)) {
      return d;
    }
  }
  return std::nullopt;
}

void mode_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  AutocastOnMeta* guard = tls_top;
  const auto device = guard != nullptr ? autocast_device(*guard) : std::nullopt;
  if (device) {
    const c10::DispatchKey key = at::autocast::get_autocast_dispatch_key_from_device_type(*device);
    const size_t n = op.schema().arguments().size();
    bool meta = false;
    if (op.hasKernelForDispatchKey(key)) {
      map_tensors(stack, n, [&](const at::Tensor& t) {
        meta = meta || (t.defined() && t.is_meta());
        return t;
      });
    }
    if (meta) {
      const c10::Device on(*device, *device == c10::kCPU ? -1 : 0);
      map_tensors(stack, n, [&](const at::Tensor& t) {
        return t.defined() && t.is_meta() ? make_proxy(*guard, t, on) : t;
      });
      op.redispatchBoxed(c10::DispatchKeySet(key), stack);  // the registered autocast kernel
      map_tensors(stack, op.schema().returns().size(), unwrap);
      return;
    }
  }
  run_below_mode(op, ks, stack);
}

void proxy_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  map_tensors(stack, op.schema().arguments().size(), unwrap);
  const HeldArguments held(stack, op.schema().arguments().size());
  op.callBoxed(stack);  // from the top, on the meta tensors
  map_tensors(stack, op.schema().returns().size(), unwrap);
}

void register_fallbacks() {
  static std::once_flag once;
  static std::string error;
  std::call_once(once, [] {
    auto failed = [](c10::DispatchKey key, const std::string& why) {
      return why.empty() ? why : std::string(c10::toString(key)) + ": " + why + "; ";
    };
    error = failed(kMode, register_fallback_for_process(
                              kMode, torch::CppFunction::makeFromBoxedFunction<&mode_fallback>())) +
        failed(kProxy, register_fallback_for_process(
                           kProxy, torch::CppFunction::makeFromBoxedFunction<&proxy_fallback>()));
  });
  TORCH_CHECK(error.empty(), "trainmem: cannot register autocast on meta on dispatch keys ",
              c10::toString(kMode), " and ", c10::toString(kProxy), " (is another library using them?): ",
              error);
}

} // namespace

AutocastOnMeta::AutocastOnMeta(c10::DeviceType preferred)
    : preferred_(preferred), previous_(tls_top), include_(kMode) {
  register_fallbacks();
  tls_top = this;
}

const AutocastOnMeta* AutocastOnMeta::active() {
  return tls_top;
}

AutocastOnMeta::~AutocastOnMeta() {
  tls_top = previous_;
  if (!proxies_.empty()) {
    at::autocast::clear_cache();  // the cached casts are this prediction's meta tensors
  }
}

} // namespace trainmem::detail
