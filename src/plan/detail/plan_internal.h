// The planner's private declarations, shared by its files (layer `plan`):
// plan_meta_kernels.cpp, predict.cpp, op_cost.cpp, region_profile.cpp,
// plan_search.cpp and planner.cpp. Not installed.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_set>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "trainmem/grad_scaler.h"
#include "trainmem/master_weights.h"
#include "trainmem/planner.h"
#include "trainmem/selective.h"
#include "plan/detail/meta_allocator.h"  // prediction_mutex()
#include "plan/detail/meta_step.h"       // StepPoint

namespace trainmem::detail {

// Views (returns alias an input, no write): free, and never cached by SAC.
// In-place ops are never cached either, but they do work.
struct OpKind {
  bool view = false;
  bool aliases = false;
};

// What one profiling run of a block saw (see Note [Checkpoint planner]).
struct BlockProfile {
  BlockChoice choice;
  // The run's boundary tensors (Note [Boundary storages]), one entry per
  // slot of its input and of its output (Note [Regions with several
  // tensors]): each input's storage bytes (0 in a slot that repeats an
  // earlier slot's tensor) and whether autograd (or the checkpoint) keeps
  // it; per output, whether autograd keeps it, and the input slot whose
  // storage it shares (a view region, a skip tensor passed on), or -1.
  // choice.stored_bytes counts each kept one once.
  std::vector<int64_t> in_bytes;
  std::vector<bool> in_kept;
  std::vector<bool> out_kept;
  std::vector<int> out_alias;
  double forward_cost = 0;
  // Op calls of the forward, in order: (call, cost, cacheable).
  std::vector<std::tuple<std::string, double, bool>> calls;
  // Non-empty: this choice cannot run (Note [Regions that start in place]),
  // and why; the DP never weighs it. forward_cost and calls are still set
  // when the forward ran.
  std::string unavailable;
};

// The shape and dtype of a tensor between regions.
struct TensorSpec {
  std::vector<int64_t> sizes;
  at::ScalarType dtype = at::kFloat;
  std::string str() const {
    return fmt::format("{}[{}]", c10::toString(dtype), fmt::join(sizes, ","));
  }
};

// The tensors between two regions, one per slot (Note [Regions with several
// tensors]): each one's shape and dtype, the first slot holding the same
// tensor (itself where none does), and whether it needs a gradient.
struct BoundarySpec {
  std::vector<TensorSpec> slots;
  std::vector<int> same;
  std::vector<bool> grad;
  int64_t size() const { return static_cast<int64_t>(slots.size()); }
  std::string str() const;
};

// A boundary of one tensor (the step's input, the loss head's input).
BoundarySpec one_slot(const TensorSpec& spec, bool grad = false);

// The tensors of `spec` on `device` (make_tensor each; a slot that repeats
// another gets that slot's tensor), needing gradients where `spec` says so
// when `grad` (as leaves).
std::vector<at::Tensor> make_tensors(const BoundarySpec& spec, c10::Device device, bool grad);

// Bit s: the storage in slot s of a boundary is counted already (Note
// [Boundary storages]). At most kMaxSlots slots.
using SlotMask = uint32_t;
constexpr int64_t kMaxSlots = 32;
constexpr SlotMask kAllSlots = ~SlotMask{0};

// The input bytes of `prof` whose slots `counted` has: those it keeps
// (`kept_only`), or all.
int64_t counted_in_bytes(const BlockProfile& prof, SlotMask counted, bool kept_only);
// The output slots counted after `prof` ran on a boundary counted as `counted`.
SlotMask counted_out(const BlockProfile& prof, SlotMask counted);

// predict_step_peak() with prediction_mutex() held by the caller, its
// arguments checked.
StepPeak predict_step_peak_locked(torch::nn::Module& module, const std::function<at::Tensor()>& loss_fn,
                                  torch::optim::Optimizer* optimizer);

// The step of a RegionModel with a GradScaler or fp32 master weights (Note
// [Planned steps with a scaler or master weights]): the scaler, or the
// masters of the trainable tensors among `params`, and the optimizer the
// step uses (model.optimizer, or one model.make_optimizer made: over
// `params`, or over the masters' optimized()). Throws, naming it, for
// master_weights without make_optimizer, with optimizer, or with a scaler.
class RecipeStep {
 public:
  RecipeStep(const RegionModel& model, const std::vector<at::Tensor>& params, const char* who);
  // Whether `model` asks for a scaler or master weights.
  static bool wanted(const RegionModel& model) { return model.grad_scaler.has_value() || model.master_weights; }
  // The masters' module (its parameters are the masters), or null.
  torch::nn::Module* masters() const { return masters_ ? masters_->ptr().get() : nullptr; }
  torch::optim::Optimizer& optimizer() const { return *opt_; }
  // One step: gradients of `modules` to none, `forward()` (the loss), then
  // `scaler.scale(loss).backward()`, unscale_, step and update, the loss
  // live to the end; or `loss.backward()`, the loss freed, and the masters'
  // step. `mark` (when set) is called at kBegin, kBackward (the loss made),
  // kOptimizerStep (backward done) and kEnd.
  void run(const std::vector<torch::nn::Module*>& modules, const std::function<at::Tensor()>& forward,
           const std::function<void(StepPoint)>& mark = {});
  // What follows backward: the scaler's unscale_, step and update, or the
  // masters' step.
  void optimizer_step();
  // The scaler's scale and growth tracker made, on `device`, as its first
  // scale() makes them; nothing without a scaler.
  void prime(c10::Device device);
  // Bytes of the scaler's own tensors (0 before prime() or a step, or
  // without a scaler).
  int64_t scaler_bytes() const;

