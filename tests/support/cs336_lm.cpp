#include "cs336_lm.h"

#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include "trainmem/meta.h"

// Note [The CS336 run's code]
// Each function below mirrors the lines of the run's Python that the
// snapshot frames name (transformer.py, training.py, optimizers.py of the
// author's assignment 1), in the same order and with the same lifetimes:
// a Python local lives until its name is rebound or its function returns,
// so a C++ local is kept (or rebound) at the same point. What is allocated
// and when follows from that and from autograd's saved tensors; C++
// temporaries of one full expression die at its end, so expressions whose
// frees the trace shows one op apart are split into statements.

namespace trainmem {

namespace {

// nn.init.trunc_normal_(std, a = -3 std, b = 3 std); a no-op on meta.
void trunc_normal(at::Tensor& t, double stddev) {
  at::NoGradGuard no_grad;
  t.normal_(0.0, stddev).clamp_(-3.0 * stddev, 3.0 * stddev);
}

} // namespace


// ---- Linear (transformer.py:22: einsum) ----

Cs336LinearImpl::Cs336LinearImpl(int64_t d_in, int64_t d_out) : d_in_(d_in), d_out_(d_out) {
  TORCH_CHECK(d_in > 0 && d_out > 0, "Cs336Linear: dimensions must be positive, but got ", d_in, " and ", d_out);
  reset();
}

void Cs336LinearImpl::reset() {
  weight = register_parameter("weight", at::empty({d_out_, d_in_}));
  trunc_normal(weight, std::sqrt(2.0 / static_cast<double>(d_in_ + d_out_)));
}

// Note [einsum across LibTorch versions]
// The run wrote the weight first, einsum("oi,...i->...o", W, x) (the frames
// show it: the weight's gradient comes out of bmm without the clone
// AccumulateGrad makes of a transposed one). Torch 2.6, which recorded it,
// contracts that as bmm(W (1, o, i), x^T (1, i, N)) and permutes the (o, N)
// result into a transposed (..., o) view; LibTorch 2.7+ swaps the operands of
// such a pair (sumproduct_pair's swap_lo_ro) into bmm(x, W^T), whose weight
// gradient is transposed and cloned. Asking for the output as "o..." keeps
// 2.6's order in every version; movedim makes the same view 2.6 returned.
at::Tensor Cs336LinearImpl::forward(const at::Tensor& x) {
  return at::einsum("oi,...i->o...", {weight, x}).movedim(0, -1);
}

// ---- Embedding (transformer.py:39: weight[token_ids]) ----

Cs336EmbeddingImpl::Cs336EmbeddingImpl(int64_t vocab_size, int64_t d_model)
    : vocab_size_(vocab_size), d_model_(d_model) {
  TORCH_CHECK(vocab_size > 0 && d_model > 0, "Cs336Embedding: dimensions must be positive");
  reset();
}

void Cs336EmbeddingImpl::reset() {
  weight = register_parameter("weight", at::empty({vocab_size_, d_model_}));
  trunc_normal(weight, 1.0);
}

at::Tensor Cs336EmbeddingImpl::forward(const at::Tensor& token_ids) {
  return weight.index({token_ids});
}

// ---- RMSNorm (transformer.py:54-57) ----

Cs336RMSNormImpl::Cs336RMSNormImpl(int64_t d_model, double eps) : d_model_(d_model), eps_(eps) {
  TORCH_CHECK(d_model > 0, "Cs336RMSNorm: d_model must be positive, but got ", d_model);
  reset();
}

void Cs336RMSNormImpl::reset() {
  weight = register_parameter("weight", at::ones({d_model_}));
}

at::Tensor Cs336RMSNormImpl::forward(const at::Tensor& input) {
  const auto in_dtype = input.scalar_type();
  const at::Tensor x = input.to(at::kFloat);  // the upcast (the residual stream is float32 already)
  at::Tensor norm = at::linalg_vector_norm(x, 2, at::IntArrayRef{-1}, /*keepdim=*/true);  // 54
  at::Tensor rms = norm.pow(2);                                           // 55: pow,
  rms = rms / static_cast<double>(d_model_);                                             //     div,
  rms = rms + eps_;                                                                      //     add,
  rms = at::sqrt(rms);                                                                   //     sqrt
  at::Tensor normed = x / rms;                                                           // 56
  at::Tensor out = at::einsum("d,...d->...d", {weight, normed});                      // 57: a mul
  return out.to(in_dtype);                                                               // 59
}

// ---- RoPE (transformer.py:117-127), one table per layer ----

Cs336RopeImpl::Cs336RopeImpl(double theta, int64_t d_k, int64_t context_length)
    : theta_(theta), d_k_(d_k), context_length_(context_length) {
  TORCH_CHECK(d_k > 0 && d_k % 2 == 0, "Cs336Rope: d_k must be positive and even, but got ", d_k);
  TORCH_CHECK(context_length > 0, "Cs336Rope: context_length must be positive, but got ", context_length);
  reset();
}

void Cs336RopeImpl::reset() {
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor inv = at::pow(theta_, at::arange(0, d_k_, 2, f32) / static_cast<double>(-d_k_));  // (d_k / 2)
  at::Tensor angles = at::outer(at::arange(context_length_, f32), inv);                         // (T, d_k / 2)
  cos_sin = register_buffer("cos_sin", at::stack({at::cos(angles), at::sin(angles)}));           // (2, T, d_k / 2)
}

at::Tensor Cs336RopeImpl::forward(const at::Tensor& x, const at::Tensor& positions) {
  // x (B, H, T, d_k); positions (B, T).
  at::Tensor cos = cos_sin.select(0, 0).index({positions}).unsqueeze(1);  // 117: (B, 1, T, d_k / 2)
  at::Tensor sin = cos_sin.select(0, 1).index({positions}).unsqueeze(1);  // 118
  const at::Tensor x1 = x.slice(-1, 0, std::nullopt, 2);
  const at::Tensor x2 = x.slice(-1, 1, std::nullopt, 2);
  at::Tensor out = at::zeros_like(x);  // 125 (x's strides)
  {                                    // 126
    at::Tensor a = x1 * cos;
    at::Tensor b = x2 * sin;
    out.slice(-1, 0, std::nullopt, 2).copy_(a - b);
  }
  {  // 127
    at::Tensor a = x1 * sin;
    at::Tensor b = x2 * cos;
    out.slice(-1, 1, std::nullopt, 2).copy_(a + b);
  }
  return out;
}

// ---- Softmax and attention (transformer.py:135-154) ----

at::Tensor cs336_softmax(const at::Tensor& x, int64_t dim) {
  at::Tensor max = std::get<0>(at::max(x, dim, /*keepdim=*/true));  // 135
  at::Tensor e = at::exp(x - max);                    // 138
  at::Tensor sum = e.sum(dim, /*keepdim=*/true);      // 140
  return e / sum;                                                    // 142
}

at::Tensor cs336_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask) {
  at::Tensor scores = at::einsum("...qd,...kd->...qk", {q, k});                // 147
  scores = scores / std::sqrt(static_cast<double>(q.size(-1)));                   // 148
  at::Tensor masked_out = at::eq(mask.expand_as(scores), 0);                      // 151
  scores = scores.masked_fill(masked_out, -std::numeric_limits<double>::infinity());
  at::Tensor probs = cs336_softmax(scores, -1);                                   // 153
  return at::einsum("...qk,...kd->...qd", {probs, v});                          // 154
}

