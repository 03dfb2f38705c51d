// The models read from Hugging Face config files (Note [Models from config
// files]): what their modules share (models/detail/hf_modeling.h), HfModel,
// build_hf_model() and the planner's regions, hf_region_model(). The config
// is read in hf_config.cpp, the modules are hf_gpt2.cpp's and hf_llama.cpp's.
#include "trainmem/models/hf_model.h"

#include <algorithm>
#include <cstdlib>
#include <string>

#include <ATen/core/Reduction.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>

#include "trainmem/checkpoint.h"
#include "trainmem/planner.h"

#include "models/detail/hf_modeling.h"

// Note [Models from config files]
// A config.json is read for the shape only: the keys that change a parameter
// or an activation. Required keys have no Hugging Face default that could
// describe a real model (the width, depth, heads, vocabulary); optional keys
// take the defaults of transformers' GPT2Config, LlamaConfig, MistralConfig,
// Qwen2Config and Qwen3Config (5.24.0). Every error names the file, the key
// and the value found, since a config is usually edited by hand.
//
// The modules follow transformers 5.24.0's modeling code op for op where
// memory depends on it, as a training forward with labels runs it (CPU,
// fp32, attn_implementation "sdpa", dropout 0), so that autograd saves the
// same tensors (tests/hf_saved_bytes.py measures transformers' side):
// - GPT-2: Conv1D is addmm on the (B T, nx) view; c_attn's output split into
//   q, k, v views; gelu_new written out as NewGELUActivation does
//   (0.5 x (1 + tanh(c (x + 0.044715 x^3)))), which saves x, tanh's result,
//   0.5 x and 1 + tanh: four (B, T, I) tensors where a fused GELU saves one.
// - The KV cache: with `use_cache` true (every config's default) the model
//   makes a DynamicCache even in training, and its first update is torch.cat
//   of an empty tensor and k (and v): contiguous copies that SDPA reads and
//   saves. For GPT-2 that is two (B, T, d) copies per layer beyond the c_attn
//   output q is a view of; for the LLaMA family the copies replace tensors of
//   the same size. The cache holds nothing that autograd does not.
// - Attention (sdpa_attention_forward): grouped-query k and v go to SDPA
//   with enable_gqa where use_gqa_in_sdpa allows it (no mask, head_dim <=
//   256 on CPU and CUDA), else repeat_kv copies them to the query heads (or,
//   for one query token, pack_gqa folds the query heads onto the KV heads);
//   is_causal without a mask. Mistral's sliding-window mask is made once
//   T >= sliding_window (masking_utils' _ignore_causal_mask_sdpa stops
//   skipping it there): a boolean (B, 1, T, T) expanded view, which SDPA
//   converts to a float mask and saves, per layer; k and v repeated.
// - LLaMA family: RMSNorm's fp32 statistics, rotary cos/sin computed once per
//   forward and shared by the blocks, Qwen3's q/k RMSNorm over the (B, T, H,
//   hd) view before the transpose.
// - The loss over the unshifted logits with shifted labels (no logits copy).

