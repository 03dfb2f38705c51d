#include "trainmem/cuda_predict.h"

#include <algorithm>
#include <functional>
#include <mutex>
#include <optional>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/AccumulateType.h>
#include <ATen/ops/empty.h>
#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>

#include "detail/conv_scratch.h"
#include "detail/intercept.h"
#include "plan/detail/meta_allocator.h"
#include "plan/detail/meta_step.h"
#include "core/detail/autocast_on_meta.h"
#include "core/detail/prediction_scope.h"
#include "detail/backward_on_meta.h"
#include "detail/optimizer_state.h"
#include "plan/detail/plan_internal.h"
#include "trainmem/meta.h"
#include "trainmem/planner.h"
#include "trainmem/format.h"

namespace trainmem {

namespace {

// The trace's events and kinds: src/plan/detail/meta_allocator.h (Note [One meta
// allocator]).
using Kind = detail::TraceKind;
using detail::TraceEvent;
using detail::TraceObserver;

bool is_matrix_operand_ok(int64_t rows, int64_t cols, int64_t s_rows, int64_t s_cols) {
  // prepare_matrix_for_cublas: column-major with ld >= rows, or row-major with ld >= cols.
  return (s_rows == 1 && s_cols >= std::max<int64_t>(1, rows)) ||
      (s_cols == 1 && s_rows >= std::max<int64_t>(1, cols));
}

} // namespace

int64_t cublas_operand_copy_bytes(const at::Tensor& t) {
  if (!t.defined() || (t.dim() != 2 && t.dim() != 3)) {
    return 0;
  }
  const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
  if (t.dim() == 2) {
    if (t.is_non_overlapping_and_dense()) {
      return 0;
    }
    return is_matrix_operand_ok(t.size(0), t.size(1), t.stride(0), t.stride(1)) ? 0 : bytes;
  }
  // prepare_batch_matrix_for_cublas: the last two dims as above, batch
  // strides non-zero, else a contiguous clone.
  if (is_matrix_operand_ok(t.size(1), t.size(2), t.stride(1), t.stride(2)) && t.stride(0) != 0) {
    return 0;
  }
  return t.is_contiguous() && t.stride(1) != 0 && t.stride(2) != 0 ? 0 : bytes;
}

namespace {

// Note [CUDA kernels on meta]
// Below autograd (the one interception key, Note [One interception key]) this
// handler sees each op of a predicted step and adds what the CUDA kernel
// would allocate beyond its outputs (and the outputs a meta kernel grows
// without allocating, Note [Meta storages that grow] in
// src/plan/detail/meta_allocator.cpp):
// - matmuls (mm, addmm, bmm, baddbmm): a contiguous clone of each operand
//   cuBLAS cannot read in place (cublas_operand_copy_bytes), freed when the
//   op returns; the first matmul of a thread makes that thread's cuBLAS
//   workspace, and an addmm LibTorch sends to cuBLASLt (1-d bias, beta 1,
//   all dims > 1, a floating type) its cuBLASLt workspace too. The thread is
//   the main one in forward and the engine's device thread in backward.
// - CPU flash attention on meta: CUDA runs memory-efficient attention for
//   fp32 (log-sum-exp (B, H, L rounded up to 32)) and flash attention for
//   fp16/bf16 (log-sum-exp (B, H, L); q, k, v and the output padded to a head
//   dim that is a multiple of 8); the philox seed and offset are CPU tensors
//   in eager mode (no device bytes).
class CudaKernelModel final : public detail::InterceptHandler {
 public:
  CudaKernelModel(const CudaPredictOptions& o, CudaWorkspaces ws, TraceObserver& trace)
      : options_(o), ws_(ws), trace_(trace) {}

  void handle(const detail::InterceptScope& scope, const c10::OperatorHandle& op, c10::DispatchKeySet ks,
              torch::jit::Stack* stack) override {
    // Where backward passes begin and end, by event index (a step function's
    // phases: predict_cuda_step_function).
    const bool backward = torch::autograd::get_current_graph_task_id() != -1;
    if (backward != in_backward_) {
      in_backward_ = backward;
      backward_marks_.emplace_back(trace_.num_events(), backward);
    }
    // Note [Meta storages that grow]
    trace_.run_growing(op, stack, [&] { run(scope, op, ks, stack); });
  }

  // Whether event `index` was made inside a backward pass.
  bool in_backward_at(size_t index) const {
    bool in = false;
    for (const auto& [at, state] : backward_marks_) {
      if (at > index) {
        break;
      }
      in = state;
    }
    return in;
  }

  const CudaWorkspaces& workspaces() const { return ws_; }

