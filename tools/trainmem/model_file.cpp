// `trainmem estimate --model FILE`: a real architecture from its config.json,
// built on the meta device (no allocation), counted and stepped there.
#include "model_file.h"

#include <algorithm>
#include <iostream>
#include <optional>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <torch/optim/adamw.h>

#include "cli.h"
#include "trainmem/accountant.h"
#include "trainmem/allocator.h"
#include "trainmem/cuda_predict.h"
#include "trainmem/grad_scaler.h"
#include "trainmem/master_weights.h"
#include "trainmem/meter.h"
#include "trainmem/models/estimate.h"
#include "trainmem/models/hf_model.h"
#include "trainmem/meta.h"
#include "trainmem/planner.h"
#include "trainmem/report.h"

namespace trainmem::cli {

void add_lora_flags(CLI::App& sub, LoraFlags& f) {
  sub.add_option("--lora-rank", f.rank, "with --model: LoRA adapters of this rank (PEFT's), every other "
                                        "weight frozen; 0: none")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 20))
      ->capture_default_str();
  sub.add_option("--lora-alpha", f.alpha, "with --lora-rank: PEFT's lora_alpha (the update scaled by alpha / r)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  sub.add_option("--lora-targets", f.targets, "with --lora-rank: the layers to adapt, by name or dotted "
                                              "suffix, comma-separated (q_proj,v_proj; GPT-2: c_attn)");
}

void add_model_file_flags(CLI::App& sub, ModelFileFlags& f) {
  sub.add_option("--model", f.path,
                 "a Hugging Face style config.json (gpt2, llama, mistral, qwen2 or qwen3, as transformers 5.24.0 computes them): estimate that model instead "
                 "(--batch and --seq-len give its micro-batch)");
  sub.add_option("--ranks", f.ranks, "data-parallel ranks the static bytes are split over (with --model)")
      ->capture_default_str();
  sub.add_option("--zero", f.zero, "ZeRO stage 0-3: 1 shards optimizer state, 2 also gradients, 3 also "
                                   "parameters (with --model)")
      ->capture_default_str();
  sub.add_option("--checkpoint", f.checkpoint, "with --model: none, full, every_<k> or selective (matmul outputs "
                                               "kept) checkpointing of the decoder blocks")
      ->capture_default_str();
  add_lora_flags(sub, f.lora);
}

namespace {

HfConfig load_config(const std::string& path, int64_t batch, int64_t seq_len) {
  if (batch < 1 || seq_len < 1) {
    throw UsageError(fmt::format("expected --batch and --seq-len > 0, but got --batch {} --seq-len {}", batch,
                                 seq_len));
  }
  HfConfig config;
  try {
    config = load_hf_config(path);
  } catch (const c10::Error& e) {
    throw UsageError(e.what_without_backtrace());
  }
  if (seq_len > config.max_positions) {
    throw UsageError(fmt::format("expected --seq-len at most {} (the positions of {}), but got {}",
                                 config.max_positions, path, seq_len));
  }
  return config;
}

std::string describe(const HfConfig& config, const std::string& path) {
  return fmt::format("{} from {}: {} layers, hidden {}, {} heads ({} key-value), MLP {}, vocab {}{}{}; "
                     "as transformers {}'s {}",
                     to_string(config.architecture), path, config.num_layers, config.hidden_size, config.num_heads,
                     config.num_kv_heads, config.intermediate_size, config.vocab_size,
                     config.tie_word_embeddings ? ", tied head" : "",
                     config.sliding_window > 0 ? fmt::format(", sliding window {}", config.sliding_window) : "",
                     kHfTransformersVersion, hf_class_name(config.architecture));
}

} // namespace

namespace {

// --lora-targets "q_proj,v_proj" -> {"q_proj", "v_proj"}; empty names refused.
std::vector<std::string> split_targets(const std::string& list) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= list.size()) {
    const size_t comma = std::min(list.find(',', start), list.size());
    const std::string name = list.substr(start, comma - start);
    if (name.empty()) {
      throw UsageError(fmt::format("--lora-targets \"{}\": expected module names separated by commas, such as "
                                   "q_proj,v_proj",
                                   list));
    }
    out.push_back(name);
    start = comma + 1;
  }
  return out;
}

