#pragma once
/// \file cs336_lm.h
/// Test support, not installed: the client the CUDA allocator model and
/// autocast on meta are held to (tests/cs336_predict_test.cpp).
/// The Transformer language model, loss and AdamW of a recorded GPU run:
/// kkaitlyn111/cs336-a2-systems (Stanford CS336, assignment 2), whose
/// cs336_systems/benchmark.py `run_memory_foward_fullstep` recorded
/// torch.cuda.memory snapshots of the "2.7b" configuration (d_model 2560,
/// d_ff 10240, 32 layers, 32 heads, vocabulary 10,000, RoPE theta 10,000,
/// batch 4, context 128/256/512) on an H100: one forward, one forward under
/// bf16 autocast, one whole first training step.
///
/// Op for op as the run's own code did it. That code is the author's
/// assignment 1 (cs336_basics/transformer.py, optimizers.py, training.py,
/// not public; the repository's cs336-basics/model.py is the course's
/// reference, which the run did not use): the snapshot frames name each
/// allocation's Python line and ATen op, and those are what this mirrors.
/// Every matmul is `einsum`; RMSNorm through `linalg_vector_norm`; softmax
/// through max / exp / sum / div; one RoPE table (cos, sin) per layer, applied
/// into a `zeros_like` output slice by slice; a causal mask built per layer
/// (ones, triu, bool, not) and compared per element; SwiGLU
/// `w2((a * sigmoid(a)) * w3(x))`; cross-entropy through max / exp / sum /
/// index / log / mean; AdamW with its state made on the first step and one
/// sqrt and one division per parameter.
///
/// Example (on meta, nothing allocated):
/// ```
/// auto p = trainmem::predict_cs336_run(trainmem::Cs336Options(), trainmem::Cs336Run::kFullStep, 4,
///     trainmem::CudaPredictOptions().cublas_workspace_bytes(trainmem::kCublasWorkspaceHopperBytes));
/// p.max_rounded_requested_bytes;   // the snapshot's allocated peak
/// ```

#include <cstdint>
#include <optional>
#include <tuple>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/optimizer.h>

#include "trainmem/cuda_predict.h"
#include "trainmem/planner.h"

