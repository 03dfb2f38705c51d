#pragma once
/// \file audit.h
/// Audit an existing training loop with a few lines: where memory goes in
/// each step (static buckets, saved activations, peaks per phase, a timeline
/// coloured by category), ready for any report writer (report.h).
///
/// Phases need no marking: backward is detected inside autograd's engine,
/// each added optimizer's step by the ops it runs on its parameters and
/// gradients (its own phase per optimizer), a pass without grad over the
/// parameters (a rollout, an evaluation) by its reads ("forward (no grad)");
/// Audit::phase() marks what a loop does that none of these can see. A step
/// may hold many forward, backward and optimizer steps (a PPO update inside
/// a library call): gradients stay GRADIENT until freed, each minibatch's
/// activations are ACTIVATION and its data INPUT. With no optimizer added,
/// its step is found by its ops and what it keeps is "optimizer state
/// (inferred)". Any number of modules (C++ modules, their
/// holders, TorchScript modules) and optimizers can be audited together.
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

#include <concepts>
#include <cstdint>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/arg.h>

#include "trainmem/export.h"
#include "trainmem/report.h"
#include "trainmem/timeline.h"

namespace torch::nn {
class Module;
} // namespace torch::nn
namespace torch::jit {
struct Module;
} // namespace torch::jit
namespace torch::optim {
class Optimizer;
} // namespace torch::optim

namespace trainmem {

class OptimizerInBackward;

/// What an Audit records.
struct AuditOptions {
  /// Title of the reports.
  TORCH_ARG(std::string, title) = "train";
  /// Meter what autograd saves in each step (saved bytes by node).
  TORCH_ARG(bool, meter) = true;
  /// Which steps the meter runs in. It rides on saved-tensor hooks and is
  /// most of the audit's cost on steps of small ops (docs/benchmarks.md).
  /// 0 (the default): the steps that differ. Every step until two in a row
  /// save the same and make the same allocations (count, sizes and order,
  /// as the CPU tracker sees them); then one in ten, and any step after
  /// one whose allocations differ from the last metered step's. 1: every
  /// step. n > 1: steps 0, n, 2n, ... A step the meter skips keeps its
  /// exact peaks and timeline; its StepRecord has `metered` false, the last
  /// metered step's saved bytes, and `repeats` naming that step when its
  /// allocations repeated it one for one (its saved bytes are then exact;
  /// otherwise unknown). Without the CPU tracker's log (a CUDA device,
  /// timeline(false)) nothing is compared, and 0 meters every step.
  TORCH_ARG(int64_t, meter_every) = 0;
  /// Record every allocation of the audited thread (CPU) for the timeline;
  /// costs a lock per allocation.
  TORCH_ARG(bool, timeline) = true;
  /// Events kept at most, over the whole run and inside one step alike;
  /// later ones are counted as dropped (40 B each: the default caps the
  /// timeline near 80 MB, and memory stays flat past it).
  TORCH_ARG(int64_t, max_events) = 2'000'000;
  /// Points of the thinned series in the report (HTML, Chrome trace).
  TORCH_ARG(int64_t, max_points) = 1500;
};

/// Audits the steps of a training loop on one device.
///
/// Threads: an Audit counts the work of the thread that calls begin_step()
/// (its allocations, the frees of what it allocated from any thread, its
/// saved tensors, its backward passes) and nothing from other threads, so
/// each thread can run its own Audit at once. Drive one Audit from one
/// thread; it may be destroyed on any thread.
///
/// On CPU it installs the counting allocator (allocator.h) if needed; install
/// it yourself first thing in main so that the model's own parameters are
/// counted too. Bytes live when recording starts that are not a parameter,
/// buffer, gradient, optimizer state or labelled tensor are "before the audit"
/// (Category::kBeforeAudit), a baseline the plot can hide. On CUDA the peaks
/// come from the caching allocator (the audit resets its peak statistics at
/// each phase, for the whole device) and the timeline is not recorded: use
/// start_cuda_memory_history() and cuda_memory_snapshot().
class TRAINMEM_API Audit {
 public:
  /// Audits `model` (and `optimizer`, may be null) on `device`. A module that
  /// no shared_ptr owns (a plain object on the stack) must outlive the
  /// Audit; a module holder or a TorchScript module may go first (see
  /// add_module()), and so may the optimizer (see add_optimizer()). Throws
  /// c10::Error naming the device if it cannot be read (see
  /// device_memory_stats()), or as add_optimizer() does.
  Audit(
      const torch::nn::Module& model,
      const torch::optim::Optimizer* optimizer = nullptr,
      c10::Device device = c10::Device(c10::kCPU),
      AuditOptions options = {});
  /// Audits a module holder (`Net model;` where `Net` is TORCH_MODULE(...)).
  template <typename Holder>
    requires requires(const Holder& h) {
      { h.ptr().get() } -> std::convertible_to<const torch::nn::Module*>;
    }
  explicit Audit(
      const Holder& model,
      const torch::optim::Optimizer* optimizer = nullptr,
      c10::Device device = c10::Device(c10::kCPU),
      AuditOptions options = {})
      : Audit(static_cast<const torch::nn::Module&>(*model.ptr().get()), optimizer, device, std::move(options)) {}
  /// Audits a TorchScript module (torch::jit::load()): its parameters are
  /// PARAMETER, never saved activations.
  explicit Audit(
      const torch::jit::Module& model,
      const torch::optim::Optimizer* optimizer = nullptr,
      c10::Device device = c10::Device(c10::kCPU),
      AuditOptions options = {});
  /// An audit of no module yet: add them with add_module().
  explicit Audit(c10::Device device = c10::Device(c10::kCPU), AuditOptions options = {});
  ~Audit();