  // The attention calls made at event `begin` or later, by backend.
  void count_attention_since(size_t begin, CudaStepPrediction& r) const {
    for (const auto& [at, flash] : attention_calls_) {
      if (at >= begin) {
        ++(flash ? r.flash_attention_calls : r.efficient_attention_calls);
      }
    }
  }

 private:
  void run(const detail::InterceptScope& scope, const c10::OperatorHandle& op, c10::DispatchKeySet ks,
           torch::jit::Stack* stack) {
    const auto& schema = op.schema();
    if (!schema.overload_name().empty()) {
      scope.call_next(op, ks, stack);
      return;
    }
    const std::string& name = schema.name();
    const size_t n = schema.arguments().size();
    auto arg = [&](size_t i) -> const c10::IValue& { return (*stack)[stack->size() - n + i]; };
    std::vector<int64_t> copies;
    bool lt = false;
    bool matmul = false;
    if (name == "aten::mm" || name == "aten::bmm") {
      matmul = true;
      copies = {cublas_operand_copy_bytes(arg(0).toTensor()), cublas_operand_copy_bytes(arg(1).toTensor())};
    } else if (name == "aten::addmm" || name == "aten::baddbmm") {
      matmul = true;
      const auto& self = arg(0).toTensor();
      const auto& m1 = arg(1).toTensor();
      const auto& m2 = arg(2).toTensor();
      copies = {cublas_operand_copy_bytes(m1), cublas_operand_copy_bytes(m2)};
      if (name == "aten::addmm") {
        const auto beta = arg(3).toScalar();
        const auto st = m1.scalar_type();
        lt = beta.toDouble() == 1.0 && self.dim() == 1 && self.size(0) == m2.size(1) && self.is_contiguous() &&
            m1.size(0) > 1 && m1.size(1) > 1 && m2.size(0) > 1 && m2.size(1) > 1 &&
            (st == at::kFloat || st == at::kDouble || st == at::kHalf || st == at::kBFloat16);
      }
    } else if (name == "aten::_scaled_dot_product_flash_attention_for_cpu") {
      flash_attention(scope, op, ks, stack, n);
      return;
    } else if (name == "aten::native_layer_norm") {
      layer_norm(scope, op, ks, stack);
      return;
    }
    scope.call_next(op, ks, stack);
    if (!matmul) {
      return;
    }
    auto& trace = trace_;
    std::vector<std::pair<uint64_t, int64_t>> temps;
    for (int64_t bytes : copies) {
      if (bytes > 0) {
        temps.emplace_back(trace.add(bytes, Kind::kKernelTemporary), bytes);
      }
    }
    const bool backward = torch::autograd::get_current_graph_task_id() != -1;
    bool& cublas = backward ? ws_.cublas_backward : ws_.cublas_forward;
    bool& cublaslt = backward ? ws_.cublaslt_backward : ws_.cublaslt_forward;
    if (!cublas) {  // cuBLASLt's handle is the thread's cuBLAS handle: both set up
      cublas = true;
      trace.add(options_.cublas_workspace_bytes(), Kind::kWorkspace);
    }
    if (lt && !cublaslt) {
      cublaslt = true;
      if (options_.cublaslt_workspace_bytes() > 0) {
        trace.add(options_.cublaslt_workspace_bytes(), Kind::kWorkspace);
      }
    }
    for (auto& [id, bytes] : temps) {
      trace.remove(id, bytes, Kind::kKernelTemporary);
    }
  }

  void flash_attention(const detail::InterceptScope& scope, const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                       torch::jit::Stack* stack, size_t n) {
    const at::Tensor q = (*stack)[stack->size() - n].toTensor();
    const bool flash = uses_flash(q, (*stack)[stack->size() - n + 1].toTensor(),
                                  (*stack)[stack->size() - n + 2].toTensor(), (*stack)[stack->size() - n + 4].toBool(),
                                  (*stack)[stack->size() - n + 5]);
    attention_calls_.emplace_back(trace_.num_events(), flash);
    const int64_t hd = q.size(3);
    std::vector<std::pair<uint64_t, int64_t>> pads;
    auto& trace = trace_;
    if (flash && hd % 8 != 0) {
      // q, k, v padded to a multiple of 8 (alive while the kernel runs).
      const int64_t padded = q.numel() / hd * (hd + 8 - hd % 8) * static_cast<int64_t>(q.element_size());
      for (int i = 0; i < 3; ++i) {
        pads.emplace_back(trace.add(padded, Kind::kKernelTemporary), padded);
      }
    }
    scope.call_next(op, ks, stack);
    // Outputs: (out (B, H, L, D) as a (B, L, H, D) buffer, logsumexp).
    at::Tensor out = (*stack)[stack->size() - 2].toTensor();
    const int64_t B = q.size(0), H = q.size(1), L = q.size(2);
    at::Tensor lse = flash
        ? at::empty({B, H, L}, q.options().dtype(at::kFloat))
        : at::empty({B, H, (L + 31) / 32 * 32}, q.options().dtype(at::kFloat)).narrow(2, 0, L);
    if (flash && hd % 8 != 0) {
      out = at::empty({B, L, H, hd + 8 - hd % 8}, q.options()).narrow(3, 0, hd).transpose(1, 2);
    }
    stack->pop_back();
    stack->pop_back();
    stack->emplace_back(std::move(out));
    stack->emplace_back(std::move(lse));
    for (auto& [id, bytes] : pads) {
      trace.remove(id, bytes, Kind::kKernelTemporary);
    }
  }

