#include "trainmem/planner.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <unordered_map>
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
#include <ATen/ops/mean.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/sum.h>
#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
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
#include "trainmem/report.h"

namespace trainmem {

// ---------------------------------------------------------------------------
// The analytic model

AnalyticActivations analytic_activation_bytes(
    const TransformerOptions& o,
    const AnalyticActivationOptions& opt) {
  TORCH_CHECK(opt.element_bytes() > 0,
              "analytic_activation_bytes: expected element_bytes > 0, but got ", opt.element_bytes());
  const int64_t L = o.num_layers(), s = o.seq_len(), b = o.batch(), h = o.d_model(),
                a = o.num_heads(), e = opt.element_bytes();
  const int64_t sbh = s * b * h;
  AnalyticActivations r;
  auto add = [&](std::string name, int64_t per_layer) {
    r.terms.push_back({std::move(name), per_layer * L});
    r.per_layer_bytes += per_layer;
  };
  // Korthikanti et al. (2022), Section 4.1, with the element size e instead
  // of fp16's 2 bytes: each (s, b, h) tensor costs e s b h bytes.
  add("LayerNorm inputs (2 s b h elements)", 2 * e * sbh);
  add("QKV input (s b h)", e * sbh);
  add("Q, K, V (3 s b h)", 3 * e * sbh);
  add("projection input (s b h)", e * sbh);
  add("MLP input (s b h)", e * sbh);
  add("GELU input (4 s b h)", 4 * e * sbh);
  add("GELU output (4 s b h)", 4 * e * sbh);
  if (opt.dropout()) {
    add("dropout masks after projection and MLP (2 x 1 B s b h)", 2 * sbh);
  }
  if (!opt.flash_attention()) {
    add("softmax output (a s^2 b elements)", e * a * s * s * b);
    if (opt.dropout()) {
      add("attention dropout mask (1 B a s^2 b)", a * s * s * b);
      add("dropped attention probabilities (a s^2 b)", e * a * s * s * b);
    }
  }
  r.total_bytes = r.per_layer_bytes * L;
  const int64_t per_token_channel = 16 * e + (opt.dropout() ? 2 : 0);
  r.formula = fmt::format("s b h x {} B", per_token_channel);
  if (!opt.flash_attention()) {
    r.formula += fmt::format(" + a s^2 b x {} B", e + (opt.dropout() ? 1 + e : 0));
  }
  r.formula += fmt::format(" = {} B per layer, x {} layers = {} B", with_commas(r.per_layer_bytes), L,
                           with_commas(r.total_bytes));
  return r;
}

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
// arguments it checks that matter on meta.
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
  if (q.size(1) != k.size(1) && !enable_gqa) {
    return false;
  }
  return !(mask.has_value() && mask->defined());  // masked: math, conservatively
}

at::Tensor sdpa_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const std::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                     std::optional<double> scale, bool enable_gqa) {
  if (cpu_would_use_flash(q, k, v, mask, dropout_p, enable_gqa) && q.size(1) == k.size(1)) {
    return std::get<0>(at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal,
                                                                       mask, scale));
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
      auto* meta = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::Meta,
                                      __FILE__, __LINE__);
      meta->impl("_scaled_dot_product_flash_attention_for_cpu", &flash_cpu_meta);
      meta->impl("_scaled_dot_product_flash_attention_for_cpu_backward", &flash_cpu_backward_meta);
      meta->impl("native_layer_norm", &layer_norm_meta);
      meta->impl("native_layer_norm_backward", &layer_norm_backward_meta);
      auto* autograd = new torch::Library(torch::Library::IMPL, "aten",
                                          c10::DispatchKey::AutogradMeta, __FILE__, __LINE__);
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
    if (now > peak_.load()) {
      peak_.store(now);
      grad_at_peak_.store(grad_live_.load());
    }
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
template <typename Live, typename Reset, typename Peak>
StepPeak run_step(torch::nn::Module& module, const std::function<at::Tensor()>& loss_fn,
                  torch::optim::Optimizer* optimizer, Live live, Reset reset, Peak peak) {
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
  loss.backward();
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
  auto& counter = MetaCounter::get();
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
        [&] { return counter.peak(); });
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
  r.transient_bytes = r.peak_bytes - r.param_bytes - r.optimizer_state_bytes - r.grad_bytes - activations;
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
        [&] { window.emplace(tracker); }, [&] { return window->peak_bytes(); });
  }
  r.grad_bytes = -1;
  r.transient_bytes = -1;
  return r;
}

