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
#include <functional>
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
#include "detail/intercept.h"
#include "core/detail/cpu_probe.h"
#include "core/detail/autocast_on_meta.h"
#include "core/detail/optimizer_state_walk.h"
#include "core/detail/prediction_scope.h"
#include "plan/detail/meta_allocator.h"
#include "plan/detail/meta_step.h"
#include "detail/optimizer_state.h"
#include "detail/process_library.h"
#include "plan/detail/plan_internal.h"

namespace trainmem {

using detail::check_on_meta;
using detail::CountingObserver;
using detail::MetaAllocator;
using detail::prediction_mutex;
using detail::StepPoint;
using detail::storage_bytes;

// ---------------------------------------------------------------------------
// The meta allocator and its counting observer: Note [One meta allocator] in
// src/plan/detail/meta_allocator.h; the step: Note [A step twice with an
// optimizer] in src/plan/detail/meta_step.h.

// Meta backward runs through detail::BackwardOnMeta: Note [Gradient
// accumulation on meta] in src/detail/backward_on_meta.cpp.

namespace {

// Note [CPU matmul operand copies on meta]
// LibTorch's CPU addmm/mm (addmm_impl_cpu_ in aten/src/ATen/native/
// LinearAlgebra.cpp) hands BLAS each operand in place when one of its dims
// has stride 1 and the other a leading dimension BLAS accepts; otherwise it
// clones the operand contiguous for the call, and frees the clone when the op
// returns (the output too, were it not so, to a Fortran-contiguous copy).
// The meta kernels do not, so a meta run missed these bytes. The common
// case is the gradient of a sum: ones expanded to the output's shape
// (strides 0, 0), the first gradient of backward; both matmuls of the last
// Linear's backward clone it (examples/explain_cuda_peaks.cpp's X of 16384 x 1024:
// 67,108,864 B each, one at a time).
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

// Note [CPU reduced-precision matmul scratch]
// In bf16 and fp16 (what autocast runs a CPU matmul in) LibTorch's CPU
// mm/addmm/bmm/baddbmm go to oneDNN, whose scratchpad comes from c10's CPU
// allocator: 34,432 B for a (32 x 64) @ (64 x 256) bf16 mm on this machine,
// after its output and freed before the op returns. Its size follows
// oneDNN's kernel choice for the CPU's instruction set, so no formula has
// it: the op is probed once per distinct call (sizes, strides, dtypes,
// scalars) on zero-filled CPU twins (src/core/detail/cpu_probe.h, as the
// convolutions are), and the meta step holds the probed scratch, operand
// copies included, for a moment after the op's output is made. So is
// `mean`, whose CPU kernel takes 12 B of scratch for an fp32 tensor (8 and 4
// B, after its output) and an fp32 copy of a bf16 one: a loss's final mean
// can be the forward's peak.
int64_t cpu_probed_scratch(const c10::OperatorHandle& op, const torch::jit::Stack& args) {
  std::ostringstream key;
  key << op.schema().name() << "." << op.schema().overload_name();
  int64_t bytes = 0;
  for (const auto& v : args) {
    if (v.isTensor()) {
      key << " " << detail::probe_key(v.toTensor());
      bytes += 2 * detail::probe_storage_bytes(v.toTensor());  // the twin, and an output as large
    } else {
      key << " " << v;  // scalars, dims, flags, dtypes
    }
  }
  return detail::cpu_scratch(key.str(), bytes, [&](const std::function<void()>& open) {
    torch::jit::Stack cpu;
    for (const auto& v : args) {
      cpu.push_back(v.isTensor() ? c10::IValue(detail::cpu_twin(v.toTensor())) : v);
    }
    open();
    op.callBoxed(&cpu);
    std::vector<at::Tensor> outs;
    for (const auto& v : cpu) {
      if (v.isTensor()) {
        outs.push_back(v.toTensor());
      }
    }
    return outs;
  });
}

// Note [Wrapped scalars on meta]
// The Scalar of a binary op's Scalar overload (add, sub, mul, div and their
// in-place forms: AdamW's exp_avg.mul_(beta1), x * 0.5) reaches the kernel as
// a 0-dim CPU tensor that is a "wrapped number": 8 B
// (a double or a long) from the CPU allocator, and on CPU the kernel's
// TensorIterator casts it to the op's type (4 B for fp32) while the op runs.
// On meta the wrapper is made on the CPU too, and nothing casts it, so a
// meta count misses 12 B during each such op: the peak of a small step's
// optimizer phase, where AdamW's scalar ops run beside every state tensor.
// The meta step holds the wrapper's bytes, and the cast's, while the op runs.
int64_t wrapped_scalar_bytes(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  static const std::unordered_set<std::string> kWrapping = {"aten::add", "aten::add_", "aten::sub", "aten::sub_",
                                                            "aten::mul", "aten::mul_", "aten::div", "aten::div_"};
  const auto& schema = op.schema();
  if (schema.overload_name() != "Scalar" || kWrapping.count(schema.name()) == 0) {
    return 0;
  }
  const size_t n = schema.arguments().size();
  const c10::IValue& self = stack[stack.size() - n];
  const c10::IValue& other = stack[stack.size() - n + 1];
  if (!self.isTensor() || !self.toTensor().defined() || !self.toTensor().is_meta() || !other.isScalar()) {
    return 0;
  }
  const at::ScalarType type = self.toTensor().scalar_type();
  const at::Scalar value = other.toScalar();
  const at::ScalarType wrapper = value.isFloatingPoint() ? at::kDouble
      : value.isComplex()                                ? at::kComplexDouble
      : value.isBoolean()                                ? at::kBool
                                                         : at::kLong;
  return static_cast<int64_t>(c10::elementSize(wrapper)) +
      (wrapper != type ? static_cast<int64_t>(c10::elementSize(type)) : 0);
}

// Below autograd, for predict_step_peak: after a meta mm or addmm returns,
// holds cpu_blas_operand_copy_bytes() on meta for a moment (its output is
// alive then, as on CPU while the clones are); in bf16 and fp16, what the
// probe of mm, addmm, bmm or baddbmm measured (Note [CPU reduced-precision
// matmul scratch]).
class CpuKernelModel final : public detail::InterceptHandler {
 public:
  explicit CpuKernelModel(const detail::MetaObserver& counter) : counter_(counter) {}