  // Note [SDPA's backend on CUDA]
  // On meta, scaled_dot_product_attention runs the CPU's flash kernel where
  // the CPU would (Note [Meta kernels with CPU layouts]); on CUDA, LibTorch's
  // sdp_utils.cpp tries flash attention, then memory-efficient attention,
  // then math, each behind its checks. This picks as those checks do for
  // the GPU's compute capability (CudaPredictOptions::compute_capability):
  // - flash: fp16 or bf16 on sm 8.0 to 12.1, q, k and v of one head dim of
  //   at most 256, no mask, is_causal only with as many queries as keys, and
  //   in training on sm 8.6-8.9 and 12.x no head dim in (192, 224]; grouped
  //   KV heads allowed;
  // - memory-efficient: fp32, fp16, or bf16 from sm 8.0, on sm 5.0 to 12.1,
  //   head dims a multiple of the GEMM alignment (sm 8.0+: 8 for 16-bit
  //   types, 4 for fp32; sm 7.x: 8 for 16-bit, 1 for fp32); a mask (made
  //   float first, as the CPU path makes it) read in place when its strides
  //   are multiples of 8.
  // Anything else (math's (B, H, T, T) scores), and what is not modelled
  // (a mask memory-efficient attention copies into a padded one;
  // memory-efficient attention over grouped KV heads) is refused with the
  // reason, never predicted as something else. cuDNN attention, which
  // CUDA 13 builds prefer on sm 9.0 and 10.x when cuDNN is newer than 9.15
  // (check_prefer_cudnn_attention), is not modelled: the prediction is that
  // of a run with TORCH_CUDNN_SDPA_DEPRIORITIZED=1 there.
  bool uses_flash(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool is_causal,
                  const c10::IValue& mask) const {
    const int64_t cc = options_.compute_capability();
    const auto st = q.scalar_type();
    const bool half = st == at::kHalf || st == at::kBFloat16;
    const int64_t hd = q.size(3);
    const bool same_hd = hd == k.size(3) && hd == v.size(3);
    const bool training = q.requires_grad() || k.requires_grad() || v.requires_grad();
    const bool has_mask = mask.isTensor() && mask.toTensor().defined();
    auto describe = [&] {
      return fmt::format("{} attention, head dim {}, {} query and {} KV heads{}, on compute capability {}.{}",
                         c10::toString(st), hd, q.size(1), k.size(1), has_mask ? ", with a mask" : "", cc / 10,
                         cc % 10);
    };
    TORCH_CHECK(st != at::kBFloat16 || cc >= 80, "scaled_dot_product_attention on CUDA, ", describe(),
                ": that GPU has no bf16 attention kernel (flash and memory-efficient attention need compute "
                "capability 8.0 for bf16)");
    const bool sm86_89_or_12x = (cc >= 86 && cc <= 89) || cc >= 120;
    const bool flash = !has_mask && half && cc >= 80 && cc <= 121 && same_hd && hd <= 256 &&
        (!is_causal || q.size(2) == k.size(2)) && !(training && sm86_89_or_12x && hd > 192 && hd <= 224);
    if (flash) {
      return true;
    }
    const int64_t align = cc >= 80 ? (half ? 8 : 4) : cc >= 70 ? (half ? 8 : 1) : 1;
    const bool efficient = cc >= 50 && cc <= 121 && hd == k.size(3) && hd % align == 0 && v.size(3) % align == 0;
    TORCH_CHECK(efficient, "scaled_dot_product_attention on CUDA, ", describe(),
                ": CUDA would take the math backend (neither flash nor memory-efficient attention accepts it), "
                "whose (B, H, T, T) scores are not modelled");
    TORCH_CHECK(q.size(1) == k.size(1), "scaled_dot_product_attention on CUDA, ", describe(),
                ": memory-efficient attention over grouped KV heads is not modelled (flash attention, which fp16 "
                "and bf16 take from compute capability 8.0, is)");
    if (has_mask) {
      // The mask here is the one SDPA made float (convert_boolean_attn_mask),
      // as on CUDA; preprocess_mask pads it to rows of 8 elements unless its
      // strides already are multiples of 8 (aligned_tensor).
      const at::Tensor& m = mask.toTensor();
      bool aligned = m.stride(-1) == 1;
      for (int64_t i = 0; i + 1 < m.dim(); ++i) {
        aligned = aligned && m.stride(i) % 8 == 0;
      }
      TORCH_CHECK(aligned, "scaled_dot_product_attention on CUDA, ", describe(),
                  ": memory-efficient attention copies a mask whose strides are not multiples of 8 into a padded "
                  "one (preprocess_mask), which is not modelled");
    }
    return false;
  }