std::string to_string(const StepPeak& p) {
  std::ostringstream os;
  os << fmt::format("step peak {:>16} B in the {}\n", with_commas(p.peak_bytes), to_string(p.phase));
  os << fmt::format("  parameters            {:>16} B\n", with_commas(p.param_bytes));
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

bool is_save(CheckpointPolicy p) {
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
  double forward_cost = 0;
  // Op calls of the forward, in order: (call, cost, cacheable).
  std::vector<std::tuple<std::string, double, bool>> calls;
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

// Runs blocks[0 .. num_blocks) alone on meta under `mode` (and `saved_ops`;
// num_blocks > 1: one checkpointed region, a segment), with the loss
// (y * 2).sum() so the incoming gradient is made by backward itself, as in
// the stack. `grad_input`: the input requires grad (not for block 0).
BlockProfile profile_block(std::vector<TransformerBlock>& blocks, int64_t num_blocks,
                           const TransformerOptions& o, BlockMode mode,
                           const std::vector<std::string>& saved_ops, bool grad_input,
                           const OpCostFn& op_cost) {
  auto& counter = MetaCounter::get();
  BlockProfile prof;
  prof.choice.region_blocks = num_blocks;
  auto reset_grads = [&] {
    for (int64_t j = 0; j < num_blocks; ++j) {
      for (auto& p : blocks[j]->parameters()) {
        p.mutable_grad().reset();
      }
    }
  };
  auto run = [&](const at::Tensor& t) {
    at::Tensor y = t;
    for (int64_t j = 0; j < num_blocks; ++j) {
      y = blocks[j]->forward(y);
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
  SelectivePolicy counting = [inner, op_cost, recompute_cost, forward_cost, calls,
                              counts = std::map<std::string, int64_t>{}](
                                 const SelectiveContext& ctx, const SelectiveOp& op) mutable {
    const auto decision = inner(ctx, op);
    const auto kind = op_kind(op);
    const double c = op_cost ? op_cost(op) : 0.0;
    if (ctx.is_recompute) {
      if (!is_save(decision) || kind.aliases) {
        *recompute_cost += c;
      }
    } else {
      *forward_cost += c;
      const std::string key = op.full_name();
      calls->emplace_back(key + "#" + std::to_string(counts[key]++), c, !kind.aliases);
    }
    return decision;
  };
  reset_grads();
  const int64_t base = counter.live();
  counter.reset_peak();
  auto x = at::empty({o.batch(), o.seq_len(), o.d_model()}, at::TensorOptions().device(at::kMeta));
  if (grad_input) {
    x.requires_grad_(true);
  }
  at::Tensor loss;
  {
    at::Tensor y;
    if (mode == BlockMode::kStore) {
      y = run(x);
    } else {
      auto opts = CheckpointOptions().context_fn(create_selective_checkpoint_contexts(counting));
      y = checkpoint(run, x, opts);
    }
    prof.choice.forward_peak_bytes = counter.peak() - base;
    loss = (y * 2.0).sum();
  }
  const int64_t after_forward = counter.live();
  prof.choice.stored_bytes = after_forward - base - storage_bytes(loss);
  counter.reset_peak();
  loss.backward();
  prof.choice.backward_transient_bytes = counter.peak() - after_forward;
  loss = at::Tensor();
  x = at::Tensor();
  reset_grads();
  prof.choice.recompute_cost = mode == BlockMode::kStore ? 0.0 : *recompute_cost;
  prof.choice.rng_state_bytes = mode == BlockMode::kStore ? 0 : cpu_rng_state_bytes();
  prof.forward_cost = *forward_cost;
  prof.calls = *calls;
  return prof;
}

struct HeadProfile {
  int64_t forward_peak_bytes = 0; // with its input
  int64_t stored_bytes = 0;       // its input, saved by pow
  int64_t backward_transient_bytes = 0;
};

HeadProfile profile_head(const TransformerOptions& o) {
  auto& counter = MetaCounter::get();
  HeadProfile h;
  const int64_t base = counter.live();
  counter.reset_peak();
  auto y = at::empty({o.batch(), o.seq_len(), o.d_model()}, at::TensorOptions().device(at::kMeta))
               .requires_grad_(true);
  auto loss = y.pow(2).mean();
  h.forward_peak_bytes = counter.peak() - base;
  const int64_t after = counter.live();
  h.stored_bytes = after - base - storage_bytes(loss);
  counter.reset_peak();
  loss.backward();
  h.backward_transient_bytes = counter.peak() - after;
  return h;
}

// AdamW's transient for one block's parameters, with state and gradients in place.
int64_t profile_adamw(TransformerBlock& block) {
  auto& counter = MetaCounter::get();
  for (auto& p : block->parameters()) {
    p.mutable_grad() = at::empty_like(p);
  }
  torch::optim::AdamW opt(block->parameters(), torch::optim::AdamWOptions(1e-3));
  opt.step();  // creates the state
  const int64_t base = counter.live();
  counter.reset_peak();
  opt.step();
  const int64_t transient = counter.peak() - base;
  for (auto& p : block->parameters()) {
    p.mutable_grad().reset();
  }
  return transient;
}

struct DpState {
  int64_t stored = 0; // bytes stored by the blocks so far
  double cost = 0;
  int64_t peak = 0;   // highest phase so far
  StepPhase phase = StepPhase::kForward;
  int64_t parent = -1;
  int option = -1;
  int64_t region = 1; // blocks the last choice covers
};

// Raises a state's peak to `bytes`, and its phase to `at`, when `bytes` is higher.
void raise_peak(DpState& state, int64_t bytes, StepPhase at) {
  if (bytes > state.peak) {
    state.peak = bytes;
    state.phase = at;
  }
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

} // namespace

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
// block i, Z = parameters + AdamW state + input, G_>i later blocks' gradients:
//   forward of block i   Z + S_i + F_i
//   backward of block i  Z + S_i + stored_i + G_>i + W_i
//   loss head            Z + S_L + (its forward peak, or stored + backward)
//   optimizer step       Z + G + AdamW transient
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
CheckpointPlan plan_checkpointing(const TransformerOptions& o, const PlanOptions& options) {
  TORCH_CHECK(options.budget_bytes() >= 0,
              "plan_checkpointing: expected budget_bytes >= 0, but got ", options.budget_bytes());
  TORCH_CHECK(o.num_layers() >= 1, "plan_checkpointing: expected num_layers >= 1, but got ",
              o.num_layers());
  enable_cpu_meta_kernels();
  std::lock_guard<std::mutex> lock(prediction_mutex());
  const OpCostFn cost_fn = options.op_cost() ? options.op_cost() : OpCostFn(flop_cost);
  const int64_t L = o.num_layers();
  // Up to max_region_blocks distinct blocks on meta (a segment needs its own
  // parameters per block: shared ones would accumulate one gradient).
  const int64_t max_region = std::clamp<int64_t>(options.max_region_blocks(), 1, L);
  std::vector<TransformerBlock> blocks;
  {
    MetaInitGuard meta;  // built on meta: nothing allocated, whatever d_model is
    for (int64_t j = 0; j < max_region; ++j) {
      blocks.push_back(TransformerBlock(o.d_model(), o.num_heads()));
    }
  }
  int64_t block_param_bytes = 0;
  for (const auto& p : blocks[0]->parameters()) {
    block_param_bytes += storage_bytes(p);
  }
  const int64_t input_bytes = o.batch() * o.seq_len() * o.d_model() * 4;

  // Candidates: cands[first][k - 1] are the regions of k blocks starting at
  // block 0 (first = 0: its input needs no grad) or at a later block.
  std::array<std::vector<std::vector<BlockProfile>>, 2> cands;
  double forward_cost_block = 0;
  for (int first = 0; first < 2; ++first) {
    const bool grad_input = first == 1;
    cands[first].resize(max_region);
    auto& c = cands[first][0];
    c.push_back(profile_block(blocks, 1, o, BlockMode::kStore, {}, grad_input, cost_fn));
    c.push_back(profile_block(blocks, 1, o, BlockMode::kCheckpoint, {}, grad_input, cost_fn));
    for (int64_t k = 2; k <= max_region; ++k) {
      cands[first][k - 1].push_back(
          profile_block(blocks, k, o, BlockMode::kCheckpoint, {}, grad_input, cost_fn));
    }
    const auto ckpt = c[1];
    forward_cost_block = ckpt.forward_cost;
    if (!options.selective()) {
      continue;
    }
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
      auto one = profile_block(blocks, 1, o, BlockMode::kSelective, {call}, grad_input, cost_fn);
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
      c.push_back(profile_block(blocks, 1, o, BlockMode::kSelective, prefix, grad_input, cost_fn));
    }
  }
  const HeadProfile head = profile_head(o);
  const int64_t adamw_transient = options.adamw() ? profile_adamw(blocks[0]) : 0;

  const int64_t params = block_param_bytes * L;
  const int64_t grads = params;
  const int64_t optimizer_state = options.adamw() ? 2 * params : 0;
  const int64_t Z = params + optimizer_state + input_bytes;

  // The dynamic program over block boundaries: layers[i] holds the states
  // after blocks 0 .. i - 1; a region of k blocks moves from i to i + k.
  std::vector<std::vector<DpState>> layers(L + 1);
  layers[0].push_back(DpState{});
  std::vector<std::vector<DpState>> incoming(L + 1);
  int64_t num_candidates = 0;
  auto prune = [](std::vector<DpState> next) {
    // Pareto: drop a state another matches or beats in stored, cost and peak.
    std::sort(next.begin(), next.end(), [](const DpState& a, const DpState& b) {
      return std::tie(a.stored, a.cost, a.peak) < std::tie(b.stored, b.cost, b.peak);
    });
    std::vector<DpState> kept;
    for (const auto& n : next) {
      bool dominated = false;
      for (const auto& k : kept) {
        if (k.stored <= n.stored && k.cost <= n.cost && k.peak <= n.peak) {
          dominated = true;
          break;
        }
      }
      if (!dominated) {
        kept.push_back(n);
      }
    }
    return kept;
  };
  for (int64_t i = 0; i < L; ++i) {
    if (i > 0) {
      layers[i] = prune(std::move(incoming[i]));
    }
    for (int64_t k = 1; k <= max_region && i + k <= L; ++k) {
      const auto& c = cands[i == 0 ? 0 : 1][k - 1];
      num_candidates += static_cast<int64_t>(c.size());
      const int64_t grads_after = block_param_bytes * (L - i - k);
      for (int64_t s = 0; s < static_cast<int64_t>(layers[i].size()); ++s) {
        const auto& st = layers[i][s];
        for (int opt = 0; opt < static_cast<int>(c.size()); ++opt) {
          const auto& ch = c[opt].choice;
          // Block 0's input is the step's input, already in Z.
          const int64_t stored = ch.stored_bytes + ch.rng_state_bytes - (i == 0 ? input_bytes : 0);
          const int64_t fwd = Z + st.stored + ch.rng_state_bytes + ch.forward_peak_bytes -
              (i == 0 ? input_bytes : 0);
          const int64_t bwd = Z + st.stored + stored + grads_after + ch.backward_transient_bytes;
          DpState n;
          n.stored = st.stored + stored;
          n.cost = st.cost + ch.recompute_cost;
          n.peak = st.peak;
          n.phase = st.phase;
          raise_peak(n, fwd, StepPhase::kForward);
          raise_peak(n, bwd, StepPhase::kBackward);
          n.parent = s;
          n.option = opt;
          n.region = k;
          incoming[i + k].push_back(n);
        }
      }
    }
  }
  layers[L] = prune(std::move(incoming[L]));
  // Final phases: the loss head and the optimizer step.
  std::vector<DpState> finals = layers[L];
  for (auto& f : finals) {
    const int64_t head_fwd = Z + f.stored + head.forward_peak_bytes;
    const int64_t head_bwd = Z + f.stored + head.stored_bytes + head.backward_transient_bytes;
    const int64_t opt = Z + grads + adamw_transient;
    raise_peak(f, head_fwd, StepPhase::kForward);
    raise_peak(f, head_bwd, StepPhase::kBackward);
    raise_peak(f, opt, StepPhase::kOptimizerStep);
  }
  auto by_cost = [](const DpState& a, const DpState& b) {
    return std::tie(a.cost, a.peak) < std::tie(b.cost, b.peak);
  };
  auto by_peak = [](const DpState& a, const DpState& b) {
    return std::tie(a.peak, a.cost) < std::tie(b.peak, b.cost);
  };
  const int64_t min_index =
      std::min_element(finals.begin(), finals.end(), by_peak) - finals.begin();
  int64_t best = -1;
  for (int64_t f = 0; f < static_cast<int64_t>(finals.size()); ++f) {
    if (options.budget_bytes() > 0 && finals[f].peak > options.budget_bytes()) {
      continue;
    }
    if (best < 0 || by_cost(finals[f], finals[best])) {
      best = f;
    }
  }
  CheckpointPlan plan;
  plan.feasible = best >= 0;
  plan.budget_bytes = options.budget_bytes();
  plan.min_peak_bytes = finals[min_index].peak;
  plan.min_peak_cost = finals[min_index].cost;
  const int64_t chosen = plan.feasible ? best : min_index;
  const DpState& end = finals[chosen];
  plan.predicted_peak_bytes = end.peak;
  plan.peak_phase = end.phase;
  plan.recompute_cost = end.cost;
  plan.forward_cost = forward_cost_block * static_cast<double>(L);
  plan.static_bytes = Z;
  plan.grad_bytes = grads;
  plan.num_candidates = num_candidates;
  plan.blocks.resize(L);
  int64_t s = chosen;
  for (int64_t i = L; i >= 1;) {
    const auto& st = i == L ? end : layers[i][s];
    const int64_t start = i - st.region;
    const auto& c = cands[start == 0 ? 0 : 1][st.region - 1];
    plan.blocks[start] = c[st.option].choice;
    for (int64_t j = start + 1; j < i; ++j) {  // inside the region: nothing of their own
      plan.blocks[j] = BlockChoice{};
      plan.blocks[j].mode = BlockMode::kCheckpoint;
      plan.blocks[j].region_blocks = 0;
    }
    s = st.parent;
    i = start;
  }
  plan.activation_bytes = head.stored_bytes;
  for (const auto& b : plan.blocks) {
    plan.activation_bytes += b.stored_bytes;
  }
  plan.name = plan_name(plan.blocks);
  return plan;
}

std::string to_string(const CheckpointPlan& p) {
  std::ostringstream os;
  os << fmt::format("checkpoint plan '{}' for a budget of {} B: {}\n", p.name,
                    p.budget_bytes > 0 ? with_commas(p.budget_bytes) : std::string("(none)"),
                    p.feasible ? "fits" : "NO PLAN FITS");
  os << fmt::format("  {:<6}{:<14}{:>16}{:>18}{:>16}  {}\n", "block", "mode", "stored B",
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
    os << fmt::format("  {:<6}{:<14}{:>16}{:>18}{:>16.4g}  {}\n", i, mode,
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
  return os.str();
}

} // namespace trainmem
