#include "trainmem/meta.h"

#include <cstdlib>
#include <functional>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/convolution.h>
#include <ATen/ops/convolution_backward.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/native_batch_norm.h>
#include <ATen/ops/native_batch_norm_backward.h>
#include <ATen/core/Reduction.h>
#include <ATen/native/Pool.h>
#include <c10/core/WrapDimMinimal.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/TensorOptions.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/instancenorm.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/modules/rnn.h>
#include <torch/library.h>
#include <torch/serialize/input-archive.h>

#include "detail/conv_scratch.h"
#include "core/detail/cpu_probe.h"
#include "core/detail/meta_fallback.h"
#include "detail/intercept.h"
#include "trainmem/allocator.h"
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
namespace detail {

// Note [CPU convolution scratch]: how probes work.
namespace {
constexpr int64_t kMaxProbeBytes = int64_t{1} << 30;
} // namespace

bool probing_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("TRAINMEM_CONV_SCRATCH");
    return v == nullptr || std::string(v) != "0";
  }();
  return on && conv_scratch_on_meta();
}

std::string probe_key(const at::Tensor& t) {
  if (!t.defined()) {
    return "-";
  }
  return fmt::format("{}[{}/{}]", c10::toString(t.scalar_type()), fmt::join(t.sizes(), ","),
                     fmt::join(t.strides(), ","));
}

at::Tensor cpu_twin(const at::Tensor& t) {
  if (!t.defined()) {
    return t;
  }
  return at::empty_strided(t.sizes(), t.strides(), t.options().device(at::kCPU)).zero_();
}

int64_t probe_storage_bytes(const at::Tensor& t) {
  return t.defined() && t.has_storage() ? static_cast<int64_t>(t.storage().nbytes()) : 0;
}

std::optional<CpuProbe> cpu_probe(const std::string& key, int64_t probe_bytes, const ProbeRun& run) {
  static std::mutex mu;
  static std::unordered_map<std::string, std::optional<CpuProbe>> cache;
  const std::string full = fmt::format("{}|threads {}|mkldnn {}", key, at::get_num_threads(),
                                       at::globalContext().userEnabledMkldnn());
  {
    std::lock_guard<std::mutex> lock(mu);
    if (auto it = cache.find(full); it != cache.end()) {
      return it->second;
    }
  }
  std::optional<CpuProbe> probe;
  if (probe_bytes <= kMaxProbeBytes) {
    auto& tracker = CpuMemoryTracker::install();
    std::optional<PeakWindow> window;
    // The probe is trainmem's own CPU work: no handler (a MetaInitGuard
    // around the user's step would make its twins meta) may see its ops.
    c10::impl::ExcludeDispatchKeyGuard unseen(detail::kInterceptKey);
    const auto outs = run([&] { window.emplace(tracker); });
    TORCH_INTERNAL_ASSERT(window.has_value());
    probe.emplace();
    int64_t out_bytes = 0;
    for (const auto& o : outs) {
      out_bytes += probe_storage_bytes(o);
      probe->outputs.push_back(o.defined() ? ProbedTensor{true, o.sizes().vec(), o.strides().vec(), o.scalar_type()}
                                           : ProbedTensor{});
    }
    probe->scratch_bytes = std::max<int64_t>(0, window->peak_bytes() - window->start_bytes() - out_bytes);
  }
  std::lock_guard<std::mutex> lock(mu);
  cache.emplace(full, probe);
  return probe;
}

int64_t cpu_scratch(const std::string& key, int64_t probe_bytes, const ProbeRun& run) {
  const auto probe = cpu_probe(key, probe_bytes, run);
  if (!probe) {
    TORCH_WARN_ONCE("trainmem: an op's CPU scratch (a convolution's, a batch norm's, a bf16 matmul's) was not "
                    "measured (its probe ",
                    "would take ", probe_bytes, " B, above ", kMaxProbeBytes,
                    " B): predicted peaks leave it out (Note [CPU convolution scratch])");
    return 0;
  }
  return probe->scratch_bytes;
}

at::Tensor hold_meta_bytes(int64_t bytes) {
  return bytes > 0 ? at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(at::kMeta)) : at::Tensor();
}

at::Tensor meta_like(const ProbedTensor& t, const at::TensorOptions& options) {
  if (!t.defined) {
    return at::Tensor();
  }
  return at::empty_strided(t.sizes, t.strides, options.dtype(t.dtype).device(at::kMeta));
}

} // namespace detail