namespace trainmem {

/// The model's shape. Defaults: the run's "2.7b" configuration at context 128.
struct Cs336Options {
  TORCH_ARG(int64_t, vocab_size) = 10000;
  TORCH_ARG(int64_t, context_length) = 128;
  TORCH_ARG(int64_t, d_model) = 2560;
  TORCH_ARG(int64_t, num_layers) = 32;
  TORCH_ARG(int64_t, num_heads) = 32;
  TORCH_ARG(int64_t, d_ff) = 10240;
  TORCH_ARG(double, rope_theta) = 10000.0;
  TORCH_ARG(double, eps) = 1e-5;  ///< RMSNorm's
};

/// Linear without bias: weight (d_out, d_in), `einsum("...i,oi->...o")`.
class Cs336LinearImpl : public torch::nn::Cloneable<Cs336LinearImpl> {
 public:
  Cs336LinearImpl(int64_t d_in, int64_t d_out);
  void reset() override;
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;
 private:
  int64_t d_in_, d_out_;
};
TORCH_MODULE(Cs336Linear);

/// Embedding: `weight[token_ids]` (an index, not index_select).
class Cs336EmbeddingImpl : public torch::nn::Cloneable<Cs336EmbeddingImpl> {
 public:
  Cs336EmbeddingImpl(int64_t vocab_size, int64_t d_model);
  void reset() override;
  at::Tensor forward(const at::Tensor& token_ids);
  at::Tensor weight;
 private:
  int64_t vocab_size_, d_model_;
};
TORCH_MODULE(Cs336Embedding);

/// RMSNorm: `x` upcast to float32, `norm = ||x||_2` over the last dim
/// (keepdim), `rms = sqrt(norm^2 / d + eps)`, `einsum("d,...d->...d", weight,
/// x / rms)`, cast back to the input's dtype.
class Cs336RMSNormImpl : public torch::nn::Cloneable<Cs336RMSNormImpl> {
 public:
  Cs336RMSNormImpl(int64_t d_model, double eps);
  void reset() override;
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;
 private:
  int64_t d_model_;
  double eps_;
};
TORCH_MODULE(Cs336RMSNorm);

/// Rotary embedding with its own table: buffer `cos_sin` (2, context, d_k / 2).
/// forward(x (..., T, d_k), positions (B, T)): `cos = table[0][positions]`,
/// `sin = table[1][positions]`, `out = zeros_like(x)`, then
/// `out[..., 0::2] = x1 * cos - x2 * sin` and `out[..., 1::2] = x1 * sin + x2 * cos`.
class Cs336RopeImpl : public torch::nn::Cloneable<Cs336RopeImpl> {
 public:
  Cs336RopeImpl(double theta, int64_t d_k, int64_t context_length);
  void reset() override;
  at::Tensor forward(const at::Tensor& x, const at::Tensor& positions);
  at::Tensor cos_sin;
 private:
  double theta_;
  int64_t d_k_, context_length_;
};
TORCH_MODULE(Cs336Rope);

/// Causal multi-head self-attention: q, k, v projections, heads split by
/// views, RoPE on q and k, causal mask, cs336_attention, heads merged (a
/// copy), output projection.
class Cs336AttentionImpl : public torch::nn::Cloneable<Cs336AttentionImpl> {
 public:
  explicit Cs336AttentionImpl(const Cs336Options& o);
  void reset() override;
  at::Tensor forward(const at::Tensor& x);
  Cs336Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, output_proj{nullptr};
  Cs336Rope rope{nullptr};
 private:
  Cs336Options options_;
};
TORCH_MODULE(Cs336Attention);

/// SwiGLU: `a = w1(x)`, `b = w3(x)`, `w2((a * sigmoid(a)) * b)`.
class Cs336SwiGLUImpl : public torch::nn::Cloneable<Cs336SwiGLUImpl> {
 public:
  Cs336SwiGLUImpl(int64_t d_model, int64_t d_ff);
  void reset() override;
  at::Tensor forward(const at::Tensor& x);
  Cs336Linear w1{nullptr}, w2{nullptr}, w3{nullptr};
 private:
  int64_t d_model_, d_ff_;
};
TORCH_MODULE(Cs336SwiGLU);

/// Pre-norm block: `h = ln1(x); h = attn(h); x = x + h; h = ln2(x); h =
/// ffn(h); x + h` (one local `h`, so each sublayer's input dies when the next
/// is assigned, unless autograd saved it).
class Cs336BlockImpl : public torch::nn::Cloneable<Cs336BlockImpl> {
 public:
  explicit Cs336BlockImpl(const Cs336Options& o);
  void reset() override;
  at::Tensor forward(const at::Tensor& x);
  Cs336RMSNorm ln1{nullptr};
  Cs336Attention attn{nullptr};
  Cs336RMSNorm ln2{nullptr};
  Cs336SwiGLU ffn{nullptr};
 private:
  Cs336Options options_;
};
TORCH_MODULE(Cs336Block);

/// The language model: embedding, blocks, final RMSNorm, LM head (untied).
/// Parameters in the run's order: token_embeddings, per layer ln1, q, k, v,
/// output projections, ln2, w1, w2, w3, then ln_final and lm_head.
class Cs336TransformerLMImpl : public torch::nn::Cloneable<Cs336TransformerLMImpl> {
 public:
  explicit Cs336TransformerLMImpl(const Cs336Options& o = {});
  void reset() override;
  /// token_ids (B, T) int64 -> logits (B, T, vocab_size).
  at::Tensor forward(const at::Tensor& token_ids);
  Cs336Embedding token_embeddings{nullptr};
  torch::nn::ModuleList layers{nullptr};
  Cs336RMSNorm ln_final{nullptr};
  Cs336Linear lm_head{nullptr};
  const Cs336Options& options() const { return options_; }
 private:
  Cs336Options options_;
};
TORCH_MODULE(Cs336TransformerLM);

/// Softmax over `dim`: `exp(x - max) / sum`.
at::Tensor cs336_softmax(const at::Tensor& x, int64_t dim);

/// Scaled dot-product attention: `einsum(q, k)`, divided by sqrt(d_k),
/// `masked_fill(mask == 0, -inf)` (mask (T, T) bool, true where allowed,
/// compared at the scores' shape), cs336_softmax, `einsum(p, v)`.
at::Tensor cs336_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask);

