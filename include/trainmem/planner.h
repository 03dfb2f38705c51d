#pragma once
/// \file planner.h
/// Plan before running: how many bytes a training step of any model will
/// need, predicted exactly on the meta device, and the cheapest checkpointing
/// that fits a memory budget.
///
/// - predict_saved_activations(), predict_step_peak(): the forward (and the
///   whole step) run on meta tensors, so no data is touched: the exact bytes
///   autograd saves, and the step's peak from a counting meta allocator.
/// - plan_regions(): per-region choices (store, checkpoint, selective with a
///   per-op knapsack, segments of several regions) that meet a budget for the
///   whole step's peak at the least recompute, for any model given as a
///   sequence of regions; the result's checkpointing() is what run_regions()
///   (and the reference Transformer::forward) take.
/// The reference transformer's adapters (analytic count, plan_checkpointing())
/// are in trainmem/models/transformer_plan.h.
///
/// Example:
/// ```
/// trainmem::RegionModel m;
/// m.regions = trainmem::regions_of(net);                 // a torch::nn::Sequential
/// m.input = [](c10::Device d) { return at::empty({8, 3, 32, 32}, at::TensorOptions().device(d)); };
/// m.loss = [](const at::Tensor& y) { return y.pow(2).mean(); };
/// auto plan = trainmem::plan_regions(m, trainmem::PlanOptions().budget_bytes(40 << 20));
/// std::cout << trainmem::to_string(plan);                // regions, peak, recompute FLOPs
/// auto y = trainmem::run_regions(m.regions, x, plan);
/// ```

#include <concepts>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/arg.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>

#include "trainmem/block_checkpointing.h"
#include "trainmem/export.h"
#include "trainmem/grad_scaler.h"
#include "trainmem/meta.h"
#include "trainmem/meter.h"
#include "trainmem/selective.h"
#include "trainmem/timeline.h"

namespace torch::nn {
class Module;
} // namespace torch::nn
namespace torch::optim {
class Optimizer;
} // namespace torch::optim

