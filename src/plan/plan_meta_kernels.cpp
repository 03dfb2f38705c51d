#include "trainmem/planner.h"

#include <algorithm>
#include <cctype>
#include <atomic>
#include <chrono>
#include <cmath>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include <ATen/Context.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Generator.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <ATen/ops/_scaled_dot_product_attention_math.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/mean.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/sum.h>
#include <c10/core/Allocator.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/autograd/function.h>  // Node: node.h only since 2.13
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>
#include <torch/nn/module.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>

#include "trainmem/accountant.h"
#include "trainmem/allocator.h"
#include "trainmem/meta.h"
#include "trainmem/format.h"
#include "detail/backward_on_meta.h"
#include "core/detail/checkpoint_state.h"
#include "detail/intercept.h"
#include "detail/optimizer_state.h"
#include "detail/process_library.h"
#include "plan/detail/plan_internal.h"

namespace trainmem {


// ---------------------------------------------------------------------------
// Meta kernels with the CPU kernels' layouts

namespace {

// Note [Meta kernels with CPU layouts]
// LibTorch ships C++ meta kernels for structured ops only; CPU flash
// attention and LayerNorm get theirs from Python (torch/_meta_registrations.py),
// which a C++ process never loads. And scaled_dot_product_attention picks its
// backend through a DispatchStub that has no meta entry, so on meta it always
// takes the math path (which saves the (B, H, T, T) scores). We register meta
// kernels that allocate exactly what the CPU kernels return, in their layouts
// (flash attention's output and log-sum-exp are (B, T, H, .) buffers
// transposed, which is why the projection's reshape is a view on CPU), and an
// AutogradMeta kernel for scaled_dot_product_attention that chooses flash
// whenever the CPU would. Registered once, on first use, never unregistered.

std::tuple<at::Tensor, at::Tensor> flash_cpu_meta(
    const at::Tensor& q, const at::Tensor& /*key*/, const at::Tensor& v, double /*dropout_p*/,
    bool /*is_causal*/, const std::optional<at::Tensor>& /*attn_mask*/,
    std::optional<double> /*scale*/) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), hd = v.size(3);
  auto out = at::empty({B, T, H, hd}, q.options()).transpose(1, 2);
  auto lse = at::empty({B, T, H}, q.options().dtype(at::toOpMathType(q.scalar_type()))).transpose(1, 2);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_cpu_backward_meta(
    const at::Tensor& /*grad_out*/, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& /*out*/, const at::Tensor& /*lse*/, double /*dropout_p*/, bool /*is_causal*/,
    const std::optional<at::Tensor>& /*attn_mask*/, std::optional<double> /*scale*/) {
  auto like = [](const at::Tensor& t) {
    return at::empty({t.size(0), t.size(2), t.size(1), t.size(3)}, t.options()).transpose(1, 2);
  };
  return {like(q), like(k), like(v)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_meta(
    const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    double /*eps*/) {
  const int64_t axis = input.dim() - static_cast<int64_t>(normalized_shape.size());
  TORCH_CHECK(axis >= 0, "native_layer_norm (meta): normalized_shape has more dims than the input");
  auto x = input.contiguous();  // the CPU kernel's expect_contiguous()
  int64_t M = 1;
  std::vector<int64_t> stat_shape;
  for (int64_t i = 0; i < input.dim(); ++i) {
    if (i < axis) {
      M *= input.size(i);
      stat_shape.push_back(input.size(i));
    } else {
      stat_shape.push_back(1);
    }
  }
  auto y = at::empty(x.sizes(), x.options());
  // layer_norm_cpu's param_scalar_type: the statistics in the input's dtype,
  // in its op-math type (fp32 for bf16 or fp16) only when the weight or bias
  // has another dtype (a bf16 input with fp32 parameters). CUDA keeps them in
  // fp32 always: its kernel model re-types them (cuda_predict.cpp).
  at::ScalarType param_type = at::ScalarType::Undefined;
  for (const auto* p : {&weight, &bias}) {
    if (param_type == at::ScalarType::Undefined && p->has_value() && (*p)->defined()) {
      param_type = (*p)->scalar_type();
    }
  }
  const bool mixed = param_type != at::ScalarType::Undefined && param_type != x.scalar_type();
  auto stats = x.options().dtype(mixed ? at::toOpMathType(x.scalar_type()) : x.scalar_type());
  auto mean = at::empty({M}, stats).view(stat_shape);
  auto rstd = at::empty({M}, stats).view(stat_shape);
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_meta(
    const at::Tensor& grad_out, const at::Tensor& input, c10::SymIntArrayRef /*normalized_shape*/,
    const at::Tensor& /*mean*/, const at::Tensor& /*rstd*/, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, std::array<bool, 3> mask) {
  auto x = input.contiguous();
  auto dy = grad_out.contiguous();
  at::Tensor dx, dw, db;
  if (mask[0]) {
    dx = at::empty(x.sizes(), x.options());
  }
  if (mask[1] && weight.has_value() && weight->defined()) {
    dw = at::empty(weight->sizes(), weight->options());
  }
  if (mask[2] && bias.has_value() && bias->defined()) {
    db = at::empty(bias->sizes(), bias->options());
  }
  return {dx, dw, db};
}

// The CPU's choice (sdp_utils_cpp.cpp's use_flash_attention_cpp), for the
// arguments it checks that matter on meta. Measured on LibTorch 2.13's CPU
// (tests/hf_saved_bytes.py): flash takes grouped-query k and v with
// enable_gqa (query heads a multiple of theirs), and masks that broadcast to
// (B, H, Tq, Tk), 2-D or 4-D, boolean or floating.
bool cpu_would_use_flash(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const std::optional<at::Tensor>& mask, double dropout_p, bool enable_gqa) {
  if (dropout_p != 0.0 || q.dim() != 4 || k.dim() != 4 || v.dim() != 4) {
    return false;
  }
  if (!c10::isFloatingType(q.scalar_type()) || q.scalar_type() != k.scalar_type() ||
      q.scalar_type() != v.scalar_type()) {
    return false;
  }
  if (q.size(3) != k.size(3) || k.size(3) != v.size(3) || q.size(2) == 0 || k.size(2) == 0) {
    return false;
  }
  if (q.stride(3) != 1 || k.stride(3) != 1 || v.stride(3) != 1) {
    return false;
  }
  if (q.size(0) != k.size(0) || k.size(0) != v.size(0) || k.size(1) != v.size(1)) {
    return false;
  }
  if (q.size(1) != k.size(1) && !(enable_gqa && k.size(1) > 0 && q.size(1) % k.size(1) == 0)) {
    return false;
  }
  if (mask.has_value() && mask->defined()) {
    const auto& m = *mask;
    if (m.scalar_type() != at::kBool && m.scalar_type() != q.scalar_type()) {
      return false;
    }
    if (m.dim() != 2 && m.dim() != 4) {
      return false;
    }
    const std::vector<int64_t> full{q.size(0), q.size(1), q.size(2), k.size(2)};
    for (int64_t i = 0; i < m.dim(); ++i) {
      const int64_t want = full[4 - m.dim() + i];
      if (m.size(i) != 1 && m.size(i) != want) {
        return false;
      }
    }
  }
  return true;
}

at::Tensor sdpa_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const std::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                     std::optional<double> scale, bool enable_gqa) {
  if (cpu_would_use_flash(q, k, v, mask, dropout_p, enable_gqa)) {
    // attention.cpp's convert_boolean_attn_mask: a boolean mask becomes a
    // contiguous float mask of its shape (flash's backward saves it).
    std::optional<at::Tensor> m = mask;
    if (m.has_value() && m->defined() && m->scalar_type() == at::kBool) {
      m = at::empty(m->sizes(), q.options());
    }
    return std::get<0>(at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, m, scale));
  }
  return std::get<0>(at::_scaled_dot_product_attention_math(q, k, v, mask, dropout_p, is_causal,
                                                            std::nullopt, scale, enable_gqa));
}

} // namespace

void enable_cpu_meta_kernels() {
  register_meta_kernels();  // one call gives every meta kernel trainmem adds
  static std::once_flag once;
  static std::string error;
  std::call_once(once, [] {
    try {
      auto* meta = &detail::keep_for_process(std::make_unique<torch::Library>(
          torch::Library::IMPL, "aten", c10::DispatchKey::Meta, __FILE__, __LINE__));
      meta->impl("_scaled_dot_product_flash_attention_for_cpu", &flash_cpu_meta);
      meta->impl("_scaled_dot_product_flash_attention_for_cpu_backward", &flash_cpu_backward_meta);
      meta->impl("native_layer_norm", &layer_norm_meta);
      meta->impl("native_layer_norm_backward", &layer_norm_backward_meta);
      auto* autograd = &detail::keep_for_process(std::make_unique<torch::Library>(
          torch::Library::IMPL, "aten", c10::DispatchKey::AutogradMeta, __FILE__, __LINE__));
      autograd->impl("scaled_dot_product_attention", &sdpa_meta);
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  TORCH_CHECK(error.empty(), "enable_cpu_meta_kernels: cannot register the meta kernels: ", error);
}

} // namespace trainmem