/// Mean cross-entropy of logits (B, T, V) against targets (B, T):
/// `shifted = logits - max`, `log(sum(exp(shifted))) - shifted[i, target_i]`, mean.
at::Tensor cs336_cross_entropy(const at::Tensor& logits, const at::Tensor& targets);

/// The run's AdamW hyper-parameters (lr 1e-4, betas (0.9, 0.95), eps 1e-8,
/// weight decay 0.01).
struct Cs336AdamWOptions : public torch::optim::OptimizerCloneableOptions<Cs336AdamWOptions> {
  Cs336AdamWOptions(double lr = 1e-4) : lr_(lr) {}  // NOLINT(google-explicit-constructor): as AdamWOptions
  TORCH_ARG(double, lr) = 1e-4;
  TORCH_ARG(double, beta1) = 0.9;
  TORCH_ARG(double, beta2) = 0.95;
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 0.01;
  double get_lr() const override { return lr_; }
  void set_lr(const double lr) override { lr_ = lr; }
};

/// Its per-parameter state: step, m, v.
struct Cs336AdamWParamState : public torch::optim::OptimizerCloneableParamState<Cs336AdamWParamState> {
  TORCH_ARG(int64_t, step) = 0;
  TORCH_ARG(at::Tensor, m);
  TORCH_ARG(at::Tensor, v);
};

/// The run's hand-written AdamW, op for op: on a parameter's first step
/// `m = zeros_like(p)`, `v = zeros_like(p)`; then in place `m = b1 m + (1 - b1) g`,
/// `v = b2 v + (1 - b2) g^2`; `update = m / (sqrt(v) + eps)` (a sqrt, its
/// eps added in place, a division; `update` stays alive until the next
/// parameter's replaces it, as the Python loop's local does); in place
/// `p -= lr_t update` and `p -= lr wd p`. Two temporaries per parameter,
/// nothing else allocated.
class Cs336AdamW : public torch::optim::Optimizer {
 public:
  explicit Cs336AdamW(std::vector<at::Tensor> params, Cs336AdamWOptions defaults = {});
  at::Tensor step(LossClosure closure = nullptr) override;
};

/// The model as regions for the planner (planner.h): `token_embeddings`,
/// `layers.0` ... `layers.31` (one block each), `head` (ln_final, lm_head);
/// input: `batch` x context zero tokens; loss: cs336_cross_entropy against
/// them; optimizer: Cs336AdamW (make_optimizer). `model` may be on meta.
///
/// Example:
/// ```
/// auto m = trainmem::cs336_region_model(model, 4);
/// auto plan = trainmem::plan_regions_cuda(m, *model, trainmem::PlanOptions().budget_bytes(40LL << 30),
///                                         trainmem::CudaBudgetKind::kAllocated);
/// ```
RegionModel cs336_region_model(const Cs336TransformerLM& model, int64_t batch_size);

/// What a recording covers.
enum class Cs336Run {
  kForward,   ///< `logits = model(inputs)`, kept alive
  kFullStep,  ///< zero_grad, forward, cs336_cross_entropy, backward, the first AdamW step
};

/// Builds the model on meta (MetaInitGuard: nothing allocated) and predicts
/// the recorded run on CUDA with predict_cuda_step_peak: the batch (B,
/// context) int64 resident on the device before the model's tensors, the
/// logits and the loss kept alive to the end (benchmark.py's locals),
/// first_step for kFullStep (no warm-up: the optimizer state is made inside
/// the recorded step), forward_only for kForward. `cuda` gives the
/// allocator settings and workspace sizes (the recording's H100:
/// kCublasWorkspaceHopperBytes); its resident, first_step and forward_only
/// are set here. `autocast`: the run inside `torch.autocast(dtype)` (the
/// *_mixed recordings: bfloat16): LibTorch's CUDA autocast, its casts made
/// on meta (docs/design.md, Note [Autocast on meta]).
CudaStepPrediction predict_cs336_run(const Cs336Options& model, Cs336Run run, int64_t batch_size = 4,
                                     CudaPredictOptions cuda = {},
                                     std::optional<at::ScalarType> autocast = std::nullopt);

} // namespace trainmem