// --precision with --model: any of the five, for estimate and plan alike.
Precision model_precision(const std::string& precision) {
  try {
    return parse_precision(precision);
  } catch (const c10::Error& e) {
    throw UsageError("--precision: " + std::string(e.what_without_backtrace()));
  }
}

ModelEstimateOptions estimate_options(const ModelFileFlags& f, int64_t batch, int64_t seq_len,
                                      const CudaPredictOptions* cuda, const std::string& precision) {
  if (f.ranks < 1) {
    throw UsageError("expected --ranks >= 1, but got " + std::to_string(f.ranks));
  }
  if (f.zero < 0 || f.zero > 3) {
    throw UsageError("expected --zero 0, 1, 2 or 3, but got " + std::to_string(f.zero));
  }
  auto o = model_options(batch, seq_len, precision, f.lora).ranks(f.ranks).zero(f.zero);
  o.checkpoint(f.checkpoint);
  if (cuda != nullptr) {
    o.cuda(*cuda);
  }
  return o;
}

} // namespace

ModelEstimateOptions model_options(int64_t batch, int64_t seq_len, const std::string& precision,
                                   const LoraFlags& lora) {
  auto o = ModelEstimateOptions().batch(batch).seq_len(seq_len).precision(model_precision(precision));
  if (lora.rank > 0) {
    if (lora.targets.empty()) {
      throw UsageError(fmt::format("--lora-rank {}: name the layers to adapt with --lora-targets, such as "
                                   "q_proj,v_proj",
                                   lora.rank));
    }
    o.lora(LoraOptions().rank(lora.rank).alpha(lora.alpha).targets(split_targets(lora.targets)));
  } else if (!lora.targets.empty()) {
    throw UsageError("--lora-targets " + lora.targets + ": give the adapters' rank with --lora-rank");
  }
  return o;
}

nlohmann::ordered_json step_peak_json(const StepPeak& peak, bool phases_split, const std::string& optimizer) {
  return {{"optimizer", optimizer},
          {"peak_bytes", peak.peak_bytes},
          {"phase", to_string(peak.phase)},
          {"param_bytes", peak.param_bytes},
          {"optimizer_state_bytes", peak.optimizer_state_bytes},
          {"activation_bytes", peak.activation_bytes},
          {"forward_peak_bytes", peak.forward_peak_bytes},
          {"backward_peak_bytes", peak.backward_peak_bytes},
          {"optimizer_peak_bytes", peak.optimizer_peak_bytes},
          {"phases_split", phases_split}};
}

