#include "trainmem/models/lora.h"

#include <cmath>
#include <memory>
#include <optional>
#include <unordered_set>
#include <utility>

#include <c10/util/Exception.h>
#include <torch/nn/init.h>
#include <torch/nn/options/linear.h>

#include "trainmem/meta.h"
#include "trainmem/models/hf_model.h"

namespace trainmem {

namespace {

constexpr const char* kAdapterName = "lora";

// PEFT's target matching (check_target_module_exists): the whole name, or a
// suffix after a dot.
bool matches(const std::string& name, const std::string& target) {
  return name == target ||
         (name.size() > target.size() && name.compare(name.size() - target.size(), target.size(), target) == 0 &&
          name[name.size() - target.size() - 1] == '.');
}

// (in, out, weight) of a layer LoRA can adapt, or nothing.
struct LinearShape {
  int64_t in = 0, out = 0;
  at::Tensor weight;
};
std::optional<LinearShape> linear_shape(torch::nn::Module& m) {
  if (auto* l = dynamic_cast<torch::nn::LinearImpl*>(&m)) {
    return LinearShape{l->options.in_features(), l->options.out_features(), l->weight};
  }
  if (auto* c = dynamic_cast<Conv1DImpl*>(&m)) {  // weight (in, out): PEFT's fan_in_fan_out
    return LinearShape{c->nx, c->nf, c->weight};
  }
  return std::nullopt;
}

} // namespace

LoraImpl::LoraImpl(int64_t in_features_, int64_t out_features_, int64_t rank_, double scaling_)
    : in_features(in_features_), out_features(out_features_), rank(rank_), scaling(scaling_) {
  reset();
}

void LoraImpl::reset() {
  TORCH_CHECK(rank > 0, "Lora: expected rank > 0, but got ", rank);
  lora_A = register_module("lora_A", torch::nn::Linear(torch::nn::LinearOptions(in_features, rank).bias(false)));
  lora_B = register_module("lora_B", torch::nn::Linear(torch::nn::LinearOptions(rank, out_features).bias(false)));
  torch::NoGradGuard no_grad;
  torch::nn::init::zeros_(lora_B->weight);  // PEFT's init_lora_weights=True: B = 0, A as nn.Linear's default
}

at::Tensor LoraImpl::forward(const at::Tensor& x) {
  const auto dtype = lora_A->weight.scalar_type();
  const at::Tensor in = x.scalar_type() == dtype ? x : x.to(dtype);
  return lora_B->forward(lora_A->forward(in)) * scaling;
}

LoraImpl* lora_of(const torch::nn::Module& layer) {
  for (const auto& item : layer.named_children()) {
    if (item.key() == kAdapterName) {
      return dynamic_cast<LoraImpl*>(item.value().get());
    }
  }
  return nullptr;
}

at::Tensor lora_forward(const torch::nn::Module& layer, const at::Tensor& base_output, const at::Tensor& x) {
  LoraImpl* adapter = lora_of(layer);
  if (adapter == nullptr) {
    return base_output;
  }
  const at::Tensor result = base_output + adapter->forward(x);
  return result.scalar_type() == base_output.scalar_type() ? result : result.to(base_output.scalar_type());
}

LoraSummary apply_lora(torch::nn::Module& module, const LoraOptions& options) {
  TORCH_CHECK(!options.targets().empty(), "apply_lora: expected at least one target module name, but got none");
  TORCH_CHECK(options.rank() > 0, "apply_lora: expected rank > 0, but got ", options.rank());
  TORCH_CHECK(std::isfinite(options.alpha()) && options.alpha() > 0, "apply_lora: expected alpha > 0, but got ",
              options.alpha());
  // Find every layer first: an error leaves the module as it was.
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> chosen;
  std::unordered_set<std::string> found;
  for (const auto& item : module.named_modules("", /*include_self=*/false)) {
    TORCH_CHECK(item.key().size() < 5 || item.key().compare(item.key().size() - 5, 5, ".lora") != 0,
                "apply_lora: the module has LoRA adapters already (", item.key(), ")");
    for (const auto& t : options.targets()) {
      if (!matches(item.key(), t)) {
        continue;
      }
      TORCH_CHECK(linear_shape(*item.value()).has_value(), "apply_lora: target \"", t, "\" matches ", item.key(),
                  ", a ", item.value()->name(), ", but LoRA adapts linear layers only (Linear, Conv1D)");
      found.insert(t);
      chosen.emplace_back(item.key(), item.value());
      break;
    }
  }
  for (const auto& t : options.targets()) {
    TORCH_CHECK(found.count(t) > 0, "apply_lora: target module \"", t, "\" is not found in the model (a name or "
                "a dotted suffix of one, as PEFT's target_modules)");
  }
  const double r = static_cast<double>(options.rank());
  const double scaling = options.rslora() ? options.alpha() / std::sqrt(r) : options.alpha() / r;
  for (auto& p : module.parameters()) {
    p.set_requires_grad(false);
  }
  LoraSummary summary;
  for (auto& [name, layer] : chosen) {
    const auto shape = *linear_shape(*layer);
    // Made where the weight lives; fp32 whatever the base's dtype (PEFT's
    // autocast_adapter_dtype upcasts bf16 and fp16 adapters).
    const auto dtype = shape.weight.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    Lora adapter{nullptr};
    if (shape.weight.is_meta()) {
      MetaInitGuard meta;  // a model on meta gets adapters on meta: nothing allocated
      adapter = Lora(shape.in, shape.out, options.rank(), scaling);
    } else {
      adapter = Lora(shape.in, shape.out, options.rank(), scaling);
      adapter->to(shape.weight.device());
    }
    adapter->to(dtype);
    layer->register_module(kAdapterName, adapter);
    summary.adapted.push_back(name);
    summary.trainable_params += adapter->lora_A->weight.numel() + adapter->lora_B->weight.numel();
  }
  std::unordered_set<const void*> seen;
  for (const auto& p : module.parameters()) {
    if (!p.requires_grad() && seen.insert(p.unsafeGetTensorImpl()).second) {
      summary.frozen_params += p.numel();
    }
  }
  return summary;
}

} // namespace trainmem
