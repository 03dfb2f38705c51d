// trainmem audit, estimate and report.

#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>

#include <c10/util/Exception.h>
#include <torch/optim/adamw.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli.h"
#include "model_file.h"
#include "trainmem/accountant.h"
#include "trainmem/cuda_predict.h"
#include "trainmem/grad_scaler.h"
#include "trainmem/device.h"
#include "trainmem/meta.h"
#ifdef TRAINMEM_WITH_DISTRIBUTED
#include "app/distributed_trainer.h"
#endif
#include "trainmem/models/transformer_plan.h"
#include "trainmem/report.h"
#include "app/trainer.h"
#include "trainmem/models/transformer.h"

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
                 "fp32, bf16-autocast, bf16, fp16-autocast (with a GradScaler) or bf16-master (a bf16 model with "
                 "fp32 master weights: estimate --model only)")
      ->check(CLI::IsMember({"fp32", "bf16-autocast", "bf16", "fp16-autocast", "bf16-master"}))
      ->capture_default_str();
  sub.add_option("--accumulate", f.accumulate, "micro-batches per step (gradient accumulation)")
      ->check(int_in(1, kMaxBatch))
      ->capture_default_str();
}

void run_audit_distributed(const AuditFlags& f, const TrainerOptions& t);

// Bytes per element of parameters/gradients and of optimizer state.
int64_t element_bytes(const std::string& precision) {
  return precision == "bf16" ? 2 : 4;
}

// `trainmem estimate`'s figures, shared with audit's memory pre-flight.
struct Estimate {
  int64_t params = 0;
  std::vector<std::pair<std::string, int64_t>> buckets;
  int64_t static_bytes = 0;
  TransformerOptions micro;
  int64_t first_order = 0;  // 64 T B d per layer (fp32), halved for 2-byte precisions
  bool exact = false;       // fp32: the term-by-term count
  ActivationEstimate terms;
  int64_t activation_bytes = 0;
};

Estimate estimate(const AuditFlags& f) {
  Estimate e;
  const auto mo = model_options(f.model);
  e.params = transformer_num_params(mo);
  const int64_t eb = element_bytes(f.precision);
  // LibTorch's optimizers keep state in the parameters' dtype.
  const int64_t state_per_param = f.optimizer == "sgd" ? 1 : 2;
  e.buckets = {{"parameters", e.params * eb}, {"gradients", e.params * eb},
               {"optimizer state", e.params * eb * state_per_param}};
  for (const auto& b : e.buckets) {
    e.static_bytes += b.second;
  }
  e.micro = TransformerOptions(mo).batch(mo.batch() / f.accumulate);
  e.exact = f.precision == "fp32";
  const int64_t first_order = predicted_activation_bytes(e.micro);
  e.first_order = e.exact ? first_order : first_order / 2;
  e.terms = estimate_activation_bytes(e.micro);
  e.activation_bytes = e.exact ? e.terms.total_bytes : first_order / 2;
  return e;
}

// Note [Memory pre-flight]
// An audit that cannot fit is killed by the kernel (exit 137, no message),
// after minutes. Before building the model, audit compares its own estimate
// with the memory this process may still use (MemAvailable, cgroup limit)
// and refuses with both figures unless --force. Without checkpointing the
// estimate is static + activations (the step's peak is within a few percent
// of it); with checkpointing only one block's activations are counted, a
// figure below the peak, so a run that fits is never refused.
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
  const Estimate e = estimate(shard);
  const bool whole = f.checkpoint == "none";
  const int64_t buckets = ranks > 1 && !f.gradient_as_bucket_view ? e.buckets[1].second : 0;  // a gradient copy
  const int64_t per_rank =
      e.static_bytes + buckets + (whole ? e.activation_bytes : e.activation_bytes / f.model.layers);
  const int64_t need = ranks * per_rank;
  if (need > *available) {
    throw CheckFailed(fmt::format(
        "not enough memory: this audit needs about {} B ({}: {}{} static{} + {} of activations{}{}), but only {} B "
        "({}) is available; shrink the model or batch, use --checkpoint, or pass --force to run anyway",
        with_commas(need), human_bytes(need), ranks > 1 ? fmt::format("{} ranks x (", ranks) : "",
        with_commas(e.static_bytes), buckets > 0 ? fmt::format(" + {} DDP buckets", with_commas(buckets)) : "",
        with_commas(per_rank - e.static_bytes - buckets), whole ? "" : ", one block's",
        ranks > 1 ? ")" : "", with_commas(*available), human_bytes(*available)));
  }
}