namespace trainmem {

// ---------------------------------------------------------------------------
// Exact predictions on the meta device

/// Registers meta kernels for the CPU ops LibTorch leaves to Python's meta
/// registrations (CPU flash attention forward and backward, LayerNorm forward
/// and backward) with the CPU kernels' output layouts, and makes
/// `scaled_dot_product_attention` on meta tensors choose the backend the CPU
/// would, so a forward on meta saves exactly what it saves on CPU. Also adds
/// register_meta_kernels()'s (meta.h): one call gives every meta kernel
/// trainmem adds. Idempotent; the predict functions call it. Throws if the
/// registration fails.
TRAINMEM_API void enable_cpu_meta_kernels();

/// Runs `forward` (which must build its inputs on the meta device and return
/// its output or loss) under a SavedTensorMeter that excludes `module`'s
/// parameters, with no data touched: the exact bytes autograd would save on
/// CPU. Throws, naming it, if a parameter of `module` is not on the meta
/// device (move the module with to_meta() first).
///
/// Example:
/// ```
/// trainmem::Transformer model(o);
/// trainmem::to_meta(*model);
/// auto r = trainmem::predict_saved_activations(*model, [&] {
///   return model->forward(torch::empty({16, 64, 128}, at::kMeta), plan).pow(2).mean(); });
/// r.saved_bytes;   // 51,052,544 for plan = none
/// ```
TRAINMEM_API SavedTensorReport predict_saved_activations(
    const torch::nn::Module& module,
    const std::function<at::Tensor()>& forward);

/// The phase of a training step.
using StepPhase = Phase;  ///< the audit's phases (timeline.h)

/// "forward", "backward", "optimizer step".
TRAINMEM_API std::string to_string(StepPhase phase);

/// A training step's peak, split as static buckets + the activations live at
/// the start of backward + the largest transient. Plain data; all in bytes.
struct StepPeak {
  int64_t param_bytes = 0;           ///< parameters (live all step)
  /// Module buffers (BatchNorm's running statistics; live all step), the
  /// accountant's StaticBuckets::buffer_bytes.
  int64_t buffer_bytes = 0;
  int64_t optimizer_state_bytes = 0; ///< optimizer state (live all step)
  /// Gradients live when the peak is reached (all of them in the optimizer
  /// step, those of the blocks already done in backward); -1 if unknown.
  int64_t grad_bytes = 0;
  /// Saved for backward at the end of the forward (the meter's count, the
  /// selective checkpoint caches included).
  int64_t activation_bytes = 0;
  /// The rest of the peak: recomputed activations, gradient buffers,
  /// temporaries (peak_bytes - the terms above, module buffers included; in
  /// backward the activations
  /// already freed make it smaller than the true transient). -1 if unknown.
  int64_t transient_bytes = 0;
  int64_t peak_bytes = 0;            ///< the step's peak live bytes
  StepPhase phase = StepPhase::kBackward; ///< where the peak is
  int64_t forward_peak_bytes = 0;    ///< highest live bytes in forward
  int64_t backward_peak_bytes = 0;   ///< highest live bytes in backward
  int64_t optimizer_peak_bytes = 0;  ///< highest in the optimizer step (0 without one)
  /// Values the step read from meta tensors (`.item()`, a meta tensor to the
  /// CPU), by op and value returned: where control flow may have differed from
  /// a real run. Empty when it read none.
  std::vector<ScalarRead> scalar_reads;
};

/// Predicts the peak of one training step (zero_grad to none, `loss_fn()`,
/// backward, `optimizer->step()` when given) by running it on meta tensors
/// under a counting meta allocator: no data is touched. With an optimizer the
/// step runs twice and the second is reported (optimizer state exists, as in a
/// training loop). `loss_fn` must build its inputs on meta (they count in the
/// step) and return a scalar. Counts the meta allocations, and what the CPU
/// allocates beside a kernel's outputs where it is modelled (BLAS operand
/// copies, oneDNN and convolution scratch by probe, checkpoints' RNG stashes,
/// wrapped scalars). A tensor `loss_fn` makes without a device (a causal
/// mask from torch::ones({T, T}), torch::arange(T)) lands on meta, as on
/// the CPU it would land where the step runs, and is counted. The module's
/// gradients and buffers and the optimizer's state are as they were
/// afterwards, also when `loss_fn`, the backward or the optimizer's step
/// throws (Note [Predictions leave no trace]). Throws, naming it, if a
/// parameter is not on meta.
///
/// Example:
/// ```
/// trainmem::Transformer meta(o);
/// trainmem::to_meta(*meta);
/// torch::optim::AdamW opt(meta->parameters(), torch::optim::AdamWOptions(1e-3));
/// auto p = trainmem::predict_step_peak(*meta, [&] {
///   return meta->forward(at::empty({16, 64, 128}, at::kMeta)).pow(2).mean(); }, &opt);
/// p.peak_bytes;   // 67,687,944: the CPU measures the same
/// ```
TRAINMEM_API StepPeak predict_step_peak(
    torch::nn::Module& module,
    const std::function<at::Tensor()>& loss_fn,
    torch::optim::Optimizer* optimizer = nullptr);

/// The same step run for real on CPU, measured by the CpuMemoryTracker (which
/// must be installed): peak_bytes is the static buckets plus the highest live
/// bytes above the step's start (so bytes live before the step that are not
/// the module's or the optimizer's do not count). grad_bytes and
/// transient_bytes are -1 (the allocator does not know what a block is).
TRAINMEM_API StepPeak measure_step_peak(
    torch::nn::Module& module,
    const std::function<at::Tensor()>& loss_fn,
    torch::optim::Optimizer* optimizer = nullptr);

/// Text: the peak, its phase and its terms.
TRAINMEM_API std::string to_string(const StepPeak& peak);

/// What a training step written as the user's own function holds: live
/// bytes at its start (split by what they are) and at its peak and end.
/// Plain data; all in bytes.
struct StepFunctionPeak {
  /// Live when the measured step starts, each storage once: the modules'
  /// parameters and buffers, the gradients left from the step before (a
  /// loop that calls zero_grad() after its forward keeps them through the
  /// forward), and the optimizers' state.
  int64_t start_bytes = 0;
  int64_t param_bytes = 0;            ///< parameters, in start_bytes
  int64_t buffer_bytes = 0;           ///< buffers, in start_bytes
  int64_t grad_bytes = 0;             ///< gradients, in start_bytes
  int64_t optimizer_state_bytes = 0;  ///< optimizer state, in start_bytes
  /// start_bytes plus the highest rise of live bytes above the start during
  /// the step: the step's peak.
  int64_t peak_bytes = 0;
  /// start_bytes plus what the step left live minus what it freed.
  int64_t end_bytes = 0;
  /// Values the step read from meta tensors (`.item()` for logging or an
  /// early-stopping `if`, a meta tensor to the CPU), by op and value
  /// returned, warm-up steps included: where control flow may have differed
  /// from a real run (measure_step_function() leaves it empty).
  std::vector<ScalarRead> scalar_reads;
};

/// Predicts the peak of `step`, the user's whole training step as it is
/// written in their loop (any number of forward and backward passes,
/// optimizers and zero_grad() calls, in any order: a GAN's discriminator and
/// generator steps, gradient accumulation, zero_grad after the forward), by
/// running it on meta. `modules` and `optimizers` are what it trains (their
/// parameters must be on meta); what they hold when the measured step starts
/// is start_bytes. The step runs `warmup_steps` times first (gradients and
/// optimizer state made as in a loop), then once more, measured. Tensors it
/// makes without a device land on meta and are counted, as on the CPU
/// (data made inside the step counts; a batch made between steps does not).
/// `loss.backward()` inside the step accumulates gradients as the CPU's
/// engine does. The modules' gradients and buffers and the optimizers' state
/// are as they were afterwards, also when the step throws (Note [Predictions
/// leave no trace]). Throws, naming it, for an empty step, no module, a null
/// module or optimizer, a parameter not on meta, or warmup_steps < 0.
///
/// Example:
/// ```
/// // a GAN's step: D on real and fake, then G through D
/// auto p = trainmem::predict_step_function({G.get(), D.get()}, {&opt_g, &opt_d}, [&] {
///   auto real = at::empty({64, 784}, at::kMeta);
///   auto fake = G->forward(at::empty({64, 100}, at::kMeta));
///   opt_d.zero_grad();
///   (D->forward(real).mean() - D->forward(fake.detach()).mean()).backward();
///   opt_d.step();
///   opt_g.zero_grad();
///   D->forward(fake).mean().backward();
///   opt_g.step();
/// });
/// p.peak_bytes;   // what measure_step_function() measures on CPU
/// ```
TRAINMEM_API StepFunctionPeak predict_step_function(const std::vector<torch::nn::Module*>& modules,
                                                    const std::vector<torch::optim::Optimizer*>& optimizers,
                                                    const std::function<void()>& step, int64_t warmup_steps = 1);

/// The same step run for real on CPU, measured by the CpuMemoryTracker
/// (which must be installed), with the same start_bytes accounting: bytes
/// live before the step that are none of the modules' and optimizers' do not
/// count.
TRAINMEM_API StepFunctionPeak measure_step_function(const std::vector<torch::nn::Module*>& modules,
                                                    const std::vector<torch::optim::Optimizer*>& optimizers,
                                                    const std::function<void()>& step, int64_t warmup_steps = 1);

/// Text: the peak, the end and the start's terms.
TRAINMEM_API std::string to_string(const StepFunctionPeak& peak);

// ---------------------------------------------------------------------------
// The checkpoint planner

/// The cost of recomputing one op (any unit; FLOPs or seconds), from the op
/// and its inputs. Must not throw.
using OpCostFn = std::function<double(const SelectiveOp& op)>;

/// FLOPs of an op from its input shapes: 2 m k n for mm (+ m n for addmm),
/// 2 b m k n for bmm / baddbmm, 4 B H T S hd for attention (half when
/// causal), 0 for views and metadata ops, and one per element of the largest
/// input tensor for everything else.
TRAINMEM_API double flop_cost(const SelectiveOp& op);

/// Measures each op's CPU time over `repeats` runs of `run` (which should run
/// a forward of the model the plan is for, on CPU, at the planned shapes) and
/// returns a cost function that looks an op up by name and input shapes (the
/// median of its calls, in seconds). Ops never seen cost their flop_cost()
/// at the measured run's median seconds per FLOP. Times vary from run to run:
/// a plan chosen by them may too.
///
/// Example:
/// ```
/// auto cost = trainmem::measured_op_cost([&] { model->forward(x); }, 3);
/// auto plan = trainmem::plan_checkpointing(o, 16, 64, trainmem::PlanOptions().budget_bytes(b).op_cost(cost));
/// ```
TRAINMEM_API OpCostFn measured_op_cost(const std::function<void()>& run, int64_t repeats = 3);

/// How a planned block runs.
enum class BlockMode {
  kStore,      ///< no checkpoint: everything saved
  kCheckpoint, ///< checkpointed: only its input saved, all recomputed
  kSelective,  ///< checkpointed selectively: `saved_ops` cached, the rest recomputed
};

/// "store", "checkpoint", "selective".
TRAINMEM_API std::string to_string(BlockMode mode);

/// One block of a plan, with what it costs. Plain data.
struct BlockChoice {
  BlockMode mode = BlockMode::kStore;
  /// kSelective: the op calls whose outputs are cached, as
  /// "aten::mm.default#2" (the third call of that op in the block's forward).
  std::vector<std::string> saved_ops;
  /// Bytes the block keeps from its forward to its backward (its input
  /// included), in bytes.
  int64_t stored_bytes = 0;
  /// Highest live bytes above the stored ones while the block's backward
  /// (and recompute) runs, its parameters' gradients included, in bytes.
  int64_t backward_transient_bytes = 0;
  /// Highest live bytes above the blocks before it during its forward (its
  /// input and output included), in bytes.
  int64_t forward_peak_bytes = 0;
  /// What its recompute costs, in the unit of the planner's OpCostFn.
  double recompute_cost = 0;
  /// CPU bytes a checkpointed region keeps from its forward to its backward
  /// beside its tensors: the CPU RNG state (preserve_rng_state), 5,056 B in
  /// LibTorch 2.13; 0 for a stored block. Counted in the planner's peak (its
  /// step runs on CPU), not in stored_bytes (the meter does not see it).
  int64_t rng_state_bytes = 0;
  /// Blocks of the checkpointed region that starts here: 1 (the block alone),
  /// k > 1 (a segment of k blocks, Chen et al.; its bytes and cost are on this
  /// entry), or 0 (a block inside a segment that started earlier).
  int64_t region_blocks = 1;
};

/// The policy that caches exactly the listed op calls ("aten::mm.default#0",
/// the first mm of the region; calls are counted per region and per pass)
/// and recomputes the rest.
TRAINMEM_API SelectivePolicy save_op_calls_policy(std::vector<std::string> op_calls);

/// Options of plan_checkpointing.
///
/// Example:
/// ```
/// auto opts = trainmem::PlanOptions().budget_bytes(40 << 20).selective(false);
/// ```
struct PlanOptions {
  /// The whole step's peak must not exceed this, in bytes (static buckets,
  /// activations, recompute and optimizer transients). 0: no limit.
  TORCH_ARG(int64_t, budget_bytes) = 0;
  /// The cost of recomputing an op (FLOPs by default; a measured time works).
  TORCH_ARG(OpCostFn, op_cost) = flop_cost;
  /// Also consider per-op selective choices inside blocks (else whole blocks
  /// only: store or checkpoint).
  TORCH_ARG(bool, selective) = true;
  /// Longest run of consecutive blocks checkpointed as one region (segments
  /// that keep one input for several blocks; 1: each block on its own).
  TORCH_ARG(int64_t, max_region_blocks) = 8;
};

/// A region the planner profiled on CPU, at the planned shapes, because one
/// of its ops has no meta kernel. Plain data.
struct CpuFallback {
  int64_t region = 0; ///< its index
  std::string op;     ///< the op without a meta kernel, e.g. "aten::nonzero"
  std::string reason; ///< the error's first line
};

/// A choice plan_regions() could not weigh for a region: it fails when run
/// (a checkpoint of a region whose first op writes its input in place, e.g.
/// ReLU(inplace): backward would throw). Plain data.
struct UnavailableChoice {
  int64_t region = 0;                     ///< the index of its first region
  int64_t blocks = 1;                     ///< 1, or k > 1 for a segment of k regions
  BlockMode mode = BlockMode::kCheckpoint; ///< kCheckpoint or kSelective
  /// Why, naming the op: "aten::relu_ writes the region's input in place,
  /// which a checkpoint keeps" (or the error's first line).
  std::string reason;
};

/// A checkpointing plan: per block (or region), how it runs. Plain data.
struct TRAINMEM_API CheckpointPlan {
  /// True when predicted_peak_bytes fits the budget. When false, `blocks` is
  /// the plan with the smallest reachable peak.
  bool feasible = false;
  int64_t budget_bytes = 0;            ///< the budget asked for (0: none)
  std::vector<BlockChoice> blocks;     ///< one per layer, in order
  std::string name;                    ///< "none", "full", "every_2", "chosen", "selective"...
  int64_t predicted_peak_bytes = 0;    ///< the step's predicted peak, in bytes
  StepPhase peak_phase = StepPhase::kBackward; ///< where that peak is
  int64_t static_bytes = 0;            ///< parameters + buffers + optimizer state + input, in bytes
  int64_t grad_bytes = 0;              ///< the gradient bucket, in bytes
  /// Stored at the start of backward (the input included, as the meter counts it), in bytes.
  int64_t activation_bytes = 0;
  double recompute_cost = 0;           ///< sum over blocks, in the OpCostFn's unit
  double forward_cost = 0;             ///< one forward of all blocks, same unit
  /// The smallest peak any plan reaches, in bytes (the regions' composition;
  /// with RegionModel::grad_scaler or master_weights, when no plan fits, the
  /// whole step's of the least-peak plan, the scaler's or masters' bytes in).
  int64_t min_peak_bytes = 0;
  double min_peak_cost = 0;            ///< the least recompute that reaches it
  /// 0 when the search was exact. Otherwise it bucketed the stored bytes at
  /// large boundaries (Note [Bucketed boundaries] in plan_search.cpp): no plan
  /// with a peak within the budget less this many bytes costs less than this
  /// one. The plan's own figures are exact either way.
  int64_t bucket_bytes = 0;
  int64_t num_candidates = 0;          ///< per-block choices the planner weighed
  /// Region runs profiled (each distinct region or segment and choice once;
  /// identical regions share their profiles, see plan_regions()).
  int64_t num_profiles = 0;
  /// One per block (region): its name (plan_regions(); "block" otherwise).
  std::vector<std::string> region_names;
  /// Regions profiled on CPU because an op has no meta kernel (plan_regions()).
  std::vector<CpuFallback> cpu_fallbacks;
  /// Choices never made because they cannot run (plan_regions()); the plan
  /// text lists them.
  std::vector<UnavailableChoice> unavailable;
  /// Where regions carry tensors past each other (Note [Regions with
  /// several tensors]), or the step runs a GradScaler or master weights
  /// (RegionModel::grad_scaler, master_weights): the peak composed from the
  /// regions' profiles, in bytes; predicted_peak_bytes and peak_phase are then
  /// the whole planned step's on meta (predict_step_peak, or the step with
  /// its scaler or masters), and a plan within the budget is one whose whole
  /// step is. 0 otherwise (or where the whole step has no meta path).
  int64_t composed_peak_bytes = 0;
  /// Plans weighed against their whole step (0: none).
  int64_t whole_step_rounds = 0;
  /// plan_regions(): the values the regions, the loss and the whole step
  /// read from meta tensors while planning (`.item()`...), each given a
  /// documented value (Note [Scalar reads inside a prediction]); the text
  /// lists them.
  std::vector<ScalarRead> scalar_reads;

