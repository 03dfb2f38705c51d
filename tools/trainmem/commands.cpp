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
#include "trainmem/meta.h"
#ifdef TRAINMEM_WITH_DISTRIBUTED
#include "app/distributed_trainer.h"
#endif
#include "trainmem/report.h"
#include "app/trainer.h"
#include "trainmem/models/estimate.h"
#include "trainmem/models/transformer.h"

namespace trainmem::cli {
namespace {

TransformerOptions model_options(const ModelFlags& f) {
  return TransformerOptions()
      .num_layers(f.layers)
      .d_model(f.d_model)
      .num_heads(f.heads);
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
  int64_t meter_every = 0;
  bool force = false;
  std::string html, trace, snapshot;
  // Data-parallel ranks (--nproc N; distributed_trainer.h).
  int64_t nproc = 1;
  double bucket_cap_mb = 25;
  bool bucket_cap_given = false;  // DDP: the 1 MiB first bucket only without bucket_cap_mb
  bool gradient_as_bucket_view = false;
  int64_t timeout_s = 60;
  int64_t fail_rank = -1;
  std::string fail_mode = "kill";
  bool tf32 = false;
  // estimate --device cuda: the caching allocator's settings and cuBLAS's workspace.
  std::string alloc_conf;
  int64_t cublas_workspace = kCublasWorkspaceBytes;
  bool cublas_workspace_given = false;
  std::string gpu;  // --gpu NAME: the GPU predicted (implies --device cuda)
};

void add_training_flags(CLI::App& sub, AuditFlags& f) {
  add_model_flags(sub, f.model);
  sub.add_option("--optimizer", f.optimizer, "adamw, adam or sgd (momentum 0.9)")
      ->check(CLI::IsMember({"adamw", "adam", "sgd"}))
      ->capture_default_str();
  sub.add_option("--precision", f.precision,
                 "fp32, bf16-autocast, bf16, fp16-autocast (with a GradScaler), fp16 (a model held in fp16: "
                 "estimate --model only), bf16-master or fp16-master (a bf16 or fp16 model with fp32 master "
                 "weights, fp16 with a GradScaler: estimate --model only)")
      ->check(CLI::IsMember({"fp32", "bf16-autocast", "bf16", "fp16", "fp16-autocast", "bf16-master", "fp16-master"}))
      ->capture_default_str();
  sub.add_option("--accumulate", f.accumulate, "micro-batches per step (gradient accumulation)")
      ->check(int_in(1, kMaxBatch))
      ->capture_default_str();
}

void run_audit_distributed(const AuditFlags& f, const TrainerOptions& t);

// The bundled transformer of the flags built on meta (in bf16 for --precision
// bf16), the optimizer the trainer makes, and the loss of one micro-batch of
// `batch` / --accumulate sequences, its input made on meta: what `trainmem
// estimate` and audit's memory pre-flight hand to estimate().
struct MetaStep {
  Transformer model{nullptr};
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  std::function<at::Tensor()> loss;
};

MetaStep meta_step(const AuditFlags& f, int64_t batch) {
  MetaStep s;
  {
    MetaInitGuard guard;
    s.model = Transformer(model_options(f.model));
  }
  const bool pure = f.precision == "bf16";
  if (pure) {
    s.model->to(at::kBFloat16);
  }
  s.optimizer = detail::make_optimizer(f.optimizer, s.model->parameters(), f.lr);
  // The loss in fp32, as the trainer computes it (a no-op cast in fp32).
  s.loss = [model = s.model.ptr(), shape = std::vector<int64_t>{batch / f.accumulate, f.model.seq_len, f.model.d_model},
            dtype = pure ? at::kBFloat16 : at::kFloat] {
    const auto x = at::empty(shape, at::TensorOptions().device(at::kMeta).dtype(dtype));
    return model->forward(x).to(at::kFloat).pow(2).mean();
  };
  return s;
}

// estimate() of the bundled transformer's step at `batch` (--accumulate
// micro-batches); `step` false: its static buckets and saved bytes only.
Estimate estimate_of(const AuditFlags& f, int64_t batch, bool step, const CudaPredictOptions* cuda) {
  MetaStep s = meta_step(f, batch);
  auto options = EstimateOptions().precision(parse_precision(f.precision)).accumulation(f.accumulate).step(step);
  if (cuda != nullptr) {
    options.cuda(*cuda);
  }
  return estimate(*s.model, s.loss, *s.optimizer, options);
}

// Note [Memory pre-flight]
// An audit that cannot fit is killed by the kernel (exit 137, no message),
// after minutes. Before building the model, audit compares its own estimate
// with the memory this process may still use (MemAvailable, cgroup limit)
// and refuses with both figures unless --force. The estimate is estimate()'s
// static total and saved bytes, without its step prediction (one forward on
// meta, quick for any size): without checkpointing static + activations (the
// step's peak is within a few percent of it); with checkpointing only one
// block's activations are counted, a figure below the peak, so a run that
// fits is never refused.
// With --nproc every rank is a process of its own on this host: each holds
// the static bytes, its shard's activations and (without
// --gradient-as-bucket-view) DDP's copy of the gradients, so the need is
// nproc times that.
void check_memory_fits(const AuditFlags& f) {
  if (f.force || !c10::Device(f.device).is_cpu()) {
    return;
  }
  const auto available = available_memory_bytes();
  if (!available) {
    return;
  }
  AuditFlags shard = f;
  const int64_t ranks = f.nproc > 1 && f.model.batch % f.nproc == 0 ? f.nproc : 1;
  shard.model.batch = f.model.batch / ranks;
  const Estimate e = estimate_of(shard, shard.model.batch, /*step=*/false, nullptr);
  const int64_t static_bytes = e.buckets.predicted_total_bytes();
  const bool whole = f.checkpoint == "none";
  const int64_t buckets = ranks > 1 && !f.gradient_as_bucket_view ? e.buckets.predicted_grad_bytes : 0;  // a copy
  const int64_t per_rank = static_bytes + buckets + (whole ? e.saved_bytes : e.saved_bytes / f.model.layers);
  const int64_t need = ranks * per_rank;
  if (need > *available) {
    throw CheckFailed(fmt::format(
        "not enough memory: this audit needs about {} B ({}: {}{} static{} + {} of activations{}{}), but only {} B "
        "({}) is available; shrink the model or batch, use --checkpoint, or pass --force to run anyway",
        with_commas(need), human_bytes(need), ranks > 1 ? fmt::format("{} ranks x (", ranks) : "",
        with_commas(static_bytes), buckets > 0 ? fmt::format(" + {} DDP buckets", with_commas(buckets)) : "",
        with_commas(per_rank - static_bytes - buckets), whole ? "" : ", one block's",
        ranks > 1 ? ")" : "", with_commas(*available), human_bytes(*available)));
  }
}

// bf16-master, fp16-master and fp16 are predicted for config-file models only (estimate
// --model).
void refuse_master_weights(const AuditFlags& f, const char* command) {
  if (f.precision == "fp16") {
    throw UsageError(fmt::format("--precision fp16 with {}: the bundled transformer's trainer runs fp32, bf16 or "
                                 "autocast; `trainmem estimate --model FILE --precision fp16` predicts a config-file "
                                 "model held in fp16",
                                 command));
  }
  if (f.precision == "bf16-master" || f.precision == "fp16-master") {
    throw UsageError(fmt::format("--precision {0} with {1}: the bundled transformer's trainer keeps no fp32 "
                                 "master weights; `trainmem estimate --model FILE --precision {0}` "
                                 "predicts a config-file model's step with them",
                                 f.precision, command));
  }
}

void run_audit(const AuditFlags& f) {
  refuse_master_weights(f, "audit");
  check_model_flags(f.model);
  check_device(f.device);
  TrainerOptions o;
  o.model(model_options(f.model))
      .batch(f.model.batch)
      .seq_len(f.model.seq_len)
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
      .meter_every(f.meter_every)
      .tf32(f.tf32);
  if (f.nproc != 1) {
    run_audit_distributed(f, o);
    return;
  }
  try {
    check_trainer_options(o);
  } catch (const c10::Error& e) {
    throw UsageError(e.what_without_backtrace());
  }
  // Every output is opened before training, so a long run never ends in a
  // report that cannot be written (OutputFile).
  int num_stdout = 0;
  for (const auto* path : {&f.html, &f.trace, &f.snapshot}) {
    num_stdout += *path == "-" ? 1 : 0;
  }
  if (num_stdout > 1) {
    throw UsageError("expected at most one of --html, --trace, --snapshot to be - (stdout)");
  }
  if (num_stdout == 1 && f.json) {
    throw UsageError("--json prints the report to stdout; write --html, --trace or --snapshot to a file");
  }
  std::optional<OutputFile> html, trace, snapshot;
  if (!f.html.empty()) html.emplace(f.html);
  if (!f.trace.empty()) trace.emplace(f.trace);
  if (!f.snapshot.empty()) snapshot.emplace(f.snapshot);
  check_memory_fits(f);
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
  if (html) {
    html->commit(to_html(run.report));
    std::cerr << "trainmem: wrote " << f.html << "\n";
  }
  if (trace) {
    trace->commit(to_chrome_trace(run.report));
    std::cerr << "trainmem: wrote " << f.trace << "\n";
  }
  if (snapshot) {
    snapshot->commit(cuda ? cuda_memory_snapshot() : to_memory_viz_pickle(run.timeline));
    if (cuda) {
      stop_cuda_memory_history();
    }
    std::cerr << "trainmem: wrote " << f.snapshot << "\n";
  }
  if (num_stdout == 0) {  // "-": that file is stdout's one document
    std::cout << (f.json ? to_json(run.report) + "\n" : to_text(run.report));
  }
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
  // DDP: a 1 MiB first bucket only when bucket_cap_mb is not given (even
  // --bucket-cap-mb 25 makes the first bucket 25 MiB, as DDP(bucket_cap_mb=25)).
  // int(bucket_cap_mb * 1024 * 1024), as DDP rounds it.
  auto dp = DataParallelOptions().gradient_as_bucket_view(f.gradient_as_bucket_view);
  if (f.bucket_cap_given) {
    dp.bucket_cap_bytes(static_cast<int64_t>(f.bucket_cap_mb * 1024 * 1024));
  }
  auto o = DistributedTrainerOptions()
               .trainer(t)
               .nproc(f.nproc)
               .timeout_ms(f.timeout_s * 1000)
               .fail_rank(f.fail_rank)
               .fail_mode(f.fail_mode)
               .data_parallel(dp);
  try {
    check_distributed_trainer_options(o);
  } catch (const c10::Error& e) {
    throw UsageError(e.what_without_backtrace());
  }
  // As run_audit: outputs opened before the ranks start (OutputFile), "-" is stdout.
  const int num_stdout = (f.html == "-" ? 1 : 0) + (f.trace == "-" ? 1 : 0);
  if (num_stdout > 1 || (num_stdout == 1 && f.json)) {
    throw UsageError("expected at most one document on stdout: one of --html -, --trace -, --json");
  }
  std::optional<OutputFile> html, trace;
  if (!f.html.empty()) html.emplace(f.html);
  if (!f.trace.empty()) trace.emplace(f.trace);
  check_memory_fits(f);
  if (show_progress()) {
    std::cerr << fmt::format("trainmem: {} ranks, {} steps each\n", f.nproc, f.steps);
  }
  const auto run = train_distributed(o);
  if (html) {
    html->commit(to_html(run.report));
    std::cerr << "trainmem: wrote " << f.html << "\n";
  }
  if (trace) {
    trace->commit(to_chrome_trace(run.report));
    std::cerr << "trainmem: wrote " << f.trace << "\n";
  }
  if (num_stdout == 0) {
    std::cout << (f.json ? to_json(run.report) + "\n" : to_text(run.report));
  }
#else
  (void)t;
  throw UsageError(fmt::format("--nproc {}: this trainmem was built without distributed audits "
                               "(configure with gloo's headers, Debian libgloo-dev)", f.nproc));
#endif
}

// estimate --device cuda: the flags checked, the allocator settings parsed.
CudaPredictOptions cuda_predict_options(const AuditFlags& f) {
  std::optional<c10::Device> device;
  try {
    device.emplace(f.device);
  } catch (const c10::Error&) {
  }
  if (!device || !device->is_cuda()) {
    throw UsageError("--device " + f.device + ": expected cpu or cuda[:index]");
  }
  if (f.accumulate != 1) {
    throw UsageError("--device cuda predicts one batch; drop --accumulate");
  }
  if (f.optimizer == "sgd") {
    throw UsageError("--device cuda --optimizer sgd: the CUDA prediction models AdamW and Adam (same state)");
  }
  return cuda_options(f.alloc_conf, f.gpu, f.cublas_workspace_given ? std::optional<int64_t>(f.cublas_workspace)
                                                                      : std::nullopt);
}

// estimate --json: the estimate document (docs/report.md).
nlohmann::ordered_json estimate_json(const AuditFlags& f, const Estimate& e, const CudaPredictOptions* cuda,
                                     const std::optional<ActivationEstimate>& terms, int64_t first_order) {
  const auto& b = e.buckets;
  nlohmann::ordered_json j;
  j["schema"] = "trainmem/1";
  j["kind"] = "estimate";
  j["config"] = {{"layers", f.model.layers}, {"d_model", f.model.d_model}, {"heads", f.model.heads},
                 {"batch", f.model.batch}, {"seq_len", f.model.seq_len}, {"optimizer", f.optimizer},
                 {"precision", f.precision}, {"accumulation", f.accumulate}};
  j["num_params"] = b.num_params;
  j["buckets"].push_back({{"name", "parameters"}, {"bytes", b.param_bytes}});
  if (b.buffer_bytes > 0) {
    j["buckets"].push_back({{"name", "buffers"}, {"bytes", b.buffer_bytes}});
  }
  j["buckets"].push_back({{"name", "gradients"}, {"bytes", b.predicted_grad_bytes}});
  j["buckets"].push_back({{"name", "optimizer state"}, {"bytes", b.predicted_optimizer_state_bytes}});
  j["static_bytes"] = b.predicted_total_bytes();
  if (terms) {
    j["first_order_activation_bytes"] = first_order;
  }
  j["activation_bytes"] = e.saved_bytes;
  j["activation_bytes_exact"] = true;
  if (terms) {
    for (const auto& t : terms->terms) {
      j["activation_terms"].push_back({{"name", t.name}, {"bytes", t.bytes}});
    }
  }
  j["step_peak"] = step_peak_json(e.step_peak, e.step_phases_split, b.optimizer);
  j["step_peak"]["exact_on_meta"] = true;
  if (e.cuda) {
    j["cuda"] = {{"max_memory_allocated_bytes", e.cuda->max_memory_allocated_bytes},
                 {"max_memory_reserved_bytes", e.cuda->max_memory_reserved_bytes},
                 {"peak_phase", phase_name(e.cuda->phase)},
                 {"workspace_bytes", e.cuda->terms.workspace_bytes},
                 {"kernel_temporary_bytes", e.cuda->terms.kernel_temporary_bytes},
                 {"rounding_bytes", e.cuda->terms.rounding_bytes},
                 {"alloc_conf", f.alloc_conf},
                 {"gpu", cuda->gpu_name()},
                 {"compute_capability", cuda->compute_capability()},
                 {"flash_attention_calls", e.cuda->flash_attention_calls},
                 {"efficient_attention_calls", e.cuda->efficient_attention_calls},
                 {"cublas_workspace_bytes", cuda->cublas_workspace_bytes()},
                 {"cublaslt_workspace_bytes", cuda->cublaslt_workspace_bytes()}};
  }
  j["assumptions"] = e.assumptions;
  return j;
}

// estimate: the text the command prints.
std::string estimate_text(const AuditFlags& f, const Estimate& e, const CudaPredictOptions* cuda,
                          const std::optional<ActivationEstimate>& terms, int64_t first_order) {
  const auto& b = e.buckets;
  const auto& peak = e.step_peak;
  std::string out = fmt::format(
      "trainmem estimate: {} layers, d_model {}, {} heads, batch {} x {} tokens, {}, {} (built on meta, nothing is "
      "run)\n",
      f.model.layers, f.model.d_model, f.model.heads, f.model.batch, f.model.seq_len, f.optimizer, f.precision);
  out += fmt::format("parameters {:>30}  = L (12 d^2 + 13 d)\n", with_commas(b.num_params));
  const auto bucket = [&](const char* name, int64_t bytes) {
    out += fmt::format("  {:<24} {:>16} B  {:>10}\n", name, with_commas(bytes), human_bytes(bytes));
  };
  bucket("parameters", b.param_bytes);
  if (b.buffer_bytes > 0) {
    bucket("buffers", b.buffer_bytes);
  }
  bucket("gradients", b.predicted_grad_bytes);
  bucket("optimizer state", b.predicted_optimizer_state_bytes);
  bucket("static total", b.predicted_total_bytes());
  out += fmt::format("activations of one micro-batch (batch {}), no checkpointing\n", f.model.batch / f.accumulate);
  if (terms) {
    for (const auto& t : terms->terms) {
      out += fmt::format("  {:<40} {:>16} B\n", t.name, with_commas(t.bytes));
    }
    out += fmt::format("  {:<40} {:>16} B  (exact on meta; first-order 64 T B d per layer: {} B)\n",
                       "saved for backward", with_commas(e.saved_bytes), with_commas(first_order));
  } else {
    out += fmt::format("  {:<40} {:>16} B  (exact on meta)\n", "saved for backward", with_commas(e.saved_bytes));
  }
  out += fmt::format("step peak {:>35} B  {:>10}  ", with_commas(peak.peak_bytes), human_bytes(peak.peak_bytes));
  out += e.step_phases_split
      ? fmt::format("in the {} (forward {} B, backward {} B, optimizer step {} B)", to_string(peak.phase),
                    with_commas(peak.forward_peak_bytes), with_commas(peak.backward_peak_bytes),
                    with_commas(peak.optimizer_peak_bytes))
      : std::string("(the step as a function: phases not split)");
  out += "; exact on meta: the CPU's allocator holds the same\n";
  if (e.cuda) {
    out += fmt::format("on {} ({}; a meta run replayed through the CUDA caching-allocator model, {}, {}, no "
                       "checkpointing):\n",
                       f.device, gpu_words(*cuda), f.precision,
                       f.alloc_conf.empty() ? "default allocator settings" : f.alloc_conf);
    out += to_string(*e.cuda);
  }
  out += "assumed:\n";
  for (const auto& a : e.assumptions) {
    out += "  " + a + "\n";
  }
  return out;
}

// `trainmem estimate`: estimate() of the bundled transformer's step, and in
// fp32 the exact count's terms (estimate_activation_bytes) beside it.
void run_estimate(const AuditFlags& f) {
  refuse_master_weights(f, "estimate (without --model)");
  check_model_flags(f.model);
  if (f.accumulate < 1 || f.model.batch % f.accumulate != 0) {
    throw UsageError(fmt::format("expected --batch {} to split into --accumulate {} equal micro-batches",
                                 f.model.batch, f.accumulate));
  }
  std::optional<CudaPredictOptions> cuda;
  if (f.device != "cpu") {
    cuda = cuda_predict_options(f);
  }
  const Estimate e = estimate_of(f, f.model.batch, /*step=*/true, cuda ? &*cuda : nullptr);
  std::optional<ActivationEstimate> terms;
  int64_t first_order = 0;
  if (f.precision == "fp32") {
    const auto mo = model_options(f.model);
    terms = estimate_activation_bytes(mo, f.model.batch / f.accumulate, f.model.seq_len);
    first_order = predicted_activation_bytes(mo, f.model.batch / f.accumulate, f.model.seq_len);
  }
  if (f.json) {
    std::cout << estimate_json(f, e, cuda ? &*cuda : nullptr, terms, first_order).dump(2) << "\n";
    return;
  }
  std::cout << estimate_text(f, e, cuda ? &*cuda : nullptr, terms, first_order);
}

// A trainmem/1 report of a long audit is a few MiB; 256 MiB is far beyond
// any, and bounds what `trainmem report /dev/zero` reads.
constexpr int64_t kMaxReportBytes = int64_t{256} << 20;

} // namespace

void add_audit_command(CLI::App& app) {
  auto f = std::make_shared<AuditFlags>();
  auto* sub = app.add_subcommand("audit", "train the bundled transformer for a few steps and report where memory goes");
  add_training_flags(*sub, *f);
  sub->add_option("--lr", f->lr, "learning rate")->check(positive_finite())->capture_default_str();
  sub->add_option("--device", f->device, "cpu or cuda[:index]")->capture_default_str();
  sub->add_option("--steps", f->steps, "audited steps")->check(int_in(1, 1000000))->capture_default_str();
  sub->add_option("--checkpoint", f->checkpoint, "none, full, every_<k> or selective (save matmuls)")
      ->capture_default_str();
  sub->add_flag("--offload", f->offload, "keep saved activations on the CPU (save-on-CPU)");
  sub->add_flag("--optimizer-in-backward", f->optimizer_in_backward, "step each parameter inside backward");
  sub->add_option("--seed", f->seed, "seed of weights and data")->capture_default_str();
  sub->add_flag("--json", f->json, "print one JSON document (schema trainmem/1) instead of text");
  sub->add_option("--html", f->html, "write a self-contained HTML report to FILE (- for stdout)")
      ->check(output_path());
  sub->add_option("--trace", f->trace, "write a Chrome-trace/Perfetto JSON timeline to FILE (- for stdout)")
      ->check(output_path());
  sub->add_option("--snapshot", f->snapshot, "write a memory_viz snapshot (pickle) to FILE (- for stdout)")
      ->check(output_path());
  sub->add_flag("--no-timeline", f->no_timeline, "do not record allocator events (CPU)");
  sub->add_option("--meter-every", f->meter_every, "meter saved tensors on steps 0, N, 2N, ... only (1: every step; 0: the steps that differ)")
      ->check(int_in(0, 1000000))
      ->capture_default_str();
  sub->add_option("--nproc", f->nproc, "data-parallel ranks: local processes on Gloo (--device cuda: NCCL, one GPU per rank), the batch split across them")
      ->check(CLI::Range(int64_t{1}, int64_t{1024}))
      ->capture_default_str();
  sub->add_option_function<double>(
         "--bucket-cap-mb",
         [f](double v) {
           f->bucket_cap_mb = v;
           f->bucket_cap_given = true;
         },
         "DDP bucket cap in MiB (with --nproc); as in DDP, the first bucket is 1 MiB only when this is not given")
      ->default_str("25");
  sub->add_flag("--gradient-as-bucket-view", f->gradient_as_bucket_view,
                "gradients are views of the DDP buckets (with --nproc)");
  sub->add_option("--timeout", f->timeout_s, "seconds before a collective or the store gives up (with --nproc)")
      ->capture_default_str();
  sub->add_option("--fail-rank", f->fail_rank, "fault injection (with --nproc): this rank fails")
      ->capture_default_str();
  sub->add_option("--fail-mode", f->fail_mode, "kill, throw or model (with --fail-rank)")
      ->check(CLI::IsMember({"kill", "throw", "model"}))
      ->capture_default_str();
  sub->add_flag("--tf32", f->tf32, "CUDA: allow TF32 in fp32 matmuls and convolutions (recorded in the report)");
  sub->add_flag("--force", f->force, "run even when the estimate exceeds the memory available");
  sub->callback([f] { run_audit(*f); });
}

// estimate --model predicts one AdamW step of the config's model with no
// accumulation (estimate_model(): its precision, checkpointing and LoRA are
// flags): a flag given for another question is refused, naming it, rather
// than answered as that one.
void refuse_flags_model_ignores(const CLI::App& sub, const AuditFlags& f) {
  const auto given = [&](const char* name) { return sub.get_option(name)->count() > 0; };
  for (const auto& [name, value] : {std::pair<const char*, int64_t>{"--layers", f.model.layers},
                                     {"--d-model", f.model.d_model}, {"--heads", f.model.heads}}) {
    if (given(name)) {
      throw UsageError(fmt::format("{} {} with --model: the model's shape comes from its config file; drop {}", name,
                                   value, name));
    }
  }
  if (f.optimizer != "adamw") {
    throw UsageError(fmt::format("--optimizer {} with --model: estimate --model predicts AdamW only; drop "
                                 "--optimizer",
                                 f.optimizer));
  }
  if (f.accumulate != 1) {
    throw UsageError(fmt::format("--accumulate {} with --model: estimate --model predicts one batch (--batch is "
                                 "the micro-batch); drop --accumulate",
                                 f.accumulate));
  }
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
  add_gpu_flag(*sub, f->gpu);
  auto m = std::make_shared<ModelFileFlags>();
  add_model_file_flags(*sub, *m);  // --model FILE (model_file.cpp)
  sub->callback([f, m, sub] {
    f->cublas_workspace_given = sub->get_option("--cublas-workspace")->count() > 0;
    f->device = device_for_gpu(f->device, sub->get_option("--device")->count() > 0, f->gpu);
    if (!m->path.empty()) {
      refuse_flags_model_ignores(*sub, *f);
      std::optional<CudaPredictOptions> cuda;
      if (f->device != "cpu") {
        cuda = cuda_predict_options(*f);
      }
      run_estimate_model(*m, f->model.batch, f->model.seq_len, f->json, cuda ? &*cuda : nullptr, f->device,
                         f->precision);
    } else {
      for (const char* name : {"--checkpoint", "--lora-rank", "--lora-alpha", "--lora-targets", "--ranks", "--zero"}) {
        if (sub->get_option(name)->count() > 0) {
          throw UsageError(fmt::format("{} goes with --model (a config file's model); the bundled transformer's "
                                       "estimate has no such option",
                                       name));
        }
      }
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
  sub->add_option("--html", f->html, "write the HTML report to FILE (- for stdout)")->check(output_path());
  sub->add_option("--trace", f->trace, "write the Chrome-trace timeline to FILE (- for stdout)")
      ->check(output_path());
  sub->add_flag("--json", f->json, "print the report as JSON (normalized) instead of text");
  sub->callback([f] {
    const int num_stdout = (f->html == "-" ? 1 : 0) + (f->trace == "-" ? 1 : 0);
    if (num_stdout > 1 || (num_stdout == 1 && f->json)) {
      throw UsageError("expected at most one document on stdout: one of --html -, --trace -, --json");
    }
    std::optional<OutputFile> html, trace;
    if (!f->html.empty()) html.emplace(f->html);
    if (!f->trace.empty()) trace.emplace(f->trace);
    AuditReport r;
    try {
      r = report_from_json(read_file_bounded(f->input, kMaxReportBytes));
    } catch (const c10::Error& e) {
      throw UsageError(f->input + ": " + e.what_without_backtrace());
    }
    if (html) {
      html->commit(to_html(r));
      std::cerr << "trainmem: wrote " << f->html << "\n";
    }
    if (trace) {
      trace->commit(to_chrome_trace(r));
      std::cerr << "trainmem: wrote " << f->trace << "\n";
    }
    if (num_stdout == 0) {
      std::cout << (f->json ? to_json(r) + "\n" : to_text(r));
    }
  });
}

} // namespace trainmem::cli