  void handle(const detail::InterceptScope& scope, const c10::OperatorHandle& op, c10::DispatchKeySet ks,
              torch::jit::Stack* stack) override {
    counter_.run_growing(op, stack, [&] { model(scope, op, ks, stack); });  // Note [Meta storages that grow]
  }

 private:
  void model(const detail::InterceptScope& scope, const c10::OperatorHandle& op, c10::DispatchKeySet ks,
             torch::jit::Stack* stack) {
    const auto& schema = op.schema();
    const std::string& name = schema.name();
    const bool plain = schema.overload_name().empty();
    const bool mm = name == "aten::mm" && plain;
    const bool addmm = name == "aten::addmm" && plain;
    const bool batched = (name == "aten::bmm" || name == "aten::baddbmm") && plain;
    // Note [Wrapped scalars on meta]
    const auto wrapped = detail::hold_meta_bytes(wrapped_scalar_bytes(op, *stack));
    if (name == "aten::mean") {
      probe_after(scope, op, ks, stack);
      return;
    }
    if (!mm && !addmm && !batched) {
      scope.call_next(op, ks, stack);
      return;
    }
    const size_t n = schema.arguments().size();
    const size_t first = stack->size() - n;
    const at::Tensor m1 = (*stack)[first + (mm || name == "aten::bmm" ? 0 : 1)].toTensor();
    const at::Tensor m2 = (*stack)[first + (mm || name == "aten::bmm" ? 1 : 2)].toTensor();
    if (m1.scalar_type() == at::kBFloat16 || m1.scalar_type() == at::kHalf) {
      probe_after(scope, op, ks, stack);  // Note [CPU reduced-precision matmul scratch]
      return;
    }
    scope.call_next(op, ks, stack);
    if (m1.is_meta() && !batched) {  // operand copies: modelled for mm and addmm only
      detail::hold_meta_bytes(cpu_blas_operand_copy_bytes(stack->back().toTensor(), m1, m2));
    }
  }