  Audit(const Audit&) = delete;
  Audit& operator=(const Audit&) = delete;

  /// Audits `module` too (several networks, a trunk and a head). Its
  /// parameters are PARAMETER, its buffers (BatchNorm's running statistics)
  /// BUFFER and a "buffers" bucket, and both are excluded from the saved
  /// bytes. Call it outside a step. A module a shared_ptr owns (a module
  /// holder's) is held weakly: destroyed before report(), it is skipped and a
  /// note says so; a plain module object must outlive the Audit.
  ///
  /// Example:
  /// ```
  /// trainmem::Audit audit(*generator);
  /// audit.add_module(*discriminator);
  /// audit.add_optimizer(opt_g, "G");
  /// audit.add_optimizer(opt_d, "D");
  /// ```
  void add_module(const torch::nn::Module& module);
  /// Audits a module holder too.
  template <typename Holder>
    requires requires(const Holder& h) {
      { h.ptr().get() } -> std::convertible_to<const torch::nn::Module*>;
    }
  void add_module(const Holder& module) {
    add_module(static_cast<const torch::nn::Module&>(*module.ptr().get()));
  }
  /// Audits a TorchScript module too.
  void add_module(const torch::jit::Module& module);

  /// Counts `optimizer`'s state too, and gives its step a phase of its own,
  /// named `name` (by default its type, numbered when several share it).
  /// Throws c10::Error at once if it has no parameters, if some of them are
  /// not parameters of an audited module (add the module first), or inside
  /// a step.
  ///
  /// Optimizers may come and go: one made per epoch or rebuilt by a
  /// scheduler is added again each time. A new optimizer at the address of
  /// one added before, or over any of its parameters, replaces it (and takes
  /// its name and phase); the same object added twice stays one. An
  /// optimizer destroyed is never read again once the audit can tell (it
  /// was replaced, or its state tensors are all gone), and report() never
  /// reads one: the state it counts is as of each optimizer's last step, and
  /// a note names the ones replaced or destroyed. The one limit: a stateless
  /// optimizer (before its first step) destroyed while another, not added,
  /// steps its parameters.
  ///
  /// Example:
  /// ```
  /// for (int epoch = 0; epoch < epochs; ++epoch) {
  ///   torch::optim::Adam opt(model->parameters(), 1e-3);
  ///   audit.add_optimizer(opt);                 // replaces last epoch's
  ///   for (auto& batch : loader) { auto step = audit.step(); /* ... */ }
  /// }
  /// ```
  void add_optimizer(const torch::optim::Optimizer& optimizer, std::string name = {});
  /// Counts the per-parameter optimizers of an OptimizerInBackward: their
  /// state, made inside backward, is OPTIMIZER_STATE. Same checks.
  void add_optimizer(const OptimizerInBackward& optimizer, std::string name = {});

