// `trainmem plan`: choose the cheapest checkpointing of the bundled
// transformer whose predicted step peak fits a budget, then run it and print
// the measured figures beside the predicted ones.
//
//   trainmem plan --budget 40MiB            the plan, predicted and measured
//   trainmem plan --budget 40MiB --json     one JSON document (schema trainmem/1)
//   trainmem plan --budget 1MiB             exit 3: the smallest reachable peak and its cost
#include <chrono>
#include <iostream>
#include <memory>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/optim/adamw.h>

#include "cli.h"
#include "model_file.h"
#include "trainmem/allocator.h"
#include "trainmem/cuda_predict.h"
#include "trainmem/meta.h"
#include "trainmem/models/transformer_plan.h"
#include "trainmem/planner.h"
#include "trainmem/report.h"
#include "trainmem/models/transformer.h"

namespace trainmem::cli {
namespace {

struct PlanFlags {
  ModelFlags model;
  std::string budget;
  bool json = false;
  bool no_selective = false;
  bool no_run = false;
  std::string cost = "flops";
  std::string device = "cpu";             // cuda: plan against the predicted CUDA peak
  std::string budget_kind = "allocated";  // with cuda: allocated or reserved
  std::string model_file;                 // --model: a config.json (model_file.cpp)
  bool run_model = false;                 // --run: with --model, run the plan on CPU
  std::string precision = "fp32";         // --precision: with --model
  std::string checkpoint;                 // --checkpoint: refused (the plan chooses it)
  LoraFlags lora;                         // --lora-*: with --model
  std::string gpu;                        // --gpu NAME: implies --device cuda
  int64_t ranks = 1;                      // --ranks, --zero: refused above 1 and 0 (one rank is planned)
  int64_t zero = 0;
  std::function<bool(const char*)> given; // whether a flag was given
};

struct Measured {
  StepPeak meta;      // the whole step simulated on meta
  StepPeak cpu;       // the step run on CPU
  double step_ms = 0; // wall time of the measured CPU step (not asserted anywhere)
};

Measured run_plan(const TransformerOptions& o, int64_t batch, int64_t seq_len, const CheckpointPlan& plan) {
  Measured m;
  const auto checkpointing = plan.checkpointing();
  {
    Transformer meta{nullptr};
    {
      MetaInitGuard guard;  // no CPU bytes for the meta twin
      meta = Transformer(o);
    }
    torch::optim::AdamW opt(meta->parameters(), torch::optim::AdamWOptions(1e-3));
    m.meta = predict_step_peak(*meta, [&] {
      return meta->forward(at::empty({batch, seq_len, o.d_model()}, at::kMeta), checkpointing)
          .pow(2)
          .mean();
    }, &opt);
  }
  torch::manual_seed(0);
  Transformer model(o);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
  const auto t0 = std::chrono::steady_clock::now();
  m.cpu = measure_step_peak(*model, [&] {
    return model->forward(torch::randn({batch, seq_len, o.d_model()}), checkpointing).pow(2).mean();
  }, &opt);
  m.step_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / 2;
  return m;
}

// plan --device cuda: the budget is on the predicted CUDA max_memory_allocated
// or max_memory_reserved (cuda_predict.h); nothing runs (no GPU is needed).
// --device (cuda[:index]) and --budget-kind checked; the kind.
CudaBudgetKind cuda_budget_kind(const PlanFlags& f) {
  std::optional<c10::Device> device;
  try {
    device.emplace(f.device);
  } catch (const c10::Error&) {
  }
  if (!device || !device->is_cuda()) {
    throw UsageError("--device " + f.device + ": expected cpu or cuda[:index]");
  }
  if (f.budget_kind != "allocated" && f.budget_kind != "reserved") {
    throw UsageError("--budget-kind " + f.budget_kind + ": expected allocated or reserved");
  }
  return f.budget_kind == "allocated" ? CudaBudgetKind::kAllocated : CudaBudgetKind::kReserved;
}

void run_cuda(const PlanFlags& f, const TransformerOptions& o, const PlanOptions& options, const std::string& unit) {
  const auto kind = cuda_budget_kind(f);
  const auto cuda = cuda_options("", f.gpu, std::nullopt);
  const auto r = plan_checkpointing_cuda(o, f.model.batch, f.model.seq_len, options, kind, cuda);
  if (f.json) {
    nlohmann::ordered_json doc = {
        {"schema", "trainmem/1"},
        {"command", "plan"},
        {"device", f.device},
        {"gpu", cuda.gpu_name()},
        {"compute_capability", cuda.compute_capability()},
        {"budget_kind", to_string(kind)},
        {"plan", plan_json(r.plan)},
        {"cost_unit", unit},
        {"cuda", cuda_plan_json(r)},
    };
    std::cout << doc.dump() << "\n";
  } else {
    std::cout << fmt::format("trainmem plan --device {} ({}): budget {} B on max_memory_{} (predicted; nothing "
                             "is run)\n\n",
                             f.device, gpu_words(cuda), with_commas(r.budget_bytes), to_string(kind));
    std::cout << cuda_plan_text(r);
  }
  check_cuda_plan_fits(r);
}

// The flags plan refuses: a config file's options without --model, and
// sharding (Note [A plan is one rank's]).
void refuse_plan_flags(const PlanFlags& f) {
  if (f.model_file.empty()) {
    for (const char* name : {"--precision", "--lora-rank", "--lora-alpha", "--lora-targets"}) {
      if (f.given(name)) {
        throw UsageError(fmt::format("{} goes with --model (a config file's model); the bundled transformer is "
                                     "planned in fp32",
                                     name));
      }
    }
  }
  if (f.ranks != 1 || f.zero != 0) {
    // Note [A plan is one rank's]
    throw UsageError(fmt::format(
        "--ranks {} --zero {}: plan predicts one rank's whole step, unsharded; how ZeRO's partitions and DDP's "
        "buckets live inside the step depends on the framework's schedule, which is not modelled. "
        "`trainmem estimate --model FILE --ranks {} --zero {}` gives the sharded static bytes by recipe",
        f.ranks, f.zero, f.ranks, f.zero));
  }
}

// plan --model FILE: a config file's model, planned on meta (model_file.cpp).
void run_model_file(const PlanFlags& f, int64_t budget) {
  const auto options = model_options(f.model.batch, f.model.seq_len, f.precision, f.lora);
  if (f.cost != "flops") {
    throw UsageError("--cost " + f.cost + " with --model: a model file is planned with FLOP costs (drop --cost)");
  }
  if (f.device != "cpu") {
    const auto kind = cuda_budget_kind(f);
    const CudaPredictOptions cuda = cuda_options("", f.gpu, std::nullopt);
    run_plan_model(f.model_file, budget, options, !f.no_selective, f.run_model, f.json, &cuda, kind, f.device);
    return;
  }
  run_plan_model(f.model_file, budget, options, !f.no_selective, f.run_model, f.json);
}

// The bundled transformer's plan and, when it ran, the measured figures.
void print_plan(const PlanFlags& f, const TransformerOptions& o, const CheckpointPlan& plan, const std::string& unit,
                const std::optional<Measured>& measured, int64_t budget) {
  if (f.json) {
    nlohmann::ordered_json doc = {
        {"schema", "trainmem/1"},
        {"command", "plan"},
        {"model", {{"num_layers", o.num_layers()}, {"d_model", o.d_model()}, {"num_heads", o.num_heads()},
                   {"batch", f.model.batch}, {"seq_len", f.model.seq_len}}},
        {"plan", plan_json(plan)},
        {"cost_unit", unit},
    };
    if (measured) {
      doc["measured"] = {{"peak_bytes", measured->cpu.peak_bytes},
                         {"peak_phase", to_string(measured->cpu.phase)},
                         {"activation_bytes", measured->cpu.activation_bytes},
                         {"meta_peak_bytes", measured->meta.peak_bytes},
                         {"step_ms", measured->step_ms}};
    }
    std::cout << doc.dump() << "\n";
    return;
  }
  std::cout << fmt::format(
      "trainmem plan: {} pre-LN blocks, d_model {}, {} heads, input ({}, {}, {}), fp32, AdamW\n\n",
      o.num_layers(), o.d_model(), o.num_heads(), f.model.batch, f.model.seq_len, o.d_model());
  std::cout << to_string(plan);
  if (measured) {
    const auto& c = measured->cpu;
    std::cout << "\nran it (one AdamW step after a warm-up step)\n";
    std::cout << fmt::format("  {:<34}{:>16}{:>16}\n", "", "predicted B", "measured B");
    std::cout << fmt::format("  {:<34}{:>16}{:>16}\n", "step peak (CPU allocator)",
                             with_commas(plan.predicted_peak_bytes), with_commas(c.peak_bytes));
    std::cout << fmt::format("  {:<34}{:>16}{:>16}\n", "step peak (whole step on meta)",
                             with_commas(measured->meta.peak_bytes), with_commas(c.peak_bytes));
    std::cout << fmt::format("  {:<34}{:>16}{:>16}\n", "saved for backward", with_commas(plan.activation_bytes),
                             with_commas(c.activation_bytes));
    std::cout << fmt::format("  peak phase: predicted {}, measured {}; step time {:.1f} ms (mean of two)\n",
                             to_string(plan.peak_phase), to_string(c.phase), measured->step_ms);
    for (const auto& r : measured->meta.scalar_reads) {  // none from the reference transformer
      std::cout << fmt::format("  read from meta (a real run's control flow may differ): {} x {} -> {}\n",
                               r.num_reads, r.op, r.value);
    }
    std::cout << fmt::format("  measured / predicted peak {:.3f}; {}\n",
                             static_cast<double>(c.peak_bytes) / static_cast<double>(plan.predicted_peak_bytes),
                             c.peak_bytes <= budget ? "within the budget" : "OVER the budget");
  }
}

void run(const PlanFlags& f) {
  check_model_flags(f.model);
  const int64_t budget = parse_bytes(f.budget);
  if (budget <= 0) {
    throw UsageError("--budget " + f.budget + ": expected a positive size, such as 40MiB");
  }
  refuse_plan_flags(f);
  if (!f.checkpoint.empty()) {
    throw UsageError("--checkpoint " + f.checkpoint + ": plan chooses the checkpointing that fits --budget; "
                     "`trainmem estimate --model FILE --checkpoint " + f.checkpoint + "` predicts a given one");
  }
  if (!f.model_file.empty()) {
    run_model_file(f, budget);
    return;
  }
  if (f.run_model) {
    throw UsageError("--run goes with --model (the bundled model's plan runs unless --no-run)");
  }
  CpuMemoryTracker::install();  // first: every CPU byte of the run is counted
  const auto o = TransformerOptions()
                     .num_layers(f.model.layers)
                     .d_model(f.model.d_model)
                     .num_heads(f.model.heads);
  auto plan_options = PlanOptions().budget_bytes(budget).selective(!f.no_selective);
  if (f.cost == "time") {
    torch::manual_seed(0);
    Transformer model(o);
    auto x = torch::randn({f.model.batch, f.model.seq_len, o.d_model()});
    if (show_progress()) {  // seconds of work: say so on a terminal, nowhere else
      std::cerr << "trainmem: timing each op on CPU (3 forward passes)..." << std::endl;
    }
    plan_options.op_cost(measured_op_cost([&] { model->forward(x); }, 3));
  } else if (f.cost != "flops") {
    throw UsageError("--cost " + f.cost + ": expected flops or time");
  }
  const std::string unit = f.cost == "time" ? "s" : "FLOPs";
  if (f.device != "cpu") {
    run_cuda(f, o, plan_options, unit);
    return;
  }
  const auto plan = plan_checkpointing(o, f.model.batch, f.model.seq_len, plan_options);
  std::optional<Measured> measured;
  if (plan.feasible && !f.no_run) {
    if (show_progress()) {
      std::cerr << "trainmem: running the plan (a warm-up step and a measured step)..." << std::endl;
    }
    measured = run_plan(o, f.model.batch, f.model.seq_len, plan);
  }
  print_plan(f, o, plan, unit, measured, budget);
  if (!plan.feasible) {
    throw CheckFailed(fmt::format(
        "no plan fits a budget of {} B: the smallest reachable peak is {} B (plan '{}'), at a "
        "recompute cost of {:.6g} {} ({:.1f} % of a forward)",
        with_commas(budget), with_commas(plan.min_peak_bytes), plan.name, plan.min_peak_cost, unit,
        plan.forward_cost > 0 ? 100.0 * plan.min_peak_cost / plan.forward_cost : 0.0));
  }
}

} // namespace

void add_plan_command(CLI::App& app) {
  auto f = std::make_shared<PlanFlags>();
  auto* sub = app.add_subcommand(
      "plan", "choose the cheapest checkpointing whose step peak fits a budget, then run it");
  add_model_flags(*sub, f->model);
  sub->add_option("--budget", f->budget, "peak bytes for the whole step: 40MiB, 64MB, 1GiB, 50000000")
      ->required();
  sub->add_flag("--json", f->json, "print one JSON document instead of text");
  sub->add_flag("--no-selective", f->no_selective, "whole blocks only (store, checkpoint, segments)");
  sub->add_flag("--no-run", f->no_run, "plan only; do not run the plan");
  sub->add_option("--cost", f->cost, "recompute cost per op: flops (from shapes) or time (measured on CPU first)");
  sub->add_option("--device", f->device, "cpu, or cuda[:index]: the budget is on the predicted CUDA peak")
      ->capture_default_str();
  sub->add_option("--budget-kind", f->budget_kind, "with --device cuda: allocated or reserved")
      ->check(CLI::IsMember({"allocated", "reserved"}))
      ->capture_default_str();
  sub->add_option("--model", f->model_file,
                  "a Hugging Face style config.json (gpt2, llama, mistral, qwen2 or qwen3, as transformers 5.24.0 computes them): plan that model on meta instead "
                  "(--batch and --seq-len give its micro-batch)");
  sub->add_flag("--run", f->run_model, "with --model: also build it on CPU and run one step under the plan");
  sub->add_option("--precision", f->precision,
                  "with --model: fp32, bf16-autocast, bf16 (a model held in bf16), fp16 (a model held in fp16), "
                  "fp16-autocast (with a GradScaler), bf16-master or fp16-master (bf16 or fp16 weights, fp32 "
                  "master weights; fp16 with a GradScaler)")
      ->check(CLI::IsMember({"fp32", "bf16-autocast", "bf16", "fp16", "fp16-autocast", "bf16-master", "fp16-master"}))
      ->capture_default_str();
  add_lora_flags(*sub, f->lora);
  add_gpu_flag(*sub, f->gpu);
  sub->add_option("--checkpoint", f->checkpoint, "refused: the plan chooses the checkpointing (estimate takes it)");
  sub->add_option("--ranks", f->ranks, "data-parallel ranks: only 1 (a plan is one rank's step)")
      ->capture_default_str();
  sub->add_option("--zero", f->zero, "ZeRO stage: only 0 (a plan is one rank's step, unsharded)")
      ->capture_default_str();
  f->given = [sub](const char* name) { return sub->get_option(name)->count() > 0; };
  sub->callback([f] {
    f->device = device_for_gpu(f->device, f->given("--device"), f->gpu);
    run(*f);
  });
}

} // namespace trainmem::cli
