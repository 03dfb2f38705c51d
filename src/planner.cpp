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
#include "detail/checkpoint_state.h"
#include "detail/intercept.h"
#include "detail/optimizer_state.h"
#include "detail/process_library.h"

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
    const std::optional<at::Tensor>& /*weight*/, const std::optional<at::Tensor>& /*bias*/,
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
  auto stats = x.options().dtype(at::toOpMathType(x.scalar_type()));
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

// ---------------------------------------------------------------------------
// Counting meta allocator

namespace {

// Note [Counting meta allocator]
// Meta storages come from GetAllocator(kMeta) (empty_meta, empty_strided_meta),
// a stub that returns a null pointer. Ours returns a null pointer too, with a
// small context that remembers the size, so the free is seen: live and peak
// meta bytes, as the CPU tracker counts CPU bytes. Installed once with a
// priority above the stub's, never destroyed. Predictions run on one thread;
// the peak and the gradient bytes at the peak are updated on that thread.
class MetaCounter final : public c10::Allocator {
 public:
  struct Block {
    int64_t bytes;
  };

  static MetaCounter& get() {
    static MetaCounter* counter = [] {
      auto* c = new MetaCounter();
      c10::SetAllocator(c10::DeviceType::Meta, c, /*priority=*/1);
      return c;
    }();
    return *counter;
  }

  c10::DataPtr allocate(size_t n) override {
    const auto bytes = static_cast<int64_t>(n);
    const int64_t now = live_.fetch_add(bytes) + bytes;
    raise_peak(now);
    return {nullptr, new Block{bytes}, &free_block, c10::Device(c10::DeviceType::Meta)};
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return nullptr;
  }
  void copy_data(void* /*dest*/, const void* /*src*/, std::size_t /*count*/) const override {}

  int64_t live() const { return live_.load(); }
  int64_t peak() const { return peak_.load(); }
  int64_t grad_at_peak() const { return grad_at_peak_.load(); }
  void reset_peak() {
    peak_.store(live_.load());
    grad_at_peak_.store(grad_live_.load());
  }
  void add_grad(int64_t bytes) { grad_live_.fetch_add(bytes); }
  void reset_grad() { grad_live_.store(0); }

 private:
  MetaCounter() = default;
  void raise_peak(int64_t now) {
    if (now > peak_.load()) {
      peak_.store(now);
      grad_at_peak_.store(grad_live_.load());
    }
  }
  static void free_block(void* ctx) {
    auto* b = static_cast<Block*>(ctx);
    get().live_.fetch_sub(b->bytes);
    delete b;
  }
  std::atomic<int64_t> live_{0};
  std::atomic<int64_t> peak_{0};
  std::atomic<int64_t> grad_live_{0};
  std::atomic<int64_t> grad_at_peak_{0};
};

// Meta backward runs through detail::BackwardOnMeta: Note [Gradient
// accumulation on meta] in src/detail/backward_on_meta.cpp.

// Note [CPU matmul operand copies on meta]
// LibTorch's CPU addmm/mm (addmm_impl_cpu_ in aten/src/ATen/native/
// LinearAlgebra.cpp) hands BLAS each operand in place when one of its dims
// has stride 1 and the other a leading dimension BLAS accepts; otherwise it
// clones the operand contiguous for the call, and frees the clone when the op
// returns (the output too, were it not so, to a Fortran-contiguous copy).
// The meta kernels do not, so a meta run missed these bytes. The common
// case is the gradient of a sum: ones expanded to the output's shape
// (strides 0, 0), the first gradient of backward; both matmuls of the last
// Linear's backward clone it (seed 001: 67,108,864 B each, one at a time).
// cpu_blas_operand_copy_bytes() repeats the kernel's choice for the output
// and both operands; the meta step below holds a meta tensor of those bytes
// while the op's output is alive (CPU: output, then the clones, then the
// clones freed).
// fp32/fp64 only: the reduced-precision types may take oneDNN's path.
int64_t cpu_blas_operand_copy_bytes(const at::Tensor& c, const at::Tensor& mat1, const at::Tensor& mat2) {
  if (!c.defined() || !mat1.defined() || !mat2.defined() || c.dim() != 2 || mat1.dim() != 2 ||
      mat2.dim() != 2 || c.numel() == 0 || mat1.size(1) == 0) {
    return 0;
  }
  const auto st = mat1.scalar_type();
  if ((st != at::kFloat && st != at::kDouble) || mat2.scalar_type() != st) {
    return 0;
  }
  // Column-major with a leading dimension >= its rows, or row-major with one
  // >= its columns: BLAS reads it in place; else a contiguous clone.
  auto copy = [](const at::Tensor& t) -> int64_t {
    const int64_t r = t.size(0), k = t.size(1), s0 = t.stride(0), s1 = t.stride(1);
    const bool ok = (s0 == 1 && s1 >= std::max<int64_t>(1, r)) || (s1 == 1 && s0 >= std::max<int64_t>(1, k));
    return ok ? 0 : t.numel() * static_cast<int64_t>(t.element_size());
  };
  return copy(c) + copy(mat1) + copy(mat2);
}

namespace {

// Below autograd, for predict_step_peak: after a meta mm or addmm returns,
// holds cpu_blas_operand_copy_bytes() on meta for a moment (its output is
// alive then, as on CPU while the clones are).
class CpuKernelModel final : public detail::InterceptHandler {
 public:
  void handle(const detail::InterceptScope& scope, const c10::OperatorHandle& op, c10::DispatchKeySet ks,
              torch::jit::Stack* stack) override {
    const auto& schema = op.schema();
    const std::string& name = schema.name();
    const bool mm = name == "aten::mm" && schema.overload_name().empty();
    const bool addmm = name == "aten::addmm" && schema.overload_name().empty();
    if (!mm && !addmm) {
      scope.call_next(op, ks, stack);
      return;
    }
    const size_t n = schema.arguments().size();
    const size_t first = stack->size() - n;
    const at::Tensor m1 = (*stack)[first + (mm ? 0 : 1)].toTensor();
    const at::Tensor m2 = (*stack)[first + (mm ? 1 : 2)].toTensor();
    scope.call_next(op, ks, stack);
    if (!m1.is_meta()) {
      return;
    }
    const int64_t bytes = cpu_blas_operand_copy_bytes(stack->back().toTensor(), m1, m2);
    if (bytes > 0) {
      at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(at::kMeta));
    }
  }
};

} // namespace

std::mutex& prediction_mutex() {
  static std::mutex m;
  return m;
}

void check_on_meta(const torch::nn::Module& module, const char* who) {
  for (const auto& p : module.named_parameters(/*recurse=*/true)) {
    TORCH_CHECK(p.value().is_meta(), who, ": parameter '", p.key(), "' is on ", p.value().device(),
                ", not on the meta device; move the module with trainmem::to_meta() first");
  }
}

int64_t storage_bytes(const at::Tensor& t) {
  return t.defined() && t.has_storage() ? static_cast<int64_t>(t.storage().nbytes()) : 0;
}

// Whether autograd (a saved tensor, or a checkpoint's kept input) holds `t`
// besides the caller's one reference: the tensor itself (a leaf or an input)
// or its storage (an output, saved as tensor_data()). A leaf that requires
// grad is also held by its AccumulateGrad node, which keeps it for its
// gradient, not for backward's use: the meter does not count that (the
// loss head's input, GPT's logits, is such a leaf and is not saved).
bool kept_by_autograd(const at::Tensor& t) {
  const bool accumulator = t.is_leaf() && t.requires_grad() &&
      torch::autograd::impl::try_get_grad_accumulator(t) != nullptr;
  return t.use_count() > (accumulator ? 2 : 1) || t.storage().use_count() > 1;
}

// Counts each parameter's gradient once, when AccumulateGrad has written it.
class GradWatch {
 public:
  GradWatch(const torch::nn::Module& module, MetaCounter* counter) {
    for (const auto& p : module.parameters(/*recurse=*/true)) {
      if (!p.requires_grad()) {
        continue;
      }
      auto acc = torch::autograd::impl::grad_accumulator(p);
      if (!acc) {
        continue;
      }
      auto hook = std::make_unique<Hook>(p, counter);
      const auto key = acc->add_post_hook(std::move(hook));
      hooks_.emplace_back(acc, key);
    }
  }
  ~GradWatch() {
    for (auto& [acc, key] : hooks_) {
      acc->del_post_hook(key);
    }
  }
  GradWatch(const GradWatch&) = delete;
  GradWatch& operator=(const GradWatch&) = delete;

 private:
  struct Hook final : torch::autograd::FunctionPostHook {
    Hook(at::Tensor p, MetaCounter* c) : param(std::move(p)), counter(c) {}
    torch::autograd::variable_list operator()(
        const torch::autograd::variable_list& outputs,
        const torch::autograd::variable_list& /*inputs*/) override {
      if (!counted && param.grad().defined()) {
        counted = true;
        if (counter != nullptr) {
          counter->add_grad(storage_bytes(param.grad()));
        }
      }
      return outputs;
    }
    at::Tensor param;
    MetaCounter* counter;
    bool counted = false;
  };
  // shared_ptr<Node> before LibTorch 2.13, intrusive_ptr<Node> since.
  using NodePtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));
  std::vector<std::pair<NodePtr, uintptr_t>> hooks_;
};

} // namespace

// ---------------------------------------------------------------------------
// Predictions on meta, and the same step measured on CPU

SavedTensorReport predict_saved_activations(
    const torch::nn::Module& module,
    const std::function<at::Tensor()>& forward) {
  TORCH_CHECK(static_cast<bool>(forward), "predict_saved_activations: the forward function is empty");
  check_on_meta(module, "predict_saved_activations");
  enable_cpu_meta_kernels();
  SavedTensorMeter meter(module);
  {
    SavedTensorMeterGuard scope(meter);
    at::Tensor out = forward();
    TORCH_CHECK(!out.defined() || out.is_meta(),
                "predict_saved_activations: the forward returned a tensor on ", out.device(),
                "; build its inputs on the meta device");
  }
  return meter.report();
}

std::string to_string(StepPhase phase) {
  return phase_name(phase);
}

namespace {

void set_phase_peak(StepPeak& r) {
  r.peak_bytes = std::max({r.forward_peak_bytes, r.backward_peak_bytes, r.optimizer_peak_bytes});
  r.phase = r.peak_bytes == r.backward_peak_bytes ? StepPhase::kBackward
      : r.peak_bytes == r.forward_peak_bytes      ? StepPhase::kForward
                                                  : StepPhase::kOptimizerStep;
}

// One step: zero_grad (to none), loss_fn() under a meter, backward, step.
// `live` reads the allocator's live bytes, `reset`/`peak` its peak window.
template <typename Live, typename Reset, typename Peak, typename Backward>
StepPeak run_step(torch::nn::Module& module, const std::function<at::Tensor()>& loss_fn,
                  torch::optim::Optimizer* optimizer, Live live, Reset reset, Peak peak, Backward backward) {
  for (auto& p : module.parameters()) {
    p.mutable_grad().reset();
  }
  if (optimizer != nullptr) {
    optimizer->zero_grad();
  }
  StepPeak r;
  const auto buckets = optimizer != nullptr ? account(module, *optimizer) : account(module);
  r.param_bytes = buckets.param_bytes;
  r.optimizer_state_bytes = buckets.optimizer_state_bytes;
  // Buffers (BatchNorm's running statistics) are live all step, as the
  // parameters are: they count in every phase's peak, as the allocator
  // counts them, and have their own term in the decomposition.
  r.buffer_bytes = buckets.buffer_bytes;
  const int64_t static_bytes = buckets.total_bytes();
  const int64_t start = live();
  SavedTensorMeter meter(module);
  at::Tensor loss;
  reset();
  {
    SavedTensorMeterGuard scope(meter);
    loss = loss_fn();
  }
  TORCH_CHECK(loss.defined() && loss.numel() == 1,
              "step peak: loss_fn must return a scalar, but got a tensor of shape ",
              loss.defined() ? loss.sizes() : at::IntArrayRef{});
  r.forward_peak_bytes = static_bytes + peak() - start;
  r.activation_bytes = meter.report().saved_bytes;
  reset();
  backward(loss);
  loss = at::Tensor();
  r.backward_peak_bytes = static_bytes + peak() - start;
  if (optimizer != nullptr) {
    reset();
    optimizer->step();
    r.optimizer_peak_bytes = static_bytes + peak() - start;
  }
  set_phase_peak(r);
  return r;
}

} // namespace