  // Runs the op on meta, then holds its probed CPU scratch for a moment.
  static void probe_after(const detail::InterceptScope& scope, const c10::OperatorHandle& op,
                          c10::DispatchKeySet ks, torch::jit::Stack* stack) {
    const size_t n = op.schema().arguments().size();
    torch::jit::Stack args(stack->end() - static_cast<std::ptrdiff_t>(n), stack->end());
    const bool meta = !args.empty() && args[0].isTensor() && args[0].toTensor().is_meta();
    scope.call_next(op, ks, stack);
    if (meta && detail::probing_enabled()) {
      detail::hold_meta_bytes(cpu_probed_scratch(op, args));
    }
  }

  const detail::MetaObserver& counter_;
};

// What predict_step_peak and predict_step_function count a meta step under:
// the meta allocator's counter, and what a CPU run allocates besides the meta
// kernels' outputs: the CPU kernels' scratch and the matmuls' operand copies
// (CpuKernelModel; Note [CPU matmul operand copies on meta]) and the
// checkpoints' CPU RNG stashes and recompute fork copies (Note [Checkpoint
// RNG copies on meta]). Members are made in order and ended in reverse.
struct CpuStepCount {
  CountingObserver counter;
  detail::MetaObserverScope attached{counter};
  CpuKernelModel kernels{counter};
  bool registered = (detail::register_intercept_fallback(), true);
  detail::InterceptScope kernel_scope{kernels};
  detail::MetaRngCopies copies{/*stash=*/true, /*fork=*/true};
  detail::RngCopyObserverGuard copies_scope{&copies};
};

// Counts each parameter's gradient once, when AccumulateGrad has written it.
class GradWatch {
 public:
  GradWatch(const torch::nn::Module& module, CountingObserver* counter) {
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
    Hook(at::Tensor p, CountingObserver* c) : param(std::move(p)), counter(c) {}
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
    CountingObserver* counter;
    bool counted = false;
  };
  // shared_ptr<Node> before LibTorch 2.13, intrusive_ptr<Node> since.
  using NodePtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));
  std::vector<std::pair<NodePtr, uintptr_t>> hooks_;
};

} // namespace

namespace detail {

void check_on_meta(const torch::nn::Module& module, const char* who) {
  for (const auto& p : module.named_parameters(/*recurse=*/true)) {
    TORCH_CHECK(p.value().is_meta(), who, ": parameter '", p.key(), "' is on ", p.value().device(),
                ", not on the meta device; move the module with trainmem::to_meta() first");
  }
}

int64_t storage_bytes(const at::Tensor& t) {
  return t.defined() && t.has_storage() ? static_cast<int64_t>(t.storage().nbytes()) : 0;
}

// See src/plan/detail/plan_internal.h.
bool kept_by_autograd(const at::Tensor& t) {
  const bool accumulator = t.is_leaf() && t.requires_grad() &&
      torch::autograd::impl::try_get_grad_accumulator(t) != nullptr;
  return t.use_count() > (accumulator ? 2 : 1) || t.storage().use_count() > 1;
}

} // namespace detail

// ---------------------------------------------------------------------------
// Predictions on meta, and the same step measured on CPU

