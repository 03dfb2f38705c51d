#include "trainmem/transformer.h"

#include <algorithm>
#include <optional>

#include <ATen/TensorOperators.h>
#include <ATen/ops/abs.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/max.h>
#include <ATen/ops/mean.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <c10/util/Exception.h>
#include <torch/nn/options/linear.h>
#include <torch/nn/options/normalization.h>
#include <torch/optim/adamw.h>

#include "trainmem/allocator.h"
#include "trainmem/optimizer_in_backward.h"

namespace trainmem {

TransformerBlockImpl::TransformerBlockImpl(int64_t d_model_, int64_t num_heads_)
    : d_model(d_model_), num_heads(num_heads_) {
  reset();
}

void TransformerBlockImpl::reset() {
  TORCH_CHECK(d_model > 0, "TransformerBlock: expected d_model > 0, but got ", d_model);
  TORCH_CHECK(num_heads > 0 && d_model % num_heads == 0,
              "TransformerBlock: expected num_heads to divide d_model (", d_model,
              "), but got num_heads = ", num_heads);
  using torch::nn::LayerNormOptions;
  ln1 = register_module("ln1", torch::nn::LayerNorm(LayerNormOptions({d_model})));
  qkv = register_module("qkv", torch::nn::Linear(d_model, 3 * d_model));
  proj = register_module("proj", torch::nn::Linear(d_model, d_model));
  ln2 = register_module("ln2", torch::nn::LayerNorm(LayerNormOptions({d_model})));
  fc1 = register_module("fc1", torch::nn::Linear(d_model, 4 * d_model));
  fc2 = register_module("fc2", torch::nn::Linear(4 * d_model, d_model));
}

torch::Tensor TransformerBlockImpl::forward(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 3 && x.size(2) == d_model,
              "TransformerBlock: expected input of shape (B, T, ", d_model,
              "), but got ", x.sizes());
  const int64_t B = x.size(0), T = x.size(1), hd = d_model / num_heads;
  // (B, T, 3d) -> (B, T, 3, H, hd) -> 3 x (B, H, T, hd): views of one buffer.
  auto qkv_out = qkv->forward(ln1->forward(x)).view({B, T, 3, num_heads, hd});
  auto q = qkv_out.select(2, 0).transpose(1, 2);
  auto k = qkv_out.select(2, 1).transpose(1, 2);
  auto v = qkv_out.select(2, 2).transpose(1, 2);
  auto attn = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
  // (B, H, T, hd) -> (B, T, d)
  auto h = x + proj->forward(attn.transpose(1, 2).reshape({B, T, d_model}));
  return h + fc2->forward(at::gelu(fc1->forward(ln2->forward(h))));
}

TransformerImpl::TransformerImpl(TransformerOptions options_) : options(options_) {
  reset();
}

void TransformerImpl::reset() {
  TORCH_CHECK(options.num_layers() > 0,
              "Transformer: expected num_layers > 0, but got ", options.num_layers());
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < options.num_layers(); ++i) {
    blocks->push_back(TransformerBlock(options.d_model(), options.num_heads()));
  }
}

torch::Tensor TransformerImpl::forward(torch::Tensor x) {
  for (const auto& b : *blocks) {
    x = b->as<TransformerBlockImpl>()->forward(x);
  }
  return x;
}

torch::Tensor TransformerImpl::forward(torch::Tensor x, const BlockCheckpointing& plan) {
  TORCH_CHECK(static_cast<int64_t>(plan.blocks.size()) == options.num_layers(),
              "Transformer::forward: the checkpoint plan '", plan.name, "' has ",
              plan.blocks.size(), " blocks, but the model has ", options.num_layers());
  TORCH_CHECK(plan.region_length.empty() || plan.region_length.size() == plan.blocks.size(),
              "Transformer::forward: the plan '", plan.name, "' has ", plan.region_length.size(),
              " region lengths, expected 0 or ", plan.blocks.size());
  const int64_t L = options.num_layers();
  for (int64_t i = 0; i < L;) {
    const int64_t k = plan.region_length.empty() ? 1 : std::max<int64_t>(1, plan.region_length[i]);
    if (!plan.blocks[i]) {
      x = block(i)->forward(x);
      ++i;
    } else if (k == 1) {
      x = checkpoint(block(i), x, plan.options_for(i));
      ++i;
    } else {
      TORCH_CHECK(i + k <= L, "Transformer::forward: the region of ", k, " blocks at block ", i,
                  " of plan '", plan.name, "' runs past the last block (", L, ")");
      std::vector<TransformerBlock> region;
      for (int64_t j = i; j < i + k; ++j) {
        region.push_back(block(j));
      }
      x = checkpoint(
          [region](const at::Tensor& t) mutable {
            at::Tensor y = t;
            for (auto& b : region) {
              y = b->forward(y);
            }
            return y;
          },
          x, plan.options_for(i));
      i += k;
    }
  }
  return x;
}