StepPeak predict_step_peak(
    torch::nn::Module& module,
    const std::function<at::Tensor()>& loss_fn,
    torch::optim::Optimizer* optimizer) {
  TORCH_CHECK(static_cast<bool>(loss_fn), "predict_step_peak: the loss function is empty");
  check_on_meta(module, "predict_step_peak");
  enable_cpu_meta_kernels();
  std::lock_guard<std::mutex> lock(prediction_mutex());
  detail::StepStateGuard untouched(module, optimizer);  // Note [Predictions leave no trace]
  auto& counter = MetaCounter::get();
  // What a CPU run allocates besides the meta kernels' outputs: the CPU
  // matmuls' operand copies (Note [CPU matmul operand copies on meta]) and
  // the checkpoints' CPU RNG stashes and recompute fork copies.
  CpuKernelModel kernels;
  detail::register_intercept_fallback();
  detail::InterceptScope kernel_scope(kernels);
  struct Mirror {
    bool fork = std::exchange(detail::mirror_rng_fork_on_meta(), true);
    bool stash = std::exchange(detail::mirror_rng_stash_on_meta(), true);
    ~Mirror() {
      detail::mirror_rng_fork_on_meta() = fork;
      detail::mirror_rng_stash_on_meta() = stash;
    }
  } mirror;
  StepPeak r;
  std::vector<int64_t> grad_at_peak;  // per phase window: forward, backward, optimizer step
  for (int step = 0; step < (optimizer != nullptr ? 2 : 1); ++step) {
    GradWatch watch(module, &counter);
    counter.reset_grad();
    grad_at_peak.clear();
    r = run_step(
        module, loss_fn, optimizer, [&] { return counter.live(); },
        [&] {
          if (!grad_at_peak.empty()) {
            grad_at_peak.back() = counter.grad_at_peak();  // the window that just ended
          }
          grad_at_peak.push_back(0);
          counter.reset_peak();
        },
        [&] { return counter.peak(); }, &detail::BackwardOnMeta::run);
    grad_at_peak.back() = counter.grad_at_peak();
  }
  // Decompose: static buckets, activations at the start of backward, the rest.
  const size_t window = r.phase == StepPhase::kForward ? 0 : r.phase == StepPhase::kBackward ? 1 : 2;
  r.grad_bytes = window < grad_at_peak.size() ? grad_at_peak[window] : 0;
  if (r.phase == StepPhase::kOptimizerStep) {
    r.grad_bytes = 0;
    for (const auto& p : module.parameters()) {
      r.grad_bytes += storage_bytes(p.grad());
    }
  }
  const int64_t activations = r.phase == StepPhase::kOptimizerStep ? 0 : r.activation_bytes;
  r.transient_bytes =
      r.peak_bytes - r.param_bytes - r.buffer_bytes - r.optimizer_state_bytes - r.grad_bytes - activations;
  return r;
}

StepPeak measure_step_peak(
    torch::nn::Module& module,
    const std::function<at::Tensor()>& loss_fn,
    torch::optim::Optimizer* optimizer) {
  TORCH_CHECK(static_cast<bool>(loss_fn), "measure_step_peak: the loss function is empty");
  TORCH_CHECK(CpuMemoryTracker::installed(),
              "measure_step_peak: install the CpuMemoryTracker first (CpuMemoryTracker::install())");
  auto& tracker = CpuMemoryTracker::install();
  StepPeak r;
  for (int step = 0; step < (optimizer != nullptr ? 2 : 1); ++step) {
    std::optional<PeakWindow> window;
    r = run_step(
        module, loss_fn, optimizer, [&] { return tracker.stats().allocated_bytes; },
        [&] { window.emplace(tracker); }, [&] { return window->peak_bytes(); },
        [](const at::Tensor& loss) { loss.backward(); });
  }
  r.grad_bytes = -1;
  r.transient_bytes = -1;
  return r;
}

std::string to_string(const StepPeak& p) {
  std::ostringstream os;
  os << fmt::format("step peak {:>16} B in the {}\n", with_commas(p.peak_bytes), to_string(p.phase));
  os << fmt::format("  parameters            {:>16} B\n", with_commas(p.param_bytes));
  if (p.buffer_bytes != 0) {  // most nets have none
    os << fmt::format("  buffers               {:>16} B\n", with_commas(p.buffer_bytes));
  }
  os << fmt::format("  optimizer state       {:>16} B\n", with_commas(p.optimizer_state_bytes));
  if (p.grad_bytes >= 0) {
    os << fmt::format("  gradients at the peak {:>16} B\n", with_commas(p.grad_bytes));
  }
  os << fmt::format("  saved activations     {:>16} B (at the start of backward)\n",
                    with_commas(p.activation_bytes));
  if (p.transient_bytes != -1) {  // -1: not decomposed (a measurement)
    os << fmt::format("  largest transient     {:>16} B\n", with_commas(p.transient_bytes));
  }
  os << fmt::format("  phase peaks: forward {} B, backward {} B, optimizer step {} B\n",
                    with_commas(p.forward_peak_bytes), with_commas(p.backward_peak_bytes),
                    with_commas(p.optimizer_peak_bytes));
  return os.str();
}

// ---------------------------------------------------------------------------
// Costs and policies

namespace {

// Views (returns alias an input, no write): free, and never cached by SAC.
// In-place ops are never cached either, but they do work.
struct OpKind {
  bool view = false;
  bool aliases = false;
};

OpKind op_kind(const SelectiveOp& op) {
  static std::mutex mutex;
  static std::unordered_map<std::string, OpKind> cache;
  const std::string key = op.full_name();
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(key);
  if (it != cache.end()) {
    return it->second;
  }
  OpKind kind;
  auto handle = c10::Dispatcher::singleton().findSchema(
      {op.name, op.overload == "default" ? "" : op.overload});
  if (handle) {
    const auto& schema = handle->schema();
    bool alias_return = false;
    for (const auto& r : schema.returns()) {
      alias_return |= r.alias_info() != nullptr;
    }
    kind.aliases = alias_return || schema.is_mutable();
    kind.view = alias_return && !schema.is_mutable();
  }
  cache.emplace(key, kind);
  return kind;
}

// Saved or offloaded: not recomputed (selective.cpp's is_save counts only the first).
bool is_kept(CheckpointPolicy p) {
  return p == CheckpointPolicy::kMustSave || p == CheckpointPolicy::kPreferSave ||
      p == CheckpointPolicy::kMustCpuOffload || p == CheckpointPolicy::kPreferCpuOffload;
}

const at::Tensor* tensor_arg(const SelectiveOp& op, size_t i) {
  return i < op.inputs.size() && op.inputs[i].isTensor() ? &op.inputs[i].toTensor() : nullptr;
}

} // namespace

double flop_cost(const SelectiveOp& op) {
  const auto kind = op_kind(op);
  if (kind.view) {
    return 0.0;
  }
  auto dims_ok = [](const at::Tensor* t, int64_t d) { return t != nullptr && t->dim() == d; };
  if (op.name == "aten::mm") {
    const auto *a = tensor_arg(op, 0), *b = tensor_arg(op, 1);
    if (dims_ok(a, 2) && dims_ok(b, 2)) {
      return 2.0 * static_cast<double>(a->size(0)) * static_cast<double>(a->size(1)) *
          static_cast<double>(b->size(1));
    }
  }
  if (op.name == "aten::addmm") {
    const auto *a = tensor_arg(op, 1), *b = tensor_arg(op, 2);
    if (dims_ok(a, 2) && dims_ok(b, 2)) {
      const double m = static_cast<double>(a->size(0)), k = static_cast<double>(a->size(1)),
                   n = static_cast<double>(b->size(1));
      return 2.0 * m * k * n + m * n;
    }
  }
  if (op.name == "aten::bmm" || op.name == "aten::baddbmm") {
    const size_t first = op.name == "aten::bmm" ? 0 : 1;
    const auto *a = tensor_arg(op, first), *b = tensor_arg(op, first + 1);
    if (dims_ok(a, 3) && dims_ok(b, 3)) {
      const double bs = static_cast<double>(a->size(0)), m = static_cast<double>(a->size(1)),
                   k = static_cast<double>(a->size(2)), n = static_cast<double>(b->size(2));
      return 2.0 * bs * m * k * n + (first == 1 ? bs * m * n : 0.0);
    }
  }
  if (op.name == "aten::_scaled_dot_product_flash_attention_for_cpu") {
    const auto *q = tensor_arg(op, 0), *k = tensor_arg(op, 1);
    if (dims_ok(q, 4) && dims_ok(k, 4)) {
      const bool causal = op.inputs.size() > 4 && op.inputs[4].isBool() && op.inputs[4].toBool();
      const double f = 4.0 * static_cast<double>(q->size(0)) *
          static_cast<double>(q->size(1)) * static_cast<double>(q->size(2)) *
          static_cast<double>(k->size(2)) * static_cast<double>(q->size(3));
      return causal ? f / 2.0 : f;
    }
  }
  double largest = 0.0;
  for (const auto& v : op.inputs) {
    if (v.isTensor()) {
      largest = std::max(largest, static_cast<double>(v.toTensor().numel()));
    }
  }
  return largest;
}

namespace {

// Per-op CPU times, collected by thread-local RecordFunction callbacks (which
// take no state: the table is thread-local while measuring).
thread_local std::unordered_map<std::string, std::vector<double>>* tls_op_times = nullptr;

struct OpTimer final : at::ObserverContext {
  std::string key;
  std::chrono::steady_clock::time_point start;
};

template <typename Inputs>
std::string op_key(const std::string& name, const Inputs& inputs) {
  std::string key = name;
  for (const auto& v : inputs) {
    key += '|';
    if (v.isTensor()) {
      for (auto d : v.toTensor().sizes()) {
        key += std::to_string(d) + ',';
      }
    }
  }
  return key;
}

std::unique_ptr<at::ObserverContext> on_timed_op_start(const at::RecordFunction& fn) {
  if (tls_op_times == nullptr) {
    return nullptr;
  }
  auto timer = std::make_unique<OpTimer>();
  timer->key = op_key(fn.name(), fn.inputs());
  timer->start = std::chrono::steady_clock::now();
  return timer;
}

void on_timed_op_end(const at::RecordFunction& /*fn*/, at::ObserverContext* ctx) {
  if (tls_op_times == nullptr || ctx == nullptr) {
    return;
  }
  auto* timer = static_cast<OpTimer*>(ctx);
  const std::chrono::duration<double> seconds = std::chrono::steady_clock::now() - timer->start;
  (*tls_op_times)[timer->key].push_back(seconds.count());
}

} // namespace

