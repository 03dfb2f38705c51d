#pragma once
/// \file distributed.h
/// Per-rank audits of data-parallel training on LibTorch's c10d: every rank
/// audits its own step (audit.h), the reports are gathered to rank 0 through
/// the user's `c10d::ProcessGroup`, and rank 0 writes one report (a per-rank
/// table, max / min / imbalance, the worst rank) as text, JSON, HTML (ranks
/// side by side) or a Chrome trace with one process per rank.
///
/// Gradients are all-reduced the way `torch.nn.parallel.DistributedDataParallel`
/// does it, by LibTorch's own `c10d::Reducer` (DataParallel below), and its
/// bucket buffers are counted as their own figure ("communication buffers").
///
/// Built when trainmem is configured with TRAINMEM_DISTRIBUTED (on when gloo's
/// headers are found).
///
/// Example (each rank, with a process group made as c10d's docs show):
/// ```
/// trainmem::CpuMemoryTracker::install();
/// Net model; torch::optim::SGD opt(model->parameters(), 0.01);
/// trainmem::check_model_agreement(*model, pg);        // throws naming the ranks that differ
/// trainmem::DataParallel ddp(*model, pg);              // DDP's buckets, c10d::Reducer
/// trainmem::DistributedAudit audit(*model, &opt, pg);
/// audit.set_data_parallel(ddp);
/// for (auto& batch : loader) {                        // this rank's shard
///   ddp.prepare_for_forward();
///   auto step = audit.step();
///   ddp.zero_grad();
///   auto loss = loss_fn(model->forward(batch.data), batch.target);
///   ddp.prepare_for_backward();
///   loss.backward();                                  // buckets all-reduced here
///   opt.step();
/// }
/// if (auto report = audit.gather()) std::cout << trainmem::to_text(*report);   // rank 0
/// ```

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/arg.h>

#include "trainmem/export.h"
#include "trainmem/audit.h"
#include "trainmem/report.h"

namespace c10d {
class Backend;
class ProcessGroup;
class Store;
} // namespace c10d
namespace torch::nn {
class Module;
} // namespace torch::nn
namespace torch::optim {
class Optimizer;
} // namespace torch::optim

namespace trainmem {

/// A `c10d::ProcessGroup` around a bare backend (a `ProcessGroupGloo` or
/// `ProcessGroupNCCL` made by hand), for the APIs below. `store` is the store
/// the backend was made with. Throws c10::Error naming an unknown backend.
TRAINMEM_API c10::intrusive_ptr<c10d::ProcessGroup> make_process_group(
    const c10::intrusive_ptr<c10d::Backend>& backend,
    const c10::intrusive_ptr<c10d::Store>& store);

/// How gradients are bucketed, with DDP's names and defaults.
struct DataParallelOptions {
  /// DDP's bucket_cap_mb, in bytes. Unset: DDP's default (25 MiB), as
  /// `DDP(model)` without bucket_cap_mb.
  TORCH_ARG(std::optional<int64_t>, bucket_cap_bytes) = std::nullopt;
  /// The first bucket's cap once buckets are rebuilt in gradient order after
  /// the first step, in bytes. Unset: DDP's rule
  /// (torch/nn/parallel/distributed.py, _BucketCapacityConfig): 1 MiB
  /// (dist._DEFAULT_FIRST_BUCKET_BYTES) while bucket_cap_bytes is unset, and
  /// bucket_cap_bytes as soon as it is given, even when it is 25 MiB.
  TORCH_ARG(std::optional<int64_t>, first_bucket_cap_bytes) = std::nullopt;
  /// Gradients are views into the buckets (no second copy of every gradient).
  /// Zero them with DataParallel::zero_grad(): LibTorch's
  /// `Optimizer::zero_grad()` detaches them in place, which views forbid.
  TORCH_ARG(bool, gradient_as_bucket_view) = false;