namespace {

using detail::cpu_scratch;
using detail::cpu_twin;
using detail::hold_meta_bytes;
using detail::probe_key;
using detail::probe_storage_bytes;
using detail::probing_enabled;


thread_local int tls_meta_guards = 0;

// set_data() refuses a CPU -> Meta swap because the key sets differ; the
// shallow copy it would do after that check is exactly what we want: the
// TensorImpl (and so the tensor's identity and autograd metadata) stays, its
// storage, device and key set become the other tensor's.
void adopt(const at::Tensor& t, const at::Tensor& from) {
  t.unsafeGetTensorImpl()->shallow_copy_from(from.getIntrusivePtr());
}

void swap_to_meta(const at::Tensor& t) {
  if (!t.defined() || t.is_meta()) {
    return;
  }
  adopt(t, at::empty_strided(t.sizes(), t.strides(), t.options().device(at::kMeta)));
}

// A fresh, ordinary tensor (autograd keys included) viewing `storage`.
at::Tensor view_of(const c10::Storage& storage, const at::Tensor& like, c10::Device device) {
  const auto key = c10::computeDispatchKey(like.scalar_type(), like.layout(), device);
  auto t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(storage), c10::DispatchKeySet(key),
                                                    like.dtype());
  t.unsafeGetTensorImpl()->set_sizes_and_strides(like.sizes(), like.strides(),
                                                 like.storage_offset());
  return t;
}

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
void rewrite_factory(const c10::FunctionSchema& schema, torch::jit::Stack* stack) {
  const auto& args = schema.arguments();
  const size_t base = stack->size() - args.size();
  int64_t device_at = -1;
  int64_t pin_at = -1;
  for (size_t i = 0; i < args.size(); ++i) {
    if (mentions_tensor(args[i].real_type())) {
      return;
    }
    if (args[i].name() == "device") {
      device_at = static_cast<int64_t>(i);
    } else if (args[i].name() == "pin_memory") {
      pin_at = static_cast<int64_t>(i);
    }
  }
  if (device_at < 0) {
    return;
  }
  (*stack)[base + device_at] = c10::IValue(c10::Device(c10::kMeta));
  if (pin_at >= 0 && (*stack)[base + pin_at].isBool()) {
    (*stack)[base + pin_at] = c10::IValue(false);
  }
}

// The modules post-order: children in registration order, then the parent;
// a module registered twice is visited once.
void post_order(torch::nn::Module& m, std::unordered_set<const torch::nn::Module*>& seen,
                std::vector<torch::nn::Module*>& out) {
  if (!seen.insert(&m).second) {
    return;
  }
  for (const auto& child : m.children()) {
    post_order(*child, seen, out);
  }
  out.push_back(&m);
}

template <typename T>
bool try_reset(torch::nn::Module& m) {
  if (auto* p = dynamic_cast<T*>(&m)) {
    p->reset_parameters();
    return true;
  }
  return false;
}

// Note [Meta kernels LibTorch lacks]
// Python registers meta kernels for many ops from Python; LibTorch's C++ has
// none for a few that models built here need (Embedding's index_select, relu,
// randperm). We add them on the Meta key, each only if the op still has no
// Meta kernel (a LibTorch that gains one keeps its own).
at::Tensor index_select_meta(const at::Tensor& self, int64_t dim, const at::Tensor& index) {
  TORCH_CHECK(index.dim() <= 1, "index_select(): Index is supposed to be a vector, but got ",
              index.dim(), " dimensions");
  auto sizes = self.sizes().vec();
  if (!sizes.empty()) {
    sizes[c10::maybe_wrap_dim(dim, self.dim())] = index.numel();
  }
  return at::empty(sizes, self.options());
}

at::Tensor relu_meta(const at::Tensor& self) {
  return at::empty_like(self);
}

at::Tensor& randperm_out_meta(int64_t n, std::optional<at::Generator>, at::Tensor& out) {
  TORCH_CHECK(n >= 0, "randperm: expected n >= 0, but got ", n);
  out.resize_({n});
  return out;
}

// Note [Meta kernels for conv nets]
// Convolution, batch norm, 3-D max pooling, adaptive average pooling, the
// dense embedding backward and the 2-D nll loss have CPU kernels and Python
// meta registrations only (convolution's composite kernel picks a backend by
// device and ends in `convolution_overrideable not implemented` on meta). Ours
// return what the CPU kernels return: the same sizes, dtypes and memory
// formats (so views, saved tensors and byte counts downstream are the CPU's).
// They reproduce the CPU's layout rules, which the meta tests check op by op
// against real CPU calls:
// - convolution: channels-last out (and grads) when the input or the weight
//   suggests channels-last (mkldnn_conv_use_channels_last), else contiguous;
// - batch norm: output in the input's suggested format; save_mean/invstd [C]
//   in training, [0] in eval, in the parameters' dtype (float for bf16 input
//   with float parameters);
// - pooling: output (and indices, int64) in the input's suggested format.

// A list argument of `n` entries given as 1 (broadcast) or n values.
std::vector<int64_t> expand_arg(at::IntArrayRef v, size_t n, const char* op, const char* name,
                                int64_t if_empty) {
  if (v.empty()) {
    return std::vector<int64_t>(n, if_empty);
  }
  if (v.size() == 1) {
    return std::vector<int64_t>(n, v[0]);
  }
  TORCH_CHECK(v.size() == n, op, " (meta): expected ", name, " to have 1 or ", n, " values, but got ",
              v.size());
  return v.vec();
}