  /// Names a long-lived tensor that is no parameter of an audited module: a
  /// data set held in memory, a frozen table, an EMA copy of the weights.
  /// Its storage is never counted as saved activations, the reports show its
  /// bytes as a bucket called `name`, and the timeline gives its bytes
  /// `category` (INPUT for data, PARAMETER for frozen weights...) instead of
  /// "before the audit" or unknown. Throws if the tensor is undefined, if
  /// `name` is empty, or inside a step.
  ///
  /// Example:
  /// ```
  /// audit.label(dataset_images, "data set (images)", trainmem::Category::kInput);
  /// ```
  void label(const at::Tensor& tensor, std::string name, Category category);
  /// A tensor the training loop optimizes that belongs to no module (neural
  /// style transfer's image): call before add_optimizer() with an optimizer
  /// over it. It gets a bucket of its own ("optimized input (name)",
  /// INPUT on the timeline) and is never counted as a saved activation; its
  /// gradient counts with the gradients and its optimizer state with the
  /// optimizer state. Throws unless it is a leaf that requires grad.
  ///
  /// Example:
  /// ```
  /// auto image = content.clone().requires_grad_(true);
  /// torch::optim::LBFGS opt({image});
  /// trainmem::Audit audit(*vgg);  // frozen features
  /// audit.add_optimized_input(image, "image");
  /// audit.add_optimizer(opt);
  /// ```
  void add_optimized_input(const at::Tensor& tensor, std::string name);
  /// As label(), but adds no bucket to the reports: only the timeline's
  /// category of the tensor's storage (and it is never counted as saved
  /// activations). For bytes a report counts elsewhere: DistributedAudit
  /// gives DDP's bucket buffers Category::kCommunication this way. Same checks.
  void set_category(const at::Tensor& tensor, Category category);

  /// Starts a step. Throws if a step is already open.
  void begin_step();
  /// Ends the open step. Throws if none is open.
  void end_step();

  /// RAII step: begin_step() on construction, end_step() on destruction
  /// (never throws; a failure there becomes a warning). Not thread-local, but
  /// must be destroyed on the thread that made it.
  class TRAINMEM_API StepGuard {
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

  /// Starts an explicitly marked phase inside the open step, named `name`
  /// (empty: the phase's own name). Until end_phase(), automatic detection
  /// of optimizer steps and forward is off (a backward inside still is its
  /// own phase, and the marked phase resumes after it). Throws outside a
  /// step or if a marked phase is already open.
  void begin_phase(Phase phase, std::string name = {});
  /// Ends the marked phase; automatic detection resumes (what follows is
  /// forward until a backward or an optimizer's step shows otherwise).
  void end_phase();

  /// RAII marked phase: begin_phase() on construction, end_phase() on
  /// destruction (never throws).
  ///
  /// Example:
  /// ```
  /// { auto p = audit.phase(trainmem::Phase::kOptimizerStep, "EMA update"); ema.update(model); }
  /// ```
  class TRAINMEM_API PhaseGuard {
   public:
    PhaseGuard(Audit& audit, Phase phase, std::string name);
    ~PhaseGuard();
    PhaseGuard(const PhaseGuard&) = delete;
    PhaseGuard& operator=(const PhaseGuard&) = delete;
    PhaseGuard(PhaseGuard&&) = delete;
    PhaseGuard& operator=(PhaseGuard&&) = delete;

   private:
    Audit& audit_;
  };
  /// Marks a phase until the returned guard goes out of scope.
  [[nodiscard]] PhaseGuard phase(Phase phase, std::string name = {}) {
    return PhaseGuard(*this, phase, std::move(name));
  }

  /// Marks `tensor`'s storage as INPUT in the timeline (call inside a step,
  /// after the batch is made; a batch made on another thread, by a data
  /// loader, is counted from here on).
  void mark_input(const at::Tensor& tensor);

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
  /// Moves the timeline out (no copy of a long run's events); the audit's
  /// own is empty afterwards and goes on as the next piece: its
  /// baseline_bytes are what this one ends with, by category, and the frees
  /// of blocks still live keep their category. Throws while a step is open.
  Timeline take_timeline();

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

} // namespace trainmem