  // layer_norm_cuda keeps mean and rstd in the input's accumulate type (fp32
  // for bf16 and fp16) whatever the parameters' dtype; the meta kernel follows
  // the CPU, which keeps a bf16 model's statistics in bf16.
  void layer_norm(const detail::InterceptScope& scope, const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                  torch::jit::Stack* stack) {
    scope.call_next(op, ks, stack);
    for (size_t i = stack->size() - 2; i < stack->size(); ++i) {
      const at::Tensor stat = (*stack)[i].toTensor();
      const auto acc = at::toAccumulateType(stat.scalar_type(), c10::DeviceType::CUDA);
      if (stat.scalar_type() != acc) {
        (*stack)[i] = at::empty(stat.sizes(), stat.options().dtype(acc));
      }
    }
  }

  CudaPredictOptions options_;
  CudaWorkspaces ws_;
  TraceObserver& trace_;
  bool in_backward_ = false;
  std::vector<std::pair<size_t, bool>> backward_marks_;
  std::vector<std::pair<size_t, bool>> attention_calls_;  // (event index, flash)
};

void storages_of(const torch::nn::Module& module, std::vector<at::Tensor>& out) {
  std::unordered_set<const c10::StorageImpl*> seen;
  auto add = [&](const at::Tensor& t) {
    if (t.defined() && t.has_storage() && seen.insert(t.storage().unsafeGetStorageImpl()).second) {
      out.push_back(t);
    }
  };
  for (const auto& p : module.parameters(/*recurse=*/true)) {
    add(p);
  }
  for (const auto& b : module.buffers(/*recurse=*/true)) {
    add(b);
  }
}

struct StepMarks {
  size_t begin = 0;          // first event of the step
  size_t backward = 0;       // first event of backward
  size_t optimizer = 0;      // first event after backward
  size_t end = 0;            // one past the step's last event
};

void check_workspaces(const CudaPredictOptions& options, const char* who) {
  TORCH_CHECK(options.cublas_workspace_bytes() >= 0 && options.cublaslt_workspace_bytes() >= 0, who,
              ": workspace sizes must be >= 0, but got ", options.cublas_workspace_bytes(), " and ",
              options.cublaslt_workspace_bytes());
}

void check_arguments(const torch::nn::Module& module, const std::function<at::Tensor()>& loss_fn,
                     const CudaPredictOptions& options) {
  TORCH_CHECK(static_cast<bool>(loss_fn), "predict_cuda_step_peak: the loss function is empty");
  detail::check_on_meta(module, "predict_cuda_step_peak");
  for (const auto& t : options.resident()) {
    TORCH_CHECK(t.defined() && t.is_meta(), "predict_cuda_step_peak: resident tensors must be meta tensors, but got ",
                t.defined() ? t.device().str() : std::string("an undefined tensor"));
  }
  check_workspaces(options, "predict_cuda_step_peak");
}

// The traced step(s): every allocation and free on meta, in order, the
// marks of the step that counts (the last), and the trace ids of the
// gradients alive after it.
struct StepTrace {
  std::vector<TraceEvent> events;
  StepMarks marks;
  std::unordered_set<uint64_t> grad_ids;
  at::Tensor forward_output;  // forward_only: alive past the trace's end
};

// The step (Note [A step twice with an optimizer]: with an optimizer and
// not first_step, a warm-up step and then the step) with `trace` attached,
// the kernels' workspaces and temporaries added by `kernels`.
void trace_steps(torch::nn::Module& module, const std::function<at::Tensor()>& loss_fn,
                 torch::optim::Optimizer* optimizer, const CudaPredictOptions& options,
                 CudaKernelModel& kernels, TraceObserver& trace, StepTrace& t) {
  {
    detail::MetaObserverScope attached(trace);
    detail::InterceptScope scope(kernels);
    detail::StepOptions o;
    o.who = "predict_cuda_step_peak";
    o.autocast_device = c10::kCUDA;
    o.first_step = options.first_step();
    o.forward_only = options.forward_only();
    StepMarks& m = t.marks;
    t.forward_output = detail::run_meta_step(module, loss_fn, optimizer, o, [&](int, detail::StepPoint point) {
      const size_t now = trace.num_events();
      switch (point) {
        case detail::StepPoint::kBegin: break;
        case detail::StepPoint::kForward: m = StepMarks{now, now, now, now}; break;
        case detail::StepPoint::kBackward: m.backward = now; break;
        case detail::StepPoint::kOptimizerStep: m.optimizer = now; break;
        case detail::StepPoint::kEnd: m.end = now; break;
      }
    });
    // Gradients alive after the step: which trace ids they are.
    for (const auto& p : module.parameters()) {
      if (const uint64_t id = trace.id_of(p.grad())) {
        t.grad_ids.insert(id);
      }
    }
  }
  t.events = trace.events();
}

// The device before the step: resident tensors, then the modules' storages
// (each once), then the workspaces that already exist.
std::vector<TraceEvent> device_before(const std::vector<const torch::nn::Module*>& modules,
                                      const CudaPredictOptions& options) {
  std::vector<TraceEvent> before;
  uint64_t synthetic = 1ULL << 62;
  for (const auto& t : options.resident()) {
    before.push_back({detail::storage_bytes(t), synthetic++, Kind::kResident});
  }
  std::vector<at::Tensor> storages;
  for (const auto* m : modules) {
    storages_of(*m, storages);
  }
  std::unordered_set<const c10::StorageImpl*> seen;  // a module shared by two counts once
  for (const auto& t : storages) {
    if (seen.insert(t.storage().unsafeGetStorageImpl()).second) {
      before.push_back({detail::storage_bytes(t), synthetic++, Kind::kParameter});
    }
  }
  const auto& w = options.workspaces();
  for (bool made : {w.cublas_forward, w.cublas_backward}) {
    if (made) {
      before.push_back({options.cublas_workspace_bytes(), synthetic++, Kind::kWorkspace});
    }
  }
  for (bool made : {w.cublaslt_forward, w.cublaslt_backward}) {
    if (made && options.cublaslt_workspace_bytes() > 0) {
      before.push_back({options.cublaslt_workspace_bytes(), synthetic++, Kind::kWorkspace});
    }
  }
  return before;
}

// The trace replayed on the caching allocator's model, tracking what each
// live block is.
class Replay {
 public:
  struct Live {
    uint64_t address;
    int64_t requested;
    int64_t block;
    Kind kind;
  };