  /// The plan as Transformer::forward takes it.
  BlockCheckpointing checkpointing() const;
};

/// Text: the plan block by block, its predicted peak and recompute cost.
TRAINMEM_API std::string to_string(const CheckpointPlan& plan);

// ---------------------------------------------------------------------------
// Planning any model: a sequence of regions

/// One region of a model: a callable `Tensor(Tensor)`, or one over several
/// tensors, and the modules whose parameters and buffers it uses. The
/// planner chooses per region (store, checkpoint, selective) and per run of
/// regions (one checkpointed segment). Copies share the callable and the
/// modules.
///
/// Any module holder or module whose `forward` takes and returns one tensor
/// converts implicitly (TORCH_MODULE types, `Sequential`, `Linear`, your own
/// `Impl` by `shared_ptr`), as does an `AnyModule`; a lambda needs the
/// modules it uses named beside it.
///
/// Skip connections (a U-Net's encoder features, an FPN's levels, a DenseNet
/// block's inputs): a region given as a `Tensors(Tensors)` callable takes
/// every tensor the region before it returned, and returns every tensor a
/// later region needs, passing on unchanged (the same tensor) what it only
/// carries. The first region takes the step's input alone and the last one
/// returns one tensor, the loss's input (Note [Regions with several
/// tensors]).
///
/// Example:
/// ```
/// std::vector<trainmem::Region> regions = {
///     net->conv1,                                                   // a module holder
///     trainmem::Region("head", [&](const at::Tensor& x) { return net->fc(x.flatten(1)); }, {net->fc.ptr()}),
/// };
/// // A U-Net: each encoder stage returns its features twice (the next
/// // stage's input and a skip tensor), each decoder stage takes one back.
/// using T = trainmem::Region::Tensors;
/// trainmem::Region down("down1", [&](const T& xs) -> T {
///   auto h = net->down1(xs[0]);
///   return {h, h};                                 // the input of down2, the skip for up1
/// }, {net->down1.ptr()});
/// trainmem::Region up("up1", [&](const T& xs) -> T {
///   return {net->up1(at::cat({net->upsample(xs[0]), xs[1]}, 1))};
/// }, {net->up1.ptr()});
/// ```
class TRAINMEM_API Region {
 public:
  using Forward = std::function<at::Tensor(const at::Tensor&)>;
  using Tensors = std::vector<at::Tensor>;
  /// Several tensors in, several out.
  using ListForward = std::function<Tensors(const Tensors&)>;

