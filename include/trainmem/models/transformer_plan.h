#pragma once
/// \file transformer_plan.h
/// The reference transformer's planner adapters: the analytic activation
/// count (Korthikanti et al.), plan_checkpointing() and its CUDA forms. Each
/// is a thin client of the generic planner (planner.h, cuda_predict.h) over
/// the model's blocks as regions.
///
/// Example:
/// ```
/// trainmem::TransformerOptions o;                        // the capstone's model
/// auto plan = trainmem::plan_checkpointing(o, 16, 64, trainmem::PlanOptions().budget_bytes(40 << 20));
/// std::cout << trainmem::to_string(plan);                // blocks, peak, recompute FLOPs
/// auto y = model->forward(x, plan.checkpointing());
/// ```

#include <cstdint>
#include <string>
#include <vector>

#include <torch/arg.h>

#include "trainmem/export.h"
#include "trainmem/block_checkpointing.h"
#include "trainmem/cuda_predict.h"
#include "trainmem/models/transformer.h"
#include "trainmem/planner.h"

namespace trainmem {

// ---------------------------------------------------------------------------
// The analytic activation model

/// The setting of an analytic activation count.
///
/// Example:
/// ```
/// auto fp16 = trainmem::AnalyticActivationOptions::korthikanti();   // 34 s b h + 5 a s^2 b
/// ```
struct AnalyticActivationOptions {
  /// Korthikanti et al.'s setting: fp16, dropout, eager attention.
  static AnalyticActivationOptions korthikanti() {
    return AnalyticActivationOptions().element_bytes(2).dropout(true).flash_attention(false);
  }

  /// Bytes per activation element: 4 (fp32), 2 (fp16 / bf16).
  TORCH_ARG(int64_t, element_bytes) = 4;
  /// Dropout after attention's softmax, the projection and the MLP: 1-byte
  /// masks are saved (and the dropped attention probabilities).
  TORCH_ARG(bool, dropout) = false;
  /// Fused (flash-style) attention: the (B, H, T, T) scores are recomputed in
  /// backward, not saved.
  TORCH_ARG(bool, flash_attention) = true;

};

/// An analytic activation count with its terms shown. Plain data.
struct AnalyticActivations {
  /// What each term is and its bytes over all layers (term bytes sum to total_bytes).
  std::vector<ActivationTerm> terms;
  int64_t per_layer_bytes = 0; ///< one block, in bytes
  int64_t total_bytes = 0;     ///< all blocks, in bytes
  /// The formula with its values, e.g. "s b h (16 x 4 B) = 8,388,608 B per layer".
  std::string formula;
};

/// Per-layer saved activations of the reference block under `options`, over
/// `model.num_layers()` layers, for an input of `batch` sequences of
/// `seq_len` tokens, with s, b, h, a = seq_len, batch, d_model, num_heads: (16 e + 2 [masks]) s b h + a s^2 b (e [softmax] + 1 + e
/// [dropout mask and output]) bytes, e the element size. Korthikanti et al.'s
/// 34 s b h + 5 a s^2 b at e = 2 with dropout and eager attention; the
/// first-order 64 s b h at e = 4, no dropout, fused attention (50,331,648 B for the
/// capstone). Not counted (see estimate_activation_bytes for the exact count):
/// LayerNorm's mean and rstd, fused attention's log-sum-exp, the loss.
TRAINMEM_API AnalyticActivations analytic_activation_bytes(
    const TransformerOptions& model,
    int64_t batch,
    int64_t seq_len,
    const AnalyticActivationOptions& options = {});

// ---------------------------------------------------------------------------
// Planning the reference transformer

/// Chooses, per block, store / checkpoint / selective (which op outputs to
/// cache) so the predicted peak of a training step of the reference
/// Transformer on a (batch, seq_len, d_model) input (forward, loss
/// out.pow(2).mean(), backward, AdamW step) fits
/// `options.budget_bytes()` at the least recompute cost.
///
/// Each block choice is profiled once on meta (its stored bytes, forward
/// peak, backward transient and recompute cost); selective candidates are
/// the prefixes of the block's op calls ranked by recompute cost per byte
/// saved (a greedy knapsack, as PyTorch's SAC estimator ranks ops); dynamic
/// programs over the blocks (states: bytes stored so far, on 2-D staircases
/// of (stored, peak) and (stored, cost)) find the smallest reachable peak and
/// the cheapest plan whose every phase fits. Ties in cost go to the smaller
/// peak, so raising the budget never raises the recompute cost and lowering
/// it never raises the peak, while the search is exact (bucket_bytes == 0;
/// past 4,096 states at a boundary it buckets stored bytes, see
/// CheckpointPlan::bucket_bytes). A budget no plan meets gives
/// feasible = false with the smallest reachable peak and its cost.
/// `adamw`: the step includes an AdamW step (its state, 8 B per parameter,
/// is live all step, and its transients count). plan_regions() over the
/// model's blocks, each region named "block".
TRAINMEM_API CheckpointPlan plan_checkpointing(const TransformerOptions& model, int64_t batch, int64_t seq_len,
                                               const PlanOptions& options = {}, bool adamw = true);

/// The reference Transformer's training step on CUDA on a (batch, seq_len,
/// d_model) input (forward with
/// `checkpointing`, loss out.pow(2).mean(), backward, an AdamW step when
/// `adamw`), predicted with predict_cuda_step_peak from a model built on meta.
///
/// Example:
/// ```
/// auto p = trainmem::predict_cuda_transformer_step(trainmem::TransformerOptions(), 16, 64,
///                                                  trainmem::BlockCheckpointing::named(6, "full"));
/// p.max_memory_allocated_bytes;
/// ```
TRAINMEM_API CudaStepPrediction predict_cuda_transformer_step(
    const TransformerOptions& model,
    int64_t batch,
    int64_t seq_len,
    const BlockCheckpointing& checkpointing,
    bool adamw = true,
    const CudaPredictOptions& options = {});

/// plan_checkpointing() for a CUDA budget: plans against the CPU peak model,
/// predicts the plan's CUDA step, and while the CUDA peak of `kind` exceeds
/// the budget plans again for a CPU peak that much under the last plan's (or
/// the last planner budget, if lower), at most 8 rounds.
/// `options.budget_bytes()` is the CUDA budget. plan_regions_cuda() over
/// the model's blocks.
///
/// Example:
/// ```
/// auto p = trainmem::plan_checkpointing_cuda(o, 16, 64, trainmem::PlanOptions().budget_bytes(64 << 20),
///                                            trainmem::CudaBudgetKind::kReserved);
/// ```
TRAINMEM_API CudaCheckpointPlan plan_checkpointing_cuda(
    const TransformerOptions& model,
    int64_t batch,
    int64_t seq_len,
    const PlanOptions& options,
    CudaBudgetKind kind,
    const CudaPredictOptions& cuda = {},
    bool adamw = true);

} // namespace trainmem