namespace {

// estimate --model --json: the estimate_model document (docs/cli.md).
nlohmann::ordered_json estimate_model_json(const ModelFileFlags& f, const HfConfig& config,
                                           const ModelEstimateOptions& options, const ModelEstimate& e,
                                           const std::string& device, const std::string& precision) {
  const int64_t batch = options.batch(), seq_len = options.seq_len();
  const auto& peak = e.step_peak;
  nlohmann::ordered_json j;
  j["schema"] = "trainmem/1";
  j["kind"] = "estimate_model";
  j["model"] = {{"file", f.path},
                {"architecture", to_string(config.architecture)},
                {"vocab_size", config.vocab_size},
                {"hidden_size", config.hidden_size},
                {"num_layers", config.num_layers},
                {"num_heads", config.num_heads},
                {"num_kv_heads", config.num_kv_heads},
                {"intermediate_size", config.intermediate_size},
                {"max_positions", config.max_positions},
                {"tie_word_embeddings", config.tie_word_embeddings},
                {"sliding_window", config.sliding_window},
                {"use_cache", config.use_cache},
                {"follows", fmt::format("transformers {} {}", kHfTransformersVersion,
                                        hf_class_name(config.architecture))}};
  j["micro_batch"] = {{"batch", batch}, {"seq_len", seq_len}};
  j["sharding"] = {{"zero_stage", f.zero}, {"world_size", f.ranks}, {"largest_layer_params", e.largest_layer_params}};
  j["num_params"] = e.num_params;
  j["trainable_params"] = e.trainable_params;
  for (const auto& s : e.recipes) {
    j["recipes"].push_back({{"recipe", to_string(s.formula.recipe)},
                            {"bytes_per_param", s.formula.bytes_per_param},
                            {"static_bytes", s.formula.total_bytes},
                            {"device_per_rank_bytes", s.device_per_rank_bytes},
                            {"host_per_rank_bytes", s.host_per_rank_bytes}});
  }
  j["precision"] = precision;
  j["checkpoint"] = options.checkpoint();
  if (options.lora()) {
    const auto& l = *options.lora();
    j["lora"] = {{"rank", l.rank()}, {"alpha", l.alpha()}, {"targets", l.targets()}, {"layers", e.lora_layers.size()},
                 {"follows", fmt::format("peft {}", kPeftVersion)}};
  } else {
    j["lora"] = nullptr;
  }
  j["activation_bytes"] = e.saved_bytes;
  j["step_peak"] = step_peak_json(peak, e.step_phases_split, "AdamW");
  if (e.cuda) {
    j["cuda"] = {{"device", device},
                 {"gpu", e.options.cuda()->gpu_name()},
                 {"compute_capability", e.options.cuda()->compute_capability()},
                 {"flash_attention_calls", e.cuda->flash_attention_calls},
                 {"efficient_attention_calls", e.cuda->efficient_attention_calls},
                 {"max_memory_allocated_bytes", e.cuda->max_memory_allocated_bytes},
                 {"max_memory_reserved_bytes", e.cuda->max_memory_reserved_bytes},
                 {"workspace_bytes", e.cuda->terms.workspace_bytes},
                 {"rounding_bytes", e.cuda->terms.rounding_bytes}};
  }
  j["assumptions"] = e.assumptions;
  return j;
}

// estimate --model: the text the command prints.
std::string estimate_model_text(const ModelFileFlags& f, const HfConfig& config, const ModelEstimateOptions& options,
                                const ModelEstimate& e, const std::string& device, const std::string& precision) {
  const int64_t batch = options.batch(), seq_len = options.seq_len();
  const auto& peak = e.step_peak;
  std::string out =
      fmt::format("trainmem estimate: {} (built on meta, nothing is run)\n", describe(config, f.path));
  out += fmt::format("parameters {:>24}", with_commas(e.num_params));
  out += e.trainable_params == e.num_params ? "\n"
                                            : fmt::format("  ({} trainable)\n", with_commas(e.trainable_params));
  out += fmt::format("static bytes by recipe, ZeRO-{} over {} rank{} (per rank: device, host):\n", f.zero,
                     f.ranks, f.ranks == 1 ? "" : "s");
  for (const auto& s : e.recipes) {
    out += fmt::format("  {:<26} {:>5.2f} B/param {:>20} B   per rank {:>20} B {:>10}, host {} B\n",
                       to_string(s.formula.recipe), s.formula.bytes_per_param, with_commas(s.formula.total_bytes),
                       with_commas(s.device_per_rank_bytes), human_bytes(s.device_per_rank_bytes),
                       with_commas(s.host_per_rank_bytes));
  }
  out += fmt::format("activations of one micro-batch (batch {} x {} tokens, {}, checkpointing {}{})\n", batch, seq_len,
                     precision, options.checkpoint(), options.lora() ? ", LoRA" : "");
  out += fmt::format("  {:<26} {:>20} B  {:>10}  (exact on meta)\n", "saved for backward",
                     with_commas(e.saved_bytes), human_bytes(e.saved_bytes));
  if (e.step_phases_split) {
    out += fmt::format("step peak, {} AdamW, one rank {:>20} B  {:>10}  in the {} (forward {} B, backward {} B, "
                       "optimizer step {} B)\n",
                       precision, with_commas(peak.peak_bytes), human_bytes(peak.peak_bytes), to_string(peak.phase),
                       with_commas(peak.forward_peak_bytes), with_commas(peak.backward_peak_bytes),
                       with_commas(peak.optimizer_peak_bytes));
  } else {
    out += fmt::format("step peak, {} AdamW, one rank {:>20} B  {:>10}  (the step as a function: phases not split)\n",
                       precision, with_commas(peak.peak_bytes), human_bytes(peak.peak_bytes));
  }
  if (e.cuda) {
    out += fmt::format("on {} ({}; the same step replayed through the CUDA caching-allocator model, {} AdamW, "
                       "one rank):\n",
                       device, gpu_words(*e.options.cuda()), precision);
    out += to_string(*e.cuda);
  }
  out += "assumed:\n";
  for (const auto& a : e.assumptions) {
    out += "  " + a + "\n";
  }
  return out;
}

} // namespace