  explicit Replay(const CudaAllocatorConfig& config) : model(config) {}

  void apply(const TraceEvent& e) {
    if (e.bytes > 0) {
      const uint64_t a = model.malloc(e.bytes);
      if (a != 0) {
        live[e.id] = {a, e.bytes, model.round_size(e.bytes), e.kind};
      }
    } else if (e.bytes < 0) {
      auto it = live.find(e.id);
      if (it != live.end()) {
        model.free(it->second.address);
        live.erase(it);
      }
    }
  }

  // The step's events [m.begin, m.end): the peak, where it was and what was
  // live there, and the snapshot's series: requested sizes, and each
  // rounded as the allocator rounds it (512 B by default), as snapshot.h's
  // recorded figure is.
  void step(const std::vector<TraceEvent>& events, const StepMarks& m, CudaStepPrediction& r) {
    model.reset_peak();
    r.start_allocated_bytes = model.stats().allocated_bytes;
    peak = model.stats().allocated_bytes;
    peak_index = m.begin;
    live_at_peak = live;
    int64_t requested = 0;
    int64_t rounded = 0;
    for (const auto& [id, l] : live) {
      requested += l.requested;
      rounded += l.block;
    }
    r.max_requested_bytes = requested;
    r.max_rounded_requested_bytes = rounded;
    for (size_t i = m.begin; i < m.end; ++i) {
      const auto& e = events[i];
      if (e.bytes < 0) {
        auto it = live.find(e.id);
        if (it != live.end()) {
          requested -= it->second.requested;
          rounded -= it->second.block;
        }
      }
      apply(e);
      if (e.bytes > 0) {
        if (auto it = live.find(e.id); it != live.end()) {
          requested += e.bytes;
          rounded += it->second.block;
        }
      }
      r.max_requested_bytes = std::max(r.max_requested_bytes, requested);
      r.max_rounded_requested_bytes = std::max(r.max_rounded_requested_bytes, rounded);
      if (model.stats().allocated_bytes > peak) {
        peak = model.stats().allocated_bytes;
        peak_index = i;
        live_at_peak = live;
      }
    }
  }