// ---- Multi-head self-attention (transformer.py:188-212) ----

Cs336AttentionImpl::Cs336AttentionImpl(const Cs336Options& o) : options_(o) {
  TORCH_CHECK(o.num_heads() > 0 && o.d_model() % o.num_heads() == 0,
              "Cs336Attention: d_model (", o.d_model(), ") must be a multiple of num_heads (", o.num_heads(), ")");
  reset();
}

void Cs336AttentionImpl::reset() {
  const int64_t d = options_.d_model();
  q_proj = register_module("q_proj", Cs336Linear(d, d));
  k_proj = register_module("k_proj", Cs336Linear(d, d));
  v_proj = register_module("v_proj", Cs336Linear(d, d));
  output_proj = register_module("output_proj", Cs336Linear(d, d));
  rope = register_module("rope", Cs336Rope(options_.rope_theta(), d / options_.num_heads(),
                                           options_.context_length()));
}

at::Tensor Cs336AttentionImpl::forward(const at::Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1), d = options_.d_model(), H = options_.num_heads();
  const at::Tensor q = q_proj->forward(x);  // 188
  const at::Tensor k = k_proj->forward(x);  // 189
  const at::Tensor v = v_proj->forward(x);  // 190
  // "b t (h d) -> b h t d": views.
  const at::Tensor qh = q.view({B, T, H, d / H}).transpose(1, 2);
  const at::Tensor kh = k.view({B, T, H, d / H}).transpose(1, 2);
  const at::Tensor vh = v.view({B, T, H, d / H}).transpose(1, 2);
  const at::Tensor positions = at::arange(T, x.options().dtype(at::kLong)).unsqueeze(0).expand({B, T});  // 199
  const at::Tensor q_rot = rope->forward(qh, positions);  // 200
  const at::Tensor k_rot = rope->forward(kh, positions);  // 201
  at::Tensor mask = at::ones({T, T}, x.options());        // 204
  mask = at::triu(mask, 1);
  mask = mask.to(at::kBool);
  mask = at::bitwise_not(mask);                            // 205: true where attending is allowed
  at::Tensor out = cs336_attention(q_rot, k_rot, vh, mask);  // 208
  out = out.transpose(1, 2).reshape({B, T, d});              // 211: "b h t d -> b t (h d)", a copy
  return output_proj->forward(out);                          // 212
}