void run_estimate_model(const ModelFileFlags& f, int64_t batch, int64_t seq_len, bool json,
                        const CudaPredictOptions* cuda_options, const std::string& device,
                        const std::string& precision) {
  const auto options = estimate_options(f, batch, seq_len, cuda_options, precision);
  const HfConfig config = load_config(f.path, batch, seq_len);
  ModelEstimate e;
  try {
    e = estimate_model(config, options);
  } catch (const c10::Error& err) {
    throw UsageError(err.what_without_backtrace());
  }
  if (json) {
    std::cout << estimate_model_json(f, config, options, e, device, precision).dump(2) << "\n";
    return;
  }
  std::cout << estimate_model_text(f, config, options, e, device, precision);
}

namespace {

// The plan_model document's common part (docs/cli.md).
nlohmann::ordered_json plan_model_json(const std::string& path, const HfConfig& config,
                                       const ModelEstimateOptions& o, const CheckpointPlan& plan) {
  nlohmann::ordered_json j;
  j["schema"] = "trainmem/1";
  j["kind"] = "plan_model";
  j["model"] = {{"file", path}, {"architecture", to_string(config.architecture)}, {"num_layers", config.num_layers}};
  j["micro_batch"] = {{"batch", o.batch()}, {"seq_len", o.seq_len()}};
  j["precision"] = precision_name(o.precision());
  if (o.lora()) {
    j["lora"] = {{"rank", o.lora()->rank()}, {"alpha", o.lora()->alpha()}, {"targets", o.lora()->targets()}};
  } else {
    j["lora"] = nullptr;
  }
  j["plan"] = plan_json(plan);
  return j;
}

// What a plan is for: "fp32, AdamW", "bf16-autocast, LoRA r 8 on q_proj,v_proj, AdamW".
std::string plan_assumes(const ModelEstimateOptions& o) {
  std::string lora;
  if (o.lora()) {
    lora = fmt::format(", LoRA r {} on {} (the rest frozen)", o.lora()->rank(), fmt::join(o.lora()->targets(), ","));
  }
  std::string recipe;  // Note [Planned steps with a scaler or master weights]
  if (o.precision() == Precision::kFp16Autocast) {
    recipe = " (loss scaled by a GradScaler, its tensors counted)";
  } else if (o.precision() == Precision::kBf16Master) {
    recipe = " (bf16 weights and gradients, AdamW over fp32 master weights)";
  } else if (o.precision() == Precision::kFp16Master) {
    recipe = " (fp16 weights and gradients, AdamW over fp32 master weights, loss scaled by a GradScaler)";
  }
  return fmt::format("{}{}{}, AdamW", precision_name(o.precision()), recipe, lora);
}

// AdamW over all it is given: MasterWeights' optimized() tensors (its
// masters require no gradient, so adamw_of_trainable would drop them).
std::unique_ptr<torch::optim::Optimizer> adamw_of_all(const std::vector<at::Tensor>& params) {
  return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-3));
}

// Whether the planned step runs a GradScaler or master weights: its plan's
// predicted peak is already its whole step on meta (plan_regions).
bool has_recipe(const RegionModel& m) { return m.grad_scaler.has_value() || m.master_weights; }

// AdamW over the parameters that train (LoRA leaves the base frozen).
std::unique_ptr<torch::optim::Optimizer> adamw_of_trainable(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> trainable;
  for (const auto& p : params) {
    if (p.requires_grad()) {
      trainable.push_back(p);
    }
  }
  return std::make_unique<torch::optim::AdamW>(std::move(trainable), torch::optim::AdamWOptions(1e-3));
}