OpCostFn measured_op_cost(const std::function<void()>& run, int64_t repeats) {
  TORCH_CHECK(static_cast<bool>(run), "measured_op_cost: the function to time is empty");
  TORCH_CHECK(repeats >= 1, "measured_op_cost: expected repeats >= 1, but got ", repeats);
  std::unordered_map<std::string, std::vector<double>> times;
  tls_op_times = &times;
  const auto handle = at::addThreadLocalCallback(
      at::RecordFunctionCallback(&on_timed_op_start, &on_timed_op_end)
          .needsInputs(true)
          .scopes({at::RecordScope::FUNCTION}));
  try {
    for (int64_t r = 0; r < repeats; ++r) {
      run();
    }
  } catch (...) {
    at::removeCallback(handle);
    tls_op_times = nullptr;
    throw;
  }
  at::removeCallback(handle);
  tls_op_times = nullptr;
  auto table = std::make_shared<std::unordered_map<std::string, double>>();
  for (auto& [key, samples] : times) {
    std::sort(samples.begin(), samples.end());
    (*table)[key] = samples[samples.size() / 2];
  }
  // Seconds per FLOP over the matmuls seen, for ops the run never made.
  std::vector<double> per_flop;
  for (const auto& [key, seconds] : *table) {
    if (key.rfind("aten::mm|", 0) == 0) {
      std::vector<int64_t> d;
      std::string num;
      for (char c : key.substr(9)) {
        if (c == ',' || c == '|') {
          if (!num.empty()) d.push_back(std::stoll(num));
          num.clear();
        } else {
          num += c;
        }
      }
      if (d.size() == 4 && d[0] * d[1] * d[3] > 0) {
        per_flop.push_back(seconds / (2.0 * static_cast<double>(d[0] * d[1] * d[3])));
      }
    }
  }
  std::sort(per_flop.begin(), per_flop.end());
  const double seconds_per_flop = per_flop.empty() ? 1e-9 : per_flop[per_flop.size() / 2];
  return [table, seconds_per_flop](const SelectiveOp& op) {
    auto it = table->find(op_key(op.name, op.inputs));
    return it != table->end() ? it->second : flop_cost(op) * seconds_per_flop;
  };
}

SelectivePolicy save_op_calls_policy(std::vector<std::string> op_calls) {
  // Each checkpoint call copies the policy (selective.cpp keeps one copy per
  // region), so the counters below are per region; one set per pass.
  return [calls = std::move(op_calls), counts = std::array<std::map<std::string, int64_t>, 2>{}](
             const SelectiveContext& ctx, const SelectiveOp& op) mutable {
    const std::string key = op.full_name();
    const int64_t n = counts[ctx.is_recompute ? 1 : 0][key]++;
    const std::string call = key + "#" + std::to_string(n);
    return std::find(calls.begin(), calls.end(), call) != calls.end()
        ? CheckpointPolicy::kMustSave
        : CheckpointPolicy::kPreferRecompute;
  };
}

std::string to_string(BlockMode mode) {
  switch (mode) {
    case BlockMode::kStore: return "store";
    case BlockMode::kCheckpoint: return "checkpoint";
    case BlockMode::kSelective: return "selective";
  }
  return "unknown";
}

// ---------------------------------------------------------------------------
// The planner

namespace {

// What one profiling run of a block saw (see Note [Checkpoint planner]).
struct BlockProfile {
  BlockChoice choice;
  // The run's boundary tensors (Note [Boundary storages]): its input's and
  // its output's storage bytes, whether autograd (or the checkpoint) keeps
  // each, and whether the output shares the input's storage (a view region).
  // choice.stored_bytes counts each kept one once.
  int64_t in_bytes = 0;
  bool in_kept = false;
  int64_t out_bytes = 0;
  bool out_kept = false;
  bool out_aliases_in = false;
  double forward_cost = 0;
  // Op calls of the forward, in order: (call, cost, cacheable).
  std::vector<std::tuple<std::string, double, bool>> calls;
  // Non-empty: this choice cannot run (Note [Regions that start in place]),
  // and why; the DP never weighs it. forward_cost and calls are still set
  // when the forward ran.
  std::string unavailable;
};

// The CPU generator's state, as a checkpoint stashes it (a CPU tensor even
// when the region runs on meta or CUDA).
int64_t cpu_rng_state_bytes() {
  static const int64_t bytes = [] {
    auto gen = at::globalContext().defaultGenerator(at::kCPU);
    std::lock_guard<std::mutex> lock(gen.mutex());
    return static_cast<int64_t>(gen.get_state().nbytes());
  }();
  return bytes;
}

// Live and peak bytes of the device a profile runs on: the counting meta
// allocator, or the CPU tracker where a region falls back to the CPU.
class ByteCounter {
 public:
  explicit ByteCounter(bool cpu) : cpu_(cpu) {
    if (cpu_) {
      tracker_ = &CpuMemoryTracker::install();
    }
  }
  int64_t live() const {
    return cpu_ ? tracker_->stats().allocated_bytes : MetaCounter::get().live();
  }
  void reset_peak() {
    if (cpu_) {
      window_.reset();
      window_.emplace(*tracker_);
    } else {
      MetaCounter::get().reset_peak();
    }
  }
  int64_t peak() const {
    return cpu_ ? (window_ ? window_->peak_bytes() : live()) : MetaCounter::get().peak();
  }

 private:
  bool cpu_;
  CpuMemoryTracker* tracker_ = nullptr;
  std::optional<PeakWindow> window_;
};

// The shape and dtype of a tensor between regions.
struct TensorSpec {
  std::vector<int64_t> sizes;
  at::ScalarType dtype = at::kFloat;
  std::string str() const {
    return fmt::format("{}[{}]", c10::toString(dtype), fmt::join(sizes, ","));
  }
};

TensorSpec spec_of(const at::Tensor& t) {
  return {t.sizes().vec(), t.scalar_type()};
}

// A tensor of `spec` on `device`: empty on meta; on CPU random floats and
// zero integers (integer inputs are indices).
at::Tensor make_tensor(const TensorSpec& spec, c10::Device device) {
  auto options = at::TensorOptions().dtype(spec.dtype).device(device);
  if (device.is_meta()) {
    return at::empty(spec.sizes, options);
  }
  return c10::isFloatingType(spec.dtype) ? at::randn(spec.sizes, options) : at::zeros(spec.sizes, options);
}

// The op a NotImplementedError names: "Could not run 'aten::foo' with
// arguments from the 'Meta' backend", or "foo not implemented".
std::string missing_op(const std::string& what) {
  const std::string quoted = "Could not run '";
  if (auto a = what.find(quoted); a != std::string::npos) {
    a += quoted.size();
    return what.substr(a, what.find('\'', a) - a);
  }
  // "aten::_cdist_forward: attempted to run this operator with Meta
  // tensors" (2.13), or "convolution_overrideable not implemented".
  std::string first = what.substr(0, what.find_first_of(" \n"));
  while (!first.empty() && (first.back() == ':' || first.back() == '.')) {
    first.pop_back();
  }
  return first.find("::") == std::string::npos ? "aten::" + first : first;
}

std::string first_line(const std::string& s) {
  return s.substr(0, s.find('\n'));
}

// Note [Planning a live model]
// plan_regions() takes the user's model as it is, usually on CPU with its
// data. While planning, every parameter and buffer of the regions' modules
// becomes a meta tensor in place (the TensorImpl stays, so closures, optimizers
// and meters that hold them still do) and gets its storage back afterwards, as
// do gradients; the optimizer's state is swapped out for the planning steps
// and swapped back. A region profiled on CPU (an op with no meta kernel) gets
// its parameters' own storages back for that profile (its buffers get copies,
// so BatchNorm's running statistics are not updated by planning), or zero
// tensors when the model was built on meta.
class PlanningSwap {
 public:
  explicit PlanningSwap(const std::vector<Region>& regions) {
    for (const auto& region : regions) {
      for (const auto& m : region.modules()) {
        TORCH_CHECK(m != nullptr, "plan_regions: region '", region.name(), "' lists a null module");
        for (const auto& p : m->parameters(/*recurse=*/true)) {
          add(p, /*buffer=*/false);
        }
        for (const auto& b : m->buffers(/*recurse=*/true)) {
          add(b, /*buffer=*/true);
        }
      }
    }
    for (auto& e : entries_) {
      if (!e.tensor.is_meta()) {
        adopt(e.tensor, at::empty_strided(e.tensor.sizes(), e.tensor.strides(),
                                          e.tensor.options().device(at::kMeta)));
      }
    }
  }
  ~PlanningSwap() {
    for (auto& e : entries_) {
      try {
        if (e.real.defined()) {
          adopt(e.tensor, e.real);
        } else if (!e.tensor.is_meta()) {  // a meta model's CPU fallback: meta again
          adopt(e.tensor, at::empty_strided(e.tensor.sizes(), e.tensor.strides(),
                                            e.tensor.options().device(at::kMeta)));
        }
        if (e.tensor.requires_grad() || e.grad.defined()) {
          e.tensor.mutable_grad() = e.grad;
        }
      } catch (const std::exception& ex) {
        TORCH_WARN("plan_regions: could not restore a tensor of the model: ", ex.what());
      }
    }
  }
  PlanningSwap(const PlanningSwap&) = delete;
  PlanningSwap& operator=(const PlanningSwap&) = delete;

  // Gives the tensors of `modules` CPU storage (their own where they had it),
  // or meta storage again.
  void set_cpu(const std::vector<std::shared_ptr<torch::nn::Module>>& modules, bool cpu) {
    std::unordered_set<const c10::TensorImpl*> mine;
    for (const auto& m : modules) {
      for (const auto& p : m->parameters(true)) mine.insert(p.unsafeGetTensorImpl());
      for (const auto& b : m->buffers(true)) mine.insert(b.unsafeGetTensorImpl());
    }
    for (auto& e : entries_) {
      if (!mine.count(e.tensor.unsafeGetTensorImpl())) {
        continue;
      }
      if (cpu) {
        at::Tensor real = e.real.defined() && e.real.is_cpu() ? e.real : at::Tensor();
        if (!real.defined()) {
          real = at::zeros(e.tensor.sizes(), e.tensor.options().device(at::kCPU));
        } else if (e.buffer) {
          real = real.clone();
        }
        adopt(e.tensor, real);
      } else {
        adopt(e.tensor, at::empty_strided(e.tensor.sizes(), e.tensor.strides(),
                                          e.tensor.options().device(at::kMeta)));
      }
    }
  }

