#pragma once
// What the config-file models' modules share (never installed), as
// transformers' modeling code shares it: a layer's LoRA update, the KV
// cache's copies, attention through SDPA, checkpointed runs of blocks
// (Note [Models from config files]). Defined in hf_model.cpp; used by the
// GPT-2 modules (hf_gpt2.cpp), the LLaMA family's (hf_llama.cpp) and
// hf_region_model().
#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/TensorOptions.h>

#include "trainmem/block_checkpointing.h"
#include "trainmem/models/lora.h"

namespace trainmem::detail {

// A layer's forward with its LoRA adapter's update when apply_lora() gave it
// one (lora.h), as PEFT's lora.Linear wraps the layer.
template <typename Holder>
at::Tensor adapted(const Holder& layer, const at::Tensor& x) {
  return lora_forward(*layer, layer.ptr()->forward(x), x);
}

// DynamicLayer::update (cache_utils.py) on its first call: torch.cat of an
// empty 1-D tensor and the new k or v along the sequence: a contiguous copy,
// which attention then reads (so autograd saves the copy). transformers
// makes this cache whenever `use_cache` is true, in training too.
at::Tensor cache_copy(const at::Tensor& x);

// sdpa_attention_forward (integrations/sdpa_attention.py) in a training
// forward, with the projection's reshape after it: q (B, H, T, hd), k and v
// (B, KV, T, hd), an optional boolean mask (B, 1, T, T) -> (B, T, H hd).
at::Tensor sdpa_attention(const at::Tensor& q, at::Tensor k, at::Tensor v, const std::optional<at::Tensor>& mask,
                          double scale);

// transformers' sliding-window causal mask as sdpa_mask builds it: position
// q sees k when k <= q and q - k < window; (1, 1, T, T) expanded to B.
at::Tensor sliding_window_mask(int64_t B, int64_t T, int64_t window, const at::TensorOptions& options);

// Runs blocks 0 .. L-1 on h, checkpointing the regions `plan` names (as
// Transformer::forward): each region's inputs are h and `shared`.
using BlockFn = std::function<at::Tensor(int64_t, const at::Tensor&, const std::vector<at::Tensor>&)>;
at::Tensor run_blocks(const char* model, int64_t L, at::Tensor h, const std::vector<at::Tensor>& shared,
                      const BlockCheckpointing* plan, const BlockFn& block);

} // namespace trainmem::detail