  /// `forward` using the parameters and buffers of `modules` (and no others:
  /// the planner counts gradients and moves tensors to meta by them).
  Region(std::string name, Forward forward,
         std::vector<std::shared_ptr<torch::nn::Module>> modules = {});

  /// `forward` over several tensors: it takes what the region before it
  /// returned and returns what the region after it takes. A tensor it only
  /// carries to a later region is returned as it came (the same tensor).
  Region(std::string name, ListForward forward,
         std::vector<std::shared_ptr<torch::nn::Module>> modules = {});

  /// A module holder whose forward takes and returns one tensor.
  template <typename ModuleHolder>
    requires(detail::kIsModuleHolder<ModuleHolder> &&
             requires(ModuleHolder m, const at::Tensor& x) {
               { m->forward(x) } -> std::convertible_to<at::Tensor>;
             })
  Region(const ModuleHolder& module)  // NOLINT(google-explicit-constructor): lists of holders
      : Region(module->name(),
               [m = module](const at::Tensor& x) mutable -> at::Tensor { return m->forward(x); },
               {module.ptr()}) {}

  /// A module (a subclass of torch::nn::Module) whose forward takes and
  /// returns one tensor.
  template <typename M>
    requires(std::derived_from<M, torch::nn::Module> &&
             requires(M& m, const at::Tensor& x) {
               { m.forward(x) } -> std::convertible_to<at::Tensor>;
             })
  Region(std::shared_ptr<M> module)  // NOLINT(google-explicit-constructor)
      : Region(module->name(),
               [m = module](const at::Tensor& x) -> at::Tensor { return m->forward(x); },
               {std::static_pointer_cast<torch::nn::Module>(module)}) {}