SavedTensorReport predict_saved_activations(
    const torch::nn::Module& module,
    const std::function<at::Tensor()>& forward) {
  TORCH_CHECK(static_cast<bool>(forward), "predict_saved_activations: the forward function is empty");
  check_on_meta(module, "predict_saved_activations");
  enable_cpu_meta_kernels();
  detail::PredictionScope prediction;  // Note [Init replayed on materialize]: nothing recorded
  SavedTensorMeter meter(module);
  {
    detail::AutocastOnMeta autocast(c10::kCPU);  // Note [Autocast on meta]
    SavedTensorMeterGuard scope(meter);
    at::Tensor out = forward();
    TORCH_CHECK(!out.defined() || out.is_meta(),
                "predict_saved_activations: the forward returned a tensor on ", out.device(),
                "; build its inputs on the meta device");
  }
  auto report = meter.report();
  report.scalar_reads = prediction.scalar_reads();  // Note [Scalar reads inside a prediction]
  return report;
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

// The phase peaks of a step (the last one run counts), from its marks
// (detail::run_steps) and a counter: `live` reads its live bytes,
// `open_window` starts a peak window at them, `peak` reads the window's
// peak. The loss is metered (metered()) for the activations saved.
class PhasePeaks {
 public:
  PhasePeaks(torch::nn::Module& module, torch::optim::Optimizer* optimizer, std::function<int64_t()> live,
             std::function<void()> open_window, std::function<int64_t()> peak)
      : module_(module), optimizer_(optimizer), live_(std::move(live)), open_window_(std::move(open_window)),
        peak_(std::move(peak)) {}

  // loss_fn() under this step's meter.
  at::Tensor metered(const std::function<at::Tensor()>& loss_fn) {
    SavedTensorMeterGuard scope(*meter_);
    return loss_fn();
  }

  void mark(StepPoint point) {
    switch (point) {
      case StepPoint::kBegin:
        r_ = StepPeak();
        break;
      case StepPoint::kForward:
        start();
        break;
      case StepPoint::kBackward:
        r_.forward_peak_bytes = static_bytes_ + peak_() - start_;
        r_.activation_bytes = meter_->report().saved_bytes;
        open_window_();
        break;
      case StepPoint::kOptimizerStep:
        r_.backward_peak_bytes = static_bytes_ + peak_() - start_;
        if (optimizer_ != nullptr) {
          open_window_();
        }
        break;
      case StepPoint::kEnd:
        if (optimizer_ != nullptr) {
          r_.optimizer_peak_bytes = static_bytes_ + peak_() - start_;
        }
        set_phase_peak(r_);
        meter_.reset();
        break;
    }
  }

  const StepPeak& result() const { return r_; }

 private:
  // The gradients are none: the static buckets, then the forward's window.
  void start() {
    const auto buckets = optimizer_ != nullptr ? account(module_, *optimizer_) : account(module_);
    r_.param_bytes = buckets.param_bytes;
    r_.optimizer_state_bytes = buckets.optimizer_state_bytes;
    // Buffers (BatchNorm's running statistics) are live all step, as the
    // parameters are: they count in every phase's peak, as the allocator
    // counts them, and have their own term in the decomposition.
    r_.buffer_bytes = buckets.buffer_bytes;
    static_bytes_ = buckets.total_bytes();
    start_ = live_();
    meter_.emplace(module_);
    open_window_();
  }

  torch::nn::Module& module_;
  torch::optim::Optimizer* optimizer_;
  std::function<int64_t()> live_;
  std::function<void()> open_window_;
  std::function<int64_t()> peak_;
  StepPeak r_;
  int64_t static_bytes_ = 0;
  int64_t start_ = 0;
  std::optional<SavedTensorMeter> meter_;
};

// Decomposes a predicted peak: static buckets, the gradients live at the
// peak (per phase window: forward, backward, optimizer step), the
// activations at the start of backward, and the rest.
void decompose(StepPeak& r, const torch::nn::Module& module, const std::vector<int64_t>& grad_at_peak) {
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
  return detail::predict_step_peak_locked(module, loss_fn, optimizer);
}

namespace detail {

StepPeak predict_step_peak_locked(torch::nn::Module& module, const std::function<at::Tensor()>& loss_fn,
                                  torch::optim::Optimizer* optimizer) {
  detail::PredictionScope prediction;  // Note [Init replayed on materialize]: nothing recorded
  detail::StepStateGuard untouched(module, optimizer);  // Note [Predictions leave no trace]
  auto& meta = MetaAllocator::get();
  CpuStepCount count;
  CountingObserver& counter = count.counter;
  std::optional<GradWatch> watch;
  PhasePeaks phases(
      module, optimizer, [&] { return meta.live_bytes(); }, [&] { counter.open_window(); },
      [&] { return meta.peak_bytes(); });
  detail::StepOptions options;
  options.who = "predict_step_peak";
  // A tensor the step makes without a device (a mask from torch::ones) lands
  // on meta and counts, as it would land on the CPU the step runs on.
  MetaInitGuard factories;
  detail::run_meta_step(module, [&] { return phases.metered(loss_fn); }, optimizer, options,
                        [&](int /*step*/, StepPoint point) {
                          if (point == StepPoint::kBegin) {
                            watch.reset();
                            watch.emplace(module, &counter);  // each gradient counted once a step
                            counter.clear();
                          }
                          phases.mark(point);
                          if (point == StepPoint::kEnd) {
                            counter.close_window();
                          }
                        });
  StepPeak r = phases.result();
  decompose(r, module, counter.grad_at_peak());
  r.scalar_reads = prediction.scalar_reads();  // Note [Scalar reads inside a prediction]
  return r;
}

} // namespace detail

StepPeak measure_step_peak(
    torch::nn::Module& module,
    const std::function<at::Tensor()>& loss_fn,
    torch::optim::Optimizer* optimizer) {
  TORCH_CHECK(static_cast<bool>(loss_fn), "measure_step_peak: the loss function is empty");
  TORCH_CHECK(CpuMemoryTracker::installed(),
              "measure_step_peak: install the CpuMemoryTracker first (CpuMemoryTracker::install())");
  auto& tracker = CpuMemoryTracker::install();
  std::optional<PeakWindow> window;
  PhasePeaks phases(
      module, optimizer, [&] { return tracker.stats().allocated_bytes; }, [&] { window.emplace(tracker); },
      [&] { return window->peak_bytes(); });
  detail::StepOptions options;
  options.who = "measure_step_peak";
  options.on_meta = false;
  detail::run_steps(module, [&] { return phases.metered(loss_fn); }, optimizer, options,
                    [&](int /*step*/, StepPoint point) { phases.mark(point); });
  StepPeak r = phases.result();
  r.grad_bytes = -1;
  r.transient_bytes = -1;
  return r;
}

// ---------------------------------------------------------------------------
// The user's own step function

namespace {

// What the modules and optimizers hold now, each storage once.
StepFunctionPeak resident(const std::vector<torch::nn::Module*>& modules,
                          const std::vector<torch::optim::Optimizer*>& optimizers) {
  StepFunctionPeak r;
  std::unordered_set<const c10::StorageImpl*> seen;
  const auto add = [&](const at::Tensor& t, int64_t& bucket) {
    if (t.defined() && t.has_storage() && seen.insert(t.storage().unsafeGetStorageImpl()).second) {
      bucket += static_cast<int64_t>(t.storage().nbytes());
    }
  };
  for (const auto* m : modules) {
    for (const auto& p : m->parameters(/*recurse=*/true)) {
      add(p, r.param_bytes);
    }
    for (const auto& b : m->buffers(/*recurse=*/true)) {
      add(b, r.buffer_bytes);
    }
  }
  for (const auto* m : modules) {
    for (const auto& p : m->parameters(/*recurse=*/true)) {
      add(p.grad(), r.grad_bytes);
    }
  }
  for (const auto* o : optimizers) {
    detail::for_each_state_tensor(*o, [&](const std::string& /*field*/, const at::Tensor& t) {
      add(t, r.optimizer_state_bytes);
    });
  }
  r.start_bytes = r.param_bytes + r.buffer_bytes + r.grad_bytes + r.optimizer_state_bytes;
  return r;
}


// Runs the warm-up steps, then the measured one between `begin` (which
// returns the live bytes at the start and opens a peak window) and `end`
// (which returns the window's peak and the live bytes at the end).
StepFunctionPeak run_step_function(const std::vector<torch::nn::Module*>& modules,
                                   const std::vector<torch::optim::Optimizer*>& optimizers,
                                   const std::function<void()>& step, int64_t warmup_steps,
                                   const std::function<int64_t()>& begin,
                                   const std::function<std::pair<int64_t, int64_t>()>& end) {
  for (int64_t i = 0; i < warmup_steps; ++i) {
    step();
  }
  StepFunctionPeak r = resident(modules, optimizers);
  const int64_t live = begin();
  step();
  const auto [peak, after] = end();
  r.peak_bytes = r.start_bytes + peak - live;
  r.end_bytes = r.start_bytes + after - live;
  return r;
}

} // namespace

StepFunctionPeak predict_step_function(const std::vector<torch::nn::Module*>& modules,
                                       const std::vector<torch::optim::Optimizer*>& optimizers,
                                       const std::function<void()>& step, int64_t warmup_steps) {
  detail::check_step_function_args(modules, optimizers, step, warmup_steps, "predict_step_function");
  for (const auto* m : modules) {
    check_on_meta(*m, "predict_step_function");
  }
  enable_cpu_meta_kernels();
  std::lock_guard<std::mutex> lock(prediction_mutex());
  return detail::predict_step_function_locked(modules, optimizers, step, warmup_steps);
}

namespace detail {

StepFunctionPeak predict_step_function_locked(const std::vector<torch::nn::Module*>& modules,
                                              const std::vector<torch::optim::Optimizer*>& optimizers,
                                              const std::function<void()>& step, int64_t warmup_steps) {
  detail::PredictionScope prediction;  // Note [Init replayed on materialize]: nothing recorded
  detail::StepFunctionStateGuard untouched(modules, optimizers);
  auto& meta = MetaAllocator::get();
  CpuStepCount count;
  CountingObserver& counter = count.counter;
  // The step's own backward calls accumulate as the CPU's engine does (Note
  // [Gradient accumulation on meta]); its autocast regions cast as the CPU's
  // autocast does (Note [Autocast on meta]); its factories land on meta.
  detail::BackwardOnMeta backward;
  detail::AutocastOnMeta autocast(c10::kCPU);
  MetaInitGuard factories;
  StepFunctionPeak r = run_step_function(
      modules, optimizers, step, warmup_steps,
      [&] {
        counter.open_window();
        return meta.live_bytes();
      },
      [&] {
        const int64_t peak = meta.peak_bytes();
        counter.close_window();
        return std::make_pair(peak, meta.live_bytes());
      });
  r.scalar_reads = prediction.scalar_reads();  // Note [Scalar reads inside a prediction]
  return r;
}

} // namespace detail

StepFunctionPeak measure_step_function(const std::vector<torch::nn::Module*>& modules,
                                       const std::vector<torch::optim::Optimizer*>& optimizers,
                                       const std::function<void()>& step, int64_t warmup_steps) {
  detail::check_step_function_args(modules, optimizers, step, warmup_steps, "measure_step_function");
  TORCH_CHECK(CpuMemoryTracker::installed(),
              "measure_step_function: install the CpuMemoryTracker first (CpuMemoryTracker::install())");
  auto& tracker = CpuMemoryTracker::install();
  std::optional<PeakWindow> window;
  return run_step_function(
      modules, optimizers, step, warmup_steps,
      [&] {
        window.emplace(tracker);
        return tracker.stats().allocated_bytes;
      },
      [&] { return std::make_pair(window->peak_bytes(), tracker.stats().allocated_bytes); });
}

std::string to_string(const StepFunctionPeak& p) {
  std::ostringstream os;
  os << fmt::format("step peak {:>16} B, at its end {} B\n", with_commas(p.peak_bytes), with_commas(p.end_bytes));
  os << fmt::format("  at its start          {:>16} B: parameters {} B, buffers {} B, gradients {} B, optimizer "
                    "state {} B\n",
                    with_commas(p.start_bytes), with_commas(p.param_bytes), with_commas(p.buffer_bytes),
                    with_commas(p.grad_bytes), with_commas(p.optimizer_state_bytes));
  os << detail::scalar_reads_line(p.scalar_reads);
  return os.str();
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
  os << detail::scalar_reads_line(p.scalar_reads);
  return os.str();
}

} // namespace trainmem