 public:  // (TORCH_ARG leaves the members private)
  /// DDP's default bucket cap, 25 MiB, in bytes.
  static constexpr int64_t kDefaultBucketCapBytes = 25 * 1024 * 1024;
  /// DDP's default first bucket cap (dist._DEFAULT_FIRST_BUCKET_BYTES), in bytes.
  static constexpr int64_t kDefaultFirstBucketCapBytes = 1024 * 1024;
  /// The bucket cap these options give, in bytes.
  int64_t effective_bucket_cap_bytes() const {
    return bucket_cap_bytes().value_or(kDefaultBucketCapBytes);
  }
  /// The first bucket's cap these options give, in bytes (DDP's rule above).
  int64_t effective_first_bucket_cap_bytes() const {
    if (first_bucket_cap_bytes()) {
      return *first_bucket_cap_bytes();
    }
    return bucket_cap_bytes() ? *bucket_cap_bytes() : kDefaultFirstBucketCapBytes;
  }
};

/// Data-parallel gradient synchronisation: LibTorch's `c10d::Reducer` (what
/// DDP runs under the hood) set up as DDP sets it up: one bucket for the
/// first step, then buckets rebuilt in the order gradients arrived, capped at
/// the effective first bucket cap then the bucket cap; each bucket is all-reduced
/// and averaged as soon as its gradients are ready during backward.
///
/// It does not broadcast rank 0's parameters: check_model_agreement() reports
/// ranks that differ instead. The model and process group must outlive it.
class TRAINMEM_API DataParallel {
 public:
  /// Registers hooks on every trainable parameter of `model`. Throws
  /// c10::Error naming a bad option (a cap <= 0), or a model with no
  /// trainable parameters.
  DataParallel(
      torch::nn::Module& model,
      c10::intrusive_ptr<c10d::ProcessGroup> process_group,
      DataParallelOptions options = {});
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  /// Call before each forward: after the first step, rebuilds the buckets in
  /// gradient order (once, a collective), as DDP's forward does. Returns true
  /// when it rebuilt them. Call it outside an audited step: the new buckets
  /// are allocated here.
  bool prepare_for_forward();
  /// Call after forward, before backward (DDP's post-forward).
  void prepare_for_backward();
  /// Sets gradients to zero in place when they are bucket views, else to
  /// undefined (set_to_none, like `Optimizer::zero_grad()`).
  void zero_grad();

