#pragma once
/// \file audit.h
/// Audit an existing training loop with a few lines: where memory goes in
/// each step (static buckets, saved activations, peaks per phase, a timeline
/// coloured by category), ready for any report writer (report.h).
///
/// Phases need no marking: backward is detected inside autograd's engine,
/// the optimizer step is what follows the last backward of a step.
///
/// Example:
/// ```
/// trainmem::CpuMemoryTracker::install();      // first thing in main (CPU)
/// Net model; torch::optim::SGD opt(model->parameters(), 0.01);
/// trainmem::Audit audit(*model, &opt);
/// for (auto& batch : loader) {
///   auto step = audit.step();                 // RAII: begin ... end of step
///   opt.zero_grad();
///   auto loss = torch::nll_loss(model->forward(batch.data), batch.target);
///   loss.backward();
///   opt.step();
/// }
/// std::cout << trainmem::to_text(audit.report());
/// ```

#include <cstdint>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/arg.h>

#include "trainmem/report.h"
#include "trainmem/timeline.h"

namespace torch::nn {
class Module;
} // namespace torch::nn
namespace torch::optim {
class Optimizer;
} // namespace torch::optim

namespace trainmem {

/// What an Audit records.
struct AuditOptions {
  /// Title of the reports.
  TORCH_ARG(std::string, title) = "train";
  /// Meter what autograd saves in each step (saved bytes by node).
  TORCH_ARG(bool, meter) = true;
  /// Record every allocation (CPU) for the timeline; costs a lock per allocation.
  TORCH_ARG(bool, timeline) = true;
  /// Events kept at most; later ones are counted as dropped.
  TORCH_ARG(int64_t, max_events) = 2'000'000;
  /// Points of the thinned series in the report (HTML, Chrome trace).
  TORCH_ARG(int64_t, max_points) = 1500;
};

/// Audits the steps of a training loop on one device. Not thread-safe: drive
/// it from the thread that runs the loop (backward may run anywhere).
///
/// On CPU it installs the counting allocator (allocator.h) if needed; install
/// it yourself first thing in main so that the model's own parameters are
/// counted too. On CUDA the peaks come from the caching allocator (the
/// audit resets its peak statistics at each phase) and the timeline is not
/// recorded: use start_cuda_memory_history() and cuda_memory_snapshot().
class Audit {
 public:
  /// Audits `model` (and `optimizer`, may be null) on `device`. Both must
  /// outlive the Audit. Throws c10::Error naming the device if it cannot be
  /// read (see device_memory_stats()).
  Audit(
      const torch::nn::Module& model,
      const torch::optim::Optimizer* optimizer = nullptr,
      c10::Device device = c10::Device(c10::kCPU),
      AuditOptions options = {});
  ~Audit();

  Audit(const Audit&) = delete;
  Audit& operator=(const Audit&) = delete;

  /// Starts a step. Throws if a step is already open.
  void begin_step();
  /// Ends the open step. Throws if none is open.
  void end_step();

  /// RAII step: begin_step() on construction, end_step() on destruction
  /// (never throws; a failure there becomes a warning). Not thread-local, but
  /// must be destroyed on the thread that made it.
  class StepGuard {
   public:
    explicit StepGuard(Audit& audit);
    ~StepGuard();
    StepGuard(const StepGuard&) = delete;
    StepGuard& operator=(const StepGuard&) = delete;
    StepGuard(StepGuard&&) = delete;
    StepGuard& operator=(StepGuard&&) = delete;

   private:
    Audit& audit_;
  };
  /// Opens a step until the returned guard goes out of scope.
  [[nodiscard]] StepGuard step() { return StepGuard(*this); }

  /// Marks `tensor`'s storage as INPUT in the timeline (call inside a step,
  /// after the batch is made).
  void mark_input(const at::Tensor& tensor);

  /// Counts `optimizer`'s state too (several optimizers: one per parameter
  /// group, or OptimizerInBackward's per-parameter ones). Must outlive the Audit.
  void add_optimizer(const torch::optim::Optimizer& optimizer);

  /// Adds a setting shown in the reports ("batch" -> "16").
  void set_config(const std::string& key, const std::string& value);
  /// Adds a caveat shown in the reports.
  void add_note(const std::string& note);
  /// Sets the activation bytes a model predicts, to show beside the measured.
  void set_predicted_activation_bytes(int64_t bytes);

  /// Steps ended so far.
  int64_t num_steps() const;
  /// The report of the steps ended so far. Throws while a step is open.
  AuditReport report() const;
  /// The raw timeline (CPU): every event, classified.
  const Timeline& timeline() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

} // namespace trainmem