// plan --model FILE --device cuda: planned on meta against the predicted CUDA peak.
void run_plan_model_cuda(const std::string& path, const HfConfig& config, int64_t budget,
                         const ModelEstimateOptions& o, bool selective, bool json, const CudaPredictOptions& cuda,
                         CudaBudgetKind kind, const std::string& device) {
  HfModel model;
  {
    MetaInitGuard meta;
    model = build_model(config, o);
  }
  auto m = model_regions(model, o, c10::kCUDA);
  m.make_optimizer = m.master_weights ? adamw_of_all : adamw_of_trainable;  // the masters, or what trains
  const auto r = plan_regions_cuda(m, *model.module, PlanOptions().budget_bytes(budget).selective(selective),
                                   kind, cuda);
  if (json) {
    auto j = plan_model_json(path, config, o, r.plan);
    j["device"] = device;
    j["gpu"] = cuda.gpu_name();
    j["compute_capability"] = cuda.compute_capability();
    j["budget_kind"] = to_string(kind);
    j["cuda"] = cuda_plan_json(r);
    j["cuda"]["rounds"] = r.num_rounds;
    std::cout << j.dump(2) << "\n";
  } else {
    std::cout << fmt::format("trainmem plan: {}; batch {} x {} tokens, {} (planned on meta for --device {}, {}: "
                             "budget {} B on max_memory_{}, predicted; nothing is run)\n\n",
                             describe(config, path), o.batch(), o.seq_len(), plan_assumes(o), device, gpu_words(cuda),
                             with_commas(budget), to_string(kind));
    std::cout << cuda_plan_text(r);
  }
  check_cuda_plan_fits(r);
}

} // namespace

std::string cuda_plan_text(const CudaCheckpointPlan& r) {
  return to_string(r.plan) + "\n" + to_string(r.cuda) +
         fmt::format("planner budget after {} round(s): {} B (CUDA adds workspaces, rounding, copies, slack)\n",
                     r.num_rounds, with_commas(r.planner_budget_bytes));
}

nlohmann::ordered_json plan_json(const CheckpointPlan& p) {
  nlohmann::ordered_json blocks = nlohmann::ordered_json::array();
  for (size_t i = 0; i < p.blocks.size(); ++i) {
    const auto& b = p.blocks[i];
    blocks.push_back({{"region", i < p.region_names.size() ? p.region_names[i] : std::string("block")},
                      {"mode", to_string(b.mode)},
                      {"saved_ops", b.saved_ops},
                      {"region_blocks", b.region_blocks},
                      {"stored_bytes", b.stored_bytes},
                      {"backward_transient_bytes", b.backward_transient_bytes},
                      {"forward_peak_bytes", b.forward_peak_bytes},
                      {"recompute_cost", b.recompute_cost}});
  }
  nlohmann::ordered_json fallbacks = nlohmann::ordered_json::array();
  for (const auto& f : p.cpu_fallbacks) {
    fallbacks.push_back({{"region", f.region}, {"op", f.op}, {"reason", f.reason}});
  }
  nlohmann::ordered_json unavailable = nlohmann::ordered_json::array();
  for (const auto& u : p.unavailable) {
    unavailable.push_back({{"region", u.region}, {"blocks", u.blocks}, {"mode", to_string(u.mode)}, {"reason", u.reason}});
  }
  return {{"name", p.name},
          {"feasible", p.feasible},
          {"budget_bytes", p.budget_bytes},
          {"blocks", blocks},
          {"predicted_peak_bytes", p.predicted_peak_bytes},
          {"peak_phase", to_string(p.peak_phase)},
          {"static_bytes", p.static_bytes},
          {"grad_bytes", p.grad_bytes},
          {"activation_bytes", p.activation_bytes},
          {"recompute_cost", p.recompute_cost},
          {"forward_cost", p.forward_cost},
          {"min_peak_bytes", p.min_peak_bytes},
          {"min_peak_recompute_cost", p.min_peak_cost},
          {"bucket_bytes", p.bucket_bytes},
          {"num_candidates", p.num_candidates},
          {"num_profiles", p.num_profiles},
          {"cpu_fallbacks", fallbacks},
          {"unavailable", unavailable}};
}

nlohmann::ordered_json cuda_plan_json(const CudaCheckpointPlan& r) {
  return {{"feasible", r.feasible},
          {"budget_bytes", r.budget_bytes},
          {"planner_budget_bytes", r.planner_budget_bytes},
          {"max_memory_allocated_bytes", r.cuda.max_memory_allocated_bytes},
          {"max_memory_reserved_bytes", r.cuda.max_memory_reserved_bytes}};
}

void check_cuda_plan_fits(const CudaCheckpointPlan& r) {
  if (!r.feasible) {
    throw CheckFailed(fmt::format("no plan's predicted CUDA max_memory_{} fits {} B (the last plan tried, '{}', "
                                  "predicts {} B allocated, {} B reserved)",
                                  to_string(r.kind), with_commas(r.budget_bytes), r.plan.name,
                                  with_commas(r.cuda.max_memory_allocated_bytes),
                                  with_commas(r.cuda.max_memory_reserved_bytes)));
  }
}

