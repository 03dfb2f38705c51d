#include "trainmem/models/estimate.h"

#include <utility>

#include <ATen/autocast_mode.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <torch/optim/adamw.h>

#include "trainmem/block_checkpointing.h"
#include "trainmem/format.h"
#include "trainmem/grad_scaler.h"
#include "trainmem/master_weights.h"
#include "trainmem/meta.h"

namespace trainmem {

const char* precision_name(Precision precision) {
  switch (precision) {
    case Precision::kFp32: return "fp32";
    case Precision::kBf16Autocast: return "bf16-autocast";
    case Precision::kBf16: return "bf16";
    case Precision::kFp16: return "fp16";
    case Precision::kFp16Autocast: return "fp16-autocast";
    case Precision::kBf16Master: return "bf16-master";
    case Precision::kFp16Master: return "fp16-master";
  }
  return "?";
}

Precision parse_precision(const std::string& name) {
  for (auto p : {Precision::kFp32, Precision::kBf16Autocast, Precision::kBf16, Precision::kFp16,
                 Precision::kFp16Autocast, Precision::kBf16Master, Precision::kFp16Master}) {
    if (name == precision_name(p)) {
      return p;
    }
  }
  TORCH_CHECK(false,
              "expected precision fp32, bf16-autocast, bf16, fp16, fp16-autocast, bf16-master or fp16-master, "
              "but got \"", name, "\"");
}

at::Tensor run_under_autocast(c10::DeviceType device, at::ScalarType dtype, const std::function<at::Tensor()>& fn) {
  struct Region {
    c10::DeviceType device;
    bool was_enabled;
    at::ScalarType was_dtype;
    ~Region() {
      at::autocast::set_autocast_enabled(device, was_enabled);
      at::autocast::set_autocast_dtype(device, was_dtype);
      if (!at::autocast::is_autocast_enabled(at::kCPU) && !at::autocast::is_autocast_enabled(at::kCUDA)) {
        at::autocast::clear_cache();  // as leaving torch.autocast's outermost region
      }
    }
  };
  Region region{device, at::autocast::is_autocast_enabled(device), at::autocast::get_autocast_dtype(device)};
  at::autocast::set_autocast_dtype(device, dtype);
  at::autocast::set_autocast_enabled(device, true);
  return fn();
}

namespace {

const std::vector<Recipe> kRecipes = {Recipe::kFp32AdamW,       Recipe::kMixedAdamW, Recipe::kPureBf16AdamW,
                                      Recipe::kFp32SGD,         Recipe::kFp32SGDMomentum,
                                      Recipe::kFp32Adafactor};

std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) {
    out += (out.empty() ? "" : ",") + n;
  }
  return out;
}

std::string precision_assumption(Precision p, bool cuda) {
  switch (p) {
    case Precision::kFp32:
      return "precision fp32: parameters, gradients, AdamW state and activations in fp32";
    case Precision::kBf16Autocast:
      return fmt::format("precision bf16-autocast: fp32 parameters, gradients and AdamW state; the forward under "
                         "LibTorch's autocast in bf16, the CPU's policy for the CPU figures{}",
                         cuda ? ", CUDA's for the CUDA ones" : "");
    case Precision::kBf16:
    case Precision::kFp16:
      return fmt::format("precision {0}: the model held in {0}, its gradients and AdamW state too{1}; the loss in "
                         "fp32 (the logits upcast, as transformers' ForCausalLMLoss)",
                         precision_name(p), p == Precision::kFp16 ? ", the loss not scaled" : "");
    case Precision::kFp16Autocast:
      return fmt::format("precision fp16-autocast: fp32 parameters, gradients and AdamW state; the forward under "
                         "LibTorch's autocast in fp16, the CPU's policy for the CPU figures{}; the loss scaled by "
                         "trainmem's GradScaler (its step taken; the step predicted as a function, its phases not "
                         "split: Note [fp16 autocast as a step function])",
                         cuda ? ", CUDA's for the CUDA ones" : "");
    case Precision::kBf16Master:
      return "precision bf16-master: the model and its gradients in bf16, AdamW over fp32 master copies of the "
             "bf16 weights (fp32 moments); after backward each bf16 gradient becomes its master's fp32 gradient "
             "and is freed, and after the step the masters are copied into the weights and their gradients freed "
             "(Note [bf16 weights with fp32 master weights]; the step predicted as a function, its phases not "
             "split); the loss in fp32";
    case Precision::kFp16Master:
      return "precision fp16-master: the model and its gradients in fp16, AdamW over fp32 master copies of the "
             "fp16 weights (fp32 moments), the loss scaled by trainmem's GradScaler (its step taken); after "
             "backward each fp16 gradient becomes its master's fp32 gradient and is freed, the scaler unscales "
             "them and steps, and the masters are copied into the weights and their gradients freed "
             "(Note [bf16 weights with fp32 master weights]; the step predicted as a function, its phases not "
             "split); the loss in fp32";
  }
  return "";
}