 private:
  std::optional<MasterWeights> masters_;
  std::optional<GradScaler> scaler_;
  std::unique_ptr<torch::optim::Optimizer> made_;
  torch::optim::Optimizer* opt_ = nullptr;
};

// predict_step_function() with prediction_mutex() held by the caller, its
// arguments checked.
StepFunctionPeak predict_step_function_locked(const std::vector<torch::nn::Module*>& modules,
                                              const std::vector<torch::optim::Optimizer*>& optimizers,
                                              const std::function<void()>& step, int64_t warmup_steps);

// Runs regions [first, first + count) on `xs`, each taking the one before's
// outputs.
std::vector<at::Tensor> run_span(const std::vector<Region>& regions, int64_t first, int64_t count,
                                 std::vector<at::Tensor> xs);

// Note [Planning a live model]
// plan_regions() takes the user's model as it is, usually on CPU with its
// data. While planning, every parameter and buffer of the regions' modules
// becomes a meta tensor in place (the TensorImpl stays, so closures, optimizers
// and meters that hold them still do) and gets its storage back afterwards, as
// do gradients; the optimizer's state is swapped out for the planning steps
// and swapped back. A region profiled on CPU (an op with no meta kernel) gets
// its parameters' own storages back for that profile (its buffers get copies,
// so BatchNorm's running statistics are not updated by planning), or zero
// tensors when the model was built on meta.
class PlanningSwap {
 public:
  explicit PlanningSwap(const std::vector<Region>& regions) {
    for (const auto& region : regions) {
      for (const auto& m : region.modules()) {
        TORCH_CHECK(m != nullptr, "plan_regions: region '", region.name(), "' lists a null module");
        for (const auto& p : m->parameters(/*recurse=*/true)) {
          add(p, /*buffer=*/false);
        }
        for (const auto& b : m->buffers(/*recurse=*/true)) {
          add(b, /*buffer=*/true);
        }
      }
    }
    for (auto& e : entries_) {
      if (!e.tensor.is_meta()) {
        adopt(e.tensor, at::empty_strided(e.tensor.sizes(), e.tensor.strides(),
                                          e.tensor.options().device(at::kMeta)));
      }
    }
  }
  ~PlanningSwap() {
    for (auto& e : entries_) {
      try {
        if (e.real.defined()) {
          adopt(e.tensor, e.real);
        } else if (!e.tensor.is_meta()) {  // a meta model's CPU fallback: meta again
          adopt(e.tensor, at::empty_strided(e.tensor.sizes(), e.tensor.strides(),
                                            e.tensor.options().device(at::kMeta)));
        }
        if (e.tensor.requires_grad() || e.grad.defined()) {
          e.tensor.mutable_grad() = e.grad;
        }
      } catch (const std::exception& ex) {
        TORCH_WARN("plan_regions: could not restore a tensor of the model: ", ex.what());
      }
    }
  }
  PlanningSwap(const PlanningSwap&) = delete;
  PlanningSwap& operator=(const PlanningSwap&) = delete;

