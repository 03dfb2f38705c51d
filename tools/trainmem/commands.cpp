// trainmem audit, estimate and report.

#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli.h"
#include "model_file.h"
#include "trainmem/accountant.h"
#include "trainmem/cuda_predict.h"
#include "trainmem/device.h"
#include "trainmem/report.h"
#include "trainmem/trainer.h"
#include "trainmem/transformer.h"

namespace trainmem::cli {
namespace {

TransformerOptions model_options(const ModelFlags& f) {
  return TransformerOptions()
      .num_layers(f.layers)
      .d_model(f.d_model)
      .num_heads(f.heads)
      .batch(f.batch)
      .seq_len(f.seq_len);
}

struct AuditFlags {
  ModelFlags model;
  std::string optimizer = "adamw";
  double lr = 1e-3;
  std::string precision = "fp32";
  std::string device = "cpu";
  int64_t steps = 2;
  std::string checkpoint = "none";
  bool offload = false;
  bool optimizer_in_backward = false;
  int64_t accumulate = 1;
  uint64_t seed = 0;
  bool json = false;
  bool no_timeline = false;
  std::string html, trace, snapshot;
  bool tf32 = false;
  // estimate --device cuda: the caching allocator's settings and cuBLAS's workspace.
  std::string alloc_conf;
  int64_t cublas_workspace = kCublasWorkspaceBytes;
};

void add_training_flags(CLI::App& sub, AuditFlags& f) {
  add_model_flags(sub, f.model);
  sub.add_option("--optimizer", f.optimizer, "adamw, adam or sgd (momentum 0.9)")
      ->check(CLI::IsMember({"adamw", "adam", "sgd"}))
      ->capture_default_str();
  sub.add_option("--precision", f.precision, "fp32, bf16-autocast, bf16 or fp16-autocast (with a GradScaler)")
      ->check(CLI::IsMember({"fp32", "bf16-autocast", "bf16", "fp16-autocast"}))
      ->capture_default_str();
  sub.add_option("--accumulate", f.accumulate, "micro-batches per step (gradient accumulation)")
      ->capture_default_str();
}

void run_audit(const AuditFlags& f) {
  check_model_flags(f.model);
  TrainerOptions o;
  o.model(model_options(f.model))
      .optimizer(f.optimizer)
      .lr(f.lr)
      .precision(parse_precision(f.precision))
      .device(f.device)
      .steps(f.steps)
      .checkpoint(f.checkpoint)
      .offload(f.offload)
      .optimizer_in_backward(f.optimizer_in_backward)
      .accumulation(f.accumulate)
      .seed(f.seed)
      .timeline(!f.no_timeline)
      .tf32(f.tf32);
  try {
    check_trainer_options(o);
  } catch (const c10::Error& e) {
    throw UsageError(e.what_without_backtrace());
  }
  // Every output is checked before training, so a long run never ends in
  // a report that cannot be written.
  for (const auto* path : {&f.html, &f.trace, &f.snapshot}) {
    if (!path->empty()) {
      check_writable(*path);
    }
  }
  const bool cuda = c10::Device(f.device).is_cuda();
  if (!f.snapshot.empty() && cuda) {
    start_cuda_memory_history();
  }
  if (!f.snapshot.empty() && !cuda && f.no_timeline) {
    throw UsageError("--snapshot on cpu needs the timeline; drop --no-timeline");
  }
  const bool progress = show_progress();
  auto run = train(o, [progress](int64_t step, int64_t steps) {
    if (progress) {
      std::cerr << fmt::format("\rtrainmem: step {}/{}", step, steps) << (step == steps ? "\n" : "") << std::flush;
    }
  });
  if (!f.html.empty()) {
    write_file_atomically(f.html, to_html(run.report));
    std::cerr << "trainmem: wrote " << f.html << "\n";
  }
  if (!f.trace.empty()) {
    write_file_atomically(f.trace, to_chrome_trace(run.report));
    std::cerr << "trainmem: wrote " << f.trace << "\n";
  }
  if (!f.snapshot.empty()) {
    write_file_atomically(f.snapshot, cuda ? cuda_memory_snapshot() : to_memory_viz_pickle(run.timeline));
    if (cuda) {
      stop_cuda_memory_history();
    }
    std::cerr << "trainmem: wrote " << f.snapshot << "\n";
  }
  std::cout << (f.json ? to_json(run.report) + "\n" : to_text(run.report));
}

// Bytes per element of parameters/gradients and of optimizer state.
int64_t element_bytes(const std::string& precision) {
  return precision == "bf16" ? 2 : 4;
}

// estimate --device cuda: the step (forward, loss, backward, optimizer step)
// run on meta and replayed through the caching-allocator model.
CudaStepPrediction estimate_cuda(const AuditFlags& f, const TransformerOptions& mo) {
  std::optional<c10::Device> device;
  try {
    device.emplace(f.device);
  } catch (const c10::Error&) {
  }
  if (!device || !device->is_cuda()) {
    throw UsageError("--device " + f.device + ": expected cpu or cuda[:index]");
  }
  if (f.precision != "fp32") {
    throw UsageError("--device cuda --precision " + f.precision +
                     ": the CUDA prediction runs fp32 (LibTorch's autocast has no meta dispatch key)");
  }
  if (f.accumulate != 1) {
    throw UsageError("--device cuda predicts one batch; drop --accumulate");
  }
  if (f.optimizer == "sgd") {
    throw UsageError("--device cuda --optimizer sgd: the CUDA prediction models AdamW and Adam (same state)");
  }
  if (f.cublas_workspace < 0) {
    throw UsageError(fmt::format("--cublas-workspace {}: expected bytes >= 0", f.cublas_workspace));
  }
  CudaPredictOptions o;
  try {
    o.allocator(CudaAllocatorConfig::parse(f.alloc_conf));
  } catch (const c10::Error& e) {
    throw UsageError("--alloc-conf: " + std::string(e.what_without_backtrace()));
  }
  o.cublas_workspace_bytes(f.cublas_workspace);
  return predict_cuda_transformer_step(mo, BlockCheckpointing::named(mo.num_layers(), "none"),
                                       /*adamw=*/true, o);
}

void run_estimate(const AuditFlags& f) {
  check_model_flags(f.model);
  if (f.accumulate < 1 || f.model.batch % f.accumulate != 0) {
    throw UsageError(fmt::format("expected --batch {} to split into --accumulate {} equal micro-batches",
                                 f.model.batch, f.accumulate));
  }
  const auto mo = model_options(f.model);
  const int64_t params = transformer_num_params(mo);
  const int64_t e = element_bytes(f.precision);
  // LibTorch's optimizers keep state in the parameters' dtype.
  const int64_t state_per_param = f.optimizer == "sgd" ? 1 : 2;
  const std::vector<std::pair<std::string, int64_t>> buckets = {
      {"parameters", params * e}, {"gradients", params * e}, {"optimizer state", params * e * state_per_param}};
  int64_t static_bytes = 0;
  for (const auto& b : buckets) {
    static_bytes += b.second;
  }
  const auto micro = TransformerOptions(mo).batch(mo.batch() / f.accumulate);
  const int64_t first_order = predicted_activation_bytes(micro);
  const bool exact = f.precision == "fp32";
  const auto terms = estimate_activation_bytes(micro);
  const int64_t activations = exact ? terms.total_bytes : first_order / 2;
  std::optional<CudaStepPrediction> cuda;
  if (f.device != "cpu") {
    cuda = estimate_cuda(f, mo);
  }
  if (f.json) {
    nlohmann::ordered_json j;
    j["schema"] = "trainmem/1";
    j["kind"] = "estimate";
    j["config"] = {{"layers", f.model.layers}, {"d_model", f.model.d_model}, {"heads", f.model.heads},
                   {"batch", f.model.batch}, {"seq_len", f.model.seq_len}, {"optimizer", f.optimizer},
                   {"precision", f.precision}, {"accumulation", f.accumulate}};
    j["num_params"] = params;
    for (const auto& [name, bytes] : buckets) {
      j["buckets"].push_back({{"name", name}, {"bytes", bytes}});
    }
    j["static_bytes"] = static_bytes;
    j["first_order_activation_bytes"] = exact ? first_order : first_order / 2;
    j["activation_bytes"] = activations;
    j["activation_bytes_exact"] = exact;
    if (exact) {
      for (const auto& t : terms.terms) {
        j["activation_terms"].push_back({{"name", t.name}, {"bytes", t.bytes}});
      }
    }
    j["lower_bound_peak_bytes"] = static_bytes + activations;
    if (cuda) {
      j["cuda"] = {{"max_memory_allocated_bytes", cuda->max_memory_allocated_bytes},
                   {"max_memory_reserved_bytes", cuda->max_memory_reserved_bytes},
                   {"peak_phase", phase_name(cuda->phase)},
                   {"workspace_bytes", cuda->terms.workspace_bytes},
                   {"kernel_temporary_bytes", cuda->terms.kernel_temporary_bytes},
                   {"rounding_bytes", cuda->terms.rounding_bytes},
                   {"alloc_conf", f.alloc_conf},
                   {"cublas_workspace_bytes", f.cublas_workspace}};
    }
    std::cout << j.dump(2) << "\n";
    return;
  }
  std::string out = fmt::format(
      "trainmem estimate: {} layers, d_model {}, {} heads, batch {} x {} tokens, {}, {} (nothing is run)\n",
      f.model.layers, f.model.d_model, f.model.heads, f.model.batch, f.model.seq_len, f.optimizer, f.precision);
  out += fmt::format("parameters {:>30}  = L (12 d^2 + 13 d)\n", with_commas(params));
  for (const auto& [name, bytes] : buckets) {
    out += fmt::format("  {:<24} {:>16} B  {:>10}\n", name, with_commas(bytes), human_bytes(bytes));
  }
  out += fmt::format("  {:<24} {:>16} B  {:>10}\n", "static total", with_commas(static_bytes), human_bytes(static_bytes));
  out += fmt::format("activations of one micro-batch (batch {}), no checkpointing\n", micro.batch());
  if (exact) {
    for (const auto& t : terms.terms) {
      out += fmt::format("  {:<40} {:>16} B\n", t.name, with_commas(t.bytes));
    }
    out += fmt::format("  {:<40} {:>16} B  (first-order 64 T B d per layer: {} B)\n", "saved for backward",
                       with_commas(activations), with_commas(first_order));
  } else {
    out += fmt::format("  {:<40} {:>16} B  (first-order, 2-byte elements; run `trainmem audit` for exact bytes)\n",
                       "saved for backward", with_commas(activations));
  }
  out += fmt::format("lower bound of the step peak {:>16} B  {:>10}  (static + activations, before transients)\n",
                     with_commas(static_bytes + activations), human_bytes(static_bytes + activations));
  if (cuda) {
    out += fmt::format("on {} (a meta run replayed through the CUDA caching-allocator model, {}, no checkpointing):\n",
                       f.device, f.alloc_conf.empty() ? "default allocator settings" : f.alloc_conf);
    out += to_string(*cuda);
  }
  std::cout << out;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw UsageError("cannot read \"" + path + "\"");
  }
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

} // namespace

void add_audit_command(CLI::App& app) {
  auto f = std::make_shared<AuditFlags>();
  auto* sub = app.add_subcommand("audit", "train the bundled transformer for a few steps and report where memory goes");
  add_training_flags(*sub, *f);
  sub->add_option("--lr", f->lr, "learning rate")->capture_default_str();
  sub->add_option("--device", f->device, "cpu or cuda[:index]")->capture_default_str();
  sub->add_option("--steps", f->steps, "audited steps")->capture_default_str();
  sub->add_option("--checkpoint", f->checkpoint, "none, full, every_<k> or selective (save matmuls)")
      ->capture_default_str();
  sub->add_flag("--offload", f->offload, "keep saved activations on the CPU (save-on-CPU)");
  sub->add_flag("--optimizer-in-backward", f->optimizer_in_backward, "step each parameter inside backward");
  sub->add_option("--seed", f->seed, "seed of weights and data")->capture_default_str();
  sub->add_flag("--json", f->json, "print one JSON document (schema trainmem/1) instead of text");
  sub->add_option("--html", f->html, "write a self-contained HTML report to FILE");
  sub->add_option("--trace", f->trace, "write a Chrome-trace/Perfetto JSON timeline to FILE");
  sub->add_option("--snapshot", f->snapshot, "write a memory_viz snapshot (pickle) to FILE");
  sub->add_flag("--no-timeline", f->no_timeline, "do not record allocator events (CPU)");
  sub->add_flag("--tf32", f->tf32, "CUDA: allow TF32 in fp32 matmuls and convolutions (recorded in the report)");
  sub->callback([f] { run_audit(*f); });
}

void add_estimate_command(CLI::App& app) {
  auto f = std::make_shared<AuditFlags>();
  auto* sub = app.add_subcommand("estimate", "predict static buckets and activations without running anything");
  add_training_flags(*sub, *f);
  sub->add_flag("--json", f->json, "print one JSON document instead of text");
  sub->add_option("--device", f->device, "cpu, or cuda[:index]: also predict the CUDA step's max allocated/reserved")
      ->capture_default_str();
  sub->add_option("--alloc-conf", f->alloc_conf, "with --device cuda: PYTORCH_CUDA_ALLOC_CONF settings to model");
  sub->add_option("--cublas-workspace", f->cublas_workspace,
                  "with --device cuda: cuBLAS workspace bytes per thread (8519680; 33554432 on Hopper and later)")
      ->capture_default_str();
  auto m = std::make_shared<ModelFileFlags>();
  add_model_file_flags(*sub, *m);  // --model FILE (model_file.cpp)
  sub->callback([f, m] {
    if (!m->path.empty()) {
      run_estimate_model(*m, f->model.batch, f->model.seq_len, f->json);
    } else {
      run_estimate(*f);
    }
  });
}

void add_report_command(CLI::App& app) {
  struct Flags {
    std::string input, html, trace;
    bool json = false;
  };
  auto f = std::make_shared<Flags>();
  auto* sub = app.add_subcommand("report", "re-render a saved JSON report (trainmem audit --json) as text or HTML");
  sub->add_option("FILE", f->input, "a report written by trainmem audit --json")->required()->check(CLI::ExistingFile);
  sub->add_option("--html", f->html, "write the HTML report to FILE");
  sub->add_option("--trace", f->trace, "write the Chrome-trace timeline to FILE");
  sub->add_flag("--json", f->json, "print the report as JSON (normalized) instead of text");
  sub->callback([f] {
    for (const auto* path : {&f->html, &f->trace}) {
      if (!path->empty()) {
        check_writable(*path);
      }
    }
    AuditReport r;
    try {
      r = report_from_json(read_file(f->input));
    } catch (const c10::Error& e) {
      throw UsageError(f->input + ": " + e.what_without_backtrace());
    }
    if (!f->html.empty()) {
      write_file_atomically(f->html, to_html(r));
      std::cerr << "trainmem: wrote " << f->html << "\n";
    }
    if (!f->trace.empty()) {
      write_file_atomically(f->trace, to_chrome_trace(r));
      std::cerr << "trainmem: wrote " << f->trace << "\n";
    }
    std::cout << (f->json ? to_json(r) + "\n" : to_text(r));
  });
}

} // namespace trainmem::cli