  /// One element of a Sequential, by its type-erased forward.
  Region(torch::nn::AnyModule module);  // NOLINT(google-explicit-constructor)

  /// Runs the region on one tensor. Throws, naming the region, if it returns
  /// more than one.
  at::Tensor operator()(const at::Tensor& input) const;
  /// Runs the region on several tensors (one-tensor regions take exactly one).
  Tensors operator()(const Tensors& inputs) const;
  /// Whether it was given as a `Tensors(Tensors)` callable.
  bool takes_tensors() const { return takes_tensors_; }
  /// Its name ("trainmem::TransformerBlockImpl", or the one given).
  const std::string& name() const { return name_; }
  /// The modules whose tensors it uses.
  const std::vector<std::shared_ptr<torch::nn::Module>>& modules() const { return modules_; }
  /// Regions with equal keys, on inputs of equal shapes, are profiled once
  /// (see plan_regions()). Empty (the default): the key is made from its
  /// modules' types and their tensors' names, shapes and dtypes, and the
  /// region's output shape. Set one when two regions with the same modules
  /// run different code.
  Region& key(std::string key) {
    key_ = std::move(key);
    return *this;
  }
  const std::string& key() const { return key_; }

 private:
  std::string name_;
  std::shared_ptr<ListForward> forward_;
  std::vector<std::shared_ptr<torch::nn::Module>> modules_;
  std::string key_;
  bool takes_tensors_ = false;
};

/// One region per module of `sequential`, in order.
TRAINMEM_API std::vector<Region> regions_of(const torch::nn::Sequential& sequential);

/// One region per element of `list`, each run as an `Impl` (its
/// `forward(Tensor)`). Throws, naming it, if an element is not an `Impl`.
///
/// Example:
/// ```
/// auto regions = trainmem::regions_of<trainmem::TransformerBlockImpl>(model->blocks);
/// ```
template <typename Impl>
std::vector<Region> regions_of(const torch::nn::ModuleList& list) {
  std::vector<Region> regions;
  for (size_t i = 0; i < list->size(); ++i) {
    auto element = std::dynamic_pointer_cast<Impl>(list->ptr(i));
    TORCH_CHECK(element != nullptr, "regions_of: element ", i, " of the ModuleList is a ",
                list->ptr(i)->name(), ", not the type asked for");
    regions.emplace_back(std::move(element));
  }
  return regions;
}

/// One region per element of `list`; each element must be a Sequential (its
/// type is otherwise unknown: use regions_of<Impl>(list)).
TRAINMEM_API std::vector<Region> regions_of(const torch::nn::ModuleList& list);

/// Makes an optimizer over the given parameters (any torch::optim optimizer:
/// its kind and options).
using OptimizerFactory =
    std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor> params)>;

