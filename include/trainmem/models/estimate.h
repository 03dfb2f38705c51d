#pragma once
/// \file estimate.h
/// One call for "will it fit". estimate() predicts one training step of any
/// module built on meta (its loss and optimizer given): the static buckets,
/// the bytes autograd saves, the step's exact peak on the CPU's kernels and,
/// with CUDA options, the step's max_memory_allocated and
/// max_memory_reserved through the caching-allocator model; `trainmem
/// estimate` prints what it returns for the bundled transformer.
/// estimate_model() builds a config-file model (hf_model.h) on meta, with the
/// precision, checkpointing, LoRA and data parallelism asked for, and
/// predicts one AdamW training step of it the same way, with the static
/// bytes of every recipe (sharded as asked); `trainmem estimate --model`
/// prints what it returns. Nothing is allocated and nothing is run.
///
/// Example:
/// ```
/// auto config = trainmem::load_hf_config("tests/data/llama2_7b.json");
/// auto e = trainmem::estimate_model(config, trainmem::ModelEstimateOptions()
///     .batch(1).seq_len(2048).precision(trainmem::Precision::kBf16Autocast)
///     .checkpoint("full").lora(trainmem::LoraOptions().rank(16).targets({"q_proj", "v_proj"}))
///     .cuda(trainmem::CudaPredictOptions().cublas_workspace_bytes(trainmem::kCublasWorkspaceHopperBytes)));
/// e.cuda->max_memory_reserved_bytes;
/// std::cout << e.assumptions;   // what every figure assumes
/// ```

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>
#include <torch/arg.h>

#include "trainmem/accountant.h"
#include "trainmem/cuda_predict.h"
#include "trainmem/export.h"
#include "trainmem/models/hf_model.h"
#include "trainmem/models/lora.h"
#include "trainmem/planner.h"

