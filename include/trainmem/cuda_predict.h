#pragma once
/// \file cuda_predict.h
/// A training step's CUDA memory, predicted on a machine without a GPU: the
/// step runs on meta tensors (no data), every storage it allocates and frees
/// is recorded in order, the CUDA kernels' own allocations that meta kernels
/// do not make are added (cuBLAS and cuBLASLt workspaces, contiguous copies
/// cuBLAS needs, fused attention's log-sum-exp layout), and the trace is
/// replayed through the caching-allocator model (cuda_allocator_model.h):
/// the `torch.cuda.max_memory_allocated()` and `max_memory_reserved()` a
/// CUDA run of the same step would print.
///
/// Example:
/// ```
/// trainmem::Transformer meta(o);
/// trainmem::to_meta(*meta);
/// torch::optim::AdamW opt(meta->parameters(), torch::optim::AdamWOptions(1e-3));
/// auto p = trainmem::predict_cuda_step_peak(*meta, [&] {
///   return meta->forward(at::empty({16, 64, 128}, at::kMeta)).pow(2).mean(); }, &opt);
/// std::cout << trainmem::to_string(p);   // max_memory_allocated, reserved, terms
/// ```

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include "trainmem/export.h"
#include "trainmem/cuda_allocator_model.h"
#include "trainmem/planner.h"
#include "trainmem/timeline.h"

namespace torch::nn {
class Module;
} // namespace torch::nn
namespace torch::optim {
class Optimizer;
} // namespace torch::optim