/// A training step of a model made of regions, as plan_regions() sees it:
/// input -> regions in order -> loss -> backward -> optimizer step.
///
/// Example:
/// ```
/// trainmem::RegionModel m;
/// m.regions = trainmem::regions_of(net);            // a Sequential
/// m.input = [](c10::Device d) { return at::empty({64, 1, 28, 28}, at::TensorOptions(d)); };
/// m.loss = [](const at::Tensor& y) { return at::nll_loss(y, at::zeros({64}, y.options().dtype(at::kLong))); };
/// m.optimizer = &sgd;                               // or m.make_optimizer
/// ```
struct TRAINMEM_API RegionModel {
  /// The model, in order: region i + 1 takes region i's outputs (one
  /// tensor, or several: Region's `Tensors` form).
  std::vector<Region> regions;
  /// A sample input on `device` (the meta device while planning, the CPU for
  /// a region profiled there): its shape and dtype are what the plan is for.
  /// Integer inputs are indices: make them valid (zeros) on CPU.
  std::function<at::Tensor(c10::Device device)> input;
  /// The loss of the last region's output: a scalar. Targets it needs are
  /// made inside, on `output.device()`; they count in the step.
  std::function<at::Tensor(const at::Tensor& output)> loss;
  /// The step's optimizer over the regions' parameters, any torch::optim
  /// optimizer, or null. Its state is set aside while planning and put back.
  torch::optim::Optimizer* optimizer = nullptr;
  /// Or its kind and options: called once with the parameters (on meta).
  OptimizerFactory make_optimizer;
  /// fp16 mixed precision: when set, each step scales the loss with a
  /// trainmem::GradScaler made with these options and runs
  /// `scaler.scale(loss).backward(); scaler.unscale_(opt); scaler.step(opt);
  /// scaler.update()` instead of `loss.backward(); opt.step()`. The scaler's
  /// own tensors (its scale and growth tracker, live from its first step on;
  /// the found-inf flag and the inverse scale of unscale_) count in the
  /// planned peak (Note [Planned steps with a scaler or master weights]).
  /// The autocast is the regions' own (each region's forward opens it).
  std::optional<GradScalerOptions> grad_scaler;
  /// bf16 (or fp16) weights with fp32 master weights (master_weights.h):
  /// when true, the planner makes a trainmem::MasterWeights of the regions'
  /// parameters that require a gradient, calls `make_optimizer` (which must
  /// be set; `optimizer` must be null) with its optimized() tensors (the
  /// masters require no gradient: it should step every tensor given), and each
  /// step runs `loss.backward(); masters->step(opt)`: the masters (4 B per
  /// low-precision parameter) and the optimizer's fp32 state count in the
  /// planned peak, and the bf16 gradients are freed inside the step (Note
  /// [bf16 weights with fp32 master weights]). With grad_scaler too (fp16
  /// weights), `scaler.scale(loss).backward(); masters->step(opt, scaler)`:
  /// the loss freed after backward, the scaler unscaling the masters'
  /// gradients.
  bool master_weights = false;
};