// ---- SwiGLU (transformer.py:76-80) ----

Cs336SwiGLUImpl::Cs336SwiGLUImpl(int64_t d_model, int64_t d_ff) : d_model_(d_model), d_ff_(d_ff) {
  reset();
}

void Cs336SwiGLUImpl::reset() {
  w1 = register_module("w1", Cs336Linear(d_model_, d_ff_));
  w2 = register_module("w2", Cs336Linear(d_ff_, d_model_));
  w3 = register_module("w3", Cs336Linear(d_model_, d_ff_));
}

at::Tensor Cs336SwiGLUImpl::forward(const at::Tensor& x) {
  at::Tensor a = w1->forward(x);            // 76
  at::Tensor b = w3->forward(x);            // 77
  at::Tensor sig = at::sigmoid(a);          // 78
  at::Tensor silu = a * sig;
  at::Tensor gated = silu * b;              // 79
  return w2->forward(gated);                // 80
}

// ---- Block (transformer.py:243-250) ----

Cs336BlockImpl::Cs336BlockImpl(const Cs336Options& o) : options_(o) {
  reset();
}

void Cs336BlockImpl::reset() {
  ln1 = register_module("ln1", Cs336RMSNorm(options_.d_model(), options_.eps()));
  attn = register_module("attn", Cs336Attention(options_));
  ln2 = register_module("ln2", Cs336RMSNorm(options_.d_model(), options_.eps()));
  ffn = register_module("ffn", Cs336SwiGLU(options_.d_model(), options_.d_ff()));
}

at::Tensor Cs336BlockImpl::forward(const at::Tensor& x) {
  at::Tensor h = ln1->forward(x);     // 243
  h = attn->forward(h);               // 244: ln1's output dies here unless saved
  at::Tensor x1 = x + h;              // 245
  h = ln2->forward(x1);               // 248: the attention's output dies here
  h = ffn->forward(h);                // 249
  return x1 + h;                      // 250
}

// ---- The language model (transformer.py:288-298) ----

Cs336TransformerLMImpl::Cs336TransformerLMImpl(const Cs336Options& o) : options_(o) {
  TORCH_CHECK(o.vocab_size() > 0 && o.context_length() > 0 && o.d_model() > 0 && o.num_layers() >= 0 &&
                  o.d_ff() > 0,
              "Cs336TransformerLM: sizes must be positive");
  reset();
}

void Cs336TransformerLMImpl::reset() {
  token_embeddings = register_module("token_embeddings", Cs336Embedding(options_.vocab_size(), options_.d_model()));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < options_.num_layers(); ++i) {
    layers->push_back(Cs336Block(options_));
  }
  ln_final = register_module("ln_final", Cs336RMSNorm(options_.d_model(), options_.eps()));
  lm_head = register_module("lm_head", Cs336Linear(options_.d_model(), options_.vocab_size()));
}