// bf16-master is predicted for config-file models only (estimate --model).
void refuse_master_weights(const AuditFlags& f, const char* command) {
  if (f.precision == "bf16-master") {
    throw UsageError(fmt::format("--precision bf16-master with {}: the bundled transformer's trainer keeps no fp32 "
                                 "master weights; `trainmem estimate --model FILE --precision bf16-master` "
                                 "predicts a config-file model's step with them",
                                 command));
  }
}

void run_audit(const AuditFlags& f) {
  refuse_master_weights(f, "audit");
  check_model_flags(f.model);
  check_device(f.device);
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

// estimate --device cuda: the step (forward, loss, backward, optimizer step)
// run on meta and replayed through the caching-allocator model.
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

// estimate --device cuda: the step (forward, loss, backward, optimizer step)
// run on meta and replayed through the caching-allocator model.
// In bf16-autocast and bf16 it is the step `trainmem audit --device cuda`
// runs: the forward under CUDA autocast (its casts on meta: Note [Autocast on
// meta] in docs/design.md) or the model and batch in bf16, then the loss in
// fp32.
CudaStepPrediction estimate_cuda(const AuditFlags& f, const TransformerOptions& mo, const CudaPredictOptions& options) {
  const auto plan = BlockCheckpointing::named(mo.num_layers(), "none");
  if (f.precision == "fp16-autocast") {
    // The audited step with its GradScaler (trainer.cpp), as a step function
    // (Note [fp16 autocast as a step function]).
    Transformer meta{nullptr};
    {
      MetaInitGuard guard;
      meta = Transformer(mo);
    }
    torch::optim::AdamW opt(meta->parameters(), torch::optim::AdamWOptions(1e-3));
    GradScaler scaler;
    return predict_cuda_step_function(
        {meta.get()}, {&opt},
        [&] {
          opt.zero_grad();
          const at::Tensor loss = [&] {  // the batch and the output die with the loss function, as in the audit
            const auto x = at::empty({mo.batch(), mo.seq_len(), mo.d_model()}, at::TensorOptions().device(at::kMeta));
            return run_under_autocast(at::kCUDA, at::kHalf, [&] { return meta->forward(x, plan); })
                .to(at::kFloat)
                .pow(2)
                .mean();
          }();
          scaler.scale(loss).backward();
          scaler.step(opt);
          scaler.update();
        },
        options);
  }
  if (f.precision == "fp32") {
    return predict_cuda_transformer_step(mo, plan, /*adamw=*/true, options);
  }
  const bool pure = f.precision == "bf16";
  Transformer meta{nullptr};
  {
    MetaInitGuard guard;
    meta = Transformer(mo);
  }
  if (pure) {
    meta->to(at::kBFloat16);
  }
  torch::optim::AdamW opt(meta->parameters(), torch::optim::AdamWOptions(1e-3));
  return predict_cuda_step_peak(
      *meta,
      [&] {
        const auto x = at::empty({mo.batch(), mo.seq_len(), mo.d_model()},
                                 at::TensorOptions().device(at::kMeta).dtype(pure ? at::kBFloat16 : at::kFloat));
        const at::Tensor y = pure ? meta->forward(x, plan)
                                  : run_under_autocast(at::kCUDA, at::kBFloat16, [&] { return meta->forward(x, plan); });
        return y.to(at::kFloat).pow(2).mean();
      },
      &opt, options);
}

void run_estimate(const AuditFlags& f) {
  refuse_master_weights(f, "estimate (without --model)");
  check_model_flags(f.model);
  if (f.accumulate < 1 || f.model.batch % f.accumulate != 0) {
    throw UsageError(fmt::format("expected --batch {} to split into --accumulate {} equal micro-batches",
                                 f.model.batch, f.accumulate));
  }
  const Estimate e = estimate(f);
  const auto& micro = e.micro;
  const int64_t activations = e.activation_bytes;
  // static + activations is not a bound: transients lift the peak above it,
  // and gradients that replace freed activations in backward keep it below
  // (the capstone's measured step peak is 3.4 % under it).
  const int64_t step_peak = e.static_bytes + activations;
  std::optional<CudaStepPrediction> cuda;
  std::optional<CudaPredictOptions> cuda_opts;
  if (f.device != "cpu") {
    cuda_opts = cuda_predict_options(f);
    cuda = estimate_cuda(f, model_options(f.model), *cuda_opts);
  }
  if (f.json) {
    nlohmann::ordered_json j;
    j["schema"] = "trainmem/1";
    j["kind"] = "estimate";
    j["config"] = {{"layers", f.model.layers}, {"d_model", f.model.d_model}, {"heads", f.model.heads},
                   {"batch", f.model.batch}, {"seq_len", f.model.seq_len}, {"optimizer", f.optimizer},
                   {"precision", f.precision}, {"accumulation", f.accumulate}};
    j["num_params"] = e.params;
    for (const auto& [name, bytes] : e.buckets) {
      j["buckets"].push_back({{"name", name}, {"bytes", bytes}});
    }
    j["static_bytes"] = e.static_bytes;
    j["first_order_activation_bytes"] = e.first_order;
    j["activation_bytes"] = activations;
    j["activation_bytes_exact"] = e.exact;
    if (e.exact) {
      for (const auto& t : e.terms.terms) {
        j["activation_terms"].push_back({{"name", t.name}, {"bytes", t.bytes}});
      }
    }
    j["estimated_peak_bytes"] = step_peak;
    if (cuda) {
      j["cuda"] = {{"max_memory_allocated_bytes", cuda->max_memory_allocated_bytes},
                   {"max_memory_reserved_bytes", cuda->max_memory_reserved_bytes},
                   {"peak_phase", phase_name(cuda->phase)},
                   {"workspace_bytes", cuda->terms.workspace_bytes},
                   {"kernel_temporary_bytes", cuda->terms.kernel_temporary_bytes},
                   {"rounding_bytes", cuda->terms.rounding_bytes},
                   {"alloc_conf", f.alloc_conf},
                   {"gpu", cuda_opts->gpu_name()},
                   {"compute_capability", cuda_opts->compute_capability()},
                   {"flash_attention_calls", cuda->flash_attention_calls},
                   {"efficient_attention_calls", cuda->efficient_attention_calls},
                   {"cublas_workspace_bytes", cuda_opts->cublas_workspace_bytes()},
                   {"cublaslt_workspace_bytes", cuda_opts->cublaslt_workspace_bytes()}};
    }
    std::cout << j.dump(2) << "\n";
    return;
  }
  std::string out = fmt::format(
      "trainmem estimate: {} layers, d_model {}, {} heads, batch {} x {} tokens, {}, {} (nothing is run)\n",
      f.model.layers, f.model.d_model, f.model.heads, f.model.batch, f.model.seq_len, f.optimizer, f.precision);
  out += fmt::format("parameters {:>30}  = L (12 d^2 + 13 d)\n", with_commas(e.params));
  for (const auto& [name, bytes] : e.buckets) {
    out += fmt::format("  {:<24} {:>16} B  {:>10}\n", name, with_commas(bytes), human_bytes(bytes));
  }
  out += fmt::format("  {:<24} {:>16} B  {:>10}\n", "static total", with_commas(e.static_bytes),
                     human_bytes(e.static_bytes));
  out += fmt::format("activations of one micro-batch (batch {}), no checkpointing\n", micro.batch());
  if (e.exact) {
    for (const auto& t : e.terms.terms) {
      out += fmt::format("  {:<40} {:>16} B\n", t.name, with_commas(t.bytes));
    }
    out += fmt::format("  {:<40} {:>16} B  (first-order 64 T B d per layer: {} B)\n", "saved for backward",
                       with_commas(activations), with_commas(e.first_order));
  } else {
    out += fmt::format("  {:<40} {:>16} B  (first-order, 2-byte elements; run `trainmem audit` for exact bytes)\n",
                       "saved for backward", with_commas(activations));
  }
  out += fmt::format("estimated step peak {:>25} B  {:>10}  (static + activations; not a bound: transients add, "
                     "gradients replacing freed activations subtract)\n",
                     with_commas(step_peak), human_bytes(step_peak));
  if (cuda) {
    out += fmt::format("on {} ({}; a meta run replayed through the CUDA caching-allocator model, {}, {}, no "
                       "checkpointing):\n",
                       f.device, gpu_words(*cuda_opts), f.precision,
                       f.alloc_conf.empty() ? "default allocator settings" : f.alloc_conf);
    out += to_string(*cuda);
  }
  std::cout << out;
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