// What a CUDA prediction assumed: the GPU, its attention backend, the
// workspaces, the allocator.
std::string cuda_assumption(const CudaPredictOptions& c, const CudaStepPrediction& p,
                            const std::string& optimizer = "AdamW") {
  const int64_t cc = c.compute_capability();
  std::string attention = "no scaled_dot_product_attention";
  if (p.flash_attention_calls + p.efficient_attention_calls > 0) {
    attention = fmt::format("scaled_dot_product_attention by {}", p.efficient_attention_calls == 0 ? "flash attention"
                                               : p.flash_attention_calls == 0 ? "memory-efficient attention"
                                                                              : "flash and memory-efficient attention");
    if (cc == 90 || cc / 10 == 10) {
      attention += " (cuDNN attention, which CUDA 13 builds of LibTorch prefer on this GPU, not modelled: set "
                   "TORCH_CUDNN_SDPA_DEPRIORITIZED=1 for the run predicted)";
    }
  }
  return fmt::format("CUDA on {} (compute capability {}.{}): {}; cuBLAS workspace {} B per handle and stream, "
                     "{}; the caching allocator with {} segments; the second of two steps ({}'s state made in "
                     "the first)",
                     c.gpu_name().empty() ? std::string("a GPU not named") : "the " + c.gpu_name(), cc / 10, cc % 10,
                     attention, with_commas(c.cublas_workspace_bytes()),
                     c.cublaslt_workspace_bytes() == 0
                         ? std::string("cuBLASLt sharing it")
                         : fmt::format("cuBLASLt's own {} B", with_commas(c.cublaslt_workspace_bytes())),
                     c.allocator().expandable_segments() ? "expandable" : "fixed", optimizer);
}

// A step predicted as a function: its peak and what it started with, the
// phases not split.
StepPeak function_peak(const StepFunctionPeak& f, int64_t saved_bytes) {
  StepPeak p;
  p.peak_bytes = f.peak_bytes;
  p.param_bytes = f.param_bytes;
  p.buffer_bytes = f.buffer_bytes;
  p.optimizer_state_bytes = f.optimizer_state_bytes;
  p.activation_bytes = saved_bytes;
  return p;
}

// `loss_fn` as the precision runs it for `device`: under autocast in bf16 or
// fp16, else as it is.
std::function<at::Tensor()> loss_under(Precision p, c10::DeviceType device, std::function<at::Tensor()> loss_fn) {
  if (p != Precision::kBf16Autocast && p != Precision::kFp16Autocast) {
    return loss_fn;
  }
  const auto dtype = p == Precision::kFp16Autocast ? at::kHalf : at::kBFloat16;
  return [device, dtype, loss_fn = std::move(loss_fn)] { return run_under_autocast(device, dtype, loss_fn); };
}

// What estimate() and estimate_model() predict of a step: its saved bytes,
// its peak on the CPU's kernels and, when asked, on CUDA.
struct StepPrediction {
  int64_t saved_bytes = 0;
  StepPeak step_peak;
  bool step_phases_split = true;
  std::optional<CudaStepPrediction> cuda;
};

// Note [fp16 autocast as a step function]
// fp16 autocast needs a GradScaler: the loss scaled before backward, the
// gradients unscaled and checked for inf/NaN, the step taken or skipped, the
// scale updated. That is not predict_step_peak's zero_grad, forward,
// backward, step, so the step is predicted as the user writes it
// (predict_step_function, predict_cuda_step_function), with trainmem's
// GradScaler, whose step is taken on meta (no gradient holds an inf there).
// Its peak is the step's; the phases are not split (forward, backward and
// optimizer peaks stay 0), and the scaler's own 8 B (scale and growth
// tracker) are not in the start, as they are no module's or optimizer's.
// The loss stays alive until the scaler's update, as in GradScaler's loop
// (`loss` is named, then scaled, unscaled, stepped): its fp32 scalar (4 B)
// is live at a peak inside the optimizer step, which full checkpointing
// makes the step's. Gradient accumulation is predicted the same way: its
// micro-batches' backward passes, then one step; there each micro-batch's
// loss is gone with its backward, and with fp16 the last one is kept.
// `loss_on(device)`: the loss function as the precision runs it for `device`.
using LossOn = std::function<std::function<at::Tensor()>(c10::DeviceType)>;