bool suggests_channels_last(const at::Tensor& t) {
  const auto f = t.suggest_memory_format();
  return f == at::MemoryFormat::ChannelsLast || f == at::MemoryFormat::ChannelsLast3d;
}

// The CPU convolution backends' memory format (determine_backend_memory_format).
at::MemoryFormat conv_memory_format(const at::Tensor& input, const at::Tensor& weight) {
  const bool cl = input.scalar_type() != at::kDouble && weight.scalar_type() != at::kDouble &&
      (suggests_channels_last(input) || suggests_channels_last(weight));
  if (!cl) {
    return at::MemoryFormat::Contiguous;
  }
  if (input.dim() == 4) {
    return at::MemoryFormat::ChannelsLast;
  }
  if (input.dim() == 5) {
    return at::MemoryFormat::ChannelsLast3d;
  }
  return at::MemoryFormat::Contiguous;
}

// Note [CPU convolution scratch]
// CPU convolutions allocate scratch inside the kernel, through the CPU
// allocator, and free it before they return: oneDNN's weight and gradient
// reorders and scratchpads (ideep allocates through c10's CPU allocator), or
// the slow path's im2col columns. Meta kernels that allocate only the outputs
// miss it, and a conv net's predicted peak fell short of the CPU's by it
// (MNIST -4.96 %: about 1 MB in conv2's backward; DCGAN's discriminator
// -11 %; ResNet-style -9 to -13 %). How much depends on the implementation
// oneDNN picks for the shapes, the layouts and the thread count, which a
// formula would chase from version to version; so the meta kernels measure
// it: the same op runs once on CPU tensors with the meta tensors' sizes and
// strides (zero-filled: scratch depends on shapes, not values), under the CPU
// tracker, and the bytes its peak rises above its outputs' are held on meta
// while the outputs are allocated, then freed: the meta peak rises as the
// CPU's did. One probe per distinct call (sizes, strides, dtypes, arguments,
// thread count), cached for the process. A probe whose tensors would take
// more than kMaxProbeBytes is skipped with one warning: its scratch is not
// counted. Batch norm is probed the same way (Note [CPU batch norm
// scratch]). TRAINMEM_CONV_SCRATCH=0 turns probing off (meta then allocates the
// outputs only, as before), and a CUDA prediction turns it off on its thread
// (detail/conv_scratch.h: cuDNN's workspaces are not the CPU's).
at::Tensor convolution_meta(const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                            at::IntArrayRef padding, at::IntArrayRef dilation, bool transposed,
                            at::IntArrayRef output_padding, int64_t groups) {
  const int64_t k = input.dim();
  TORCH_CHECK(k >= 3 && k <= 5, "convolution (meta): expected a 3-D, 4-D or 5-D input, but got ",
              k, "-D of size ", input.sizes());
  TORCH_CHECK(weight.dim() == k, "convolution (meta): expected a ", k, "-D weight for a ", k,
              "-D input, but got weight of size ", weight.sizes());
  TORCH_CHECK(groups > 0, "convolution (meta): expected groups > 0, but got ", groups);
  const size_t n = static_cast<size_t>(k - 2);
  const auto st = expand_arg(stride, n, "convolution", "stride", 1);
  const auto pad = expand_arg(padding, n, "convolution", "padding", 0);
  const auto dil = expand_arg(dilation, n, "convolution", "dilation", 1);
  const auto opad = expand_arg(output_padding, n, "convolution", "output_padding", 0);
  std::vector<int64_t> out{input.size(0)};
  if (transposed) {
    TORCH_CHECK(input.size(1) == weight.size(0),
                "convolution (meta): transposed weight of size ", weight.sizes(), " expects ",
                weight.size(0), " input channels, but got input of size ", input.sizes());
    out.push_back(weight.size(1) * groups);
  } else {
    TORCH_CHECK(input.size(1) == weight.size(1) * groups, "convolution (meta): weight of size ",
                weight.sizes(), " and groups=", groups, " expect ", weight.size(1) * groups,
                " input channels, but got input of size ", input.sizes());
    out.push_back(weight.size(0));
  }
  for (size_t d = 0; d < n; ++d) {
    const int64_t in = input.size(d + 2);
    const int64_t ks = weight.size(d + 2);
    int64_t o = 0;
    if (transposed) {
      o = (in - 1) * st[d] - 2 * pad[d] + dil[d] * (ks - 1) + opad[d] + 1;
    } else {
      o = (in + 2 * pad[d] - dil[d] * (ks - 1) - 1) / st[d] + 1;
    }
    TORCH_CHECK(o > 0, "convolution (meta): input of size ", input.sizes(),
                " gives an output size of ", o, " in spatial dim ", d, " (too small)");
    out.push_back(o);
  }
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == out[1], "convolution (meta): expected a bias of ", out[1],
                " elements, but got ", bias->numel());
  }
  int64_t scratch = 0;
  if (probing_enabled()) {
    const int64_t out_bytes =
        c10::multiply_integers(out) * static_cast<int64_t>(input.element_size());
    const at::Tensor b = bias.has_value() ? *bias : at::Tensor();
    scratch = cpu_scratch(
        fmt::format("convolution {} {} {} s[{}] p[{}] d[{}] t{} op[{}] g{}", probe_key(input),
                    probe_key(weight), probe_key(b), fmt::join(stride, ","), fmt::join(padding, ","),
                    fmt::join(dilation, ","), transposed, fmt::join(output_padding, ","), groups),
        probe_storage_bytes(input) + probe_storage_bytes(weight) + probe_storage_bytes(b) + 2 * out_bytes,
        [&](const std::function<void()>& open) {
          const auto i = cpu_twin(input), w = cpu_twin(weight), cb = cpu_twin(b);
          open();
          return std::vector<at::Tensor>{at::convolution(i, w, cb.defined() ? std::optional<at::Tensor>(cb)
                                                                            : std::nullopt,
                                                         stride, padding, dilation, transposed,
                                                         output_padding, groups)};
        });
  }
  const auto held = hold_meta_bytes(scratch);  // Note [CPU convolution scratch]
  return at::empty(out, input.options().memory_format(conv_memory_format(input, weight)));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> convolution_backward_meta(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    at::OptionalIntArrayRef bias_sizes, at::IntArrayRef stride, at::IntArrayRef padding,
    at::IntArrayRef dilation, bool transposed, at::IntArrayRef output_padding,
    int64_t groups, std::array<bool, 3> output_mask) {
  const auto format = conv_memory_format(input, weight);
  int64_t scratch = 0;
  if (probing_enabled()) {
    const int64_t in = probe_storage_bytes(grad_output) + probe_storage_bytes(input) + probe_storage_bytes(weight);
    const std::optional<std::vector<int64_t>> bsizes =
        bias_sizes.has_value() ? std::optional<std::vector<int64_t>>(bias_sizes->vec()) : std::nullopt;
    scratch = cpu_scratch(
        fmt::format("convolution_backward {} {} {} b[{}] s[{}] p[{}] d[{}] t{} op[{}] g{} m{}{}{}",
                    probe_key(grad_output), probe_key(input), probe_key(weight),
                    bsizes ? fmt::format("{}", fmt::join(*bsizes, ",")) : "none", fmt::join(stride, ","),
                    fmt::join(padding, ","), fmt::join(dilation, ","), transposed,
                    fmt::join(output_padding, ","), groups, output_mask[0], output_mask[1], output_mask[2]),
        2 * in,
        [&](const std::function<void()>& open) {
          const auto go = cpu_twin(grad_output), i = cpu_twin(input), w = cpu_twin(weight);
          open();
          auto [gi, gw, gb] = at::convolution_backward(
              go, i, w, bsizes ? at::OptionalIntArrayRef(*bsizes) : at::OptionalIntArrayRef(), stride,
              padding, dilation, transposed, output_padding, groups, output_mask);
          return std::vector<at::Tensor>{gi, gw, gb};
        });
  }
  const auto held = hold_meta_bytes(scratch);  // Note [CPU convolution scratch]
  at::Tensor grad_input, grad_weight, grad_bias;
  if (output_mask[0]) {
    grad_input = at::empty(input.sizes(), grad_output.options().memory_format(format));
  }
  if (output_mask[1]) {
    grad_weight = at::empty(weight.sizes(), weight.options().memory_format(format));
  }
  if (output_mask[2]) {
    const int64_t channels = bias_sizes.has_value() && !bias_sizes->empty()
        ? (*bias_sizes)[0]
        : (transposed ? weight.size(1) * groups : weight.size(0));
    grad_bias = at::empty({channels}, grad_output.options());
  }
  return {grad_input, grad_weight, grad_bias};
}