namespace trainmem {

/// cuBLAS's workspace per (thread, stream) when CUBLAS_WORKSPACE_CONFIG is
/// unset: ":4096:2:16:8" (2 x 4 MiB + 8 x 16 KiB) before Hopper, in bytes.
inline constexpr int64_t kCublasWorkspaceBytes = 4096 * 1024 * 2 + 16 * 1024 * 8;
/// The same on Hopper and later (compute capability 9 and up): ":4096:8", in bytes.
inline constexpr int64_t kCublasWorkspaceHopperBytes = 4096 * 1024 * 8;
/// cuBLASLt's workspace per (thread, stream) when CUBLASLT_WORKSPACE_SIZE is
/// unset (1024 KiB), in bytes.
inline constexpr int64_t kCublasLtWorkspaceBytes = 1024 * 1024;

/// Which cuBLAS / cuBLASLt workspaces exist. LibTorch keeps one per cuBLAS
/// handle and stream, handles are per thread, and on CUDA the backward runs
/// on the autograd engine's device thread: so a training loop holds up to
/// four, made on first use and never freed.
struct CudaWorkspaces {
  bool cublas_forward = false;    ///< the main thread's cuBLAS workspace
  bool cublaslt_forward = false;  ///< the main thread's cuBLASLt workspace (addmm with a bias)
  bool cublas_backward = false;   ///< the backward thread's cuBLAS workspace
  bool cublaslt_backward = false; ///< the backward thread's cuBLASLt workspace
};

/// Options of predict_cuda_step_peak.
///
/// Example:
/// ```
/// auto o = trainmem::CudaPredictOptions()
///              .allocator(trainmem::CudaAllocatorConfig::parse("expandable_segments:True"))
///              .cublas_workspace_bytes(trainmem::kCublasWorkspaceHopperBytes);
/// ```
struct CudaPredictOptions {
  /// The caching allocator's settings.
  TORCH_ARG(CudaAllocatorConfig, allocator) = {};
  /// Bytes of one cuBLAS workspace (kCublasWorkspaceBytes, or
  /// kCublasWorkspaceHopperBytes on compute capability 9+).
  TORCH_ARG(int64_t, cublas_workspace_bytes) = kCublasWorkspaceBytes;
  /// Bytes of one cuBLASLt workspace; 0 where LibTorch shares cuBLAS's.
  TORCH_ARG(int64_t, cublaslt_workspace_bytes) = kCublasLtWorkspaceBytes;
  /// The workspaces that exist before the step (earlier steps made them).
  TORCH_ARG(CudaWorkspaces, workspaces) = {};
  /// Tensors already on the device when the step starts, beside the module's
  /// parameters and buffers (another model left alive, a data set on the
  /// device): allocated first, in this order. Meta tensors.
  TORCH_ARG(std::vector<at::Tensor>, resident) = {};
  /// With an optimizer, predict its first step (its state made inside the
  /// step, as a script that starts recording before the first step sees)
  /// instead of a step after a warm-up one. The state it makes counts in
  /// CudaPeakTerms::step_bytes.
  TORCH_ARG(bool, first_step) = false;
  /// Run `loss_fn` only: no backward and no optimizer step. What it returns
  /// (any shape: the logits) stays alive to the end, with its autograd graph,
  /// as in a script that records `logits = model(x)`.
  TORCH_ARG(bool, forward_only) = false;
  /// The GPU's compute capability, major * 10 + minor (90 for an H100): it
  /// picks scaled_dot_product_attention's CUDA backend as LibTorch's
  /// sdp_utils does (Note [SDPA's backend on CUDA] in docs/design.md): flash
  /// attention, else memory-efficient attention; an attention that would
  /// take another backend (math, or any with a mask) is refused, named, and
  /// so is bf16 below 80. cuda_options_for() sets it with the workspaces.
  TORCH_ARG(int64_t, compute_capability) = 80;
  /// The GPU's name where cuda_options_for() set these options ("" where
  /// none was named); only described, in what a prediction assumes.
  TORCH_ARG(std::string, gpu_name) = "";
};

/// A GPU by name, as `--gpu` takes it. Plain data.
struct CudaGpu {
  std::string name;                ///< "H100"
  int64_t compute_capability = 0;  ///< major * 10 + minor: 90 for sm 9.0
};

/// The GPUs cuda_gpu() knows, in a fixed order: H100, H200, GH200, B200,
/// A100, A10G, A10, L4, L40S, RTX 4090, RTX 3090, T4, V100.
TRAINMEM_API const std::vector<CudaGpu>& known_cuda_gpus();

/// The GPU named `name` (case and spaces ignored: "h100", "RTX 4090",
/// "rtx4090"). Throws c10::Error naming `name` and the known names.
TRAINMEM_API CudaGpu cuda_gpu(const std::string& name);

/// `base` as the installed LibTorch runs on `gpu`: its compute capability
/// (the SDPA backend), cuBLAS's default workspace on that architecture
/// (kCublasWorkspaceHopperBytes on sm 9.x, 10.x and 12.x, else
/// kCublasWorkspaceBytes: CublasHandlePool.cpp's parseChosenWorkspaceSize),
/// and cuBLASLt sharing that workspace (cublaslt_workspace_bytes 0), as
/// LibTorch 2.11 and later do by default (TORCH_CUBLASLT_UNIFIED_WORKSPACE
/// unset); an older LibTorch keeps base's cuBLASLt workspace.
TRAINMEM_API CudaPredictOptions cuda_options_for(const CudaGpu& gpu, CudaPredictOptions base = {});

/// The bytes live at the predicted max_memory_allocated, by what they are.
/// All in bytes, block sizes (rounded as the allocator rounds them); they sum
/// to max_memory_allocated_bytes.
struct CudaPeakTerms {
  int64_t resident_bytes = 0;         ///< CudaPredictOptions::resident
  int64_t param_bytes = 0;            ///< the module's parameters and buffers
  int64_t optimizer_state_bytes = 0;  ///< live from an earlier step to the end of this one
  int64_t workspace_bytes = 0;        ///< cuBLAS / cuBLASLt workspaces
  int64_t grad_bytes = 0;             ///< parameter gradients already written
  int64_t kernel_temporary_bytes = 0; ///< what CUDA kernels allocate for themselves (cuBLAS's contiguous copies)
  /// Everything else the step made: inputs, saved activations, outputs,
  /// incoming gradients, temporaries.
  int64_t step_bytes = 0;
  /// Rounding: block sizes minus requested sizes, over all of the above.
  int64_t rounding_bytes = 0;
};

/// A predicted CUDA step. Plain data; all in bytes.
struct CudaStepPrediction {
  int64_t max_memory_allocated_bytes = 0; ///< torch.cuda.max_memory_allocated() after reset_peak_memory_stats() at the step's start
  int64_t max_memory_reserved_bytes = 0;  ///< torch.cuda.max_memory_reserved(), from an allocator holding only what was live at the step's start
  int64_t start_allocated_bytes = 0;      ///< allocated when the step starts
  /// Highest sum of live requested sizes (a memory snapshot's requested series).
  int64_t max_requested_bytes = 0;
  /// Highest sum of live requests each rounded as the allocator rounds them
  /// (512 B by default, CudaCachingAllocatorModel::round_size): what a memory
  /// snapshot's trace shows as allocated (it holds requested sizes, so a
  /// block's unsplit remainder is not seen), snapshot.h's recorded
  /// peak_allocated_bytes.
  int64_t max_rounded_requested_bytes = 0;
  int64_t peak_inactive_split_bytes = 0;  ///< highest free bytes inside split segments
  double fragmentation = 0.0;             ///< 1 - max allocated / max reserved
  Phase phase = Phase::kBackward;         ///< where max_memory_allocated is reached
  /// True for predict_cuda_step_peak's step, whose phases are known. False
  /// for a step function (predict_cuda_step_function), whose optimizer steps
  /// are not told apart: `phase` is then kBackward when the peak is inside a
  /// backward pass, else kForward (a forward, or an optimizer step).
  bool phases_split = true;
  CudaPeakTerms terms;                    ///< what is live at that peak
  int64_t num_events = 0;                 ///< allocations and frees of the step
  CudaWorkspaces workspaces;              ///< the workspaces after the step
  /// The caching allocator's segments after the step (memory_snapshot()).
  std::vector<CudaSegmentInfo> segments;
  /// scaled_dot_product_attention calls in the step, by the CUDA backend
  /// that runs them (CudaPredictOptions::compute_capability).
  int64_t flash_attention_calls = 0;
  int64_t efficient_attention_calls = 0;
  /// Values the step read from meta tensors (`.item()`, a meta tensor to the
  /// CPU), by op and value returned: where control flow may have differed from
  /// a real run. Empty when it read none.
  std::vector<ScalarRead> scalar_reads;
};

/// Predicts one training step on CUDA (zero_grad to none, `loss_fn()`,
/// backward, `optimizer->step()` when given) from a run on meta tensors. With
/// an optimizer the step runs twice and the second is reported (its state
/// exists, its first step's cached segments are reused, as in a training
/// loop), unless `options.first_step()`. `loss_fn` builds its inputs on meta
/// and returns a scalar (any shape with `options.forward_only()`, which runs
/// the forward alone). Throws, naming it, if a parameter is not on meta.
///
/// What it models beyond the meta kernels' outputs: the caching allocator
/// (rounding, pools, segments, splitting), cuBLAS / cuBLASLt workspaces made
/// on first use per thread, the contiguous copy cuBLAS makes of an operand it
/// cannot read in place (an expanded gradient, e.g. after `sum()`), and the
/// CUDA layouts of fused attention (flash attention's outputs and log-sum-exp,
/// substituted for the CPU kernel's as the trace is recorded). What it does
/// not: reduction kernels' small scratch buffers, cuDNN workspaces, NCCL,
/// memory outside the caching allocator (the CUDA context, ~0.5 GB).
TRAINMEM_API CudaStepPrediction predict_cuda_step_peak(
    torch::nn::Module& module,
    const std::function<at::Tensor()>& loss_fn,
    torch::optim::Optimizer* optimizer = nullptr,
    const CudaPredictOptions& options = {});

/// predict_step_function()'s step (planner.h: the user's own step function,
/// any number of forward and backward passes and optimizers) predicted on
/// CUDA: traced on meta, with CUDA's autocast policy and the CUDA kernels'
/// workspaces and temporaries, and replayed through the caching-allocator
/// model after `warmup_steps` steps. The device before the step holds
/// options.resident(), the modules' parameters and buffers, and what the
/// warm-up steps left (gradients, optimizer state, cached segments). A
/// tensor the step makes without a device is a CPU tensor, as it is on the
/// GPU, and takes no device bytes. `phases_split` is false (see there).
/// Throws, naming it, as predict_step_function() does.
///
/// Example:
/// ```
/// auto p = trainmem::predict_cuda_step_function({G.get(), D.get()}, {&opt_g, &opt_d}, gan_step);
/// p.max_memory_reserved_bytes;
/// ```
TRAINMEM_API CudaStepPrediction predict_cuda_step_function(
    const std::vector<torch::nn::Module*>& modules, const std::vector<torch::optim::Optimizer*>& optimizers,
    const std::function<void()>& step, const CudaPredictOptions& options = {}, int64_t warmup_steps = 1);

/// Text: max allocated and reserved, the phase, and the terms at the peak.
TRAINMEM_API std::string to_string(const CudaStepPrediction& prediction);

/// What a CUDA budget limits: what tensors hold (max_memory_allocated) or
/// what the caching allocator holds from the device (max_memory_reserved,
/// what an out-of-memory error is about).
enum class CudaBudgetKind { kAllocated, kReserved };

/// "allocated", "reserved".
TRAINMEM_API const char* to_string(CudaBudgetKind kind);

/// A checkpointing plan whose predicted CUDA peak fits a budget. Plain data.
struct CudaCheckpointPlan {
  bool feasible = false;            ///< the CUDA peak of `kind` fits the budget
  CudaBudgetKind kind = CudaBudgetKind::kAllocated;
  int64_t budget_bytes = 0;         ///< the CUDA budget, in bytes
  /// The budget the CPU planner was given last (the CUDA budget minus what
  /// CUDA adds: workspaces, rounding, kernels' copies, allocator slack), in bytes.
  int64_t planner_budget_bytes = 0;
  int64_t num_rounds = 0;           ///< planner calls made
  CheckpointPlan plan;              ///< the plan (when infeasible: the last one tried)
  CudaStepPrediction cuda;          ///< its predicted CUDA step
};

/// plan_regions() for a CUDA budget, as plan_checkpointing_cuda() does for
/// the reference transformer: plans `model` against the CPU peak model,
/// predicts the plan's CUDA step (run_regions() under the plan on the meta
/// input, `model.loss`, and the optimizer's step), and while the CUDA peak of
/// `kind` exceeds the budget plans again lower by the excess, as there (at
/// most 8 rounds). `module` owns every parameter of the
/// regions and must be on meta (built under a MetaInitGuard, or moved with
/// to_meta()). The optimizer is `model.make_optimizer` (called on the
/// module's parameters for each prediction) or `model.optimizer`, whose state
/// is set aside for the predictions and put back. Throws if the budget is not
/// positive or a parameter is not on meta.
///
/// Example:
/// ```
/// auto m = trainmem::hf_region_model(model, 8, 1024);
/// m.make_optimizer = [](std::vector<at::Tensor> p) -> std::unique_ptr<torch::optim::Optimizer> {
///   return std::make_unique<torch::optim::AdamW>(std::move(p), torch::optim::AdamWOptions(1e-3));
/// };
/// auto r = trainmem::plan_regions_cuda(m, *model.module, trainmem::PlanOptions().budget_bytes(80LL << 30),
///                                      trainmem::CudaBudgetKind::kAllocated);
/// ```
TRAINMEM_API CudaCheckpointPlan plan_regions_cuda(
    const RegionModel& model,
    torch::nn::Module& module,
    const PlanOptions& options,
    CudaBudgetKind kind,
    const CudaPredictOptions& cuda = {});

/// Bytes of the copy cuBLAS makes of a matmul operand it cannot pass as is
/// (LibTorch's prepare_matrix_for_cublas: a matrix that is neither dense
/// nor row/column strided with a valid leading dimension is cloned
/// contiguous), or 0. `t` is a 2-d or 3-d (batched) operand.
TRAINMEM_API int64_t cublas_operand_copy_bytes(const at::Tensor& t);

} // namespace trainmem