StepPrediction predict_step(torch::nn::Module& module, const LossOn& loss_on, torch::optim::Optimizer& opt,
                            const EstimateOptions& o) {
  StepPrediction r;
  const Precision p = o.precision();
  r.saved_bytes = predict_saved_activations(module, loss_on(c10::kCPU)).saved_bytes;
  if (!o.step()) {
    return r;
  }
  const bool fp16 = p == Precision::kFp16Autocast;
  const int64_t k = o.accumulation();
  if (!fp16 && k == 1) {
    r.step_peak = predict_step_peak(module, loss_on(c10::kCPU), &opt);
    if (o.cuda()) {
      r.cuda = predict_cuda_step_peak(module, loss_on(c10::kCUDA), &opt, *o.cuda());
    }
    return r;
  }
  const auto step_on = [&](c10::DeviceType device, GradScaler& scaler) {
    return [&, device] {
      for (auto& param : module.parameters()) {
        param.mutable_grad().reset();
      }
      const auto loss_fn_on = loss_on(device);
      at::Tensor kept;  // fp16: the last loss, alive through the scaler's step
      for (int64_t i = 0; i < k; ++i) {
        at::Tensor loss = loss_fn_on();
        if (k > 1) {
          loss = loss / k;
        }
        if (fp16) {
          scaler.scale(loss).backward();
          if (i == k - 1) {
            kept = loss;
          }
        } else {
          loss.backward();
        }
      }
      if (fp16) {
        scaler.unscale_(opt);
        scaler.step(opt);
        scaler.update();
      } else {
        opt.step();
      }
    };
  };
  {
    GradScaler scaler;
    r.step_phases_split = false;
    r.step_peak = function_peak(predict_step_function({&module}, {&opt}, step_on(c10::kCPU, scaler)), r.saved_bytes);
  }
  if (o.cuda()) {
    GradScaler scaler;
    r.cuda = predict_cuda_step_function({&module}, {&opt}, step_on(c10::kCUDA, scaler), *o.cuda());
  }
  return r;
}

// Note [bf16 weights with fp32 master weights]
// ZeRO's mixed-precision recipe (2 + 2 + 12 B per parameter) as a user of
// LibTorch writes it with trainmem's MasterWeights (master_weights.h): the
// model in bf16, AdamW over fp32 masters of its bf16 trainable weights. Each
// step: gradients to none, forward and backward in bf16 (the loss in fp32),
// then MasterWeights::step: each bf16 gradient converted into its master's
// fp32 gradient and freed, one at a time; AdamW's step on the masters; the
// masters copied into the bf16 weights, their gradients freed. So the
// backward holds 2 + 2 + 4 + 8 B per parameter beside the activations, and
// the optimizer step 2 + 4 + 4 + 8. The step is predicted as a function
// (predict_step_function, predict_cuda_step_function), the masters a module
// beside the model: phases not split. A framework that keeps a flat fp32
// gradient buffer across steps (DeepSpeed's bf16 optimizer) holds 4 B per
// parameter more than this; one that frees the masters' gradients later, or
// the bf16 ones earlier, moves the peak.
template <typename LossOn>
void predict_master_steps(ModelEstimate& e, const HfModel& model, const std::vector<at::Tensor>& trainable,
                          const LossOn& loss_on) {
  MasterWeights masters(trainable);
  const bool fp16 = e.options.precision() == Precision::kFp16Master;
  // fp16: the loss scaled, the masters' gradients unscaled, a scaler per
  // device predicted (its tensors made where its step runs).
  const auto step_on = [&](c10::DeviceType device, torch::optim::Optimizer& opt, GradScaler& scaler) {
    return [&, device] {
      for (auto& p : model.module->parameters()) {
        p.mutable_grad().reset();
      }
      if (fp16) {
        scaler.scale(loss_on(device)()).backward();  // the loss and the scaled loss freed here
        masters->step(opt, scaler);
      } else {
        loss_on(device)().backward();
        masters->step(opt);
      }
    };
  };
  {
    torch::optim::AdamW opt(masters->optimized(), torch::optim::AdamWOptions(1e-3));
    GradScaler scaler;
    const auto f =
        predict_step_function({model.module.get(), masters.get()}, {&opt}, step_on(c10::kCPU, opt, scaler));
    e.step_phases_split = false;
    e.step_peak = function_peak(f, e.saved_bytes);
  }
  if (e.options.cuda()) {
    torch::optim::AdamW opt(masters->optimized(), torch::optim::AdamWOptions(1e-3));
    GradScaler scaler;
    e.cuda = predict_cuda_step_function({model.module.get(), masters.get()}, {&opt},
                                        step_on(c10::kCUDA, opt, scaler), *e.options.cuda());
  }
}

} // namespace