namespace {

// A plan chosen by plan_regions() and checked by its whole step on meta
// (Note [A plan checked by its whole step]): the last plan tried, its whole
// step's peak, the planner's budget after the rounds and how many it took.
struct CheckedPlan {
  CheckpointPlan plan;
  std::optional<StepPeak> whole;
  int64_t planner_budget = 0;
  int rounds = 0;
  bool fits = false;
};

// The model of `config`, built as `o` asks: initialized on CPU (seed 0) to
// run it, else on meta.
HfModel build_plan_model(const HfConfig& config, const ModelEstimateOptions& o, bool run) {
  try {
    if (run) {
      torch::manual_seed(0);
      return build_model(config, o);
    }
    MetaInitGuard meta;
    return build_model(config, o);
  } catch (const c10::Error& e) {
    throw UsageError(e.what_without_backtrace());
  }
}

// Note [A plan checked by its whole step]
// plan_regions composes a step's peak from regions profiled alone; where a
// region's loss head casts (a bf16 model's, or autocast's, fp32 logits)
// that composition was found up to 3.6 % under the step run on CPU, and a
// plan chosen by it went over its budget. So the chosen plan's whole step
// is run on meta (predict_step_peak, exact against the CPU; or taken from
// plan_regions where it weighed the plan by it already), and while it
// is over the budget the planner's budget is lowered by the excess and the
// plan made again (at most 4 rounds). The plan fits when its whole step
// does; both figures are printed.
CheckedPlan plan_checked_by_whole_step(const RegionModel& m, const HfModel& on_meta, const ModelEstimateOptions& o,
                                       int64_t budget, bool selective) {
  const auto whole_step = [&](const CheckpointPlan& p) {
    if (p.whole_step_rounds > 0) {
      // plan_regions weighed it by its whole step already: with the scaler or
      // masters, or where regions carry tensors (a LLaMA's rotary tables).
      StepPeak w;
      w.peak_bytes = p.predicted_peak_bytes;
      w.phase = p.peak_phase;
      return w;
    }
    const auto tm = model_regions(on_meta, o, c10::kCPU);
    const auto topt = adamw_of_trainable(on_meta.module->parameters());
    const auto checkpointing = p.checkpointing();
    return predict_step_peak(*on_meta.module, [&] {
      return tm.loss(run_regions(tm.regions, tm.input(at::kMeta), checkpointing));
    }, topt.get());
  };
  CheckedPlan c;
  c.planner_budget = budget;
  for (; c.rounds < 4; ++c.rounds) {
    c.plan = plan_regions(m, PlanOptions().budget_bytes(c.planner_budget).selective(selective));
    c.whole.reset();
    if (!c.plan.feasible) {
      break;
    }
    c.whole = whole_step(c.plan);
    if (c.whole->peak_bytes <= budget) {
      break;
    }
    c.planner_budget -= c.whole->peak_bytes - budget;
    if (c.planner_budget <= 0) {
      break;
    }
  }
  c.fits = c.plan.feasible && c.whole && c.whole->peak_bytes <= budget;
  return c;
}

void print_plan_model(const std::string& path, const HfConfig& config, const ModelEstimateOptions& o, int64_t budget,
                      const CheckedPlan& c, const std::optional<StepPeak>& measured, bool run, bool json) {
  const auto& plan = c.plan;
  const auto& whole = c.whole;
  if (json) {
    auto j = plan_model_json(path, config, o, plan);
    if (whole) {
      j["whole_step_on_meta"] = {{"peak_bytes", whole->peak_bytes}, {"peak_phase", to_string(whole->phase)},
                                 {"fits", c.fits}, {"planner_budget_bytes", c.planner_budget},
                                 {"rounds", c.rounds + 1}};
    }
    if (measured) {
      j["measured"] = {{"peak_bytes", measured->peak_bytes},
                       {"peak_phase", to_string(measured->phase)},
                       {"activation_bytes", measured->activation_bytes}};
    }
    std::cout << j.dump(2) << "\n";
    return;
  }
  std::cout << fmt::format("trainmem plan: {}; batch {} x {} tokens, {} ({})\n\n", describe(config, path),
                           o.batch(), o.seq_len(), plan_assumes(o),
                           run ? "planned on meta, run on CPU" : "planned on meta, not run");
  std::cout << to_string(plan);
  if (whole) {
    std::cout << fmt::format("  its whole step on meta    {:>16} B (in the {}; planner budget {} B after {} "
                             "round{})\n",
                             with_commas(whole->peak_bytes), to_string(whole->phase), with_commas(c.planner_budget),
                             c.rounds + 1, c.rounds == 0 ? "" : "s");
  }
  if (measured) {
    const double err = static_cast<double>(measured->peak_bytes - whole->peak_bytes) /
                       static_cast<double>(whole->peak_bytes);
    const char* how = o.precision() == Precision::kFp16Autocast ? "one AdamW step with a GradScaler at scale 1"
                      : o.precision() == Precision::kBf16Master   ? "one AdamW step over fp32 master weights"
                      : o.precision() == Precision::kFp16Master
                          ? "one AdamW step over fp32 master weights with a GradScaler at scale 1"
                          : "one AdamW step";
    std::cout << fmt::format("\nran it on CPU ({} after a warm-up step)\n"
                             "  step peak: predicted {} B, measured {} B ({:+.2f} %); {}\n"
                             "  saved for backward: predicted {} B, measured {} B\n",
                             how, with_commas(whole->peak_bytes), with_commas(measured->peak_bytes), 100 * err,
                             measured->peak_bytes <= budget ? "within the budget" : "OVER the budget",
                             with_commas(plan.activation_bytes), with_commas(measured->activation_bytes));
  }
}

void check_plan_model_fits(int64_t budget, const CheckedPlan& c) {
  if (!c.plan.feasible) {
    throw CheckFailed(fmt::format("no plan fits a budget of {} B: the smallest reachable peak is {} B (plan '{}'){}",
                                  with_commas(budget), with_commas(c.plan.min_peak_bytes), c.plan.name,
                                  c.rounds == 0 ? std::string()
                                                : fmt::format(", as the planner composes it; its budget was lowered "
                                                              "to {} B after {} round(s) whose whole step ran over",
                                                              with_commas(c.planner_budget), c.rounds)));
  }
  if (!c.fits) {
    throw CheckFailed(fmt::format("no plan fits a budget of {} B: the last plan tried, '{}', runs its whole step at "
                                  "{} B on meta",
                                  with_commas(budget), c.plan.name, with_commas(c.whole ? c.whole->peak_bytes : 0)));
  }
}

// The planned step with its GradScaler or fp32 master weights run on CPU as
// a user writes it (RegionPlannerPrecisionTest's loops), a warm-up step
// first: its peak (the scaler's own tensors included, as the plan's whole
// step on meta counts them), the phase it fell in and the bytes the measured
// step's forward saved. The run's scaler starts at scale 1, not 65,536:
// memory does not depend on the scale, but a step skipped for inf gradients
// makes no AdamW state; a skipped step is an error.
StepPeak measure_recipe_step(const HfModel& model, const RegionModel& m, const BlockCheckpointing& checkpointing) {
  auto& tracker = CpuMemoryTracker::install();
  std::vector<at::Tensor> trainable;
  for (const auto& p : model.module->parameters()) {
    if (p.requires_grad()) {
      trainable.push_back(p);
    }
  }
  std::optional<GradScaler> scaler;
  std::optional<MasterWeights> masters;
  if (m.grad_scaler) {
    scaler.emplace(GradScalerOptions(*m.grad_scaler).init_scale(1.0));
  }
  if (m.master_weights) {
    masters.emplace(trainable);
  }
  auto opt = adamw_of_all(masters ? (*masters)->optimized() : trainable);
  std::vector<torch::nn::Module*> modules = {model.module.get()};
  if (masters) {
    modules.push_back(masters->get());
  }
  int calls = 0, steps_taken = 0;
  int64_t peaks[3] = {0, 0, 0};  // forward, backward, optimizer step: the measured call's windows
  SavedTensorMeter meter(*model.module);  // its parameters are not activations
  const auto f = measure_step_function(modules, {opt.get()}, [&] {
    const bool measured = ++calls == 2;
    for (auto& p : model.module->parameters()) {
      p.mutable_grad().reset();
    }
    std::optional<PeakWindow> window(std::in_place, tracker);
    at::Tensor loss;
    {
      std::optional<SavedTensorMeterGuard> metered;
      if (measured) {
        metered.emplace(meter);
      }
      loss = m.loss(run_regions(m.regions, m.input(at::kCPU), checkpointing));
    }
    peaks[0] = window->peak_bytes();
    window.emplace(tracker);
    if (scaler) {
      scaler->scale(loss).backward();  // the scaled loss freed here, the loss kept to the end
      if (masters) {
        loss.reset();  // but for the masters' step (the planned step: RecipeStep::run)
      }
    } else {
      loss.backward();
      loss.reset();
    }
    peaks[1] = window->peak_bytes();
    window.emplace(tracker);
    if (scaler && masters) {
      steps_taken += (*masters)->step(*opt, *scaler) ? 1 : 0;
    } else if (scaler) {
      scaler->unscale_(*opt);
      steps_taken += scaler->step(*opt) ? 1 : 0;
      scaler->update();
    } else {
      (*masters)->step(*opt);
      ++steps_taken;
    }
    peaks[2] = window->peak_bytes();
  });
  if (steps_taken != calls) {
    throw CheckFailed(fmt::format("--run: the GradScaler skipped {} of {} CPU steps (inf/NaN gradients at scale "
                                  "1), so the measured step is not the planned one",
                                  calls - steps_taken, calls));
  }
  StepPeak r;
  int64_t scaler_bytes = 0;
  for (const auto& t : scaler ? scaler->tensors() : std::vector<at::Tensor>{}) {
    scaler_bytes += static_cast<int64_t>(t.storage().nbytes());
  }
  r.peak_bytes = f.peak_bytes + scaler_bytes;  // made by the warm-up, none of a module's or optimizer's
  const int64_t top = std::max({peaks[0], peaks[1], peaks[2]});
  r.phase = top == peaks[1] ? StepPhase::kBackward : top == peaks[0] ? StepPhase::kForward : StepPhase::kOptimizerStep;
  r.activation_bytes = meter.report().saved_bytes;
  return r;
}

} // namespace