at::Tensor Cs336TransformerLMImpl::forward(const at::Tensor& token_ids) {
  TORCH_CHECK(token_ids.dim() == 2 && token_ids.size(1) <= options_.context_length(),
              "Cs336TransformerLM: token_ids must be (batch, T) with T <= ", options_.context_length(),
              ", but got ", token_ids.sizes());
  at::Tensor x = token_embeddings->forward(token_ids);  // 288
  for (const auto& layer : *layers) {                   // 292
    x = layer->as<Cs336BlockImpl>()->forward(x);
  }
  x = ln_final->forward(x);   // 295
  return lm_head->forward(x); // 298
}

// ---- Cross-entropy (training.py:21-33) ----

at::Tensor cs336_cross_entropy(const at::Tensor& logits, const at::Tensor& targets) {
  TORCH_CHECK(logits.dim() >= 1 && targets.numel() * logits.size(-1) == logits.numel(),
              "cs336_cross_entropy: logits ", logits.sizes(), " and targets ", targets.sizes(), " do not match");
  const int64_t V = logits.size(-1), N = targets.numel();
  at::Tensor max = std::get<0>(logits.max(-1, /*keepdim=*/true));  // 21
  at::Tensor shifted = logits - max;                               // 22
  at::Tensor e = at::exp(shifted);                  // 25
  at::Tensor sum = e.sum(-1, /*keepdim=*/true);     // 26
  // 29: shifted[arange(N), targets]; the run's arange is a CPU tensor, which
  // the index copies to the device for the kernel only (a temporary).
  at::Tensor target_logits = shifted.reshape({N, V}).index({at::arange(N, at::TensorOptions().dtype(at::kLong)),
                                                             targets.reshape({N})});
  at::Tensor losses = at::log(sum).reshape({N});    // 31
  losses = losses - target_logits;
  return losses.mean();                                            // 33
}

// ---- AdamW (optimizers.py:82-100) ----

Cs336AdamW::Cs336AdamW(std::vector<at::Tensor> params, Cs336AdamWOptions defaults)
    : torch::optim::Optimizer({torch::optim::OptimizerParamGroup(std::move(params))},
                              std::make_unique<Cs336AdamWOptions>(defaults)) {
  TORCH_CHECK(defaults.lr() >= 0 && defaults.eps() >= 0 && defaults.weight_decay() >= 0,
              "Cs336AdamW: lr, eps and weight_decay must be >= 0");
  TORCH_CHECK(defaults.beta1() >= 0 && defaults.beta1() < 1 && defaults.beta2() >= 0 && defaults.beta2() < 1,
              "Cs336AdamW: betas must be in [0, 1)");
}

at::Tensor Cs336AdamW::step(LossClosure closure) {
  at::NoGradGuard no_grad;
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode enable(true);
    loss = closure();
  }
  at::Tensor update;  // the loop's local: alive until the next parameter's replaces it
  for (auto& group : param_groups_) {
    const auto& o = static_cast<const Cs336AdamWOptions&>(group.options());
    for (auto& p : group.params()) {
      if (!p.grad().defined()) {
        continue;
      }
      const at::Tensor& g = p.grad();
      auto& slot = state_[p.unsafeGetTensorImpl()];
      if (!slot) {
        auto st = std::make_unique<Cs336AdamWParamState>();
        st->m(at::zeros_like(p));  // 82
        st->v(at::zeros_like(p));  // 84
        slot = std::move(st);
      }
      auto& st = static_cast<Cs336AdamWParamState&>(*slot);
      st.step(st.step() + 1);
      const auto t = static_cast<double>(st.step());
      st.m().mul_(o.beta1()).add_(g, 1.0 - o.beta1());
      st.v().mul_(o.beta2()).addcmul_(g, g, 1.0 - o.beta2());
      const double lr_t = o.lr() * std::sqrt(1.0 - std::pow(o.beta2(), t)) / (1.0 - std::pow(o.beta1(), t));
      update = st.m() / at::sqrt(st.v()).add_(o.eps());  // 100
      p.add_(update, -lr_t);
      p.mul_(1.0 - o.lr() * o.weight_decay());
    }
  }
  return loss;
}