// The dtype of batch norm's saved statistics and parameter gradients.
at::ScalarType batch_norm_param_dtype(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                                      const std::optional<at::Tensor>& running_mean) {
  if (weight.has_value() && weight->defined()) {
    return weight->scalar_type();
  }
  if (running_mean.has_value() && running_mean->defined()) {
    return running_mean->scalar_type();
  }
  return input.scalar_type();
}

// Note [CPU batch norm scratch]
// The CPU's batch norm allocates inside the op too (Note [CPU convolution
// scratch]), and its backward a whole gradient's worth:
// batch_norm_backward_cpu_template allocates grad_input, then, on its
// contiguous path (input and grad_out contiguous in one memory format, the
// common case), allocates it again and drops the first, so for a moment two
// input-sized tensors are live; the forward's statistics are made twice
// (a few hundred bytes). With meta kernels that allocated the outputs only, a
// conv + BatchNorm net's prediction was an input's size under the CPU's peak
// wherever a BatchNorm backward was the peak: a checkpointed conv + BatchNorm
// segment's recompute on 8 x 16 x 160 x 160 was 13 MB over its plan (issue
// 22). The meta kernels measure it as the convolutions do: one probe per
// distinct call on zero-filled CPU tensors (values do not change what the
// kernel allocates), cached, held on meta while the outputs are allocated.
// Running statistics given to a probe are copies: the model's are untouched.
std::string optional_probe_key(const std::optional<at::Tensor>& t) {
  return probe_key(t.has_value() ? *t : at::Tensor());
}