HfModel build_model(const HfConfig& config, const ModelEstimateOptions& options) {
  HfModel model = build_hf_model(config);
  if (options.precision() == Precision::kBf16 || options.precision() == Precision::kBf16Master) {
    model.module->to(at::kBFloat16);  // as from_pretrained(torch_dtype=torch.bfloat16), before PEFT
  } else if (options.precision() == Precision::kFp16 || options.precision() == Precision::kFp16Master) {
    model.module->to(at::kHalf);
  }
  if (options.lora()) {
    apply_lora(*model.module, *options.lora());
  }
  return model;
}

RegionModel model_regions(const HfModel& model, const ModelEstimateOptions& options, c10::DeviceType autocast_device) {
  RegionModel m = hf_region_model(model, options.batch(), options.seq_len());
  // Note [Planned steps with a scaler or master weights]: the step's
  // backward and optimizer step as estimate_model runs them.
  if (options.precision() == Precision::kBf16Master || options.precision() == Precision::kFp16Master) {
    m.master_weights = true;
  }
  if (options.precision() == Precision::kFp16Autocast || options.precision() == Precision::kFp16Master) {
    m.grad_scaler = GradScalerOptions();
  }
  if (options.precision() != Precision::kBf16Autocast && options.precision() != Precision::kFp16Autocast) {
    return m;
  }
  // Each region, and the loss, in an autocast region of its own: what the
  // user's forward runs under one region, with the same casts (the cast
  // cache, of weights used by two regions, is the only difference: a tied
  // embedding is not cast by its lookup).
  const auto dtype = options.precision() == Precision::kFp16Autocast ? at::kHalf : at::kBFloat16;
  const std::string tag = options.precision() == Precision::kFp16Autocast ? " (fp16 autocast)" : " (bf16 autocast)";
  std::vector<Region> wrapped;
  for (const auto& r : m.regions) {
    if (r.takes_tensors()) {  // the LLaMA family's, carrying the rotary tables
      wrapped.emplace_back(
          r.name(),
          [r, autocast_device, dtype](const Region::Tensors& xs) {
            Region::Tensors out;
            run_under_autocast(autocast_device, dtype, [&] {
              out = r(xs);
              return at::Tensor();
            });
            return out;
          },
          r.modules());
    } else {
      wrapped.emplace_back(
          r.name(),
          [r, autocast_device, dtype](const at::Tensor& x) {
            return run_under_autocast(autocast_device, dtype, [&] { return r(x); });
          },
          r.modules());
    }
    if (!r.key().empty()) {
      wrapped.back().key(r.key() + tag);
    }
  }
  m.regions = std::move(wrapped);
  m.loss = [loss = m.loss, autocast_device, dtype](const at::Tensor& y) {
    return run_under_autocast(autocast_device, dtype, [&] { return loss(y); });
  };
  return m;
}