 private:
  struct Entry {
    at::Tensor tensor; // the model's own (identity kept)
    at::Tensor real;   // its storage before planning (undefined if it was on meta)
    at::Tensor grad;   // its gradient before planning
    bool buffer = false;
  };
  void add(const at::Tensor& t, bool buffer) {
    if (!t.defined() || !seen_.insert(t.unsafeGetTensorImpl()).second) {
      return;
    }
    Entry e;
    e.tensor = t;
    e.buffer = buffer;
    if (!t.is_meta()) {
      e.real = t.variable_data();  // a new TensorImpl on the same storage
    }
    e.grad = t.grad();
    entries_.push_back(std::move(e));
  }
  // set_data() refuses a change of device; the shallow copy it would do is
  // what we want (meta.cpp's to_meta() does the same).
  static void adopt(const at::Tensor& t, const at::Tensor& from) {
    t.unsafeGetTensorImpl()->shallow_copy_from(from.getIntrusivePtr());
  }
  std::unordered_set<const c10::TensorImpl*> seen_;
  std::vector<Entry> entries_;
};

// One region run to profile: regions [first, first + count) as one unit.
struct RunSpec {
  const std::vector<Region>* regions = nullptr;
  int64_t first = 0;
  int64_t count = 1;
  TensorSpec input;
  bool grad_input = false;
  bool cpu = false; // profile on CPU (an op has no meta kernel)
  // The input is the step's (region 0): made before the count starts, as it
  // is in the step's static bytes, not the run's.
  bool input_is_static = false;
};

void reset_grads(const std::vector<at::Tensor>& params) {
  for (const auto& p : params) {
    p.mutable_grad().reset();
  }
}

std::vector<at::Tensor> params_of(const RunSpec& run) {
  std::vector<at::Tensor> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (int64_t j = run.first; j < run.first + run.count; ++j) {
    for (const auto& m : (*run.regions)[j].modules()) {
      for (const auto& p : m->parameters(true)) {
        if (seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
      }
    }
  }
  return out;
}

// Runs the run's regions alone under `mode` (and `saved_ops`; count > 1: one
// checkpointed region, a segment), with the loss (y * 2).sum() so the
// incoming gradient is made by backward itself, as in the stack.
BlockProfile profile_run(const RunSpec& run, BlockMode mode, const std::vector<std::string>& saved_ops,
                         const OpCostFn& op_cost) {
  ByteCounter counter(run.cpu);
  // The recompute's copy of the CPU generator's state, seen on meta while it
  // lives (the CPU tracker sees it on CPU).
  struct MirrorFork {
    bool before;
    explicit MirrorFork(bool on) : before(std::exchange(detail::mirror_rng_fork_on_meta(), on)) {}
    ~MirrorFork() { detail::mirror_rng_fork_on_meta() = before; }
  } mirror(!run.cpu);
  const auto params = params_of(run);
  BlockProfile prof;
  prof.choice.region_blocks = run.count;
  const auto* regions = run.regions;
  auto body = [regions, first = run.first, count = run.count](const at::Tensor& t) {
    at::Tensor y = t;
    for (int64_t j = first; j < first + count; ++j) {
      y = (*regions)[j](y);
    }
    return y;
  };
  prof.choice.mode = mode;
  prof.choice.saved_ops = saved_ops;
  auto recompute_cost = std::make_shared<double>(0.0);
  auto forward_cost = std::make_shared<double>(0.0);
  auto calls = std::make_shared<std::vector<std::tuple<std::string, double, bool>>>();
  SelectivePolicy inner = mode == BlockMode::kSelective ? save_op_calls_policy(saved_ops)
                                                        : SelectivePolicy([](const SelectiveContext&, const SelectiveOp&) {
                                                            return CheckpointPolicy::kPreferRecompute;
                                                          });
  // The storage of the run's input (set once it is made) and the first
  // forward op call given a tensor on it that is in place (name ending in
  // '_'), or else the first given one: Note [Regions that start in place].
  auto input_storage = std::make_shared<const c10::StorageImpl*>(nullptr);
  auto input_writer = std::make_shared<std::pair<std::string, bool>>();
  SelectivePolicy counting = [inner, op_cost, recompute_cost, forward_cost, calls, input_storage, input_writer,
                              counts = std::map<std::string, int64_t>{}](
                                 const SelectiveContext& ctx, const SelectiveOp& op) mutable {
    if (!ctx.is_recompute && *input_storage != nullptr && !input_writer->second) {
      for (const auto& v : op.inputs) {
        if (v.isTensor() && v.toTensor().defined() && v.toTensor().has_storage() &&
            v.toTensor().storage().unsafeGetStorageImpl() == *input_storage) {
          const bool in_place = !op.name.empty() && op.name.back() == '_';
          if (input_writer->first.empty() || in_place) {
            *input_writer = {op.name, in_place};
          }
          break;
        }
      }
    }
    const auto decision = inner(ctx, op);
    const auto kind = op_kind(op);
    const double c = op_cost ? op_cost(op) : 0.0;
    if (ctx.is_recompute) {
      if (!is_kept(decision) || kind.aliases) {
        *recompute_cost += c;
      }
    } else {
      *forward_cost += c;
      const std::string key = op.full_name();
      calls->emplace_back(key + "#" + std::to_string(counts[key]++), c, !kind.aliases);
    }
    return decision;
  };
  reset_grads(params);
  const auto device = run.cpu ? c10::Device(at::kCPU) : c10::Device(at::kMeta);
  at::Tensor x;
  if (run.input_is_static) {
    x = make_tensor(run.input, device);
  }
  // An input that needs a gradient is a clone of a leaf made before `base`,
  // not the leaf itself: in the step it is the previous region's output, a
  // non-leaf, which an in-place op may write (on a leaf that requires grad
  // it throws). The clone's bytes count as the input's did; its gradient
  // passes through CloneBackward to the leaf, as it would to the region
  // before (Note [Regions that start in place]).
  at::Tensor leaf;
  if (!run.input_is_static && run.grad_input) {
    leaf = make_tensor(run.input, device).requires_grad_(true);
  }
  const int64_t base = counter.live();
  counter.reset_peak();
  if (leaf.defined()) {
    x = leaf.clone();
  } else if (!run.input_is_static) {
    x = make_tensor(run.input, device);
  }
  if (run.grad_input && !leaf.defined()) {
    x.requires_grad_(true);
  }
  *input_storage = x.has_storage() ? x.storage().unsafeGetStorageImpl() : nullptr;
  const auto input_version = x._version();
  at::Tensor loss;
  // What the step's meter will count for this run: its own parameters and
  // buffers excluded, as SavedTensorMeter(module) excludes the model's.
  SavedTensorMeter meter;
  for (int64_t j = run.first; j < run.first + run.count; ++j) {
    for (const auto& m : (*run.regions)[j].modules()) {
      meter.exclude(*m);
    }
  }
  {
    at::Tensor y;
    {
      SavedTensorMeterGuard metered(meter);
      if (mode == BlockMode::kStore) {
        y = body(x);
      } else {
        auto opts = CheckpointOptions().context_fn(create_selective_checkpoint_contexts(counting));
        y = checkpoint(body, x, opts);
      }
    }
    prof.choice.forward_peak_bytes = counter.peak() - base;
    if (mode != BlockMode::kStore && x._version() != input_version) {
      // The checkpoint keeps `x` for its recompute, and the region wrote it:
      // backward would throw (Note [Regions that start in place]).
      prof.unavailable = fmt::format("{} writes the region's input in place, which a checkpoint keeps",
                                     input_writer->first.empty() ? std::string("an op") : input_writer->first);
      prof.forward_cost = *forward_cost;
      prof.calls = *calls;
      *input_storage = nullptr;
      return prof;
    }
    if (y.requires_grad()) {  // else: no backward reaches it (no parameters up to here)
      loss = (y * 2.0).sum();  // mul by a scalar and sum save nothing of y
    }
    // Whether autograd keeps the output's storage, while `y` (one tensor,
    // one storage reference) is still held here; a view of the input shares
    // the input's storage and is decided with it below.
    prof.out_bytes = storage_bytes(y);
    prof.out_aliases_in = x.has_storage() && y.has_storage() &&
        y.storage().unsafeGetStorageImpl() == x.storage().unsafeGetStorageImpl();
    if (!prof.out_aliases_in) {
      prof.out_kept = y.has_storage() && kept_by_autograd(y);
    }
  }
  const int64_t after_forward = counter.live();
  prof.in_bytes = storage_bytes(x);
  prof.in_kept = kept_by_autograd(x);  // `y` is gone: only autograd can hold it now
  if (prof.out_aliases_in) {
    prof.out_kept = prof.in_kept;
  }
  // The bytes kept are the meter's count, not the live bytes above `base`:
  // the two agree (the input counted where autograd or the checkpoint keeps
  // it, the output where the run saves it itself) except where a meta kernel
  // sizes its output without the allocator (arange on meta resizes its
  // storage in place: GPT's 256 B of positions are saved, yet never seen by
  // the counting allocator).
  prof.choice.stored_bytes = meter.report().saved_bytes;
  if (run.input_is_static) {
    // Made before `base` (it is in the step's static bytes).
    prof.choice.forward_peak_bytes += prof.in_bytes;
  }
  counter.reset_peak();
  if (loss.defined()) {
    if (run.cpu) {
      loss.backward();
    } else {
      detail::BackwardOnMeta::run(loss);
    }
  }
  prof.choice.backward_transient_bytes = loss.defined() ? counter.peak() - after_forward : 0;
  loss = at::Tensor();
  x = at::Tensor();
  leaf = at::Tensor();
  *input_storage = nullptr;
  reset_grads(params);
  prof.choice.recompute_cost = mode == BlockMode::kStore ? 0.0 : *recompute_cost;
  prof.choice.rng_state_bytes = mode == BlockMode::kStore ? 0 : cpu_rng_state_bytes();
  if (run.cpu) {
    // Profiled on CPU, the tracker saw the checkpoint's RNG stash in the
    // forward peak; the DP adds it on its own (the meter never sees it).
    prof.choice.forward_peak_bytes -= prof.choice.rng_state_bytes;
  }
  prof.forward_cost = *forward_cost;
  prof.calls = *calls;
  return prof;
}

struct HeadProfile {
  int64_t forward_peak_bytes = 0; // with its input
  int64_t stored_bytes = 0;       // what the loss saves (its input, for pow)
  int64_t backward_transient_bytes = 0;
  int64_t in_bytes = 0;           // the last region's output
  bool in_kept = false;           // the loss saves it (pow, nll_loss; not log_softmax + nll)
  int64_t loss_bytes = 0;         // the loss itself, live through the whole backward
};

HeadProfile profile_head(const std::function<at::Tensor(const at::Tensor&)>& loss_fn,
                         const TensorSpec& output, bool cpu) {
  ByteCounter counter(cpu);
  HeadProfile h;
  const int64_t base = counter.live();
  counter.reset_peak();
  auto y = make_tensor(output, cpu ? c10::Device(at::kCPU) : c10::Device(at::kMeta)).requires_grad_(true);
  SavedTensorMeter meter;  // what the step's meter counts for the loss (see profile_run)
  at::Tensor loss;
  {
    SavedTensorMeterGuard metered(meter);
    loss = loss_fn(y);
  }
  TORCH_CHECK(loss.defined() && loss.numel() == 1,
              "plan_regions: the loss must be a scalar, but got a tensor of shape ",
              loss.defined() ? loss.sizes() : at::IntArrayRef{});
  h.forward_peak_bytes = counter.peak() - base;
  const int64_t after = counter.live();
  h.stored_bytes = meter.report().saved_bytes;  // the last output included where the loss saves it
  h.in_bytes = storage_bytes(y);
  h.in_kept = kept_by_autograd(y);
  h.loss_bytes = storage_bytes(loss);
  counter.reset_peak();
  if (cpu) {
    loss.backward();
  } else {
    detail::BackwardOnMeta::run(loss);
  }
  h.backward_transient_bytes = counter.peak() - after;
  return h;
}

// The optimizer's state bytes (after its first step) and the transient of a
// later step, on meta, with every gradient in place.
struct OptimizerProfile {
  int64_t state_bytes = 0;
  int64_t transient_bytes = 0;
};

OptimizerProfile profile_optimizer(torch::optim::Optimizer& opt, const std::vector<at::Tensor>& params) {
  auto& counter = MetaCounter::get();
  OptimizerProfile r;
  for (const auto& p : params) {
    if (p.requires_grad()) {
      p.mutable_grad() = at::empty_like(p);
    }
  }
  const int64_t before = counter.live();
  opt.step();  // creates the state
  r.state_bytes = counter.live() - before;
  const int64_t base = counter.live();
  counter.reset_peak();
  opt.step();
  r.transient_bytes = counter.peak() - base;
  reset_grads(params);
  return r;
}

struct DpState {
  int64_t stored = 0; // bytes stored by the blocks so far
  double cost = 0;
  int64_t peak = 0;   // highest phase so far
  StepPhase phase = StepPhase::kForward;
  int64_t parent = -1;
  int option = -1;
  int64_t region = 1; // blocks the last choice covers
  // The storage of the tensor at this boundary is in `stored` already (an
  // earlier region's output that it saved itself, a view's base) or in the
  // static bytes (the step's input): a region that keeps it adds nothing
  // for it (Note [Boundary storages]).
  bool counted = true;
};

// Raises a state's peak to `bytes`, and its phase to `at`, when `bytes` is higher.
void raise_peak(DpState& state, int64_t bytes, StepPhase at) {
  if (bytes > state.peak) {
    state.peak = bytes;
    state.phase = at;
  }
}

// What a dynamic program over block boundaries minimises (Note [Two 2-D
// dynamic programs]).
enum class DpGoal {
  kPeak,  // the step's peak
  kCost,  // the recompute cost within a budget, ties to the smaller peak
};

// Drops each state another beats for `goal`. Sorted by stored (then the
// goal's key), a state is dominated exactly when an earlier one is no worse
// in the goal's (primary, secondary) order: one pass, O(n log n).
//   kPeak: (peak), stored no higher and peak no higher;
//   kCost: (cost, peak), stored no higher and cost lower, or equal with a
//          peak no higher.
std::vector<DpState> prune_states_of(std::vector<DpState> next, DpGoal goal) {
  auto key = [goal](const DpState& a) {
    return goal == DpGoal::kPeak ? std::make_tuple(a.stored, static_cast<double>(a.peak), a.cost)
                                 : std::make_tuple(a.stored, a.cost, static_cast<double>(a.peak));
  };
  std::sort(next.begin(), next.end(), [&](const DpState& a, const DpState& b) { return key(a) < key(b); });
  std::vector<DpState> kept;
  double best_primary = std::numeric_limits<double>::infinity();
  int64_t best_peak = std::numeric_limits<int64_t>::max();  // kCost: least peak at best_primary
  for (const auto& n : next) {
    if (goal == DpGoal::kPeak) {
      if (best_peak <= n.peak) {
        continue;
      }
      best_peak = n.peak;
    } else {
      if (best_primary < n.cost || (best_primary == n.cost && best_peak <= n.peak)) {
        continue;
      }
      if (n.cost < best_primary) {
        best_primary = n.cost;
        best_peak = n.peak;
      } else {
        best_peak = std::min(best_peak, n.peak);
      }
    }
    kept.push_back(n);
  }
  return kept;
}

// Pruning within each value of `counted`: a state whose boundary storage is
// counted already and one where it is not differ in what the next region
// adds, so neither dominates the other by stored bytes alone.
std::vector<DpState> prune_states(std::vector<DpState> next, DpGoal goal) {
  std::vector<DpState> yes, no;
  for (auto& n : next) {
    (n.counted ? yes : no).push_back(std::move(n));
  }
  auto kept = prune_states_of(std::move(yes), goal);
  for (auto& n : prune_states_of(std::move(no), goal)) {
    kept.push_back(std::move(n));
  }
  return kept;
}

// Keeps `n` states of a pruned set (sorted by stored within each value of
// `counted`), evenly spaced, both ends kept: a beam, for bounds only.
void thin_states(std::vector<DpState>& states, size_t n) {
  std::vector<DpState> kept;
  kept.reserve(n + 2);
  const size_t size = states.size();
  for (size_t j = 0; j < n; ++j) {
    kept.push_back(states[j * (size - 1) / (n - 1)]);
  }
  states = std::move(kept);
}

// Note [Bucketed boundaries]
// A boundary's staircase of (stored, cost) states can grow to hundreds of
// thousands (LLaMA-2-7B with selective candidates: 34 regions of dozens of
// choices each). Beyond kMaxBoundaryStates states (per value of `counted`),
// stored bytes are cut into that many buckets of g bytes, and each bucket
// keeps its cheapest state (ties: the smaller peak). The state it drops
// stores at most g bytes less, so its plans' peaks are at most g lower: with
// B the sum of the g's over the boundaries (CheckpointPlan::bucket_bytes),
// the chosen plan costs no more than the cheapest plan with a peak within
// budget - B. Its own peak and bytes are still exact, and the answer is
// exact (B = 0) while every boundary stays under the cap.
constexpr size_t kMaxBoundaryStates = 4096;

// Buckets a pruned set (Note [Bucketed boundaries]); returns g (0: untouched).
int64_t bucket_states(std::vector<DpState>& states, size_t cap) {
  int64_t width = 0;
  std::vector<DpState> kept;
  for (const bool counted : {true, false}) {
    std::vector<DpState> cls;
    for (const auto& st : states) {
      if (st.counted == counted) {
        cls.push_back(st);
      }
    }
    if (cls.size() <= cap) {
      kept.insert(kept.end(), cls.begin(), cls.end());
      continue;
    }
    int64_t lo = cls.front().stored, hi = lo;
    for (const auto& st : cls) {
      lo = std::min(lo, st.stored);
      hi = std::max(hi, st.stored);
    }
    const int64_t g = (hi - lo) / static_cast<int64_t>(cap) + 1;
    width = std::max(width, g);
    std::map<int64_t, DpState> buckets;
    for (const auto& st : cls) {
      auto [it, inserted] = buckets.emplace((st.stored - lo) / g, st);
      if (!inserted && std::tie(st.cost, st.peak) < std::tie(it->second.cost, it->second.peak)) {
        it->second = st;
      }
    }
    for (auto& [b, st] : buckets) {
      kept.push_back(st);
    }
  }
  states = std::move(kept);
  return width;
}

std::string plan_name(const std::vector<BlockChoice>& blocks) {
  const auto L = static_cast<int64_t>(blocks.size());
  bool any_sel = false, all_store = true, all_ckpt = true;
  for (const auto& b : blocks) {
    any_sel |= b.mode == BlockMode::kSelective;
    all_store &= b.mode == BlockMode::kStore;
    all_ckpt &= b.mode == BlockMode::kCheckpoint;
  }
  bool any_region = false;
  for (const auto& b : blocks) {
    any_region |= b.region_blocks != 1;
  }
  if (all_store) return "none";
  if (any_region) {
    for (int64_t n = 2; n <= L; ++n) {
      const auto seg = BlockCheckpointing::segments(L, n);
      bool match = true;
      for (int64_t i = 0; i < L;) {
        if (seg.blocks[i]) {
          const int64_t k = seg.region_length[i];
          match &= blocks[i].mode == BlockMode::kCheckpoint && blocks[i].region_blocks == k;
          for (int64_t j = i + 1; j < i + k; ++j) {
            match &= blocks[j].region_blocks == 0;
          }
          i += k;
        } else {
          match &= blocks[i].mode == BlockMode::kStore;
          ++i;
        }
      }
      if (match) return n == sqrt_segments(L) ? "sqrt" : "segments_" + std::to_string(n);
    }
    return "segments";
  }
  if (all_ckpt) return "full";
  if (any_sel) {
    bool uniform = true;
    for (const auto& b : blocks) {
      uniform &= b.mode == BlockMode::kSelective && b.saved_ops == blocks.front().saved_ops;
    }
    return uniform ? "selective" : "mixed";
  }
  for (int64_t k = 2; k < L; ++k) {  // every_L and up: block 0 alone, "chosen"
    bool match = true;
    for (int64_t i = 0; i < L; ++i) {
      match &= (blocks[i].mode == BlockMode::kCheckpoint) == (i % k == 0);
    }
    if (match) return "every_" + std::to_string(k);
  }
  return "chosen";
}


// A region's structure: its modules' types and their tensors' names, shapes
// and dtypes (or the key the user gave). Regions with the same structure on
// the same input run the same code (the user sets a key where they do not).
std::string structure_key(const Region& region) {
  if (!region.key().empty()) {
    return "key:" + region.key();
  }
  std::string k;
  for (const auto& m : region.modules()) {
    for (const auto& sub : m->modules(/*include_self=*/true)) {
      k += sub->name();
      k += '{';
      for (const auto& p : sub->named_parameters(/*recurse=*/false)) {
        k += fmt::format("{}:{}[{}]{},", p.key(), c10::toString(p.value().scalar_type()),
                         fmt::join(p.value().sizes(), ","), p.value().requires_grad() ? "g" : "");
      }
      for (const auto& b : sub->named_buffers(/*recurse=*/false)) {
        k += fmt::format("{}:{}[{}],", b.key(), c10::toString(b.value().scalar_type()),
                         fmt::join(b.value().sizes(), ","));
      }
      k += sub->is_training() ? "}t" : "}e";
    }
    k += ';';
  }
  return k;
}

// The op a failure on meta names, when it is a missing kernel.
// The op a failure on meta names: the op without a meta kernel, else the
// first op or autograd node its message mentions ("... (aten::unsafe_split.Tensor
// output ...)", "Function MkldnnRnnLayerBackward0 returned an invalid
// gradient ..."); "" when it names none.
std::string meta_failure_op(const c10::Error& e) {
  const std::string what = e.what_without_backtrace();
  if (dynamic_cast<const c10::NotImplementedError*>(&e) != nullptr ||
      what.find("Could not run '") != std::string::npos) {
    return missing_op(what);
  }
  const auto name_at = [&](size_t a) {
    size_t b = a;
    while (b < what.size() && (std::isalnum(static_cast<unsigned char>(what[b])) || what[b] == '_' ||
                               what[b] == ':' || what[b] == '.')) {
      ++b;
    }
    while (b > a && (what[b - 1] == '.' || what[b - 1] == ':')) --b;
    return what.substr(a, b - a);
  };
  if (auto a = what.find("aten::"); a != std::string::npos) return name_at(a);
  if (auto a = what.find("Function "); a != std::string::npos) return name_at(a + 9);
  return "";
}

} // namespace

Region::Region(std::string name, Forward forward, std::vector<std::shared_ptr<torch::nn::Module>> modules)
    : name_(std::move(name)),
      forward_(std::make_shared<Forward>(std::move(forward))),
      modules_(std::move(modules)) {
  TORCH_CHECK(static_cast<bool>(*forward_), "Region: the forward function of '", name_, "' is empty");
  for (size_t i = 0; i < modules_.size(); ++i) {
    TORCH_CHECK(modules_[i] != nullptr, "Region: module ", i, " of '", name_, "' is null");
  }
}

Region::Region(torch::nn::AnyModule module)
    : Region(module.ptr()->name(),
             [m = std::make_shared<torch::nn::AnyModule>(module)](const at::Tensor& x) {
               return m->forward<at::Tensor>(x);
             },
             {module.ptr()}) {}

at::Tensor Region::operator()(const at::Tensor& input) const {
  return (*forward_)(input);
}

std::vector<Region> regions_of(const torch::nn::Sequential& sequential) {
  TORCH_CHECK(sequential, "regions_of: the Sequential is empty (null)");
  std::vector<Region> regions;
  for (const auto& m : *sequential) {
    regions.emplace_back(m);
  }
  return regions;
}

std::vector<Region> regions_of(const torch::nn::ModuleList& list) {
  TORCH_CHECK(list, "regions_of: the ModuleList is empty (null)");
  std::vector<Region> regions;
  for (size_t i = 0; i < list->size(); ++i) {
    auto seq = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(list->ptr(i));
    TORCH_CHECK(seq != nullptr, "regions_of: element ", i, " of the ModuleList is a ", list->ptr(i)->name(),
                ", whose forward is unknown here; use regions_of<", list->ptr(i)->name(), ">(list)");
    regions.emplace_back(seq);
  }
  return regions;
}

at::Tensor run_regions(const std::vector<Region>& regions, const at::Tensor& input,
                       const BlockCheckpointing& plan) {
  const auto L = static_cast<int64_t>(regions.size());
  TORCH_CHECK(static_cast<int64_t>(plan.blocks.size()) == L, "run_regions: the plan '", plan.name,
              "' has ", plan.blocks.size(), " blocks, but there are ", L, " regions");
  TORCH_CHECK(plan.region_length.empty() || static_cast<int64_t>(plan.region_length.size()) == L,
              "run_regions: the plan '", plan.name, "' has ", plan.region_length.size(),
              " region lengths, expected 0 or ", L);
  at::Tensor x = input;
  for (int64_t i = 0; i < L;) {
    const int64_t k = plan.region_length.empty() ? 1 : std::max<int64_t>(1, plan.region_length[i]);
    if (!plan.blocks[i]) {
      x = regions[i](x);
      ++i;
      continue;
    }
    TORCH_CHECK(i + k <= L, "run_regions: the segment of ", k, " regions at region ", i, " of plan '",
                plan.name, "' runs past the last region (", L, ")");
    // The recompute runs in backward, after this returns: the closure keeps
    // its own copies of the regions (they share callables and modules).
    std::vector<Region> run(regions.begin() + i, regions.begin() + i + k);
    x = checkpoint(
        [run = std::move(run)](const at::Tensor& t) {
          at::Tensor y = t;
          for (const auto& r : run) {
            y = r(y);
          }
          return y;
        },
        x, plan.options_for(i));
    i += k;
  }
  return x;
}

at::Tensor run_regions(const std::vector<Region>& regions, const at::Tensor& input,
                       const CheckpointPlan& plan) {
  return run_regions(regions, input, plan.checkpointing());
}

BlockCheckpointing CheckpointPlan::checkpointing() const {
  const auto L = static_cast<int64_t>(blocks.size());
  TORCH_CHECK(L >= 1, "CheckpointPlan::checkpointing: the plan has no blocks");
  auto plan = BlockCheckpointing::none(L);
  for (int64_t i = 0; i < L; ++i) {
    if (blocks[i].mode == BlockMode::kSelective) {
      plan.set_block_policy(i, save_op_calls_policy(blocks[i].saved_ops));
    }
  }
  for (int64_t i = 0; i < L; ++i) {
    if (blocks[i].mode == BlockMode::kCheckpoint && blocks[i].region_blocks >= 1) {
      plan.blocks[i] = true;
      if (blocks[i].region_blocks > 1) {
        if (plan.region_length.empty()) {
          plan.region_length.assign(L, 1);
        }
        plan.region_length[i] = blocks[i].region_blocks;
      }
    }
  }
  plan.name = name;
  return plan;
}

// Note [Checkpoint planner]
// The step is forward, loss out.pow(2).mean(), backward, AdamW step. Every
// choice c for a block (store, checkpoint, a selective set) or for a run of k
// blocks (one checkpointed region, a segment) is profiled once, alone on
// meta: stored(c) (kept from its forward to its backward, input included,
// plus the region's CPU RNG stash), F(c) (its forward's peak), W(c) (its
// backward's peak above its stored bytes: incoming gradient, recompute, its
// gradients, temporaries) and cost(c). With S_i the bytes stored before
// block i, Z = parameters + buffers + AdamW state + input, G_>i later blocks' gradients:
//   forward of block i   Z + S_i + F_i
//   backward of block i  Z + S_i + stored_i + G_>i + W_i
//   loss head            Z + S_L + (its forward peak, or stored + backward)
//   optimizer step       Z - input + G + AdamW transient
// The step makes its input (RegionModel::input) and nothing holds it past
// backward, which frees it with the graph: in the optimizer step it is gone,
// as it is in predict_step_peak() and on CPU (counting it there put a conv
// net with a large head, whose peak is Adam's step, an input over the CPU's,
// 2,457,600 B at 8 x 3 x 160 x 160; issue 22).
// Every term grows with S_i, so a dynamic program over block boundaries
// whose state is S_i, keeping states no other beats in S, cost and peak
// (Pareto), is exact for this model. The cheapest final state within the
// budget wins, ties to the smaller peak: a larger budget never costs more
// recompute, and a smaller one never gives a larger peak (PyTorch's
// activation_memory_budget can do both). Selective candidates: each
// cacheable op call is profiled alone (bytes it adds, recompute it saves),
// ranked by recompute saved per byte, and the ranking's prefixes are profiled
// as sets, so interactions (Note [In-place ops on cached outputs]'s copies)
// are measured, not assumed.
// Note [Boundary storages]
// The meter counts each saved storage once over the whole step. Profiled
// alone, each region counts the tensors at its two boundaries as it sees
// them: its input when it (or the checkpoint) keeps it (a Linear's or a
// conv's input), its output when it keeps that itself (relu, sigmoid, tanh,
// log_softmax save their result). In the step they are one storage: region
// i's output is region i + 1's input, and a view region (flatten, reshape)
// passes its input's storage on. Counting both would count a storage twice
// (MNIST's relu -> conv2 and relu -> view -> fc1, log_softmax -> nll_loss:
// 453,120 B too many). So the DP carries, per state, whether the storage at
// its boundary is counted already (an earlier region kept it, or it is the
// step's input, in the static bytes); a region that keeps its input then
// adds nothing for it, and its forward peak, which includes its input, does
// not count it again. The same holds for the loss head. Only boundaries can
// be shared this way: a region's other tensors are its own.
CheckpointPlan plan_regions(const RegionModel& model, const PlanOptions& options) {
  TORCH_CHECK(options.budget_bytes() >= 0,
              "plan_regions: expected budget_bytes >= 0, but got ", options.budget_bytes());
  TORCH_CHECK(!model.regions.empty(), "plan_regions: the model has no regions");
  TORCH_CHECK(static_cast<bool>(model.input),
              "plan_regions: RegionModel::input is empty (it makes the sample input on a device)");
  TORCH_CHECK(static_cast<bool>(model.loss),
              "plan_regions: RegionModel::loss is empty (it makes the scalar loss of the output)");
  TORCH_CHECK(model.optimizer == nullptr || !model.make_optimizer,
              "plan_regions: give RegionModel::optimizer or make_optimizer, not both");
  enable_cpu_meta_kernels();
  std::lock_guard<std::mutex> lock(prediction_mutex());
  const OpCostFn cost_fn = options.op_cost() ? options.op_cost() : OpCostFn(flop_cost);
  const auto& regions = model.regions;
  const auto L = static_cast<int64_t>(regions.size());
  const int64_t max_region = std::clamp<int64_t>(options.max_region_blocks(), 1, L);
  PlanningSwap swap(regions);  // Note [Planning a live model]

  // Parameters, each once, owned by the last region that uses it: its
  // gradient exists from that region's backward on.
  std::vector<at::Tensor> params;
  std::unordered_map<const c10::TensorImpl*, int64_t> owner;
  std::vector<std::vector<int64_t>> region_param_ids(L);
  for (int64_t i = 0; i < L; ++i) {
    for (const auto& m : regions[i].modules()) {
      for (const auto& p : m->parameters(/*recurse=*/true)) {
        auto [it, inserted] = owner.emplace(p.unsafeGetTensorImpl(), i);
        if (inserted) {
          params.push_back(p);
        }
        it->second = i;
      }
    }
  }
  std::vector<int64_t> region_grad_bytes(L, 0);
  std::vector<bool> region_trains(L, false);
  int64_t param_bytes = 0;
  {
    std::unordered_set<const c10::StorageImpl*> storages;
    for (const auto& p : params) {
      if (storages.insert(p.storage().unsafeGetStorageImpl()).second) {
        param_bytes += storage_bytes(p);
      }
      if (p.requires_grad()) {
        const int64_t i = owner[p.unsafeGetTensorImpl()];
        region_grad_bytes[i] += storage_bytes(p);
      }
    }
    for (int64_t i = 0; i < L; ++i) {
      for (const auto& m : regions[i].modules()) {
        for (const auto& p : m->parameters(true)) {
          region_trains[i] = region_trains[i] || p.requires_grad();
        }
      }
    }
  }
  // Buffers (BatchNorm's running statistics), each storage once and none a
  // parameter holds: live all step, as the accountant's buffer bucket.
  int64_t buffer_bytes = 0;
  {
    std::unordered_set<const c10::StorageImpl*> storages;
    for (const auto& p : params) {
      storages.insert(p.storage().unsafeGetStorageImpl());
    }
    for (const auto& region : regions) {
      for (const auto& m : region.modules()) {
        for (const auto& b : m->buffers(/*recurse=*/true)) {
          if (b.defined() && b.has_storage() && storages.insert(b.storage().unsafeGetStorageImpl()).second) {
            buffer_bytes += storage_bytes(b);
          }
        }
      }
    }
  }
  int64_t grads = 0;
  for (auto b : region_grad_bytes) grads += b;

  // The optimizer: its state (live all step) and its step's transient.
  OptimizerProfile opt_prof;
  const bool has_optimizer = model.optimizer != nullptr || static_cast<bool>(model.make_optimizer);
  if (model.optimizer != nullptr) {
    detail::OptimizerStateAside aside(*model.optimizer);
    opt_prof = profile_optimizer(*model.optimizer, params);
  } else if (model.make_optimizer) {
    auto opt = model.make_optimizer(params);
    TORCH_CHECK(opt != nullptr, "plan_regions: RegionModel::make_optimizer returned null");
    opt_prof = profile_optimizer(*opt, params);
  }

  at::Tensor input = model.input(at::kMeta);
  TORCH_CHECK(input.defined() && input.is_meta(),
              "plan_regions: RegionModel::input(kMeta) must return a meta tensor, but got ",
              input.defined() ? c10::str(input.device()) : std::string("an undefined tensor"));
  const int64_t input_bytes = storage_bytes(input);
  std::vector<TensorSpec> specs(L + 1);
  specs[0] = spec_of(input);
  input = at::Tensor();

  // Shapes region by region (no grad, meta); a region that fails on meta
  // runs on CPU, and is profiled there.
  CheckpointPlan plan;
  std::vector<bool> cpu(L, false), grad_in(L, false);
  auto fall_back = [&](int64_t i, const c10::Error& e) {
    cpu[i] = true;
    const std::string op = meta_failure_op(e);
    plan.cpu_fallbacks.push_back({i, op, first_line(e.what_without_backtrace())});
    const bool missing = dynamic_cast<const c10::NotImplementedError*>(&e) != nullptr ||
        std::string(e.what_without_backtrace()).find("Could not run '") != std::string::npos;
    TORCH_WARN("plan_regions: region ", i, " ('", regions[i].name(), "') runs on CPU to be profiled: ",
               op.empty() ? "it fails on meta: " + first_line(e.what_without_backtrace())
                          : missing ? op + " has no meta kernel"
                                    : op + " fails on meta: " + first_line(e.what_without_backtrace()));
  };
  auto on_cpu = [&](const std::vector<Region>& rs, int64_t first, int64_t count, bool on) {
    for (int64_t j = first; j < first + count; ++j) {
      swap.set_cpu(rs[j].modules(), on);
    }
  };
  bool needs_grad = false;
  for (int64_t i = 0; i < L; ++i) {
    grad_in[i] = needs_grad && c10::isFloatingType(specs[i].dtype);
    at::NoGradGuard no_grad;
    try {
      specs[i + 1] = spec_of(regions[i](make_tensor(specs[i], at::kMeta)));
    } catch (const c10::Error& e) {
      fall_back(i, e);
      on_cpu(regions, i, 1, true);
      try {
        specs[i + 1] = spec_of(regions[i](make_tensor(specs[i], at::kCPU)));
      } catch (...) {
        on_cpu(regions, i, 1, false);
        throw;
      }
      on_cpu(regions, i, 1, false);
    }
    needs_grad = needs_grad || region_trains[i];
  }

  // Profiles, each distinct (regions, input, choice) once.
  std::vector<std::string> keys(L);
  for (int64_t i = 0; i < L; ++i) {
    keys[i] = structure_key(regions[i]) + "->" + specs[i + 1].str();
  }
  auto run_key = [&](int64_t first, int64_t count) {
    std::string k = fmt::format("{}{}{}{}|", first == 0 ? "S" : "", grad_in[first] ? "G" : "",
                                specs[first].str(), cpu[first] ? "C" : "");
    for (int64_t j = first; j < first + count; ++j) {
      k += keys[j] + (cpu[j] ? "C|" : "|");
    }
    return k;
  };
  int64_t num_profiles = 0;
  auto profile = [&](int64_t first, int64_t count, BlockMode mode, const std::vector<std::string>& ops) {
    RunSpec run;
    run.regions = &regions;
    run.first = first;
    run.count = count;
    run.input = specs[first];
    run.grad_input = grad_in[first];
    run.input_is_static = first == 0;
    for (int64_t j = first; j < first + count; ++j) {
      run.cpu = run.cpu || cpu[j];
    }
    ++num_profiles;
    if (!run.cpu) {
      try {
        return profile_run(run, mode, ops, cost_fn);
      } catch (const c10::Error& e) {
        if (count != 1 || mode != BlockMode::kStore) {
          // Its regions each ran on meta alone, or the region's stored run
          // did: not a missing meta kernel (a checkpoint that fails is an
          // unavailable choice: Note [Regions that start in place]).
          throw;
        }
        fall_back(first, e);  // backward has no meta kernel
        run.cpu = true;
      }
    }
    on_cpu(regions, first, count, true);
    try {
      auto p = profile_run(run, mode, ops, cost_fn);
      on_cpu(regions, first, count, false);
      return p;
    } catch (...) {
      on_cpu(regions, first, count, false);
      throw;
    }
  };

  // Note [Regions that start in place]
  // A region whose first op writes its input in place (ReLU(inplace) right
  // after a cut, as VGG-style nets and MLPs are written) runs stored, but a
  // checkpoint of it cannot: the checkpoint keeps the input for its
  // recompute, the forward then writes it, and backward throws on CPU as in
  // PyTorch ("one of the variables needed for gradient computation has been
  // modified by an inplace operation"; a selective region and a segment
  // starting there keep the same input). profile_run() sees the write (the
  // input's version moved in a checkpointed forward) and names the op; any
  // other failure of a checkpointed run whose regions ran stored is taken the
  // same way. Such a profile is an unavailable choice: the DP never weighs
  // it, and the plan lists it (CheckpointPlan::unavailable, printed by
  // to_string). The forward cost still comes from the checkpoint's forward,
  // which ran. Profiling needs the input to be a non-leaf too (an in-place
  // op on a leaf that requires grad throws): see profile_run().
  auto profile_or_unavailable = [&](int64_t first, int64_t count, BlockMode mode,
                                    const std::vector<std::string>& ops = {}) {
    BlockProfile p;
    try {
      p = profile(first, count, mode, ops);
    } catch (const c10::Error& e) {
      p = BlockProfile{};
      p.choice.mode = mode;
      p.choice.region_blocks = count;
      p.unavailable = first_line(e.what_without_backtrace());
    }
    return p;
  };

  // Per region: store, checkpoint, selective prefixes (Note [Checkpoint planner]).
  std::unordered_map<std::string, std::shared_ptr<const std::vector<BlockProfile>>> single_cache;
  std::vector<std::shared_ptr<const std::vector<BlockProfile>>> singles(L);
  for (int64_t i = 0; i < L; ++i) {
    const std::string key = run_key(i, 1);
    if (auto it = single_cache.find(key); it != single_cache.end()) {
      singles[i] = it->second;
      continue;
    }
    auto c = std::make_shared<std::vector<BlockProfile>>();
    c->push_back(profile(i, 1, BlockMode::kStore, {}));
    c->push_back(profile_or_unavailable(i, 1, BlockMode::kCheckpoint));
    if (options.selective() && (*c)[1].unavailable.empty()) {
      const auto ckpt = (*c)[1];
      struct Ranked {
        std::string call;
        double saved_cost;
        int64_t added_bytes;
      };
      std::vector<Ranked> ranked;
      for (const auto& [call, cost, cacheable] : ckpt.calls) {
        if (!cacheable) {
          continue;
        }
        auto one = profile_or_unavailable(i, 1, BlockMode::kSelective, {call});
        if (!one.unavailable.empty()) {
          continue;
        }
        const double saved = ckpt.choice.recompute_cost - one.choice.recompute_cost;
        if (saved <= 0) {
          continue;  // not recomputed anyway (early stop), or free
        }
        ranked.push_back({call, saved, one.choice.stored_bytes - ckpt.choice.stored_bytes});
      }
      std::stable_sort(ranked.begin(), ranked.end(), [](const Ranked& a, const Ranked& b) {
        const double ra = a.saved_cost / static_cast<double>(std::max<int64_t>(a.added_bytes, 1));
        const double rb = b.saved_cost / static_cast<double>(std::max<int64_t>(b.added_bytes, 1));
        return ra > rb;
      });
      std::vector<std::string> prefix;
      for (const auto& r : ranked) {
        prefix.push_back(r.call);
        c->push_back(profile_or_unavailable(i, 1, BlockMode::kSelective, prefix));
      }
    }
    singles[i] = c;
    single_cache.emplace(key, c);
  }
  // Segments: k consecutive regions checkpointed as one.
  std::unordered_map<std::string, std::shared_ptr<const BlockProfile>> segment_cache;
  std::vector<std::vector<std::shared_ptr<const BlockProfile>>> segments(L);
  for (int64_t i = 0; i < L; ++i) {
    for (int64_t k = 2; k <= max_region && i + k <= L; ++k) {
      const std::string key = run_key(i, k);
      auto it = segment_cache.find(key);
      if (it == segment_cache.end()) {
        it = segment_cache
                 .emplace(key, std::make_shared<const BlockProfile>(profile_or_unavailable(i, k, BlockMode::kCheckpoint)))
                 .first;
      }
      segments[i].push_back(it->second);
    }
  }
  // The unavailable choices, per region (Note [Regions that start in place]).
  for (int64_t i = 0; i < L; ++i) {
    for (const auto& p : *singles[i]) {
      if (!p.unavailable.empty()) {
        plan.unavailable.push_back({i, 1, p.choice.mode, p.unavailable});
      }
    }
    for (const auto& p : segments[i]) {
      if (!p->unavailable.empty()) {
        plan.unavailable.push_back({i, p->choice.region_blocks, p->choice.mode, p->unavailable});
      }
    }
  }
  // The loss head, on the last output.
  HeadProfile head;
  try {
    head = profile_head(model.loss, specs[L], /*cpu=*/false);
  } catch (const c10::Error& e) {
    const std::string op = meta_failure_op(e);
    plan.cpu_fallbacks.push_back({L, op, first_line(e.what_without_backtrace())});
    TORCH_WARN("plan_regions: the loss runs on CPU to be profiled: ",
               op.empty() ? std::string("it fails on meta") : op + " has no meta kernel");
    head = profile_head(model.loss, specs[L], /*cpu=*/true);
  }

  const int64_t Z = param_bytes + buffer_bytes + opt_prof.state_bytes + input_bytes;
  std::vector<int64_t> grads_after(L + 1, 0);  // gradients of regions >= i
  for (int64_t i = L - 1; i >= 0; --i) {
    grads_after[i] = grads_after[i + 1] + region_grad_bytes[i];
  }
  // The choices of a run of k regions at i, as one list.
  auto choices = [&](int64_t i, int64_t k) {
    // Unavailable choices (Note [Regions that start in place]) left out: a
    // run may have none (a segment), never a single region (it runs stored).
    std::vector<const BlockProfile*> c;
    if (k == 1) {
      for (const auto& p : *singles[i]) {
        if (p.unavailable.empty()) c.push_back(&p);
      }
    } else if (segments[i][k - 2]->unavailable.empty()) {
      c.push_back(segments[i][k - 2].get());
    }
    return c;
  };

  // The dynamic program over region boundaries: layers[i] holds the states
  // after regions 0 .. i - 1; a segment of k regions moves from i to i + k.
  // Under DpGoal::kCost, a state is dropped when its peak exceeds `limit`
  // (a peak only rises), when even the fewest bytes the remaining regions
  // can store would take it over `limit` (the loss head's backward sees them
  // all), or when it costs more than `max_cost`, the cost of a whole plan
  // known to fit (a cost only rises). finals: the states after the loss head
  // and the optimizer step.
  std::vector<int64_t> least_stored_after(L + 1, 0);  // the fewest bytes regions >= i add
  for (int64_t i = L - 1; i >= 0; --i) {
    int64_t least = std::numeric_limits<int64_t>::max();
    for (int64_t k = 1; k <= max_region && i + k <= L; ++k) {
      for (const auto* prof : choices(i, k)) {
        const auto& ch = prof->choice;
        const int64_t added = ch.stored_bytes + ch.rng_state_bytes - (prof->in_kept ? prof->in_bytes : 0);
        least = std::min(least, added + least_stored_after[i + k]);
      }
    }
    least_stored_after[i] = least;
  }
  struct DpRun {
    std::vector<std::vector<DpState>> layers;
    std::vector<DpState> finals;
    int64_t bucket_bytes = 0;  // Note [Bucketed boundaries]
  };
  int64_t num_candidates = 0;  // choices weighed at each boundary, the same in every run below
  for (int64_t i = 0; i < L; ++i) {
    for (int64_t k = 1; k <= max_region && i + k <= L; ++k) {
      num_candidates += static_cast<int64_t>(choices(i, k).size());
    }
  }
  auto run_dp = [&](DpGoal goal, int64_t limit, double max_cost, size_t beam) {
    DpRun r;
    auto& layers = r.layers;
    layers.resize(L + 1);
    layers[0].push_back(DpState{});
    std::vector<std::vector<DpState>> incoming(L + 1);
    for (int64_t i = 0; i < L; ++i) {
      if (i > 0) {
        layers[i] = prune_states(std::move(incoming[i]), goal);
        if (beam > 0 && layers[i].size() > beam) {
          thin_states(layers[i], beam);
        } else if (beam == 0 && goal == DpGoal::kCost) {
          r.bucket_bytes += bucket_states(layers[i], kMaxBoundaryStates);
        }
      }
      for (int64_t k = 1; k <= max_region && i + k <= L; ++k) {
        const auto c = choices(i, k);
        for (int64_t s = 0; s < static_cast<int64_t>(layers[i].size()); ++s) {
          const auto& st = layers[i][s];
          for (int opt = 0; opt < static_cast<int>(c.size()); ++opt) {
            const auto& prof = *c[opt];
            const auto& ch = prof.choice;
            // Region 0's input is the step's input, already in Z; a later
            // region's input may be in st.stored already (Note [Boundary storages]).
            const int64_t stored = ch.stored_bytes + ch.rng_state_bytes -
                (st.counted && prof.in_kept ? prof.in_bytes : 0);
            const int64_t fwd = Z + st.stored + ch.rng_state_bytes + ch.forward_peak_bytes -
                (st.counted ? prof.in_bytes : 0);
            // The step's loss (the caller holds it while backward runs) is
            // live beside every region's backward, as beside the head's.
            const int64_t bwd = Z + st.stored + stored + grads_after[i + k] + ch.backward_transient_bytes +
                head.loss_bytes;
            DpState n;
            n.stored = st.stored + stored;
            n.cost = st.cost + ch.recompute_cost;
            n.peak = st.peak;
            n.phase = st.phase;
            raise_peak(n, fwd, StepPhase::kForward);
            raise_peak(n, bwd, StepPhase::kBackward);
            if (goal == DpGoal::kCost &&
                (n.peak > limit || n.cost > max_cost || Z + n.stored + least_stored_after[i + k] > limit)) {
              continue;
            }
            n.parent = s;
            n.option = opt;
            n.region = k;
            n.counted = prof.out_aliases_in ? (st.counted || prof.in_kept) : prof.out_kept;
            incoming[i + k].push_back(n);
          }
        }
      }
      incoming[i].clear();
      incoming[i].shrink_to_fit();
    }
    layers[L] = prune_states(std::move(incoming[L]), goal);
    // Final phases: the loss head and the optimizer step.
    for (auto f : layers[L]) {
      const int64_t in_counted = f.counted ? head.in_bytes : 0;
      const int64_t head_stored = head.stored_bytes - (head.in_kept ? in_counted : 0);
      raise_peak(f, Z + f.stored + head.forward_peak_bytes - in_counted, StepPhase::kForward);
      raise_peak(f, Z + f.stored + head_stored + head.backward_transient_bytes + head.loss_bytes,
                 StepPhase::kBackward);
      if (has_optimizer) {
        // The input is not live any more (Note [Checkpoint planner]).
        raise_peak(f, Z - input_bytes + grads + opt_prof.transient_bytes, StepPhase::kOptimizerStep);
      }
      if (goal == DpGoal::kPeak || f.peak <= limit) {
        r.finals.push_back(f);
      }
    }
    return r;
  };
  auto by_cost = [](const DpState& a, const DpState& b) {
    return std::tie(a.cost, a.peak) < std::tie(b.cost, b.peak);
  };
  auto by_peak = [](const DpState& a, const DpState& b) {
    return std::tie(a.peak, a.cost) < std::tie(b.peak, b.cost);
  };
  // Note [Two 2-D dynamic programs]
  // Every later phase's bytes grow with the stored bytes S_i alone, so what a
  // boundary state's future can do depends on S_i (and whether its boundary
  // storage is counted); the peak and cost so far only add. One DP keeping
  // the (stored, peak, cost) Pareto set is exact but the set grows without
  // bound (400 layers: 14 s; LLaMA-2-7B with selective candidates: minutes).
  // Two DPs, each on a 2-D staircase, give the same answers (exactly, while
  // no boundary of the second is bucketed: Note [Bucketed boundaries]):
  //   1. the least peak P* (kPeak: a state is beaten by one with stored and
  //      peak no higher);
  //   2. the least cost within a limit, ties to the smaller peak (kCost:
  //      states above the limit dropped, then beaten by one with stored no
  //      higher and (cost, peak) no higher in that order), run with the
  //      budget (or no limit) and, for the cost of reaching P*, with P*.
  // Bounding the cost: whole plans known to fit a limit (the first DP's
  // final states, then a beam search's, which keeps a few states per
  // boundary) give the cost no state of the exact DP may exceed; a little
  // slack, as sums of the same costs in another order may differ in the
  // last bit. The cheapest plan of all three runs is taken.
  std::deque<DpRun> runs;
  const DpRun& least_peak = runs.emplace_back(run_dp(DpGoal::kPeak, 0, 0.0, 0));
  const int64_t min_peak =
      std::min_element(least_peak.finals.begin(), least_peak.finals.end(), by_peak)->peak;
  struct Pick {
    const DpRun* run = nullptr;
    int64_t index = -1;
    int64_t bucket_bytes = 0;  // of the exact run it was weighed against
    const DpState& state() const { return run->finals[index]; }
  };
  auto cheapest = [&](const std::vector<const DpRun*>& from, int64_t limit) {
    Pick best;
    for (const auto* r : from) {
      for (int64_t f = 0; f < static_cast<int64_t>(r->finals.size()); ++f) {
        if (r->finals[f].peak <= limit && (best.run == nullptr || by_cost(r->finals[f], best.state()))) {
          best = {r, f};
        }
      }
    }
    return best;
  };
  // Fits `limit` (>= min_peak, so the first DP's least-peak plan fits).
  auto cheapest_within = [&](int64_t limit) {
    auto slack = [](double c) { return c + 1e-9 * std::abs(c); };
    const DpRun& beam = runs.emplace_back(
        run_dp(DpGoal::kCost, limit, slack(cheapest({&least_peak}, limit).state().cost), 16));
    const double bound = slack(cheapest({&least_peak, &beam}, limit).state().cost);
    const DpRun& exact = runs.emplace_back(run_dp(DpGoal::kCost, limit, bound, 0));
    Pick p = cheapest({&least_peak, &beam, &exact}, limit);
    p.bucket_bytes = exact.bucket_bytes;
    return p;
  };
  const int64_t limit = options.budget_bytes() > 0 ? options.budget_bytes() : std::numeric_limits<int64_t>::max();
  const Pick within = cheapest_within(std::max(limit, min_peak));
  const Pick at_min_peak = limit <= min_peak ? within : cheapest_within(min_peak);
  plan.feasible = within.state().peak <= limit;
  plan.budget_bytes = options.budget_bytes();
  plan.min_peak_bytes = at_min_peak.state().peak;
  plan.min_peak_cost = at_min_peak.state().cost;
  const Pick chosen = plan.feasible ? within : at_min_peak;
  plan.bucket_bytes = chosen.bucket_bytes;
  const auto& layers = chosen.run->layers;
  const DpState& end = chosen.state();
  plan.predicted_peak_bytes = end.peak;
  plan.peak_phase = end.phase;
  plan.recompute_cost = end.cost;
  for (int64_t i = 0; i < L; ++i) {
    plan.forward_cost += (*singles[i])[1].forward_cost;
  }
  plan.static_bytes = Z;
  plan.grad_bytes = grads;
  plan.num_candidates = num_candidates;
  plan.num_profiles = num_profiles;
  plan.blocks.resize(L);
  int64_t s = -1;  // the index in layers[i] of the state the plan passes through
  std::vector<const BlockProfile*> chosen_profiles(L, nullptr);
  for (int64_t i = L; i >= 1;) {
    const auto& st = i == L ? end : layers[i][s];
    const int64_t start = i - st.region;
    chosen_profiles[start] = choices(start, st.region)[st.option];
    plan.blocks[start] = chosen_profiles[start]->choice;
    for (int64_t j = start + 1; j < i; ++j) {  // inside the segment: nothing of their own
      plan.blocks[j] = BlockChoice{};
      plan.blocks[j].mode = BlockMode::kCheckpoint;
      plan.blocks[j].region_blocks = 0;
    }
    s = st.parent;
    i = start;
  }
  // What the meter counts: each kept storage once, the step's input
  // included when saved. A block's stored_bytes leaves out a boundary
  // storage the block before it counted (Note [Boundary storages]).
  plan.activation_bytes = 0;
  bool counted = false;
  for (int64_t i = 0; i < L; ++i) {
    const auto* prof = chosen_profiles[i];
    if (prof == nullptr) {
      continue;  // inside a segment
    }
    auto& b = plan.blocks[i];
    b.stored_bytes -= counted && prof->in_kept ? prof->in_bytes : 0;
    plan.activation_bytes += b.stored_bytes;
    counted = prof->out_aliases_in ? (counted || prof->in_kept) : prof->out_kept;
  }
  plan.activation_bytes += head.stored_bytes - (counted && head.in_kept ? head.in_bytes : 0);
  for (const auto& r : regions) {
    plan.region_names.push_back(r.name());
  }
  plan.name = plan_name(plan.blocks);
  return plan;
}

std::string to_string(const CheckpointPlan& p) {
  std::ostringstream os;
  os << fmt::format("checkpoint plan '{}' for a budget of {} B: {}\n", p.name,
                    p.budget_bytes > 0 ? with_commas(p.budget_bytes) : std::string("(none)"),
                    p.feasible ? "fits" : "NO PLAN FITS");
  // Each row: its index and the name the caller gave its region. Left out:
  // "block" (the reference model's), the index itself, and a C++ type name
  // (a module holder's default, "torch::nn::LinearImpl": no name was given).
  std::vector<std::string> labels;
  size_t width = 6;
  for (size_t i = 0; i < p.blocks.size(); ++i) {
    const std::string name = i < p.region_names.size() ? p.region_names[i] : std::string();
    const bool given = !name.empty() && name != "block" && name != std::to_string(i) &&
        name.find("::") == std::string::npos;
    labels.push_back(given ? fmt::format("{} {}", i, name) : std::to_string(i));
    width = std::max(width, labels.back().size() + 2);
  }
  os << fmt::format("  {:<{}}{:<14}{:>16}{:>18}{:>16}  {}\n", "block", width, "mode", "stored B",
                    "bwd transient B", "recompute", "saved ops");
  for (size_t i = 0; i < p.blocks.size(); ++i) {
    const auto& b = p.blocks[i];
    std::string ops;
    for (const auto& s : b.saved_ops) {
      ops += (ops.empty() ? "" : " ") + s;
    }
    const std::string mode = b.region_blocks == 0 ? "  (region)"
        : b.region_blocks > 1 ? to_string(b.mode) + " x" + std::to_string(b.region_blocks)
                              : to_string(b.mode);
    os << fmt::format("  {:<{}}{:<14}{:>16}{:>18}{:>16.4g}  {}\n", labels[i], width, mode,
                      with_commas(b.stored_bytes), with_commas(b.backward_transient_bytes), b.recompute_cost,
                      ops);
  }
  os << fmt::format("  predicted peak     {:>16} B ({})\n", with_commas(p.predicted_peak_bytes),
                    to_string(p.peak_phase));
  os << fmt::format("    static (params, optimizer state, input) {} B, gradients {} B, "
                    "activations at the start of backward {} B\n",
                    with_commas(p.static_bytes), with_commas(p.grad_bytes), with_commas(p.activation_bytes));
  os << fmt::format("  recompute cost     {:>16.6g} ({:.1f} % of a forward)\n", p.recompute_cost,
                    p.forward_cost > 0 ? 100.0 * p.recompute_cost / p.forward_cost : 0.0);
  os << fmt::format("  smallest reachable peak {} B, at a recompute cost of {:.6g}\n",
                    with_commas(p.min_peak_bytes), p.min_peak_cost);
  // Unavailable choices, one line per region and reason: the single
  // region's and the segments' that start there together.
  for (size_t u = 0; u < p.unavailable.size();) {
    const auto& first = p.unavailable[u];
    std::vector<std::string> what;
    size_t v = u;
    for (; v < p.unavailable.size() && p.unavailable[v].region == first.region &&
           p.unavailable[v].reason == first.reason;
         ++v) {
      const auto& x = p.unavailable[v];
      what.push_back(x.blocks > 1 ? fmt::format("{} x{}", to_string(x.mode), x.blocks) : to_string(x.mode));
    }
    // Named as the rows above name it (a given name only).
    const std::string name = static_cast<size_t>(first.region) < p.region_names.size()
        ? p.region_names[first.region] : std::string();
    const bool given = !name.empty() && name != "block" && name != std::to_string(first.region) &&
        name.find("::") == std::string::npos;
    os << fmt::format("  region {}{}: {} unavailable: {}\n", first.region, given ? " '" + name + "'" : std::string(),
                      fmt::join(what, ", "), first.reason);
    u = v;
  }
  if (p.bucket_bytes > 0) {
    os << fmt::format("  the search bucketed stored bytes: no plan is cheaper within the budget less {} B\n",
                      with_commas(p.bucket_bytes));
  }
  return os.str();
}

} // namespace trainmem