BlockCheckpointing BlockCheckpointing::none(int64_t n) {
  return chosen(n, {});
}

BlockCheckpointing BlockCheckpointing::full(int64_t n) {
  auto p = every(n, 1);
  p.name = "full";
  return p;
}

BlockCheckpointing BlockCheckpointing::every(int64_t n, int64_t k) {
  TORCH_CHECK(k >= 1, "BlockCheckpointing::every: expected k >= 1, but got ", k);
  std::vector<int64_t> which;
  for (int64_t i = 0; i < n; i += k) {
    which.push_back(i);
  }
  auto p = chosen(n, which);
  p.name = "every_" + std::to_string(k);
  return p;
}

BlockCheckpointing BlockCheckpointing::selective(int64_t n, SelectivePolicy policy) {
  auto p = full(n);
  p.options.context_fn(create_selective_checkpoint_contexts(std::move(policy)));
  p.name = "selective";
  return p;
}

BlockCheckpointing BlockCheckpointing::chosen(int64_t n, const std::vector<int64_t>& which) {
  TORCH_CHECK(n >= 1, "BlockCheckpointing: expected num_layers >= 1, but got ", n);
  BlockCheckpointing p;
  p.blocks.assign(n, false);
  for (auto i : which) {
    TORCH_CHECK(i >= 0 && i < n, "BlockCheckpointing: block ", i, " is out of range [0, ", n, ")");
    p.blocks[i] = true;
  }
  p.name = which.empty() ? "none" : "chosen";
  return p;
}

BlockCheckpointing BlockCheckpointing::segments(int64_t n, int64_t num_segments) {
  TORCH_CHECK(num_segments >= 1 && num_segments <= n,
              "BlockCheckpointing::segments: expected 1 <= num_segments <= ", n,
              " (the number of blocks), but got ", num_segments);
  auto p = none(n);
  p.region_length.assign(n, 1);
  const int64_t size = n / num_segments;
  for (int64_t s = 0, begin = 0; s + 1 < num_segments; ++s, begin += size) {
    p.blocks[begin] = true;
    p.region_length[begin] = size;
  }
  p.name = "segments_" + std::to_string(num_segments);
  return p;
}

BlockCheckpointing BlockCheckpointing::sqrt(int64_t n) {
  auto p = segments(n, sqrt_segments(n));
  p.name = "sqrt";
  return p;
}

BlockCheckpointing BlockCheckpointing::named(int64_t n, const std::string& name) {
  if (name == "none") {
    return none(n);
  }
  if (name == "full") {
    return full(n);
  }
  if (name == "selective") {
    return selective(n, save_matmuls_policy());
  }
  const std::string prefix = "every_";
  const auto digits = name.substr(std::min(prefix.size(), name.size()));
  const bool every_k = name.rfind(prefix, 0) == 0 && !digits.empty() && digits.size() <= 9 &&
      digits[0] != '0' && std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; });
  TORCH_CHECK(every_k, "expected checkpoint none, full, every_<k> (k >= 1) or selective, but got \"", name, "\"");
  return every(n, std::stoll(digits));
}

std::vector<BlockCheckpointing> BlockCheckpointing::seed_variants(int64_t n) {
  return {none(n), full(n), every(n, 2), selective(n, save_matmuls_policy())};
}

const CheckpointOptions& BlockCheckpointing::options_for(int64_t i) const {
  TORCH_CHECK(block_options.empty() || block_options.size() == blocks.size(),
              "BlockCheckpointing: block_options has ", block_options.size(),
              " entries, expected 0 or ", blocks.size());
  return block_options.empty() ? options : block_options.at(i);
}

BlockCheckpointing& BlockCheckpointing::set_block_policy(int64_t i, SelectivePolicy policy) {
  const auto n = static_cast<int64_t>(blocks.size());
  TORCH_CHECK(i >= 0 && i < n, "BlockCheckpointing::set_block_policy: block ", i,
              " is out of range [0, ", n, ")");
  if (block_options.empty()) {
    block_options.assign(blocks.size(), options);
  }
  blocks[i] = true;
  block_options[i] = options;
  block_options[i].context_fn(create_selective_checkpoint_contexts(std::move(policy)));
  return *this;
}

TransformerBlock TransformerImpl::block(int64_t i) const {
  TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(blocks->size()),
              "Transformer::block: expected 0 <= i < ", blocks->size(), ", but got ", i);
  return TransformerBlock(blocks->ptr<TransformerBlockImpl>(i));
}

