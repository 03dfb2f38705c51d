// The meta kernels LibTorch's C++ lacks, for the ops models built here run:
// Embedding's index_select, relu, randperm (Note [Meta kernels LibTorch
// lacks]); convolution, batch norm, pooling, the dense embedding backward and
// losses, with the CPU's layouts and scratch (Note [Meta kernels for conv
// nets], Note [CPU convolution scratch], Note [CPU batch norm scratch]);
// GradScaler's ops. meta.cpp registers them on the Meta key.
#include "core/detail/meta_internal.h"

#include <algorithm>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Reduction.h>
#include <ATen/native/Pool.h>
#include <ATen/ops/convolution.h>
#include <ATen/ops/convolution_backward.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/native_batch_norm.h>
#include <ATen/ops/native_batch_norm_backward.h>
#include <c10/core/WrapDimMinimal.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/detail/cpu_probe.h"

namespace trainmem {
namespace detail {

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

namespace {

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

} // namespace

// Note [CPU convolution scratch]
// CPU convolutions allocate scratch inside the kernel, through the CPU
// allocator, and free it before they return: oneDNN's weight and gradient
// reorders and scratchpads (ideep allocates through c10's CPU allocator), or
// the slow path's im2col columns. Meta kernels that allocate only the outputs
// miss it, and a conv net's predicted peak then falls short of the CPU's by
// it (MNIST -4.96 %: about 1 MB in conv2's backward; DCGAN's discriminator
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
// scratch]). TRAINMEM_CONV_SCRATCH=0 turns probing off (meta then allocates
// the outputs only), and a CUDA prediction turns it off on its thread
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

namespace {

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
// (a few hundred bytes). Meta kernels that allocate the outputs only put a
// conv + BatchNorm net's prediction an input's size under the CPU's peak
// wherever a BatchNorm backward is the peak: a checkpointed conv + BatchNorm
// segment's recompute on 8 x 16 x 160 x 160 then runs 13 MB over its plan.
// The meta kernels measure it as the convolutions do: one probe per
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

} // namespace

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

namespace {

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

} // namespace

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

namespace {

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

} // namespace

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

} // namespace detail
} // namespace trainmem
