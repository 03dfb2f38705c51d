// trainmem audit, estimate and report.

#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli.h"
#include "trainmem/accountant.h"
#include "trainmem/device.h"
#ifdef TRAINMEM_WITH_DISTRIBUTED
#include "trainmem/distributed_trainer.h"
#endif
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
  // Data-parallel ranks (--nproc N; distributed_trainer.h).
  int64_t nproc = 1;
  double bucket_cap_mb = 25;
  bool gradient_as_bucket_view = false;
  int64_t timeout_s = 60;
  int64_t fail_rank = -1;
  std::string fail_mode = "kill";
};

void add_training_flags(CLI::App& sub, AuditFlags& f) {
  add_model_flags(sub, f.model);
  sub.add_option("--optimizer", f.optimizer, "adamw, adam or sgd (momentum 0.9)")
      ->check(CLI::IsMember({"adamw", "adam", "sgd"}))
      ->capture_default_str();
  sub.add_option("--precision", f.precision, "fp32, bf16-autocast or bf16")
      ->check(CLI::IsMember({"fp32", "bf16-autocast", "bf16"}))
      ->capture_default_str();
  sub.add_option("--accumulate", f.accumulate, "micro-batches per step (gradient accumulation)")
      ->capture_default_str();
}

void run_audit_distributed(const AuditFlags& f, const TrainerOptions& t);

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
      .timeline(!f.no_timeline);
  if (f.nproc != 1) {
    run_audit_distributed(f, o);
    return;
  }
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

// `trainmem audit --nproc N`: N local ranks on Gloo, one report from rank 0.
void run_audit_distributed(const AuditFlags& f, const TrainerOptions& t) {
#ifdef TRAINMEM_WITH_DISTRIBUTED
  if (!f.snapshot.empty()) {
    throw UsageError("--snapshot is per process; with --nproc use --trace (one process per rank)");
  }
  if (!(f.bucket_cap_mb > 0)) {
    throw UsageError(fmt::format("expected --bucket-cap-mb > 0, but got {}", f.bucket_cap_mb));
  }
  if (f.timeout_s < 1) {
    throw UsageError(fmt::format("expected --timeout >= 1 second, but got {}", f.timeout_s));
  }
  const auto cap = static_cast<int64_t>(f.bucket_cap_mb * 1024 * 1024);
  auto o = DistributedTrainerOptions()
               .trainer(t)
               .nproc(f.nproc)
               .timeout_ms(f.timeout_s * 1000)
               .fail_rank(f.fail_rank)
               .fail_mode(f.fail_mode)
               // DDP: a 1 MiB first bucket only while the cap is the default.
               .data_parallel(DataParallelOptions()
                                  .bucket_cap_bytes(cap)
                                  .first_bucket_cap_bytes(f.bucket_cap_mb == 25 ? 1024 * 1024 : cap)
                                  .gradient_as_bucket_view(f.gradient_as_bucket_view));
  try {
    check_distributed_trainer_options(o);
  } catch (const c10::Error& e) {
    throw UsageError(e.what_without_backtrace());
  }
  for (const auto* path : {&f.html, &f.trace}) {
    if (!path->empty()) {
      check_writable(*path);
    }
  }
  if (show_progress()) {
    std::cerr << fmt::format("trainmem: {} ranks, {} steps each\n", f.nproc, f.steps);
  }
  const auto run = train_distributed(o);
  if (!f.html.empty()) {
    write_file_atomically(f.html, to_html(run.report));
    std::cerr << "trainmem: wrote " << f.html << "\n";
  }
  if (!f.trace.empty()) {
    write_file_atomically(f.trace, to_chrome_trace(run.report));
    std::cerr << "trainmem: wrote " << f.trace << "\n";
  }
  std::cout << (f.json ? to_json(run.report) + "\n" : to_text(run.report));
#else
  (void)t;
  throw UsageError(fmt::format("--nproc {}: this trainmem was built without distributed audits "
                               "(configure with gloo's headers, Debian libgloo-dev)", f.nproc));
#endif
}

// Bytes per element of parameters/gradients and of optimizer state.
int64_t element_bytes(const std::string& precision) {
  return precision == "bf16" ? 2 : 4;
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
  sub->add_option("--nproc", f->nproc, "data-parallel ranks: local processes on Gloo, the batch split across them")
      ->check(CLI::Range(int64_t{1}, int64_t{1024}))
      ->capture_default_str();
  sub->add_option("--bucket-cap-mb", f->bucket_cap_mb, "DDP bucket cap in MiB (with --nproc)")->capture_default_str();
  sub->add_flag("--gradient-as-bucket-view", f->gradient_as_bucket_view,
                "gradients are views of the DDP buckets (with --nproc)");
  sub->add_option("--timeout", f->timeout_s, "seconds before a collective or the store gives up (with --nproc)")
      ->capture_default_str();
  sub->add_option("--fail-rank", f->fail_rank, "fault injection (with --nproc): this rank fails")
      ->capture_default_str();
  sub->add_option("--fail-mode", f->fail_mode, "kill, throw or model (with --fail-rank)")
      ->check(CLI::IsMember({"kill", "throw", "model"}))
      ->capture_default_str();
  sub->callback([f] { run_audit(*f); });
}

void add_estimate_command(CLI::App& app) {
  auto f = std::make_shared<AuditFlags>();
  auto* sub = app.add_subcommand("estimate", "predict static buckets and activations without running anything");
  add_training_flags(*sub, *f);
  sub->add_flag("--json", f->json, "print one JSON document instead of text");
  sub->callback([f] { run_estimate(*f); });
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