void run_plan_model(const std::string& path, int64_t budget, const ModelEstimateOptions& o, bool selective,
                    bool run, bool json, const CudaPredictOptions* cuda, CudaBudgetKind kind,
                    const std::string& device) {
  const HfConfig config = load_config(path, o.batch(), o.seq_len());
  if (cuda != nullptr) {
    if (run) {
      throw UsageError("--run with --device " + device + ": the CUDA plan is a prediction; run it on CPU without --device");
    }
    run_plan_model_cuda(path, config, budget, o, selective, json, *cuda, kind, device);
    return;
  }
  if (run) {
    CpuMemoryTracker::install();  // before the model: every CPU byte of the run is counted
  }
  // Planned on meta whatever the size; built on CPU (initialized) only to run it.
  HfModel model = build_plan_model(config, o, run);
  auto m = model_regions(model, o, c10::kCPU);
  auto opt = adamw_of_trainable(model.module->parameters());
  if (m.master_weights) {
    m.make_optimizer = adamw_of_all;  // over the masters, which plan_regions makes
  } else {
    m.optimizer = opt.get();
  }
  HfModel twin;  // the whole step is checked on meta also when the model runs on CPU
  if (run) {
    twin = build_plan_model(config, o, /*run=*/false);
  }
  const CheckedPlan c = plan_checked_by_whole_step(m, run ? twin : model, o, budget, selective);
  std::optional<StepPeak> measured;
  if (c.fits && run) {
    const auto checkpointing = c.plan.checkpointing();
    // The batch made in the step, as the whole step on meta makes it.
    auto step = [&] { return m.loss(run_regions(m.regions, m.input(at::kCPU), checkpointing)); };
    if (has_recipe(m)) {
      measured = measure_recipe_step(model, m, checkpointing);
    } else {
      (void)measure_step_peak(*model.module, step, opt.get());  // warm-up: AdamW's state exists from here on
      measured = measure_step_peak(*model.module, step, opt.get());
    }
  }
  print_plan_model(path, config, o, budget, c, measured, run, json);
  check_plan_model_fits(budget, c);
}

} // namespace trainmem::cli