  CudaCachingAllocatorModel model;
  std::unordered_map<uint64_t, Live> live;
  int64_t peak = 0;
  size_t peak_index = 0;
  std::unordered_map<uint64_t, Live> live_at_peak;
};

// The device before the step, the warm-up steps, then the step, replayed on
// the allocator model; the peaks and segments into `r`.
void replay_trace(Replay& replay, const StepTrace& trace, const std::vector<TraceEvent>& before,
                  CudaStepPrediction& r) {
  for (const auto& e : before) {
    replay.apply(e);
  }
  const StepMarks& m = trace.marks;
  for (size_t i = 0; i < m.begin; ++i) {  // the warm-up step(s)
    replay.apply(trace.events[i]);
  }
  replay.step(trace.events, m, r);
  const auto s = replay.model.stats();
  r.max_memory_allocated_bytes = s.peak_allocated_bytes;
  r.max_memory_reserved_bytes = s.peak_reserved_bytes;
  r.peak_inactive_split_bytes = s.peak_inactive_split_bytes;
  r.fragmentation = s.peak_reserved_bytes > 0
      ? 1.0 - static_cast<double>(s.peak_allocated_bytes) / static_cast<double>(s.peak_reserved_bytes)
      : 0.0;
  r.num_events = static_cast<int64_t>(m.end - m.begin);
  r.segments = replay.model.segments();
}

// Terms at the peak. Optimizer state: blocks of the warm-up step still live
// at the end (with an optimizer; else none).
void terms_at_peak(const StepTrace& trace, const Replay& replay, CudaStepPrediction& r) {
  const StepMarks& m = trace.marks;
  std::unordered_set<uint64_t> warm;
  for (size_t i = 0; i < m.begin; ++i) {
    if (trace.events[i].bytes > 0) {
      warm.insert(trace.events[i].id);
    }
  }
  for (const auto& [id, l] : replay.live_at_peak) {
    auto& t = r.terms;
    t.rounding_bytes += l.block - l.requested;
    switch (l.kind) {
      case Kind::kResident: t.resident_bytes += l.requested; break;
      case Kind::kParameter: t.param_bytes += l.requested; break;
      case Kind::kWorkspace: t.workspace_bytes += l.requested; break;
      case Kind::kKernelTemporary: t.kernel_temporary_bytes += l.requested; break;
      case Kind::kTensor:
        if (trace.grad_ids.count(id) != 0) {
          t.grad_bytes += l.requested;
        } else if (warm.count(id) != 0) {
          t.optimizer_state_bytes += l.requested;
        } else {
          t.step_bytes += l.requested;
        }
        break;
    }
  }
}

// The traced step replayed through the caching-allocator model from the
// device's blocks `before` it, and what a prediction reports of it: the phase
// of the peak (`phase_of`), the workspaces, the attention kernels' counts and
// the terms live at the peak. Shared by predict_cuda_step_peak() and
// predict_cuda_step_function().
CudaStepPrediction replay_prediction(StepTrace& trace, const CudaKernelModel& kernels,
                                     const CudaPredictOptions& options, const std::vector<TraceEvent>& before,
                                     bool phases_split,
                                     const std::function<Phase(const Replay&, const CudaStepPrediction&)>& phase_of) {
  Replay replay(options.allocator());
  CudaStepPrediction r;
  replay_trace(replay, trace, before, r);
  trace.forward_output = at::Tensor();
  r.phases_split = phases_split;
  r.phase = phase_of(replay, r);
  r.workspaces = kernels.workspaces();
  kernels.count_attention_since(trace.marks.begin, r);
  terms_at_peak(trace, replay, r);
  return r;
}

} // namespace

CudaStepPrediction predict_cuda_step_peak(
    torch::nn::Module& module,
    const std::function<at::Tensor()>& loss_fn,
    torch::optim::Optimizer* optimizer,
    const CudaPredictOptions& options) {
  check_arguments(module, loss_fn, options);
  enable_cpu_meta_kernels();
  detail::register_intercept_fallback();
  std::lock_guard<std::mutex> lock(detail::prediction_mutex());
  detail::NoConvScratchGuard no_cpu_scratch;  // Note [CPU convolution scratch]
  detail::PredictionScope prediction;  // Note [Init replayed on materialize]: nothing recorded
  detail::StepStateGuard untouched(module, optimizer);  // Note [Predictions leave no trace]

  TraceObserver observer;
  CudaKernelModel kernels(options, options.workspaces(), observer);
  StepTrace trace;
  trace_steps(module, loss_fn, optimizer, options, kernels, observer, trace);

  auto r = replay_prediction(trace, kernels, options, device_before({&module}, options), /*phases_split=*/true,
                           [&](const Replay& replay, const CudaStepPrediction& r) {
                             const StepMarks& m = trace.marks;
                             if (replay.peak_index == m.begin && replay.peak == r.start_allocated_bytes) {
                               return Phase::kForward;
                             }
                             return replay.peak_index < m.backward ? Phase::kForward
                                 : replay.peak_index < m.optimizer  ? Phase::kBackward
                                                                    : Phase::kOptimizerStep;
                           });
  r.scalar_reads = prediction.scalar_reads();  // Note [Scalar reads inside a prediction]
  return r;
}

CudaStepPrediction predict_cuda_step_function(const std::vector<torch::nn::Module*>& modules,
                                              const std::vector<torch::optim::Optimizer*>& optimizers,
                                              const std::function<void()>& step, const CudaPredictOptions& options,
                                              int64_t warmup_steps) {
  const char* who = "predict_cuda_step_function";
  detail::check_step_function_args(modules, optimizers, step, warmup_steps, who);
  for (const auto* m : modules) {
    detail::check_on_meta(*m, who);
  }
  check_workspaces(options, who);
  enable_cpu_meta_kernels();
  detail::register_intercept_fallback();
  std::lock_guard<std::mutex> lock(detail::prediction_mutex());
  detail::NoConvScratchGuard no_cpu_scratch;  // Note [CPU convolution scratch]
  detail::PredictionScope prediction;  // Note [Init replayed on materialize]: nothing recorded
  detail::StepFunctionStateGuard untouched(modules, optimizers);  // Note [Predictions leave no trace]

  TraceObserver observer;
  CudaKernelModel kernels(options, options.workspaces(), observer);
  StepTrace trace;
  {
    detail::MetaObserverScope attached(observer);
    detail::InterceptScope scope(kernels);
    // The step's own backward passes accumulate as the engine does on the
    // device, its autocast regions cast with CUDA's policy. A tensor it
    // makes without a device is a CPU tensor, as on the GPU: no device bytes.
    detail::BackwardOnMeta backward;
    detail::AutocastOnMeta autocast(c10::kCUDA);
    for (int64_t i = 0; i < warmup_steps; ++i) {
      step();
    }
    const size_t begin = observer.num_events();
    step();
    const size_t end = observer.num_events();
    trace.marks = StepMarks{begin, end, end, end};
    for (const auto* m : modules) {
      for (const auto& p : m->parameters()) {
        if (const uint64_t id = observer.id_of(p.grad())) {
          trace.grad_ids.insert(id);
        }
      }
    }
  }
  trace.events = observer.events();

  const std::vector<const torch::nn::Module*> trained(modules.begin(), modules.end());
  auto r = replay_prediction(trace, kernels, options, device_before(trained, options), /*phases_split=*/false,
                           [&](const Replay& replay, const CudaStepPrediction&) {
                             return replay.peak_index > trace.marks.begin && kernels.in_backward_at(replay.peak_index)
                                 ? Phase::kBackward
                                 : Phase::kForward;
                           });
  r.scalar_reads = prediction.scalar_reads();  // Note [Scalar reads inside a prediction]
  return r;
}

std::string to_string(const CudaStepPrediction& p) {
  std::ostringstream os;
  const auto& t = p.terms;
  os << fmt::format("predicted CUDA max_memory_allocated {:>16} B {}\n", with_commas(p.max_memory_allocated_bytes),
                    p.phases_split ? std::string("in the ") + phase_name(p.phase)
                    : p.phase == Phase::kBackward ? std::string("inside a backward pass")
                                                  : std::string("outside any backward pass"));
  os << fmt::format("predicted CUDA max_memory_reserved  {:>16} B (fragmentation {:.1f} %)\n",
                    with_commas(p.max_memory_reserved_bytes), 100.0 * p.fragmentation);
  auto line = [&](const char* what, int64_t bytes) {
    if (bytes != 0) {
      os << fmt::format("  {:<32} {:>16} B\n", what, with_commas(bytes));
    }
  };
  line("resident tensors", t.resident_bytes);
  line("parameters and buffers", t.param_bytes);
  line("optimizer state", t.optimizer_state_bytes);
  line("cuBLAS / cuBLASLt workspaces", t.workspace_bytes);
  line("gradients written", t.grad_bytes);
  line("step tensors (activations, temps)", t.step_bytes);
  line("CUDA kernel temporaries", t.kernel_temporary_bytes);
  line("allocator rounding (512 B blocks)", t.rounding_bytes);
  os << detail::scalar_reads_line(p.scalar_reads);
  return os.str();
}

const char* to_string(CudaBudgetKind kind) {
  return kind == CudaBudgetKind::kAllocated ? "allocated" : "reserved";
}

namespace {

// Plans `model` for the planner budget b, predicts the plan's CUDA step,
// lowers b by the excess: the loop of plan_regions_cuda (and so of
// plan_checkpointing_cuda).
CudaCheckpointPlan plan_for_cuda(const RegionModel& model, const PlanOptions& options, CudaBudgetKind kind,
                                 const std::function<CudaStepPrediction(const CheckpointPlan&)>& predict) {
  CudaCheckpointPlan r;
  r.kind = kind;
  r.budget_bytes = options.budget_bytes();
  int64_t b = options.budget_bytes();
  for (int round = 0; round < 8 && b > 0; ++round) {
    r.num_rounds = round + 1;
    r.planner_budget_bytes = b;
    r.plan = plan_regions(model, PlanOptions(options).budget_bytes(b));
    r.cuda = predict(r.plan);
    const int64_t peak = kind == CudaBudgetKind::kAllocated ? r.cuda.max_memory_allocated_bytes
                                                            : r.cuda.max_memory_reserved_bytes;
    if (r.plan.feasible && peak <= r.budget_bytes) {
      r.feasible = true;
      return r;
    }
    if (!r.plan.feasible) {
      break;  // nothing smaller exists on the CPU either
    }
    // What CUDA adds over the CPU model is about (peak - the plan's CPU
    // peak): aim the next plan's CPU peak that much under the budget. From
    // b itself when the plan's peak sits well under b, the same plan would
    // come back for rounds.
    b = std::min(b, r.plan.predicted_peak_bytes) - (peak - r.budget_bytes);
  }
  return r;
}

} // namespace

CudaCheckpointPlan plan_regions_cuda(
    const RegionModel& model,
    torch::nn::Module& module,
    const PlanOptions& options,
    CudaBudgetKind kind,
    const CudaPredictOptions& cuda) {
  TORCH_CHECK(options.budget_bytes() > 0, "plan_regions_cuda: expected a budget > 0, but got ",
              options.budget_bytes());
  detail::PredictionScope prediction;  // Note [Init replayed on materialize]: nothing recorded
  for (const auto& p : module.named_parameters(/*recurse=*/true)) {
    TORCH_CHECK(p.value().is_meta(), "plan_regions_cuda: parameter '", p.key(), "' is on ", p.value().device(),
                ", not on the meta device; build the model under a MetaInitGuard or move it with trainmem::to_meta()");
  }
  TORCH_CHECK(static_cast<bool>(model.input) && static_cast<bool>(model.loss),
              "plan_regions_cuda: RegionModel::input and RegionModel::loss must be set");
  auto predict = [&](const CheckpointPlan& p) {
    const auto checkpointing = p.checkpointing();
    auto loss = [&] { return model.loss(run_regions(model.regions, model.input(at::kMeta), checkpointing)); };
    if (detail::RecipeStep::wanted(model)) {
      // Note [Planned steps with a scaler or master weights]: the step as its
      // scaler or masters run it, predicted as a step function.
      std::optional<detail::OptimizerStateAside> aside;
      if (model.optimizer != nullptr) {
        aside.emplace(*model.optimizer);
      }
      detail::RecipeStep recipe(model, module.parameters(), "plan_regions_cuda");
      std::vector<torch::nn::Module*> modules = {&module};
      if (recipe.masters() != nullptr) {
        modules.push_back(recipe.masters());
      }
      return predict_cuda_step_function(modules, {&recipe.optimizer()}, [&] { recipe.run(modules, loss); }, cuda);
    }
    if (model.make_optimizer) {
      auto opt = model.make_optimizer(module.parameters());
      TORCH_CHECK(opt != nullptr, "plan_regions_cuda: RegionModel::make_optimizer returned null");
      return predict_cuda_step_peak(module, loss, opt.get(), cuda);
    }
    if (model.optimizer == nullptr) {
      return predict_cuda_step_peak(module, loss, nullptr, cuda);
    }
    detail::OptimizerStateAside aside(*model.optimizer);
    return predict_cuda_step_peak(module, loss, model.optimizer, cuda);
  };
  return plan_for_cuda(model, options, kind, predict);
}

} // namespace trainmem