namespace trainmem {

/// Numeric precision of a training run.
enum class Precision {
  kFp32,         ///< fp32 parameters, gradients and activations
  kBf16Autocast, ///< fp32 parameters; matmuls and attention in bf16 (autocast)
  kBf16,         ///< everything in bf16, optimizer state too (LibTorch's optimizers keep state in the parameter dtype)
  kFp16,         ///< everything in fp16, optimizer state too; no loss scaling (a GradScaler refuses fp16 gradients)
  kFp16Autocast, ///< fp32 parameters; matmuls and attention in fp16 (autocast), loss scaled by a GradScaler
  /// The model and its gradients in bf16, AdamW over fp32 master copies of
  /// the bf16 weights (ZeRO's mixed-precision recipe, 2 + 2 + 12 B per
  /// parameter): Note [bf16 weights with fp32 master weights].
  kBf16Master,
  /// The model and its gradients in fp16, AdamW over fp32 masters, the loss
  /// scaled by a GradScaler that unscales the masters' gradients
  /// (DeepSpeed's fp16 mode, apex's O2; 2 + 2 + 12 B per parameter).
  kFp16Master,
};

/// "fp32", "bf16-autocast", "bf16", "fp16", "fp16-autocast", "bf16-master",
/// "fp16-master".
TRAINMEM_API const char* precision_name(Precision precision);
/// Parses a precision_name(). Throws c10::Error naming `name` otherwise.
TRAINMEM_API Precision parse_precision(const std::string& name);

/// Runs `fn` as a user's autocast region does: autocast enabled for
/// `device` in `dtype` (at::autocast::set_autocast_enabled and
/// set_autocast_dtype), then the previous state restored and the cast cache
/// cleared, also when `fn` throws. On meta tensors the casts are those
/// LibTorch's own autocast kernels make for `device` (Note [Autocast on meta]
/// in docs/design.md).
TRAINMEM_API at::Tensor run_under_autocast(c10::DeviceType device, at::ScalarType dtype,
                                           const std::function<at::Tensor()>& fn);

/// What estimate() predicts beside the module, its loss and its optimizer.
struct EstimateOptions {
  /// How the step runs. kFp32 and kBf16 run `loss_fn` as it is (a bf16 model
  /// is the caller's to cast); kBf16Autocast and kFp16Autocast run it under
  /// LibTorch's autocast (run_under_autocast: the CPU's policy for the CPU
  /// figures, CUDA's for the CUDA ones), kFp16Autocast with trainmem's
  /// GradScaler, its step taken (Note [fp16 autocast as a step function]).
  /// kBf16Master and kFp16Master need fp32 master weights: estimate_model()
  /// predicts them.
  TORCH_ARG(Precision, precision) = Precision::kFp32;
  /// Micro-batches per step: `loss_fn` runs this many times, each loss
  /// divided by it before its backward, then one optimizer step. Above 1 the
  /// step is predicted as a function (step_phases_split false).
  TORCH_ARG(int64_t, accumulation) = 1;
  /// Predict the step's peak. false: the static buckets and saved bytes
  /// only (one forward on meta), for a quick check before a long run.
  TORCH_ARG(bool, step) = true;
  /// Also predict the step on CUDA with these options (allocator settings,
  /// cuBLAS workspace, SDPA backend).
  TORCH_ARG(std::optional<CudaPredictOptions>, cuda) = std::nullopt;
};

/// What estimate() returns. Plain data; bytes unless named otherwise.
struct Estimate {
  EstimateOptions options;
  /// account(module, optimizer): the parameters and buffers, and the
  /// gradients and optimizer state the step will hold
  /// (predicted_grad_bytes, predicted_optimizer_state_bytes;
  /// predicted_total_bytes() is the static total).
  StaticBuckets buckets;
  /// Bytes autograd saves for backward in one forward of `loss_fn` (one
  /// micro-batch), each storage once, parameters excluded
  /// (predict_saved_activations(), under the precision's autocast).
  int64_t saved_bytes = 0;
  /// The step on meta with the CPU's kernels, the second of two (the
  /// optimizer's state made in the first): exact against the same step run
  /// on the CPU (measure_step_peak(), measure_step_function()).
  /// predict_step_peak(), or predict_step_function() for fp16 autocast and
  /// accumulation, whose phases are not split (step_phases_split false, the
  /// phase peaks 0). All 0 when options.step() is false.
  StepPeak step_peak;
  bool step_phases_split = true;
  /// The same step on CUDA, when options.cuda was given.
  std::optional<CudaStepPrediction> cuda;
  /// One line per assumption the figures make: the module and its step,
  /// precision (and which autocast policy), accumulation, optimizer, the
  /// CUDA settings.
  std::vector<std::string> assumptions;
};

/// Predicts one training step of `module`, whose parameters are on meta
/// (built under a MetaInitGuard, or to_meta()): gradients to none,
/// `loss_fn()` (which makes its batch on meta and returns a scalar),
/// backward, `optimizer`'s step, as `options` asks. `optimizer` steps
/// `module`'s parameters (or some of them); its state, the module's
/// gradients and buffers are as they were afterwards (Note [Predictions
/// leave no trace]). Throws c10::Error naming the value for kBf16Master or kFp16Master, an
/// accumulation below 1, or a parameter not on meta.
///
/// Example:
/// ```
/// trainmem::Transformer meta{nullptr};
/// {
///   trainmem::MetaInitGuard guard;
///   meta = trainmem::Transformer(trainmem::TransformerOptions());
/// }
/// torch::optim::AdamW opt(meta->parameters(), torch::optim::AdamWOptions(1e-3));
/// auto e = trainmem::estimate(*meta, [&] {
///   return meta->forward(at::empty({16, 64, 128}, at::kMeta)).pow(2).mean(); }, opt);
/// e.buckets.predicted_total_bytes();  // 19,034,112: parameters, gradients, AdamW's moments
/// e.saved_bytes;                      // 51,052,544
/// e.step_peak.peak_bytes;             // 67,687,944: the CPU measures the same
/// ```
TRAINMEM_API Estimate estimate(torch::nn::Module& module, const std::function<at::Tensor()>& loss_fn,
                               torch::optim::Optimizer& optimizer, const EstimateOptions& options = {});

/// What estimate_model() predicts.
struct ModelEstimateOptions {
  TORCH_ARG(int64_t, batch) = 1;       ///< sequences in the micro-batch
  TORCH_ARG(int64_t, seq_len) = 2048;  ///< tokens per sequence (at most the config's positions)
  /// fp32, bf16 autocast, a model held in bf16, fp16 autocast with
  /// trainmem's GradScaler (its step taken; Note [fp16 autocast as a step
  /// function]), or a bf16 model with fp32 master weights.
  TORCH_ARG(Precision, precision) = Precision::kFp32;
  /// Activation checkpointing of the decoder blocks, as
  /// BlockCheckpointing::named() takes it: "none", "full", "every_<k>" or
  /// "selective" (matmul outputs saved).
  TORCH_ARG(std::string, checkpoint) = "none";
  /// LoRA adapters (lora.h) on the named layers, every other weight frozen.
  TORCH_ARG(std::optional<LoraOptions>, lora) = std::nullopt;
  TORCH_ARG(int64_t, ranks) = 1;  ///< data-parallel ranks the static bytes are sharded over
  TORCH_ARG(int64_t, zero) = 0;   ///< ZeRO stage 0-3 of that sharding
  /// Also predict the step on CUDA with these options (allocator settings,
  /// cuBLAS workspace, SDPA backend).
  TORCH_ARG(std::optional<CudaPredictOptions>, cuda) = std::nullopt;
};

/// What estimate_model() returns. Plain data; bytes unless named otherwise.
struct ModelEstimate {
  HfConfig config;
  ModelEstimateOptions options;
  int64_t num_params = 0;        ///< every parameter element (a tied head once)
  int64_t trainable_params = 0;  ///< those that get a gradient (the adapters with LoRA)
  int64_t largest_layer_params = 0;  ///< largest_layer_params() of the model (ZeRO-3's gather)
  std::vector<std::string> lora_layers;  ///< the layers LoRA adapted, in module order
  /// The static bytes of each closed-form recipe (accountant.h), sharded as
  /// asked: fp32 AdamW, mixed-precision AdamW (bf16 weights and gradients,
  /// fp32 master weights and moments: 2 + 2 + 12 B per trainable
  /// parameter), pure bf16 AdamW, fp32 SGD with and without momentum, fp32
  /// Adafactor.
  std::vector<ShardedStatic> recipes;
  /// Bytes autograd saves for backward in one forward of the micro-batch,
  /// each storage once, parameters excluded (predict_saved_activations()).
  int64_t saved_bytes = 0;
  /// One AdamW step on the CPU's kernels, one rank, unsharded
  /// (predict_step_peak(); for fp16 autocast predict_step_function(), whose
  /// phases are not split: step_phases_split false, the phase peaks 0).
  StepPeak step_peak;
  bool step_phases_split = true;
  /// The same step on CUDA, when options.cuda was given.
  std::optional<CudaStepPrediction> cuda;
  /// One line per assumption every figure above makes: model and micro-batch,
  /// precision (and which autocast policy), checkpointing, LoRA, optimizer,
  /// ranks and ZeRO stage, the CUDA settings.
  std::vector<std::string> assumptions;
};

/// The model `config` describes, built on the current device (on meta under a
/// MetaInitGuard, else on CPU and initialized) as `options` asks: cast to
/// bf16 for Precision::kBf16 and kBf16Master, to fp16 for kFp16 and
/// kFp16Master, then given LoRA adapters when asked (as
/// from_pretrained in bf16, then get_peft_model). Its loss and forward are
/// HfModel's; the autocast of kBf16Autocast is the caller's to open
/// (run_under_autocast), as in a user's loop.
TRAINMEM_API HfModel build_model(const HfConfig& config, const ModelEstimateOptions& options);

/// `model`'s training step as plan_regions() sees it (hf_region_model() at
/// options' batch and seq_len), with every region and the loss run under
/// autocast in bf16 (kBf16Autocast) or fp16 (kFp16Autocast) for
/// `autocast_device` (kCPU for plan_regions and a CPU run, kCUDA for
/// plan_regions_cuda); with RegionModel::grad_scaler set (default options)
/// for kFp16Autocast and RegionModel::master_weights for kBf16Master (both
/// for kFp16Master), so the
/// planned step is estimate_model()'s (its make_optimizer is the caller's
/// to set). Throws as hf_region_model().
TRAINMEM_API RegionModel model_regions(const HfModel& model, const ModelEstimateOptions& options,
                                       c10::DeviceType autocast_device = c10::kCPU);

/// Predicts one AdamW training step of the model `config` describes, built
/// on meta, as `options` asks (see ModelEstimateOptions). Under bf16
/// autocast the CPU figures follow the CPU's autocast policy and the CUDA
/// ones CUDA's; a bf16 model computes its loss in fp32 (transformers'
/// ForCausalLMLoss upcasts the logits) and keeps its AdamW state in bf16
/// (LoRA adapters in fp32, as PEFT makes them).
/// Throws c10::Error naming the value for a batch or length below 1, a length
/// past the config's positions, an unknown checkpointing name, ranks below 1, a ZeRO stage outside 0-3, or bad LoRA options
/// (apply_lora()).
TRAINMEM_API ModelEstimate estimate_model(const HfConfig& config, const ModelEstimateOptions& options);

} // namespace trainmem