// ---- Regions for the planner ----

RegionModel cs336_region_model(const Cs336TransformerLM& model, int64_t batch_size) {
  TORCH_CHECK(model.ptr() != nullptr, "cs336_region_model: no model");
  TORCH_CHECK(batch_size >= 1, "cs336_region_model: expected a batch >= 1, but got ", batch_size);
  using Modules = std::vector<std::shared_ptr<torch::nn::Module>>;
  auto lm = model.ptr();
  RegionModel m;
  m.regions.emplace_back(
      "token_embeddings", [lm](const at::Tensor& tokens) { return lm->token_embeddings->forward(tokens); },
      Modules{lm->token_embeddings.ptr()});
  for (size_t i = 0; i < lm->layers->size(); ++i) {
    auto block = std::dynamic_pointer_cast<Cs336BlockImpl>(lm->layers->ptr(i));
    m.regions.emplace_back(
        "layers." + std::to_string(i), [block](const at::Tensor& h) { return block->forward(h); }, Modules{block});
  }
  m.regions.emplace_back(
      "head", [lm](const at::Tensor& h) { return lm->lm_head->forward(lm->ln_final->forward(h)); },
      Modules{lm->ln_final.ptr(), lm->lm_head.ptr()});
  const int64_t context = lm->options().context_length();
  m.input = [batch_size, context](c10::Device device) {
    return at::zeros({batch_size, context}, at::TensorOptions().dtype(at::kLong).device(device));
  };
  m.loss = [](const at::Tensor& logits) {
    return cs336_cross_entropy(logits, at::zeros({logits.size(0), logits.size(1)}, logits.options().dtype(at::kLong)));
  };
  m.make_optimizer = [](std::vector<at::Tensor> params) -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<Cs336AdamW>(std::move(params));
  };
  return m;
}

// ---- The recorded runs ----

CudaStepPrediction predict_cs336_run(const Cs336Options& model_options, Cs336Run run, int64_t batch_size,
                                     CudaPredictOptions cuda, std::optional<at::ScalarType> autocast) {
  TORCH_CHECK(batch_size > 0, "predict_cs336_run: batch_size must be positive, but got ", batch_size);
  // The autocast region spans the recording, as torch.autocast("cuda", dtype)
  // did: LibTorch's own CUDA autocast, its casts made on meta (Note
  // [Autocast on meta]); its weight cache lives to the forward's end.
  struct Region {
    bool on = false;
    ~Region() {
      if (on) {
        at::autocast::set_autocast_enabled(at::kCUDA, false);
        at::autocast::clear_cache();
      }
    }
  } region;
  if (autocast) {
    TORCH_CHECK(*autocast == at::kBFloat16 || *autocast == at::kHalf,
                "predict_cs336_run: the autocast dtype must be bfloat16 or float16, but got ", *autocast);
    at::autocast::set_autocast_dtype(at::kCUDA, *autocast);
    at::autocast::set_autocast_enabled(at::kCUDA, true);
    region.on = true;
  }
  Cs336TransformerLM model{nullptr};
  {
    MetaInitGuard meta;
    model = Cs336TransformerLM(model_options);
  }
  const at::Tensor batch = at::empty({batch_size, model_options.context_length()},
                                     at::TensorOptions().dtype(at::kLong).device(at::kMeta));
  cuda.resident({batch}).forward_only(run == Cs336Run::kForward).first_step(run == Cs336Run::kFullStep);
  if (run == Cs336Run::kForward) {
    return predict_cuda_step_peak(*model, [&] { return model->forward(batch); }, nullptr, cuda);
  }
  Cs336AdamW optimizer(model->parameters());
  at::Tensor logits;  // benchmark.py's locals: alive through backward and the step
  at::Tensor loss;
  auto p = predict_cuda_step_peak(
      *model,
      [&] {
        logits = model->forward(batch);
        loss = cs336_cross_entropy(logits, batch);
        return loss;
      },
      &optimizer, cuda);
  return p;
}

} // namespace trainmem