ModelEstimate estimate_model(const HfConfig& config, const ModelEstimateOptions& options) {
  const auto& o = options;
  TORCH_CHECK(o.batch() >= 1 && o.seq_len() >= 1, "estimate_model: expected batch and seq_len > 0, but got batch ",
              o.batch(), " seq_len ", o.seq_len());
  TORCH_CHECK(o.seq_len() <= config.max_positions, "estimate_model: expected seq_len at most ", config.max_positions,
              " (the positions of ", config.source, "), but got ", o.seq_len());
  TORCH_CHECK(o.ranks() >= 1, "estimate_model: expected ranks >= 1, but got ", o.ranks());
  TORCH_CHECK(o.zero() >= 0 && o.zero() <= 3, "estimate_model: expected ZeRO stage 0, 1, 2 or 3, but got ", o.zero());
  const auto plan = BlockCheckpointing::named(config.num_layers, o.checkpoint());  // throws naming a bad name

  ModelEstimate e;
  e.config = config;
  e.options = o;
  HfModel model;
  {
    MetaInitGuard meta;  // nothing allocated, whatever the size
    model = build_model(config, o);
  }
  for (const auto& item : model.module->named_modules("", /*include_self=*/false)) {
    if (lora_of(*item.value()) != nullptr) {
      e.lora_layers.push_back(item.key());
    }
  }
  e.num_params = account(*model.module).num_params;
  std::vector<at::Tensor> trainable;
  for (const auto& p : model.module->parameters()) {
    if (p.requires_grad()) {
      trainable.push_back(p);
      e.trainable_params += p.numel();
    }
  }
  e.largest_layer_params = largest_layer_params(*model.module);
  const auto sharding = ShardingOptions().zero_stage(o.zero()).world_size(o.ranks()).largest_layer_params(
      o.zero() == 3 ? e.largest_layer_params : 0);
  for (auto r : kRecipes) {
    e.recipes.push_back(shard_static_bytes(predict_static_bytes(*model.module, r), sharding));
  }

  // One micro-batch of tokens made on meta, the model's loss of it.
  const std::function<at::Tensor()> loss_fn = [&] {
    const auto tokens = at::empty({o.batch(), o.seq_len()}, at::TensorOptions().dtype(at::kLong).device(at::kMeta));
    return o.checkpoint() == "none" ? model.loss(tokens) : model.loss(tokens, plan);
  };
  if (o.precision() == Precision::kBf16Master || o.precision() == Precision::kFp16Master) {
    // The masters are a module beside the model and the optimizer steps
    // them, not the model: a step estimate() cannot be given.
    const LossOn loss_on = [&](c10::DeviceType) { return loss_fn; };
    e.saved_bytes = predict_saved_activations(*model.module, loss_fn).saved_bytes;
    predict_master_steps(e, model, trainable, loss_on);
  } else {
    // Any other precision is estimate()'s step of the model with AdamW.
    torch::optim::AdamW opt(trainable, torch::optim::AdamWOptions(1e-3));
    auto r = estimate(*model.module, loss_fn, opt, EstimateOptions().precision(o.precision()).cuda(o.cuda()));
    e.saved_bytes = r.saved_bytes;
    e.step_peak = r.step_peak;
    e.step_phases_split = r.step_phases_split;
    e.cuda = std::move(r.cuda);
  }

  auto& a = e.assumptions;
  a.push_back(fmt::format("model {} from {}: {} parameters, {} trainable; one micro-batch of {} x {} tokens",
                          to_string(config.architecture), config.source, with_commas(e.num_params),
                          with_commas(e.trainable_params), o.batch(), o.seq_len()));
  a.push_back(precision_assumption(o.precision(), o.cuda().has_value()));
  a.push_back(o.checkpoint() == "none"
                  ? std::string("checkpointing none: every block's activations kept for backward")
                  : fmt::format("checkpointing {}: {} (BlockCheckpointing::named)", o.checkpoint(),
                                o.checkpoint() == "full"        ? "every decoder block recomputed in backward"
                                : o.checkpoint() == "selective" ? "every block, its matmul outputs kept"
                                                                : "one block in k recomputed in backward"));
  if (o.lora()) {
    const auto& l = *o.lora();
    a.push_back(fmt::format("LoRA r {} alpha {}{} on {} ({} layers, PEFT {}): every other weight frozen, without "
                            "gradient or optimizer state",
                            l.rank(), l.alpha(), l.rslora() ? " (rsLoRA)" : "", join(l.targets()),
                            e.lora_layers.size(), kPeftVersion));
  } else {
    a.push_back("LoRA none: every parameter trained");
  }
  a.push_back(fmt::format("optimizer AdamW (two moments in the dtype of what it steps: {}); the step peak is one "
                          "rank's, unsharded{}",
                          o.lora() ? "fp32, the adapters'"
                          : o.precision() == Precision::kBf16Master || o.precision() == Precision::kFp16Master
                              ? "fp32, the masters'"
                          : o.precision() == Precision::kBf16       ? "bf16"
                          : o.precision() == Precision::kFp16       ? "fp16"
                                                                    : "fp32",
                          o.ranks() > 1 || o.zero() > 0
                              ? fmt::format(" (ZeRO-{} over {} ranks is in the static bytes by recipe only)",
                                            o.zero(), o.ranks())
                              : ""));
  if (o.cuda()) {
    const auto& c = *o.cuda();
    a.push_back(cuda_assumption(c, *e.cuda));
  }
  return e;
}