std::optional<at::Tensor> optional_cpu_twin(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? std::optional<at::Tensor>(cpu_twin(*t)) : std::nullopt;
}

int64_t optional_probe_bytes(const std::optional<at::Tensor>& t) {
  return t.has_value() ? probe_storage_bytes(*t) : 0;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> native_batch_norm_meta(
    const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var, bool training, double momentum,
    double eps) {
  TORCH_CHECK(input.dim() >= 2, "batch_norm (meta): expected an input of at least 2 dims, but got ",
              input.sizes());
  int64_t scratch = 0;
  if (probing_enabled()) {
    const int64_t params = optional_probe_bytes(weight) + optional_probe_bytes(bias) +
        optional_probe_bytes(running_mean) + optional_probe_bytes(running_var);
    scratch = cpu_scratch(
        fmt::format("native_batch_norm {} {} {} {} {} t{}", probe_key(input), optional_probe_key(weight),
                    optional_probe_key(bias), optional_probe_key(running_mean),
                    optional_probe_key(running_var), training),
        2 * probe_storage_bytes(input) + 2 * params,
        [&](const std::function<void()>& open) {
          const auto i = cpu_twin(input);
          const auto w = optional_cpu_twin(weight), b = optional_cpu_twin(bias);
          const auto rm = optional_cpu_twin(running_mean), rv = optional_cpu_twin(running_var);
          open();
          auto [out, mean, invstd] = at::native_batch_norm(i, w, b, rm, rv, training, momentum, eps);
          return std::vector<at::Tensor>{out, mean, invstd};
        });
  }
  const auto held = hold_meta_bytes(scratch);  // Note [CPU batch norm scratch]
  const auto stats = input.options().dtype(batch_norm_param_dtype(input, weight, running_mean));
  auto out = at::empty(input.sizes(), input.options().memory_format(input.suggest_memory_format()));
  const int64_t c = training ? input.size(1) : 0;
  return {out, at::empty({c}, stats), at::empty({c}, stats)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> native_batch_norm_backward_meta(
    const at::Tensor& grad_out, const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var,
    const std::optional<at::Tensor>& save_mean, const std::optional<at::Tensor>& save_invstd,
    bool train, double eps, std::array<bool, 3> mask) {
  int64_t scratch = 0;
  if (probing_enabled()) {
    const int64_t params = optional_probe_bytes(weight) + optional_probe_bytes(running_mean) +
        optional_probe_bytes(running_var) + optional_probe_bytes(save_mean) + optional_probe_bytes(save_invstd);
    scratch = cpu_scratch(
        fmt::format("native_batch_norm_backward {} {} {} {} {} {} {} t{} m{}{}{}", probe_key(grad_out),
                    probe_key(input), optional_probe_key(weight), optional_probe_key(running_mean),
                    optional_probe_key(running_var), optional_probe_key(save_mean),
                    optional_probe_key(save_invstd), train, mask[0], mask[1], mask[2]),
        probe_storage_bytes(grad_out) + 3 * probe_storage_bytes(input) + 3 * params,
        [&](const std::function<void()>& open) {
          const auto go = cpu_twin(grad_out), i = cpu_twin(input);
          const auto w = optional_cpu_twin(weight), rm = optional_cpu_twin(running_mean),
                     rv = optional_cpu_twin(running_var), sm = optional_cpu_twin(save_mean),
                     si = optional_cpu_twin(save_invstd);
          open();
          auto [gi, gw, gb] = at::native_batch_norm_backward(go, i, w, rm, rv, sm, si, train, eps, mask);
          return std::vector<at::Tensor>{gi, gw, gb};
        });
  }
  const auto held = hold_meta_bytes(scratch);  // Note [CPU batch norm scratch]
  at::Tensor dx, dw, db;
  if (mask[0]) {
    dx = at::empty(input.sizes(), grad_out.options().memory_format(input.suggest_memory_format()));
  }
  const auto stats = input.options().dtype(batch_norm_param_dtype(input, weight, running_mean));
  if (mask[1]) {
    dw = at::empty({input.size(1)}, stats);
  }
  if (mask[2]) {
    db = at::empty({input.size(1)}, stats);
  }
  return {dx, dw, db};
}

// Pooling over the last `n` dims of a (N, C, ...) or (C, ...) input.
std::vector<int64_t> pooled_sizes(const at::Tensor& self, size_t n, at::IntArrayRef kernel_size,
                                  at::IntArrayRef stride, at::IntArrayRef padding,
                                  at::IntArrayRef dilation, bool ceil_mode, const char* op) {
  TORCH_CHECK(self.dim() == static_cast<int64_t>(n) + 1 || self.dim() == static_cast<int64_t>(n) + 2,
              op, " (meta): expected a ", n + 1, "-D or ", n + 2, "-D input, but got ", self.sizes());
  const auto ks = expand_arg(kernel_size, n, op, "kernel_size", 1);
  const auto st = stride.empty() ? ks : expand_arg(stride, n, op, "stride", 1);
  const auto pad = expand_arg(padding, n, op, "padding", 0);
  const auto dil = expand_arg(dilation, n, op, "dilation", 1);
  auto sizes = self.sizes().vec();
  const size_t first = sizes.size() - n;
  for (size_t d = 0; d < n; ++d) {
    const int64_t o = at::native::pooling_output_shape<int64_t>(sizes[first + d], ks[d], pad[d], st[d],
                                                               dil[d], ceil_mode);
    TORCH_CHECK(o > 0, op, " (meta): input of size ", self.sizes(), " gives an output size of ", o,
                " (too small)");
    sizes[first + d] = o;
  }
  return sizes;
}

at::MemoryFormat pool_memory_format(const at::Tensor& self) {
  return self.dim() >= 4 ? self.suggest_memory_format() : at::MemoryFormat::Contiguous;
}

std::tuple<at::Tensor, at::Tensor> max_pool3d_with_indices_meta(
    const at::Tensor& self, at::IntArrayRef kernel_size, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef dilation, bool ceil_mode) {
  const auto sizes =
      pooled_sizes(self, 3, kernel_size, stride, padding, dilation, ceil_mode, "max_pool3d");
  const auto format = self.dim() == 5 ? pool_memory_format(self) : at::MemoryFormat::Contiguous;
  return {at::empty(sizes, self.options().memory_format(format)),
          at::empty(sizes, self.options().dtype(at::kLong).memory_format(format))};
}

at::Tensor max_pool3d_with_indices_backward_meta(
    const at::Tensor& /*grad_output*/, const at::Tensor& self, at::IntArrayRef /*kernel_size*/,
    at::IntArrayRef /*stride*/, at::IntArrayRef /*padding*/, at::IntArrayRef /*dilation*/,
    bool /*ceil_mode*/, const at::Tensor& /*indices*/) {
  const auto format = self.dim() == 5 ? pool_memory_format(self) : at::MemoryFormat::Contiguous;
  return at::empty(self.sizes(), self.options().memory_format(format));
}

at::Tensor adaptive_avg_pool_meta(const at::Tensor& self, at::IntArrayRef output_size, size_t n,
                                  const char* op) {
  TORCH_CHECK(output_size.size() == n, op, " (meta): expected output_size of ", n,
              " values, but got ", output_size);
  TORCH_CHECK(self.dim() == static_cast<int64_t>(n) + 1 || self.dim() == static_cast<int64_t>(n) + 2,
              op, " (meta): expected a ", n + 1, "-D or ", n + 2, "-D input, but got ", self.sizes());
  auto sizes = self.sizes().vec();
  std::copy(output_size.begin(), output_size.end(), sizes.end() - static_cast<int64_t>(n));
  return at::empty(sizes, self.options().memory_format(pool_memory_format(self)));
}

at::Tensor adaptive_avg_pool2d_meta(const at::Tensor& self, at::IntArrayRef output_size) {
  return adaptive_avg_pool_meta(self, output_size, 2, "adaptive_avg_pool2d");
}

at::Tensor adaptive_avg_pool3d_meta(const at::Tensor& self, at::IntArrayRef output_size) {
  return adaptive_avg_pool_meta(self, output_size, 3, "adaptive_avg_pool3d");
}

at::Tensor adaptive_avg_pool_backward_meta(const at::Tensor& /*grad_output*/, const at::Tensor& self) {
  return at::empty(self.sizes(), self.options().memory_format(pool_memory_format(self)));
}

at::Tensor embedding_dense_backward_meta(const at::Tensor& grad_output, const at::Tensor& /*indices*/,
                                         int64_t num_weights, int64_t /*padding_idx*/,
                                         bool /*scale_grad_by_freq*/) {
  return at::empty({num_weights, grad_output.size(-1)}, grad_output.options());
}

std::tuple<at::Tensor, at::Tensor> nll_loss2d_forward_meta(
    const at::Tensor& self, const at::Tensor& target, const std::optional<at::Tensor>& /*weight*/,
    int64_t reduction, int64_t /*ignore_index*/) {
  TORCH_CHECK(self.dim() == 4 && target.dim() == 3,
              "nll_loss2d (meta): expected a 4-D input and a 3-D target, but got input of size ",
              self.sizes(), " and target of size ", target.sizes());
  auto out = reduction == at::Reduction::None ? at::empty(target.sizes(), self.options())
                                              : at::empty({}, self.options());
  return {out, at::empty({}, self.options())};
}

at::Tensor nll_loss2d_backward_meta(const at::Tensor& /*grad_output*/, const at::Tensor& self,
                                    const at::Tensor& /*target*/,
                                    const std::optional<at::Tensor>& /*weight*/,
                                    int64_t /*reduction*/, int64_t /*ignore_index*/,
                                    const at::Tensor& /*total_weight*/) {
  return at::empty(self.sizes(), self.options());
}

// GradScaler's ops (grad_scaler.h) work in place and allocate nothing: on
// meta, where no gradient has a value to check, they do nothing.
void amp_unscale_meta(at::TensorList /*grads*/, at::Tensor& /*found_inf*/, const at::Tensor& /*inv_scale*/) {}

at::Tensor& amp_update_scale_meta(at::Tensor& self, at::Tensor& /*growth_tracker*/, const at::Tensor& /*found_inf*/,
                                  double /*growth_factor*/, double /*backoff_factor*/, int64_t /*growth_interval*/) {
  return self;
}

at::Tensor mse_loss_backward_meta(const at::Tensor& grad_output, const at::Tensor& self,
                                  const at::Tensor& /*target*/, int64_t /*reduction*/) {
  return at::empty(self.sizes(), grad_output.options().dtype(self.scalar_type()));
}

at::Tensor binary_cross_entropy_meta(const at::Tensor& self, const at::Tensor& /*target*/,
                                     const std::optional<at::Tensor>& /*weight*/, int64_t reduction) {
  return reduction == at::Reduction::None ? at::empty(self.sizes(), self.options())
                                          : at::empty({}, self.options());
}

at::Tensor binary_cross_entropy_backward_meta(const at::Tensor& /*grad_output*/, const at::Tensor& self,
                                              const at::Tensor& /*target*/,
                                              const std::optional<at::Tensor>& /*weight*/,
                                              int64_t /*reduction*/) {
  return at::empty(self.sizes(), self.options());
}

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

bool& conv_scratch_on_meta() {
  thread_local bool on = true;
  return on;
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
    rewrite_factory(op.schema(), stack);
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
    scope.call_next(op, ks, stack);
  }
  std::optional<detail::InterceptScope> scope;
};

MetaInitGuard::MetaInitGuard() : impl_(std::make_unique<Impl>()) {
  detail::register_intercept_fallback();
  register_missing_meta_kernels();
  impl_->scope.emplace(*impl_);
  ++tls_meta_guards;
}

MetaInitGuard::~MetaInitGuard() {
  --tls_meta_guards;
  impl_->scope.reset();
}

void to_meta(torch::nn::Module& module) {
  register_missing_meta_kernels();
  for (const auto& p : module.parameters(/*recurse=*/true)) {
    swap_to_meta(p);
  }
  for (const auto& b : module.buffers(/*recurse=*/true)) {
    swap_to_meta(b);
  }
}

bool reset_builtin_parameters(torch::nn::Module& m) {
  using namespace torch::nn;
  if (auto* mha = dynamic_cast<MultiheadAttentionImpl*>(&m)) {
    mha->_reset_parameters();
    return true;
  }
  return try_reset<LinearImpl>(m) || try_reset<BilinearImpl>(m) || try_reset<Conv1dImpl>(m) ||
      try_reset<Conv2dImpl>(m) || try_reset<Conv3dImpl>(m) || try_reset<ConvTranspose1dImpl>(m) ||
      try_reset<ConvTranspose2dImpl>(m) || try_reset<ConvTranspose3dImpl>(m) ||
      try_reset<EmbeddingImpl>(m) || try_reset<EmbeddingBagImpl>(m) || try_reset<LayerNormImpl>(m) ||
      try_reset<GroupNormImpl>(m) || try_reset<BatchNorm1dImpl>(m) || try_reset<BatchNorm2dImpl>(m) ||
      try_reset<BatchNorm3dImpl>(m) || try_reset<InstanceNorm1dImpl>(m) ||
      try_reset<InstanceNorm2dImpl>(m) || try_reset<InstanceNorm3dImpl>(m) || try_reset<RNNImpl>(m) ||
      try_reset<LSTMImpl>(m) || try_reset<GRUImpl>(m) || try_reset<RNNCellImpl>(m) ||
      try_reset<LSTMCellImpl>(m) || try_reset<GRUCellImpl>(m);
}

void to_empty(torch::nn::Module& module, c10::Device device) {
  TORCH_CHECK(tls_meta_guards == 0,
              "to_empty: called under a MetaInitGuard, which would make its storage meta "
              "again; end the guard first");
  TORCH_CHECK(device.type() != c10::kMeta, "to_empty: expected a real device, but got ", device);
  // Meta storage -> (the meta storage, held so its address is not reused while
  // we map by it; the real storage that replaces it).
  std::unordered_map<const c10::StorageImpl*, std::pair<c10::Storage, c10::Storage>> storages;
  std::unordered_set<const c10::TensorImpl*> done;
  auto give_storage = [&](const at::Tensor& t) {
    if (!t.defined() || !t.is_meta() || !done.insert(t.unsafeGetTensorImpl()).second) {
      return;
    }
    const c10::Storage& meta = t.storage();
    auto& [held, real] = storages[meta.unsafeGetStorageImpl()];
    if (!real) {
      held = meta;
      real = at::empty({static_cast<int64_t>(meta.nbytes())},
                       at::TensorOptions().dtype(at::kByte).device(device))
                 .storage();
    }
    adopt(t, view_of(real, t, real.device()));
  };
  for (const auto& p : module.parameters(/*recurse=*/true)) {
    give_storage(p);
    // A meta gradient (a meta step's) holds no values and would meet the
    // real parameter in the next step: "found at least two devices, meta
    // and cpu". The parameter starts with none, as a new one does.
    if (p.grad().defined() && p.grad().is_meta()) {
      p.mutable_grad().reset();
    }
  }
  for (const auto& b : module.buffers(/*recurse=*/true)) {
    give_storage(b);
  }
}

void materialize(torch::nn::Module& module, c10::Device device, const ModuleInit& init) {
  to_empty(module, device);
  std::unordered_set<const torch::nn::Module*> seen;
  std::vector<torch::nn::Module*> order;
  post_order(module, seen, order);
  at::NoGradGuard no_grad;
  std::vector<std::string> unknown;
  for (torch::nn::Module* m : order) {
    if (init && init(*m)) {
      continue;
    }
    if (auto* r = dynamic_cast<Reinitializable*>(m)) {
      r->reset_parameters();
      continue;
    }
    if (reset_builtin_parameters(*m)) {
      continue;
    }
    if (!m->named_parameters(/*recurse=*/false).is_empty() ||
        !m->named_buffers(/*recurse=*/false).is_empty()) {
      unknown.push_back(m->name());
    }
  }
  TORCH_CHECK(unknown.empty(), "materialize: no way to re-initialize the tensors of ",
              fmt::format("{}", fmt::join(unknown, ", ")),
              " (allocated, left uninitialized); pass an init function or implement "
              "trainmem::Reinitializable");
}

TensorSource archive_source(torch::serialize::InputArchive& archive) {
  return [&archive](const std::string& name) -> at::Tensor {
    torch::serialize::InputArchive* current = &archive;
    torch::serialize::InputArchive nested;
    size_t start = 0;
    for (size_t dot = name.find('.'); dot != std::string::npos; dot = name.find('.', start)) {
      torch::serialize::InputArchive child;
      if (!current->try_read(name.substr(start, dot - start), child)) {
        return {};
      }
      nested = std::move(child);
      current = &nested;
      start = dot + 1;
    }
    at::Tensor t;
    if (!current->try_read(name.substr(start), t)) {
      return {};
    }
    return t;
  };
}

LoadReport load_into(torch::nn::Module& module, const TensorSource& source, c10::Device device,
                     bool strict) {
  TORCH_CHECK(static_cast<bool>(source), "load_into: the source is empty");
  TORCH_CHECK(tls_meta_guards == 0,
              "load_into: called under a MetaInitGuard; end the guard first");
  TORCH_CHECK(device.type() != c10::kMeta, "load_into: expected a real device, but got ", device);
  LoadReport report;
  std::unordered_set<const c10::TensorImpl*> done;
  auto load = [&](const std::string& name, const at::Tensor& t) {
    if (!t.defined() || !done.insert(t.unsafeGetTensorImpl()).second) {
      return;
    }
    at::Tensor src = source(name);
    if (!src.defined()) {
      report.missing.push_back(name);
      return;
    }
    TORCH_CHECK(src.sizes() == t.sizes(), "load_into: ", name, " has shape ", t.sizes(),
                " in the module, but ", src.sizes(), " in the source");
    const bool same_device =
        src.device().type() == device.type() && (!device.has_index() || src.device() == device);
    at::NoGradGuard no_grad;
    if (same_device && src.scalar_type() == t.scalar_type() && !src.is_meta()) {
      adopt(t, view_of(src.storage(), src, src.device()));
      ++report.num_adopted;
    } else {
      TORCH_CHECK(!src.is_meta(), "load_into: the source gave a meta tensor for ", name);
      auto converted = src.to(device, t.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
      src.reset(); // released before the next tensor is asked for
      adopt(t, view_of(converted.storage(), converted, converted.device()));
      ++report.num_copied;
    }
    ++report.num_loaded;
    report.loaded_bytes += t.numel() * static_cast<int64_t>(t.element_size());
  };
  for (const auto& p : module.named_parameters(/*recurse=*/true)) {
    load(p.key(), p.value());
  }
  for (const auto& b : module.named_buffers(/*recurse=*/true)) {
    load(b.key(), b.value());
  }
  if (strict && !report.missing.empty()) {
    const size_t shown = std::min<size_t>(report.missing.size(), 5);
    std::vector<std::string> first(report.missing.begin(), report.missing.begin() + shown);
    TORCH_CHECK(false, "load_into: the source has no tensor for ", report.missing.size(),
                " names (", fmt::format("{}", fmt::join(first, ", ")),
                report.missing.size() > shown ? ", ..." : "",
                "); the others were loaded. Pass strict = false to allow this");
  }
  return report;
}

} // namespace trainmem