/// Plans a training step of any model given as regions: the same planner as
/// plan_checkpointing() (Note [Checkpoint planner]), with the regions, the
/// input, the loss and the optimizer taken from `model`.
/// `options.adamw()` is ignored (the optimizer is the model's).
///
/// The regions may be on CPU (or any device): their parameters and buffers
/// are moved to meta in place while planning and put back unchanged (values,
/// gradients, optimizer state); or already on meta (built under a
/// MetaInitGuard). Regions with equal keys on equal input shapes are
/// profiled once, so a stack of identical blocks costs one block's
/// profiling. A region with an op that has no meta path (one whose output
/// shape depends on values: nonzero, masked_select; meta.h's
/// register_meta_kernels() gives every other op with a CPU kernel one) is
/// profiled on CPU at the planned shapes (a meta region model gets
/// zero-filled CPU tensors for that) and listed in `cpu_fallbacks` with the
/// op; the plan never fails for it. A checkpoint or selective choice that cannot run (a region that
/// starts by writing its input in place, e.g. ReLU(inplace)) is never made
/// and is listed in `unavailable` with the op. With `model.grad_scaler` or
/// `model.master_weights` the step is the one they describe, and every plan
/// is weighed by that whole step on meta (predicted_peak_bytes and
/// peak_phase are its, composed_peak_bytes the regions' composition; Note
/// [Planned steps with a scaler or master weights]); where that step has no
/// meta path the plan throws, naming it, rather than report a composition
/// without the scaler's or the masters' bytes. Throws if the model is empty,
/// a callback is missing, the loss is not a scalar, or master_weights is set
/// without make_optimizer or with `optimizer`.
///
/// Example:
/// ```
/// auto plan = trainmem::plan_regions(m, trainmem::PlanOptions().budget_bytes(64 << 20));
/// std::cout << trainmem::to_string(plan);
/// auto loss = m.loss(trainmem::run_regions(m.regions, x, plan));
/// ```
TRAINMEM_API CheckpointPlan plan_regions(const RegionModel& model, const PlanOptions& options = {});

/// Runs `regions` on `input` under `plan` (its checkpointing()): stored
/// regions run as they are, checkpointed ones through trainmem::checkpoint,
/// selective ones with the plan's cached op calls, segments as one region.
/// Throws if the plan has a different number of blocks.
TRAINMEM_API at::Tensor run_regions(const std::vector<Region>& regions, const at::Tensor& input,
                       const CheckpointPlan& plan);

/// The same with a BlockCheckpointing (BlockCheckpointing::full(n), a
/// plan's checkpointing(), ...).
TRAINMEM_API at::Tensor run_regions(const std::vector<Region>& regions, const at::Tensor& input,
                       const BlockCheckpointing& plan);

} // namespace trainmem