namespace trainmem {

// ---------------------------------------------------------------------------
// What transformers' modeling code shares (models/detail/hf_modeling.h): the
// KV cache's copies, attention through SDPA, checkpointed runs of blocks

namespace detail {

at::Tensor cache_copy(const at::Tensor& x) {
  return at::cat({at::empty({0}, x.options()), x}, -2);
}

namespace {

// (B, KV, T, hd) -> (B, KV * n_rep, T, hd), as transformers' repeat_kv.
at::Tensor repeat_kv(const at::Tensor& x, int64_t n_rep) {
  if (n_rep == 1) {
    return x;
  }
  const int64_t B = x.size(0), KV = x.size(1), T = x.size(2), hd = x.size(3);
  return x.unsqueeze(2).expand({B, KV, n_rep, T, hd}).reshape({B, KV * n_rep, T, hd});
}

// sdpa_attention.py's use_gqa_in_sdpa on CPU and CUDA (not XPU or MPS): the
// KV heads go to SDPA as they are (enable_gqa) without a mask and with a
// head_dim of at most 256, or whenever TRANSFORMERS_SDPA_FORCE_GQA is "1".
bool use_gqa_in_sdpa(const std::optional<at::Tensor>& mask, const at::Tensor& k, const at::Tensor& v) {
  const char* force = std::getenv("TRANSFORMERS_SDPA_FORCE_GQA");
  if (force != nullptr && std::string(force) == "1") {
    return true;
  }
  return !mask.has_value() && k.size(-1) == v.size(-1) && k.size(-1) <= 256;
}

} // namespace

at::Tensor sdpa_attention(const at::Tensor& q, at::Tensor k, at::Tensor v, const std::optional<at::Tensor>& mask,
                          double scale) {
  const int64_t B = q.size(0), T = q.size(2), n_rep = q.size(1) / k.size(1);
  bool gqa = false;
  at::Tensor query = q;
  if (n_rep > 1) {
    if (use_gqa_in_sdpa(mask, k, v)) {
      gqa = true;
    } else if (T == 1) {
      // pack_gqa: one query token, (B, H, 1, hd) -> (B, KV, n_rep, hd); a mask
      // shared by the heads (ours: (B, 1, T, T)) as it is.
      query = q.reshape({B, q.size(1) / n_rep, n_rep, q.size(3)});
    } else {
      k = repeat_kv(k, n_rep);
      v = repeat_kv(v, n_rep);
    }
  }
  const bool is_causal = T > 1 && !mask.has_value();
  auto out = at::scaled_dot_product_attention(query, k, v, mask, /*dropout_p=*/0.0, is_causal, scale, gqa);
  out = out.reshape({out.size(0), -1, T, v.size(-1)}).transpose(1, 2).contiguous();  // (B, T, H, hd)
  return out.reshape({B, T, -1}).contiguous();
}

at::Tensor sliding_window_mask(int64_t B, int64_t T, int64_t window, const at::TensorOptions& options) {
  auto pos = at::arange(T, options.dtype(at::kLong));
  auto q = pos.unsqueeze(1), k = pos.unsqueeze(0);
  return ((k <= q) & (k > q - window)).view({1, 1, T, T}).expand({B, 1, T, T});  // structured ops: run on meta
}

at::Tensor run_blocks(const char* model, int64_t L, at::Tensor h, const std::vector<at::Tensor>& shared,
                      const BlockCheckpointing* plan, const BlockFn& block) {
  if (plan != nullptr) {
    TORCH_CHECK(static_cast<int64_t>(plan->blocks.size()) == L, model, "::forward: the checkpoint plan '",
                plan->name, "' has ", plan->blocks.size(), " blocks, but the model has ", L);
    TORCH_CHECK(plan->region_length.empty() || static_cast<int64_t>(plan->region_length.size()) == L, model,
                "::forward: the plan '", plan->name, "' has ", plan->region_length.size(),
                " region lengths, expected 0 or ", L);
  }
  for (int64_t i = 0; i < L;) {
    const bool ckpt = plan != nullptr && plan->blocks[i];
    const int64_t k = !ckpt || plan->region_length.empty() ? 1 : std::max<int64_t>(1, plan->region_length[i]);
    if (!ckpt) {
      h = block(i, h, shared);
      ++i;
      continue;
    }
    TORCH_CHECK(i + k <= L, model, "::forward: the region of ", k, " blocks at block ", i, " of plan '",
                plan->name, "' runs past the last block (", L, ")");
    std::vector<at::Tensor> in{h};
    in.insert(in.end(), shared.begin(), shared.end());
    h = checkpoint(
        [block, i, k](const std::vector<at::Tensor>& x) {
          at::Tensor y = x[0];
          const std::vector<at::Tensor> rest(x.begin() + 1, x.end());
          for (int64_t j = i; j < i + k; ++j) {
            y = block(j, y, rest);
          }
          return std::vector<at::Tensor>{y};
        },
        in, plan->options_for(i))[0];
    i += k;
  }
  return h;
}

} // namespace detail

// ---------------------------------------------------------------------------
// Models from configs

at::Tensor HfModel::forward(const at::Tensor& tokens) const {
  TORCH_CHECK(module != nullptr, "HfModel: no module (build it with build_hf_model)");
  if (config.architecture == HfArchitecture::kGPT2) {
    return std::dynamic_pointer_cast<Gpt2Impl>(module)->forward(tokens);
  }
  return std::dynamic_pointer_cast<LlamaImpl>(module)->forward(tokens);
}

at::Tensor HfModel::forward(const at::Tensor& tokens, const BlockCheckpointing& plan) const {
  TORCH_CHECK(module != nullptr, "HfModel: no module (build it with build_hf_model)");
  if (config.architecture == HfArchitecture::kGPT2) {
    return std::dynamic_pointer_cast<Gpt2Impl>(module)->forward(tokens, plan);
  }
  return std::dynamic_pointer_cast<LlamaImpl>(module)->forward(tokens, plan);
}

namespace {

using detail::adapted;

// transformers' ForCausalLMLoss (loss_utils.py): the logits upcast to fp32
// (a copy for a model in bf16, none in fp32 or under autocast, whose linear
// layer's bf16 logits cross_entropy casts the same way), the labels padded with
// -100 to (B, T + 1), shifted left by a slice made contiguous (a copy, but
// for a batch of 1, where the slice already is: nll_loss then saves the
// padded (T + 1) storage), cross-entropy over the flattened logits (no copy
// of them).
at::Tensor causal_lm_loss(const at::Tensor& logits, const at::Tensor& labels) {
  const at::Tensor upcast = logits.to(at::kFloat);
  auto shift_labels = at::constant_pad_nd(labels, {0, 1}, -100).slice(1, 1).contiguous();  // (B, T)
  return at::cross_entropy_loss(upcast.view({-1, upcast.size(-1)}), shift_labels.view({-1}), std::nullopt,
                                at::Reduction::Mean, -100);
}

} // namespace

at::Tensor HfModel::loss(const at::Tensor& tokens) const {
  return causal_lm_loss(forward(tokens), tokens);
}

at::Tensor HfModel::loss(const at::Tensor& tokens, const BlockCheckpointing& plan) const {
  return causal_lm_loss(forward(tokens, plan), tokens);
}

HfModel build_hf_model(const HfConfig& config) {
  // On meta, SDPA and LayerNorm then save what the CPU's kernels save (and
  // causal attention does not fall into the math path's missing `where`).
  enable_cpu_meta_kernels();
  HfModel m;
  m.config = config;
  if (config.architecture == HfArchitecture::kGPT2) {
    m.module = Gpt2(gpt2_options(config)).ptr();
  } else {
    m.module = Llama(llama_options(config)).ptr();
  }
  return m;
}

RegionModel hf_region_model(const HfModel& model, int64_t batch, int64_t seq_len) {
  TORCH_CHECK(model.module != nullptr, "hf_region_model: no module (build it with build_hf_model)");
  const int64_t positions = model.config.max_positions;  // both option sets take it from here
  TORCH_CHECK(batch >= 1, "hf_region_model: expected a batch >= 1, but got ", batch);
  TORCH_CHECK(seq_len >= 2 && seq_len <= positions, "hf_region_model: expected a sequence length in [2, ",
              positions, "], but got ", seq_len);
  using Modules = std::vector<std::shared_ptr<torch::nn::Module>>;
  RegionModel m;
  if (model.config.architecture == HfArchitecture::kGPT2) {
    auto gpt = std::dynamic_pointer_cast<Gpt2Impl>(model.module);
    m.regions.emplace_back(
        "embed", [gpt](const at::Tensor& tokens) { return gpt->embed(tokens); },
        Modules{gpt->wte.ptr(), gpt->wpe.ptr()});
    for (size_t i = 0; i < gpt->h->size(); ++i) {
      auto block = std::dynamic_pointer_cast<Gpt2BlockImpl>(gpt->h->ptr(i));
      m.regions.emplace_back(
          fmt::format("h.{}", i), [block](const at::Tensor& h) { return block->forward(h); }, Modules{block});
    }
    m.regions.emplace_back("head", [gpt](const at::Tensor& h) { return gpt->head(h); },
                           Modules{gpt->ln_f.ptr(), gpt->wte.ptr()});
  } else {
    // The rotary tables are made once, with the embedding, and carried to
    // every block as the model's run_blocks shares them (Note [Regions with
    // several tensors]); the last block hands the head its output alone.
    using T = Region::Tensors;
    auto llama = std::dynamic_pointer_cast<LlamaImpl>(model.module);
    m.regions.emplace_back(
        "embed",
        [llama](const T& tokens) -> T {
          auto h = llama->embed_tokens->forward(tokens[0]);
          auto [cos, sin] = llama->rotary(h.size(1), h.options());
          return {h, cos, sin};
        },
        Modules{llama->embed_tokens.ptr()});
    const size_t L = llama->layers->size();
    for (size_t i = 0; i < L; ++i) {
      auto block = std::dynamic_pointer_cast<LlamaBlockImpl>(llama->layers->ptr(i));
      const bool last = i + 1 == L;
      m.regions.emplace_back(
          fmt::format("layers.{}", i),
          [block, last](const T& x) -> T {
            auto y = block->forward(x[0], x[1], x[2]);
            return last ? T{y} : T{y, x[1], x[2]};
          },
          Modules{block});
    }
    Modules head{llama->norm.ptr()};
    if (llama->lm_head) {
      head.push_back(llama->lm_head.ptr());
    } else {
      head.push_back(llama->embed_tokens.ptr());
    }
    m.regions.emplace_back(
        "head",
        [llama](const at::Tensor& h) {
          auto x = llama->norm->forward(h);
          return llama->lm_head ? adapted(llama->lm_head, x) : at::linear(x, llama->embed_tokens->weight);
        },
        std::move(head));
  }
  m.input = [batch, seq_len](c10::Device device) {
    return at::zeros({batch, seq_len}, at::TensorOptions().dtype(at::kLong).device(device));
  };
  // causal_lm_loss on the zero tokens of `input` as labels.
  m.loss = [](const at::Tensor& logits) {
    return causal_lm_loss(logits, at::zeros({logits.size(0), logits.size(1)}, logits.options().dtype(at::kLong)));
  };
  return m;
}

} // namespace trainmem
