#pragma once
/// \file trainer.h
/// The bundled, audited training loop behind `trainmem audit`: the reference
/// transformer (transformer.h) trained for a few steps with a chosen
/// optimizer, precision, checkpointing, offload, optimizer-in-backward and
/// gradient accumulation, every step audited (audit.h). Each memory lever
/// (precision, checkpoint, accumulation) shows its memory and time.
///
/// Example:
/// ```
/// auto run = trainmem::train(trainmem::TrainerOptions().checkpoint("every_2").steps(2));
/// std::cout << trainmem::to_text(run.report);
/// ```

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include "trainmem/report.h"
#include "trainmem/timeline.h"
#include "trainmem/models/estimate.h"
#include "trainmem/models/transformer.h"
#include "app/variants.h"

namespace trainmem {


/// What `train()` runs. Defaults: the reference transformer (6 pre-LN
/// blocks, d_model 128, 4 heads, input (16, 64, 128)) with AdamW.
struct TrainerOptions {
  TORCH_ARG(TransformerOptions, model) = {};
  /// B of the input (batch, seq_len, d_model): sequences per step (a
  /// data-parallel run's global batch, split evenly across ranks).
  TORCH_ARG(int64_t, batch) = kReferenceBatch;
  TORCH_ARG(int64_t, seq_len) = kReferenceSeqLen;  ///< T of the input: tokens per sequence
  /// "adamw", "adam" or "sgd" (momentum 0.9).
  TORCH_ARG(std::string, optimizer) = "adamw";
  TORCH_ARG(double, lr) = 1e-3;
  TORCH_ARG(Precision, precision) = Precision::kFp32;
  /// "cpu" or "cuda[:i]".
  TORCH_ARG(std::string, device) = "cpu";
  /// Audited steps (the first also creates the optimizer state).
  TORCH_ARG(int64_t, steps) = 2;
  /// "none", "full", "every_<k>" (every k-th block) or "selective" (save matmuls).
  TORCH_ARG(std::string, checkpoint) = "none";
  /// Keep saved activations on the CPU (SaveOnCpuGuard; a no-op on CPU).
  TORCH_ARG(bool, offload) = false;
  /// Step each parameter inside backward (OptimizerInBackward).
  TORCH_ARG(bool, optimizer_in_backward) = false;
  /// Micro-batches per step; the batch is split into this many equal parts.
  TORCH_ARG(int64_t, accumulation) = 1;
  /// Seed of the weights and the data.
  TORCH_ARG(uint64_t, seed) = 0;
  /// Record the allocator timeline (CPU).
  TORCH_ARG(bool, timeline) = true;
  /// Which steps meter saved tensors (AuditOptions::meter_every): 0, the
  /// steps that differ; n, every n-th.
  TORCH_ARG(int64_t, meter_every) = 0;
  /// Copy the first step's gradients into TrainingRun::grads (after the
  /// step, so the copies are not in its figures). Not with optimizer_in_backward.
  TORCH_ARG(bool, keep_grads) = false;
  /// CUDA: let cuBLAS and cuDNN use TF32 for fp32 matmuls and convolutions
  /// (PyTorch's default is off for matmuls); recorded in the report's config
  /// as "tf32". No effect on the CPU.
  TORCH_ARG(bool, tf32) = false;
};

/// Throws c10::Error naming the first bad value of `options` (sizes, names,
/// a batch that does not split into `accumulation` parts, a device this
/// LibTorch lacks).
void check_trainer_options(const TrainerOptions& options);

/// A finished run.
struct TrainingRun {
  AuditReport report;               ///< the audit of every step
  Timeline timeline;                ///< the raw classified events (CPU)
  std::vector<at::Tensor> grads;    ///< with keep_grads: the first step's gradients (fp32, CPU), in parameters() order
  std::vector<double> losses;       ///< the loss of each step
};

/// Trains and audits. `on_step(step, num_steps)` is called after each step
/// (progress lines). Throws c10::Error on bad options, before any work.
TrainingRun train(
    const TrainerOptions& options,
    const std::function<void(int64_t, int64_t)>& on_step = {});

class Audit;

namespace detail {

/// What train() and each data-parallel rank (distributed_trainer.cpp) set up
/// alike, defined in trainer.cpp. The parameters' dtype: bf16 for
/// Precision::kBf16, else fp32.
at::ScalarType trainer_dtype(const TrainerOptions& options);
/// The reference transformer of `options.model()`, built after seeding with
/// options.seed(), on `device` in trainer_dtype().
Transformer make_trainer_model(const TrainerOptions& options, c10::Device device);
/// The settings both loops report first, in this order: layers, d_model,
/// heads, batch (`batch`: a rank gives its shard's), seq_len, optimizer,
/// precision.
void set_model_config(Audit& audit, const TrainerOptions& options, int64_t batch);
/// The trainers' optimizers by name: "adamw", "adam", else SGD with momentum
/// 0.9 (train(), each data-parallel rank, and `trainmem estimate`'s step on
/// meta).
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& name, std::vector<at::Tensor> params,
                                                        double lr);

} // namespace detail

} // namespace trainmem