  /// Bytes of the bucket buffers (unique storages), in bytes. With
  /// gradient_as_bucket_view the gradients live in them.
  int64_t communication_bytes() const;
  /// Bytes of each bucket, in the order they are reduced, in bytes.
  std::vector<int64_t> bucket_bytes() const;
  /// The bucket buffers themselves (flat tensors), in the order they are reduced.
  std::vector<at::Tensor> bucket_buffers() const;
  /// World size of the process group.
  int64_t world_size() const;
  const DataParallelOptions& options() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Compares `model` across the ranks of `process_group` (a collective every
/// rank calls): number of parameters, their shapes and dtypes, and their
/// values (a hash of their bytes). Returns, on every rank, one line per rank
/// that differs from rank 0 ("rank 2: 3 parameters, rank 0 has 4"); empty when
/// all agree. Data-parallel training over such ranks would average unrelated
/// gradients: report it, do not train.
TRAINMEM_API std::vector<std::string> check_model_agreement(
    const torch::nn::Module& model,
    const c10::intrusive_ptr<c10d::ProcessGroup>& process_group);

/// One rank's audit.
struct RankReport {
  int64_t rank = 0;
  AuditReport audit;                  ///< its own steps (audit.h)
  int64_t communication_bytes = 0;    ///< DDP bucket buffers, in bytes (0 without DataParallel)
  std::vector<int64_t> bucket_bytes;  ///< each bucket, in bytes
  int64_t origin_ns = 0;              ///< CLOCK_MONOTONIC time its timeline starts at, in ns (aligns ranks on one host)
};

/// Everything a multi-rank audit found. Plain data.
struct TRAINMEM_API DistributedReport {
  std::string schema = "trainmem-distributed/1";
  std::string title = "train";
  std::string backend;                ///< the process group's backend: "gloo", "nccl"...
  int64_t world_size = 0;
  /// Settings of the run ("nproc" -> "2", "bucket_cap_bytes" -> ...).
  std::vector<std::pair<std::string, std::string>> config;
  /// Static bytes per rank predicted by the accountant (ZeRO-0: every rank
  /// holds everything), in bytes, or -1 when the recipe has no closed form.
  int64_t predicted_static_per_rank_bytes = -1;
  std::string prediction;             ///< the prediction's formula, one line per term
  std::vector<RankReport> ranks;      ///< by rank
  std::vector<std::string> disagreements; ///< check_model_agreement()'s lines
  std::vector<std::string> notes;     ///< caveats worth reading

  /// Rank with the highest peak (the lowest such rank); -1 without ranks.
  int64_t worst_rank() const;
  /// Highest and lowest peak over ranks, in bytes.
  int64_t max_peak_bytes() const;
  int64_t min_peak_bytes() const;
  /// Highest peak over the mean peak (1.0 = balanced); 0 without ranks.
  double peak_imbalance() const;
};

/// Audits one rank's steps (an Audit) and gathers every rank's report to
/// rank 0 through the process group. Not thread-safe (like Audit).
class TRAINMEM_API DistributedAudit {
 public:
  /// As Audit's constructor; `process_group` must outlive it. Throws on a
  /// null process group.
  DistributedAudit(
      const torch::nn::Module& model,
      const torch::optim::Optimizer* optimizer,
      c10::intrusive_ptr<c10d::ProcessGroup> process_group,
      c10::Device device = c10::Device(c10::kCPU),
      AuditOptions options = {});
  ~DistributedAudit();
  DistributedAudit(const DistributedAudit&) = delete;
  DistributedAudit& operator=(const DistributedAudit&) = delete;

  /// This rank's Audit (mark_input, set_config, add_note...).
  Audit& audit();
  /// Opens a step until the returned guard goes out of scope. First gives
  /// the DataParallel's bucket buffers made since the last step (a rebuild)
  /// Category::kCommunication in the timeline: open steps with this, not
  /// with audit().step().
  [[nodiscard]] Audit::StepGuard step();
  /// Reports `data_parallel`'s bucket buffers (it must outlive gather()):
  /// their bytes in the report, and Category::kCommunication in the
  /// timeline. With gradient_as_bucket_view they are the gradients' storage
  /// and stay GRADIENT there. Call it outside a step.
  void set_data_parallel(const DataParallel& data_parallel);
  /// Puts the accountant's per-rank prediction in the report (rank 0's value counts).
  void set_prediction(int64_t static_per_rank_bytes, const std::string& formula);
  /// Adds a line to the report's disagreements (rank 0's lines count).
  void add_disagreement(const std::string& line);

  /// A collective every rank calls once its steps are done: each rank's
  /// report goes to rank 0 (a gather of its JSON). Returns the whole report
  /// on rank 0 and nullopt on the others.
  std::optional<DistributedReport> gather();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// The per-rank table a person reads: static buckets, communication
/// buffers, saved bytes, peak and its phase, step time; max / min /
/// imbalance and the worst rank; the ZeRO-0 prediction beside the measured.
TRAINMEM_API std::string to_text(const DistributedReport& report);
/// One JSON document (schema "trainmem-distributed/1") with one entry per
/// rank, each holding that rank's "trainmem/1" report; `indent` < 0: one line.
TRAINMEM_API std::string to_json(const DistributedReport& report, int indent = 2);
/// Reads a document written by to_json(). Throws c10::Error naming what is wrong.
TRAINMEM_API DistributedReport distributed_report_from_json(const std::string& json);
/// A self-contained HTML page: the per-rank table, then the ranks side by
/// side (buckets, peaks and a live-bytes plot each).
TRAINMEM_API std::string to_html(const DistributedReport& report);
/// Chrome Trace Event JSON with one process per rank (pid = rank), the
/// ranks' timelines aligned on the host's monotonic clock.
TRAINMEM_API std::string to_chrome_trace(const DistributedReport& report);

} // namespace trainmem