  // Gives the tensors of `modules` CPU storage (their own where they had it),
  // or meta storage again.
  void set_cpu(const std::vector<std::shared_ptr<torch::nn::Module>>& modules, bool cpu) {
    std::unordered_set<const c10::TensorImpl*> mine;
    for (const auto& m : modules) {
      for (const auto& p : m->parameters(true)) mine.insert(p.unsafeGetTensorImpl());
      for (const auto& b : m->buffers(true)) mine.insert(b.unsafeGetTensorImpl());
    }
    for (auto& e : entries_) {
      if (!mine.count(e.tensor.unsafeGetTensorImpl())) {
        continue;
      }
      if (cpu) {
        at::Tensor real = e.real.defined() && e.real.is_cpu() ? e.real : at::Tensor();
        if (!real.defined()) {
          real = at::zeros(e.tensor.sizes(), e.tensor.options().device(at::kCPU));
        } else if (e.buffer) {
          real = real.clone();
        }
        adopt(e.tensor, real);
      } else {
        adopt(e.tensor, at::empty_strided(e.tensor.sizes(), e.tensor.strides(),
                                          e.tensor.options().device(at::kMeta)));
      }
    }
  }

 private:
  struct Entry {
    at::Tensor tensor; // the model's own (identity kept)
    at::Tensor real;   // its storage before planning (undefined if it was on meta)
    at::Tensor grad;   // its gradient before planning
    bool buffer = false;
  };
  void add(const at::Tensor& t, bool buffer) {
    if (!t.defined() || !seen_.insert(t.unsafeGetTensorImpl()).second) {
      return;
    }
    Entry e;
    e.tensor = t;
    e.buffer = buffer;
    if (!t.is_meta()) {
      e.real = t.variable_data();  // a new TensorImpl on the same storage
    }
    e.grad = t.grad();
    entries_.push_back(std::move(e));
  }
  // set_data() refuses a change of device; the shallow copy it would do is
  // what we want (materialize.cpp's to_meta() does the same).
  static void adopt(const at::Tensor& t, const at::Tensor& from) {
    t.unsafeGetTensorImpl()->shallow_copy_from(from.getIntrusivePtr());
  }
  std::unordered_set<const c10::TensorImpl*> seen_;
  std::vector<Entry> entries_;
};

// One region run to profile: regions [first, first + count) as one unit.
struct RunSpec {
  const std::vector<Region>* regions = nullptr;
  int64_t first = 0;
  int64_t count = 1;
  BoundarySpec input;  // its grad flags: which inputs need a gradient
  bool cpu = false; // profile on CPU (an op has no meta kernel)
  // The input is the step's (region 0): made before the count starts, as it
  // is in the step's static bytes, not the run's.
  bool input_is_static = false;
};

struct HeadProfile {
  int64_t forward_peak_bytes = 0; // with its input
  int64_t stored_bytes = 0;       // what the loss saves (its input, for pow)
  int64_t backward_transient_bytes = 0;
  int64_t in_bytes = 0;           // the last region's output
  bool in_kept = false;           // the loss saves it (pow, nll_loss; not log_softmax + nll)
  int64_t loss_bytes = 0;         // the loss itself, live through the whole backward
};

// The optimizer's state bytes (after its first step) and the transient of a
// later step, on meta, with every gradient in place.
struct OptimizerProfile {
  int64_t state_bytes = 0;
  int64_t transient_bytes = 0;
};

// Throws unless every parameter of `module` is on meta (`who` names the caller).
void check_on_meta(const torch::nn::Module& module, const char* who);

// The bytes of `t`'s storage (0 for an undefined tensor or one without storage).
int64_t storage_bytes(const at::Tensor& t);

// Whether autograd (a saved tensor, or a checkpoint's kept input) holds `t`
// besides the caller's one reference: the tensor itself (a leaf or an input)
// or its storage (an output, saved as tensor_data()). A leaf that requires
// grad is also held by its AccumulateGrad node, which keeps it for its
// gradient, not for backward's use: the meter does not count that (the
// loss head's input, GPT's logits, is such a leaf and is not saved).
bool kept_by_autograd(const at::Tensor& t);

OpKind op_kind(const SelectiveOp& op);

// Saved or offloaded: not recomputed (selective.cpp's is_save counts only the first).
bool is_kept(CheckpointPolicy p);

TensorSpec spec_of(const at::Tensor& t);

// A tensor of `spec` on `device`: empty on meta; on CPU random floats and
// zero integers (integer inputs are indices).
at::Tensor make_tensor(const TensorSpec& spec, c10::Device device);

std::string first_line(const std::string& s);

void reset_grads(const std::vector<at::Tensor>& params);

// Runs the run's regions alone under `mode` (and `saved_ops`; count > 1: one
// checkpointed region, a segment), with the loss (y * 2).sum() so the
// incoming gradient is made by backward itself, as in the stack.
BlockProfile profile_run(const RunSpec& run, BlockMode mode, const std::vector<std::string>& saved_ops,
                         const OpCostFn& op_cost);

HeadProfile profile_head(const std::function<at::Tensor(const at::Tensor&)>& loss_fn,
                         const TensorSpec& output, bool cpu);

OptimizerProfile profile_optimizer(torch::optim::Optimizer& opt, const std::vector<at::Tensor>& params);

// A region's structure: its modules' types and their tensors' names, shapes
// and dtypes (or the key the user gave). Regions with the same structure on
// the same input run the same code (the user sets a key where they do not).
std::string structure_key(const Region& region);

// The op a failure on meta names: the op without a meta kernel, else the
// first op or autograd node its message mentions; "" when it names none.
std::string meta_failure_op(const c10::Error& e);

// ---------------------------------------------------------------------------
// The search (plan_search.cpp)

struct DpState {
  int64_t stored = 0; // bytes stored by the blocks so far
  double cost = 0;
  int64_t peak = 0;   // highest phase so far
  StepPhase phase = StepPhase::kForward;
  int64_t parent = -1;
  int option = -1;
  int64_t region = 1; // blocks the last choice covers
  // Per slot of this boundary, whether its tensor's storage is in `stored`
  // already (an earlier region's output that it saved itself, a view's
  // base, a skip tensor a checkpoint kept) or in the static bytes (the
  // step's input): a region that keeps it adds nothing for it (Note
  // [Boundary storages]).
  SlotMask counted = kAllSlots;
};

// What a dynamic program over block boundaries minimises (Note [Two 2-D
// dynamic programs]).
enum class DpGoal {
  kPeak,  // the step's peak
  kCost,  // the recompute cost within a budget, ties to the smaller peak
};

// ---------------------------------------------------------------------------
// The planner's stages (planner.cpp, plan_search.cpp): plan_regions() is
// account_regions -> shape_regions -> profile_regions -> candidates ->
// Search (the least peak) -> cheapest_within -> assemble, each over the
// plain structs below.

// What every phase holds whatever the choices: parameters (each once, owned
// by the last region that uses it: its gradient exists from that region's
// backward on), buffers, the optimizer's state and step, the step's input.
struct StaticTerms {
  std::vector<at::Tensor> params;
  std::vector<int64_t> region_grad_bytes;  // per region: its owned parameters' gradients
  std::vector<bool> region_trains;         // per region: a parameter requires grad
  int64_t param_bytes = 0;
  int64_t buffer_bytes = 0;
  int64_t grad_bytes = 0;                  // all gradients
  bool has_optimizer = false;
  OptimizerProfile optimizer;
  int64_t input_bytes = 0;
  TensorSpec input;
  // Z of Note [Checkpoint planner]: parameters + buffers + optimizer state + input.
  int64_t static_bytes() const { return param_bytes + buffer_bytes + optimizer.state_bytes + input_bytes; }
};

// The tensors between regions, and where the regions run to be profiled.
// Stage 1 (static_terms.cpp): parameters, buffers, the optimizer (its state
// and its step's transient) and the step's input.
StaticTerms account_regions(const RegionModel& model);

// The whole step with its scaler or masters on meta (recipe_step.cpp; Note
// [Planned steps with a scaler or master weights]): a warm-up step, then the
// measured one, the scaler's own tensors counted.
StepPeak recipe_step_on_meta(const RegionModel& model, torch::nn::Module& all, const std::vector<at::Tensor>& params,
                             const std::function<at::Tensor()>& forward);

struct RegionShapes {
  std::vector<BoundarySpec> specs;         // L + 1: the input of each region, then the output
  std::vector<bool> cpu;                   // region i runs on CPU to be profiled
  std::vector<CpuFallback> cpu_fallbacks;  // appended to while profiling too
};

// Every choice's profile: per region (store, checkpoint, selective sets),
// per segment (k >= 2 regions at i: segments[i][k - 2]) and the loss head.
struct Profiles {
  std::vector<std::shared_ptr<const std::vector<BlockProfile>>> singles;
  std::vector<std::vector<std::shared_ptr<const BlockProfile>>> segments;
  HeadProfile head;
  std::vector<UnavailableChoice> unavailable;
  int64_t num_profiles = 0;
};

// The choices the search weighs, and the bounds it prunes with.
struct Candidates {
  const Profiles* profiles = nullptr;
  int64_t regions = 0;
  int64_t max_region = 1;
  std::vector<int64_t> grads_after;         // gradients of regions >= i
  std::vector<int64_t> least_stored_after;  // the fewest bytes regions >= i add
  int64_t num_candidates = 0;               // choices weighed at each boundary
  // The available choices of a run of k regions at i, as one list.
  std::vector<const BlockProfile*> choices(int64_t i, int64_t k) const;
};

// One dynamic program's boundaries (layers[i]: the states after regions
// 0 .. i - 1) and its final states (after the loss head and the optimizer).
struct DpRun {
  std::vector<std::vector<DpState>> layers;
  std::vector<DpState> finals;
  int64_t bucket_bytes = 0;  // Note [Bucketed boundaries]
};

// A final state of one run.
struct Pick {
  const DpRun* run = nullptr;
  int64_t index = -1;
  int64_t bucket_bytes = 0;  // of the exact run it was weighed against
  const DpState& state() const { return run->finals[index]; }
};

// The runs of Note [Two 2-D dynamic programs]; made with the least-peak run.
struct Search {
  Search(const Candidates& candidates, const StaticTerms& terms);
  Search(const Search&) = delete;
  Search& operator=(const Search&) = delete;
  const Candidates& candidates;
  const StaticTerms& terms;
  std::deque<DpRun> runs;  // a deque: Picks point into it
  const DpRun* least_peak = nullptr;
  int64_t min_peak = 0;
};

// The cheapest plan within `limit` (>= min_peak, so the least-peak plan fits).
Pick cheapest_within(Search& search, int64_t limit);

} // namespace trainmem::detail