namespace {

// estimate()'s precision line: how `loss_fn` ran.
std::string step_precision_assumption(Precision p, bool cuda) {
  switch (p) {
    case Precision::kFp32:
      return "precision fp32: loss_fn run as given, the module's parameters, gradients and optimizer state in "
             "their dtype";
    case Precision::kBf16:
    case Precision::kFp16:
      return fmt::format("precision {}: loss_fn run as given, the module as the caller cast it; gradients and "
                         "optimizer state in the parameters' dtype",
                         precision_name(p));
    case Precision::kBf16Autocast:
    case Precision::kFp16Autocast:
      return fmt::format("precision {}: loss_fn under LibTorch's autocast in {}, the CPU's policy for the CPU "
                         "figures{}{}",
                         precision_name(p), p == Precision::kBf16Autocast ? "bf16" : "fp16",
                         cuda ? ", CUDA's for the CUDA ones" : "",
                         p == Precision::kBf16Autocast
                             ? ""
                             : "; the loss scaled by trainmem's GradScaler (its step taken; the step predicted as "
                               "a function, its phases not split: Note [fp16 autocast as a step function])");
    case Precision::kBf16Master:
    case Precision::kFp16Master:
      break;
  }
  return "";
}

} // namespace

Estimate estimate(torch::nn::Module& module, const std::function<at::Tensor()>& loss_fn,
                  torch::optim::Optimizer& optimizer, const EstimateOptions& options) {
  const auto& o = options;
  TORCH_CHECK(o.precision() != Precision::kBf16Master && o.precision() != Precision::kFp16Master,
              "estimate: expected precision fp32, bf16-autocast, bf16, fp16 or fp16-autocast, but got ",
              precision_name(o.precision()),
              " (fp32 master weights beside the model: estimate_model() predicts a config-file model's step "
              "with them)");
  TORCH_CHECK(o.accumulation() >= 1, "estimate: expected accumulation >= 1, but got ", o.accumulation());
  TORCH_CHECK(loss_fn, "estimate: expected a loss function, but got an empty one");
  Estimate e;
  e.options = o;
  e.buckets = account(module, optimizer);
  auto r = predict_step(module, [&](c10::DeviceType device) { return loss_under(o.precision(), device, loss_fn); },
                        optimizer, o);
  e.saved_bytes = r.saved_bytes;
  e.step_peak = r.step_peak;
  e.step_phases_split = r.step_phases_split;
  e.cuda = std::move(r.cuda);

  const auto& b = e.buckets;
  auto& a = e.assumptions;
  a.push_back(fmt::format("module: {} parameters, {} trainable, {} B of buffers; the step: gradients to none, "
                          "loss_fn() (its batch made on meta), backward, the optimizer's step",
                          with_commas(b.num_params), with_commas(b.num_trainable_params),
                          with_commas(b.buffer_bytes)));
  a.push_back(step_precision_assumption(o.precision(), o.cuda().has_value()));
  if (o.accumulation() > 1) {
    a.push_back(fmt::format("accumulation {}: loss_fn run {} times, each loss divided by {} before its backward, "
                            "one optimizer step after them (the step predicted as a function, its phases not "
                            "split); the saved bytes are one micro-batch's",
                            o.accumulation(), o.accumulation(), o.accumulation()));
  }
  a.push_back(fmt::format("optimizer {}: its state as it will be after the first step ({} B); the step peak is the "
                          "second of two steps on meta with the CPU's kernels (the state made in the first), the "
                          "bytes the CPU's allocator holds when the same step runs there",
                          b.optimizer, with_commas(b.predicted_optimizer_state_bytes)));
  if (!o.step()) {
    a.push_back("the step not predicted (options.step false): static buckets and saved bytes only");
  }
  if (o.cuda() && e.cuda) {
    a.push_back(cuda_assumption(*o.cuda(), *e.cuda, b.optimizer));
  }
  return e;
}

} // namespace trainmem