int64_t transformer_num_params(const TransformerOptions& o) {
  const int64_t d = o.d_model();
  return o.num_layers() * (12 * d * d + 13 * d);
}

int64_t predicted_activation_bytes(const TransformerOptions& o) {
  return 64 * o.seq_len() * o.batch() * o.d_model() * o.num_layers();
}

ActivationEstimate estimate_activation_bytes(const TransformerOptions& o) {
  const int64_t L = o.num_layers(), B = o.batch(), T = o.seq_len(), d = o.d_model(),
                H = o.num_heads(), f = 4;  // fp32
  ActivationEstimate e;
  // Per layer, in (B, T, d) units: LayerNorm inputs 2, QKV input 1, q/k/v 3
  // (views of one buffer), attention output 1 (also the projection's input:
  // CPU flash attention returns it in (B, T, H, hd) layout, so the reshape is
  // a view), MLP input 1, GELU input 4, GELU output 4.
  e.terms = {
      ActivationTerm{"16 (B, T, d) tensors per layer (64 T B d)", 16 * B * T * d * f * L},
      ActivationTerm{"LayerNorm mean and rstd (2 per LayerNorm, (B, T, 1))", 2 * 2 * B * T * f * L},
      ActivationTerm{"SDPA log-sum-exp ((B, H, T))", B * H * T * f * L},
      ActivationTerm{"loss input (pow saves the output)", B * T * d * f},
  };
  for (const auto& t : e.terms) {
    e.total_bytes += t.bytes;
  }
  return e;
}

VariantRun run_variant(Transformer& model, const at::Tensor& x, const BlockCheckpointing& plan) {
  VariantRun run;
  run.name = plan.name;
  for (auto& p : model->parameters()) {
    p.mutable_grad().reset();  // compare this step's gradients alone
  }
  SavedTensorMeter meter(*model);
  std::optional<PeakWindow> window;
  if (CpuMemoryTracker::installed()) {
    window.emplace(CpuMemoryTracker::install());
  }
  at::Tensor loss;
  {
    SavedTensorMeterGuard scope(meter);
    loss = model->forward(x, plan).pow(2).mean();
  }
  run.saved = meter.report();
  loss.backward();
  loss = at::Tensor();
  if (window) {
    run.peak_bytes = window->peak_bytes();
    run.peak_above_start_bytes = window->peak_bytes() - window->start_bytes();
  }
  for (auto& p : model->parameters()) {
    run.grads.push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
    p.mutable_grad().reset();
  }
  return run;
}

OptimizerInBackwardPeaks measure_optimizer_in_backward(const TransformerOptions& o) {
  TORCH_CHECK(CpuMemoryTracker::installed(),
              "measure_optimizer_in_backward: install the CpuMemoryTracker first");
  auto& tracker = CpuMemoryTracker::install();
  const auto adamw = torch::optim::AdamWOptions(1e-3);
  auto measure = [&](bool in_backward) {
    torch::manual_seed(0);
    Transformer model(o);
    auto x = torch::randn({o.batch(), o.seq_len(), o.d_model()});
    int64_t peak = 0;
    std::unique_ptr<OptimizerInBackward> oib;
    std::unique_ptr<torch::optim::AdamW> opt;
    if (in_backward) {
      oib = std::make_unique<OptimizerInBackward>(model->parameters(), [adamw](std::vector<at::Tensor> p) {
        return std::make_unique<torch::optim::AdamW>(p, adamw);
      });
    } else {
      opt = std::make_unique<torch::optim::AdamW>(model->parameters(), adamw);
    }
    for (int step = 0; step < 2; ++step) {  // the first step is the warm-up
      PeakWindow window(tracker);
      if (opt) {
        opt->zero_grad();
      }
      model->forward(x).pow(2).mean().backward();
      if (opt) {
        opt->step();
      }
      peak = window.peak_bytes();
    }
    return peak;
  };
  OptimizerInBackwardPeaks r;
  r.plain_peak_bytes = measure(false);
  r.peak_bytes = measure(true);
  r.grad_bytes = 4 * transformer_num_params(o);
  return r;
}

double max_abs_diff(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  TORCH_CHECK(a.size() == b.size(), "max_abs_diff: expected lists of the same length, but got ",
              a.size(), " and ", b.size());
  double worst = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    TORCH_CHECK(a[i].defined() == b[i].defined(), "max_abs_diff: tensor ", i,
                " is defined in one list only");
    if (!a[i].defined()) {
      continue;
    }
    TORCH_CHECK(a[i].sizes() == b[i].sizes(), "max_abs_diff: tensor ", i, " has shape ",
                a[i].sizes(), " in one list and ", b[i].sizes(), " in the other");
    worst = std::max(worst, (a[i] - b[i]).abs().max().item<double>());
  }
  return worst;
}

} // namespace trainmem
