#include "trainmem/planner.h"

#include <algorithm>
#include <cctype>
#include <atomic>
#include <chrono>
#include <cmath>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include <ATen/Context.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Generator.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <ATen/ops/_scaled_dot_product_attention_math.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/mean.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/sum.h>
#include <c10/core/Allocator.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/autograd/function.h>  // Node: node.h only since 2.13
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>
#include <torch/nn/module.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>

#include "trainmem/accountant.h"
#include "trainmem/allocator.h"
#include "trainmem/meta.h"
#include "trainmem/format.h"
#include "detail/backward_on_meta.h"
#include "detail/intercept.h"
#include "core/detail/autocast_on_meta.h"
#include "core/detail/meta_fallback.h"
#include "plan/detail/meta_allocator.h"
#include "plan/detail/meta_step.h"
#include "detail/optimizer_state.h"
#include "detail/process_library.h"
#include "plan/detail/plan_internal.h"

namespace trainmem {

using detail::MetaAllocator;

namespace {

// The CPU generator's state, as a checkpoint stashes it (a CPU tensor even
// when the region runs on meta or CUDA).
int64_t cpu_rng_state_bytes() {
  static const int64_t bytes = [] {
    auto gen = at::globalContext().defaultGenerator(at::kCPU);
    std::lock_guard<std::mutex> lock(gen.mutex());
    return static_cast<int64_t>(gen.get_state().nbytes());
  }();
  return bytes;
}

// Live and peak bytes of the device a profile runs on: the meta allocator
// (Note [One meta allocator]), or the CPU tracker where a region falls back
// to the CPU.
class ByteCounter {
 public:
  explicit ByteCounter(bool cpu) : cpu_(cpu) {
    if (cpu_) {
      tracker_ = &CpuMemoryTracker::install();
    }
  }
  int64_t live() const {
    return cpu_ ? tracker_->stats().allocated_bytes : MetaAllocator::get().live_bytes();
  }
  void reset_peak() {
    if (cpu_) {
      window_.reset();
      window_.emplace(*tracker_);
    } else {
      MetaAllocator::get().reset_peak();
    }
  }
  int64_t peak() const {
    return cpu_ ? (window_ ? window_->peak_bytes() : live()) : MetaAllocator::get().peak_bytes();
  }

 private:
  bool cpu_;
  CpuMemoryTracker* tracker_ = nullptr;
  std::optional<PeakWindow> window_;
};

} // namespace

namespace detail {

TensorSpec spec_of(const at::Tensor& t) {
  return {t.sizes().vec(), t.scalar_type()};
}

// A tensor of `spec` on `device`: empty on meta; on CPU random floats and
// zero integers (integer inputs are indices).
at::Tensor make_tensor(const TensorSpec& spec, c10::Device device) {
  auto options = at::TensorOptions().dtype(spec.dtype).device(device);
  if (device.is_meta()) {
    return at::empty(spec.sizes, options);
  }
  return c10::isFloatingType(spec.dtype) ? at::randn(spec.sizes, options) : at::zeros(spec.sizes, options);
}

std::string BoundarySpec::str() const {
  std::string k;
  for (int64_t s = 0; s < size(); ++s) {
    k += s > 0 ? ";" : "";
    k += same[s] != s ? fmt::format("={}", same[s]) : slots[s].str() + (grad[s] ? "G" : "");
  }
  return k;
}

BoundarySpec one_slot(const TensorSpec& spec, bool grad) {
  return BoundarySpec{{spec}, {0}, {grad}};
}

std::vector<at::Tensor> make_tensors(const BoundarySpec& spec, c10::Device device, bool grad) {
  std::vector<at::Tensor> xs(spec.slots.size());
  for (int64_t s = 0; s < spec.size(); ++s) {
    if (spec.same[s] != s) {
      xs[s] = xs[spec.same[s]];
      continue;
    }
    xs[s] = make_tensor(spec.slots[s], device);
    if (grad && spec.grad[s]) {
      xs[s].requires_grad_(true);
    }
  }
  return xs;
}

int64_t counted_in_bytes(const BlockProfile& prof, SlotMask counted, bool kept_only) {
  int64_t bytes = 0;
  for (size_t s = 0; s < prof.in_bytes.size(); ++s) {
    if (((counted >> s) & 1U) != 0 && (!kept_only || prof.in_kept[s])) {
      bytes += prof.in_bytes[s];
    }
  }
  return bytes;
}

SlotMask counted_out(const BlockProfile& prof, SlotMask counted) {
  SlotMask out = 0;
  for (size_t t = 0; t < prof.out_kept.size(); ++t) {
    const int a = prof.out_alias[t];
    const bool kept = a >= 0 ? (((counted >> a) & 1U) != 0 || prof.in_kept[a]) : prof.out_kept[t];
    out |= kept ? SlotMask{1} << t : SlotMask{0};
  }
  return out;
}

namespace {

// The op a NotImplementedError names: "Could not run 'aten::foo' with
// arguments from the 'Meta' backend", or "foo not implemented".
std::string missing_op(const std::string& what) {
  // "trainmem: aten::nonzero has no meta kernel and ...": Note [A meta path
  // for ops without a meta kernel].
  if (auto refused = detail::meta_fallback_refused_op(what); !refused.empty()) {
    return refused;
  }
  const std::string quoted = "Could not run '";
  if (auto a = what.find(quoted); a != std::string::npos) {
    a += quoted.size();
    return what.substr(a, what.find('\'', a) - a);
  }
  // "aten::_cdist_forward: attempted to run this operator with Meta
  // tensors" (2.13), or "convolution_overrideable not implemented".
  std::string first = what.substr(0, what.find_first_of(" \n"));
  while (!first.empty() && (first.back() == ':' || first.back() == '.')) {
    first.pop_back();
  }
  return first.find("::") == std::string::npos ? "aten::" + first : first;
}

} // namespace

std::string first_line(const std::string& s) {
  return s.substr(0, s.find('\n'));
}

void reset_grads(const std::vector<at::Tensor>& params) {
  for (const auto& p : params) {
    p.mutable_grad().reset();
  }
}

namespace {

std::vector<at::Tensor> params_of(const RunSpec& run) {
  std::vector<at::Tensor> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (int64_t j = run.first; j < run.first + run.count; ++j) {
    for (const auto& m : (*run.regions)[j].modules()) {
      for (const auto& p : m->parameters(true)) {
        if (seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
      }
    }
  }
  return out;
}

} // namespace

namespace {

// What a run's checkpoint policy saw: the forward's op calls in order (call,
// cost, cacheable) and their cost, the recompute's cost, and the first
// forward op call given a tensor on the run's input storage that is in place
// (name ending in '_'), or else the first given one (Note [Regions that
// start in place]). Shared by the policy's copies (one per checkpoint call).
struct PolicyTally {
  double recompute_cost = 0.0;
  double forward_cost = 0.0;
  std::vector<std::tuple<std::string, double, bool>> calls;
  std::unordered_set<const c10::StorageImpl*> input_storages;  // set once the inputs are made
  std::pair<std::string, bool> input_writer;                   // (op, in place)
};

// The run's policy (`saved_ops` saved for kSelective, else everything
// recomputed), tallying into `tally`.
SelectivePolicy counting_policy(BlockMode mode, const std::vector<std::string>& saved_ops,
                                const OpCostFn& op_cost, std::shared_ptr<PolicyTally> tally) {
  SelectivePolicy inner = mode == BlockMode::kSelective ? save_op_calls_policy(saved_ops)
                                                        : SelectivePolicy([](const SelectiveContext&, const SelectiveOp&) {
                                                            return CheckpointPolicy::kPreferRecompute;
                                                          });
  return [inner, op_cost, tally, counts = std::map<std::string, int64_t>{}](
             const SelectiveContext& ctx, const SelectiveOp& op) mutable {
    if (!ctx.is_recompute && !tally->input_storages.empty() && !tally->input_writer.second) {
      for (const auto& v : op.inputs) {
        if (v.isTensor() && v.toTensor().defined() && v.toTensor().has_storage() &&
            tally->input_storages.count(v.toTensor().storage().unsafeGetStorageImpl()) != 0) {
          const bool in_place = !op.name.empty() && op.name.back() == '_';
          if (tally->input_writer.first.empty() || in_place) {
            tally->input_writer = {op.name, in_place};
          }
          break;
        }
      }
    }
    const auto decision = inner(ctx, op);
    const auto kind = op_kind(op);
    const double c = op_cost ? op_cost(op) : 0.0;
    if (ctx.is_recompute) {
      if (!is_kept(decision) || kind.aliases) {
        tally->recompute_cost += c;
      }
    } else {
      tally->forward_cost += c;
      const std::string key = op.full_name();
      tally->calls.emplace_back(key + "#" + std::to_string(counts[key]++), c, !kind.aliases);
    }
    return decision;
  };
}

// Each slot's first slot holding the same tensor (itself where none does).
std::vector<int> same_tensors(const std::vector<at::Tensor>& ts) {
  std::vector<int> same(ts.size());
  for (size_t t = 0; t < ts.size(); ++t) {
    same[t] = static_cast<int>(t);
    for (size_t u = 0; u < t; ++u) {
      if (ts[u].unsafeGetTensorImpl() == ts[t].unsafeGetTensorImpl()) {
        same[t] = static_cast<int>(u);
        break;
      }
    }
  }
  return same;
}

// Keeps one reference to each distinct tensor of `ts` (so that
// kept_by_autograd() sees autograd's references alone); returns each
// slot's first slot holding the same tensor.
std::vector<int> hold_once(std::vector<at::Tensor>& ts) {
  auto same = same_tensors(ts);
  for (size_t t = 0; t < ts.size(); ++t) {
    if (same[t] != static_cast<int>(t)) {
      ts[t] = at::Tensor();
    }
  }
  return same;
}

// The run's output boundary (Note [Boundary storages]), while `ys` (each
// tensor once, one storage reference) are still held by the caller:
// whether autograd keeps each one's storage; one on an input's storage (a
// view of it, or the input passed on) is decided with that input later.
void note_outputs(const std::vector<at::Tensor>& xs, std::vector<at::Tensor>& ys, BlockProfile& prof) {
  const auto same = hold_once(ys);
  prof.out_kept.assign(ys.size(), false);
  prof.out_alias.assign(ys.size(), -1);
  for (size_t t = 0; t < ys.size(); ++t) {
    const auto& y = ys[same[t]];
    for (size_t s = 0; s < xs.size() && y.has_storage(); ++s) {
      if (xs[s].has_storage() && y.storage().unsafeGetStorageImpl() == xs[s].storage().unsafeGetStorageImpl()) {
        prof.out_alias[t] = static_cast<int>(s);
        break;
      }
    }
  }
  for (size_t t = 0; t < ys.size(); ++t) {
    if (prof.out_alias[t] < 0) {
      prof.out_kept[t] = ys[same[t]].has_storage() && kept_by_autograd(ys[same[t]]);
    }
  }
}

// The run's input boundary, once the outputs are gone (only autograd can
// hold an input then; `xs` is left holding each tensor once): each input's
// bytes (counted at its first slot) and whether autograd keeps it; an output
// on an input's storage is kept as that input is.
void note_inputs(std::vector<at::Tensor>& xs, BlockProfile& prof) {
  const auto same_in = hold_once(xs);
  prof.in_bytes.assign(xs.size(), 0);
  prof.in_kept.assign(xs.size(), false);
  for (size_t s = 0; s < xs.size(); ++s) {
    const auto& x = xs[same_in[s]];
    prof.in_bytes[s] = same_in[s] == static_cast<int>(s) ? storage_bytes(x) : 0;
    prof.in_kept[s] = kept_by_autograd(x);
  }
  for (size_t t = 0; t < prof.out_kept.size(); ++t) {
    if (prof.out_alias[t] >= 0) {
      prof.out_kept[t] = prof.in_kept[prof.out_alias[t]];
    }
  }
}

// The peak of backward from `loss` above `after_forward` (0 without a loss).
int64_t backward_transient(ByteCounter& counter, const at::Tensor& loss, bool cpu, int64_t after_forward) {
  counter.reset_peak();
  if (!loss.defined()) {
    return 0;
  }
  if (cpu) {
    loss.backward();
  } else {
    detail::BackwardOnMeta::run(loss);
  }
  return counter.peak() - after_forward;
}

// The run's forward: its regions under `mode` (a checkpoint of them under
// `policy` unless kStore), metered by `meter`.
std::vector<at::Tensor> run_forward(const RunSpec& run, BlockMode mode, const SelectivePolicy& policy,
                                    const std::vector<at::Tensor>& xs, SavedTensorMeter& meter) {
  const auto* regions = run.regions;
  auto body = [regions, first = run.first, count = run.count](const std::vector<at::Tensor>& ts) {
    return run_span(*regions, first, count, ts);
  };
  SavedTensorMeterGuard metered(meter);
  if (mode == BlockMode::kStore) {
    return body(xs);
  }
  auto opts = CheckpointOptions().context_fn(create_selective_checkpoint_contexts(policy));
  return checkpoint(body, xs, opts);
}

// The run's inputs on `device`, one per slot (a slot that repeats another
// holds that slot's tensor), and the live bytes before them, where the
// run's peak window opens (`base`). An input that needs a gradient is a
// clone of a leaf made before `base`, not the leaf itself: in the step it is
// the previous region's output, a non-leaf, which an in-place op may write
// (on a leaf that requires grad it throws). The clone's bytes count as the
// input's did; its gradient passes through CloneBackward to the leaf, as it
// would to the region before (Note [Regions that start in place]). The
// step's input (region 0) is made before `base`: it is in the step's static
// bytes.
struct RunInput {
  std::vector<at::Tensor> xs;
  std::vector<at::Tensor> leaves;
  int64_t base = 0;
};

RunInput make_input(const RunSpec& run, c10::Device device, ByteCounter& counter) {
  const auto& spec = run.input;
  const auto n = static_cast<size_t>(spec.size());
  RunInput in;
  in.xs.resize(n);
  in.leaves.resize(n);
  for (size_t s = 0; s < n; ++s) {
    if (spec.same[s] != static_cast<int>(s)) {
      continue;
    }
    if (run.input_is_static) {
      in.xs[s] = make_tensor(spec.slots[s], device);
    } else if (spec.grad[s]) {
      in.leaves[s] = make_tensor(spec.slots[s], device).requires_grad_(true);
    }
  }
  in.base = counter.live();
  counter.reset_peak();
  for (size_t s = 0; s < n; ++s) {
    if (spec.same[s] != static_cast<int>(s)) {
      in.xs[s] = in.xs[spec.same[s]];
      continue;
    }
    if (in.leaves[s].defined()) {
      in.xs[s] = in.leaves[s].clone();
    } else if (!run.input_is_static) {
      in.xs[s] = make_tensor(spec.slots[s], device);
    }
    if (spec.grad[s] && !in.leaves[s].defined()) {
      in.xs[s].requires_grad_(true);
    }
  }
  return in;
}

// The step's loss stand-in over a run's outputs: (y * 2).sum() of each one
// that needs a gradient (mul by a scalar and sum save nothing of y), added
// up; undefined when none does (no backward reaches them: no parameters up
// to here).
at::Tensor stand_in_loss(const std::vector<at::Tensor>& ys) {
  at::Tensor loss;
  const auto same = same_tensors(ys);
  for (size_t t = 0; t < ys.size(); ++t) {
    if (same[t] != static_cast<int>(t) || !ys[t].requires_grad()) {
      continue;
    }
    auto l = (ys[t] * 2.0).sum();
    loss = loss.defined() ? loss + l : l;
  }
  return loss;
}

// What the step's meter will count for this run: its own parameters and
// buffers excluded, as SavedTensorMeter(module) excludes the model's.
void exclude_run_modules(const RunSpec& run, SavedTensorMeter& meter) {
  for (int64_t j = run.first; j < run.first + run.count; ++j) {
    for (const auto& m : (*run.regions)[j].modules()) {
      meter.exclude(*m);
    }
  }
}

} // namespace

// Runs the run's regions alone under `mode` (and `saved_ops`; count > 1: one
// checkpointed region, a segment), with the loss (y * 2).sum() so the
// incoming gradient is made by backward itself, as in the stack.
BlockProfile profile_run(const RunSpec& run, BlockMode mode, const std::vector<std::string>& saved_ops,
                         const OpCostFn& op_cost) {
  ByteCounter counter(run.cpu);
  // The recompute's copy of the CPU generator's state, seen on meta while it
  // lives (the CPU tracker sees it on CPU); the stash is the DP's to add
  // (Note [Checkpoint RNG copies on meta]).
  detail::MetaRngCopies copies(/*stash=*/false, /*fork=*/true);
  detail::RngCopyObserverGuard copies_scope(run.cpu ? nullptr : &copies);
  const auto params = params_of(run);
  BlockProfile prof;
  prof.choice.region_blocks = run.count;
  prof.choice.mode = mode;
  prof.choice.saved_ops = saved_ops;
  auto tally = std::make_shared<PolicyTally>();
  const SelectivePolicy counting = counting_policy(mode, saved_ops, op_cost, tally);
  reset_grads(params);
  const auto device = run.cpu ? c10::Device(at::kCPU) : c10::Device(at::kMeta);
  RunInput in = make_input(run, device, counter);
  auto& xs = in.xs;
  auto& leaves = in.leaves;
  const int64_t base = in.base;
  std::vector<int64_t> input_versions;
  for (const auto& x : xs) {
    if (x.has_storage()) {
      tally->input_storages.insert(x.storage().unsafeGetStorageImpl());
    }
    input_versions.push_back(x._version());
  }
  auto written = [&] {
    for (size_t s = 0; s < xs.size(); ++s) {
      if (xs[s].defined() && xs[s]._version() != input_versions[s]) return true;
    }
    return false;
  };
  at::Tensor loss;
  SavedTensorMeter meter;
  exclude_run_modules(run, meter);
  {
    std::vector<at::Tensor> ys;
    {
      // The forward's ops get autocast's casts where the regions enable it
      // (Note [Autocast on meta]); backward follows the forward's types.
      std::optional<detail::AutocastOnMeta> autocast;
      if (!run.cpu) {
        autocast.emplace(c10::kCPU);
      }
      ys = run_forward(run, mode, counting, xs, meter);
    }
    prof.choice.forward_peak_bytes = counter.peak() - base;
    if (mode != BlockMode::kStore && written()) {
      // The checkpoint keeps its inputs for its recompute, and the region
      // wrote one: backward would throw (Note [Regions that start in place]).
      const auto& writer = tally->input_writer.first;
      prof.unavailable = fmt::format("{} writes the region's input in place, which a checkpoint keeps",
                                     writer.empty() ? std::string("an op") : writer);
      prof.forward_cost = tally->forward_cost;
      prof.calls = tally->calls;
      tally->input_storages.clear();
      return prof;
    }
    loss = stand_in_loss(ys);
    note_outputs(xs, ys, prof);
  }
  const int64_t after_forward = counter.live();
  // The outputs are gone: only autograd can hold an input now.
  note_inputs(xs, prof);
  // The bytes kept are the meter's count, not the live bytes above `base`:
  // the two agree (the input counted where autograd or the checkpoint keeps
  // it, the output where the run saves it itself) except where a meta kernel
  // sizes its output without the allocator (arange on meta resizes its
  // storage in place: GPT's 256 B of positions are saved, yet never seen by
  // the counting allocator).
  prof.choice.stored_bytes = meter.report().saved_bytes;
  if (run.input_is_static) {
    // Made before `base` (it is in the step's static bytes).
    prof.choice.forward_peak_bytes += prof.in_bytes[0];
  }
  prof.choice.backward_transient_bytes = backward_transient(counter, loss, run.cpu, after_forward);
  loss = at::Tensor();
  xs.clear();
  leaves.clear();
  tally->input_storages.clear();
  reset_grads(params);
  prof.choice.recompute_cost = mode == BlockMode::kStore ? 0.0 : tally->recompute_cost;
  prof.choice.rng_state_bytes = mode == BlockMode::kStore ? 0 : cpu_rng_state_bytes();
  if (run.cpu) {
    // Profiled on CPU, the tracker saw the checkpoint's RNG stash in the
    // forward peak; the DP adds it on its own (the meter never sees it).
    prof.choice.forward_peak_bytes -= prof.choice.rng_state_bytes;
  }
  prof.forward_cost = tally->forward_cost;
  prof.calls = tally->calls;
  return prof;
}

HeadProfile profile_head(const std::function<at::Tensor(const at::Tensor&)>& loss_fn,
                         const TensorSpec& output, bool cpu) {
  ByteCounter counter(cpu);
  HeadProfile h;
  const int64_t base = counter.live();
  counter.reset_peak();
  auto y = make_tensor(output, cpu ? c10::Device(at::kCPU) : c10::Device(at::kMeta)).requires_grad_(true);
  SavedTensorMeter meter;  // what the step's meter counts for the loss (see profile_run)
  at::Tensor loss;
  {
    SavedTensorMeterGuard metered(meter);
    loss = loss_fn(y);
  }
  TORCH_CHECK(loss.defined() && loss.numel() == 1,
              "plan_regions: the loss must be a scalar, but got a tensor of shape ",
              loss.defined() ? loss.sizes() : at::IntArrayRef{});
  h.forward_peak_bytes = counter.peak() - base;
  const int64_t after = counter.live();
  h.stored_bytes = meter.report().saved_bytes;  // the last output included where the loss saves it
  h.in_bytes = storage_bytes(y);
  h.in_kept = kept_by_autograd(y);
  h.loss_bytes = storage_bytes(loss);
  counter.reset_peak();
  if (cpu) {
    loss.backward();
  } else {
    detail::BackwardOnMeta::run(loss);
  }
  h.backward_transient_bytes = counter.peak() - after;
  return h;
}

OptimizerProfile profile_optimizer(torch::optim::Optimizer& opt, const std::vector<at::Tensor>& params) {
  auto& counter = MetaAllocator::get();
  OptimizerProfile r;
  for (const auto& p : params) {
    if (p.requires_grad()) {
      p.mutable_grad() = at::empty_like(p);
    }
  }
  const int64_t before = counter.live_bytes();
  opt.step();  // creates the state
  r.state_bytes = counter.live_bytes() - before;
  const int64_t base = counter.live_bytes();
  counter.reset_peak();
  opt.step();
  r.transient_bytes = counter.peak_bytes() - base;
  reset_grads(params);
  return r;
}

// A region's structure: its modules' types and their tensors' names, shapes
// and dtypes (or the key the user gave). Regions with the same structure on
// the same input run the same code (the user sets a key where they do not).
std::string structure_key(const Region& region) {
  if (!region.key().empty()) {
    return "key:" + region.key();
  }
  std::string k;
  for (const auto& m : region.modules()) {
    for (const auto& sub : m->modules(/*include_self=*/true)) {
      k += sub->name();
      k += '{';
      for (const auto& p : sub->named_parameters(/*recurse=*/false)) {
        k += fmt::format("{}:{}[{}]{},", p.key(), c10::toString(p.value().scalar_type()),
                         fmt::join(p.value().sizes(), ","), p.value().requires_grad() ? "g" : "");
      }
      for (const auto& b : sub->named_buffers(/*recurse=*/false)) {
        k += fmt::format("{}:{}[{}],", b.key(), c10::toString(b.value().scalar_type()),
                         fmt::join(b.value().sizes(), ","));
      }
      k += sub->is_training() ? "}t" : "}e";
    }
    k += ';';
  }
  return k;
}

// The op a failure on meta names, when it is a missing kernel.
// The op a failure on meta names: the op without a meta kernel, else the
// first op or autograd node its message mentions ("... (aten::unsafe_split.Tensor
// output ...)", "Function MkldnnRnnLayerBackward0 returned an invalid
// gradient ..."); "" when it names none.
std::string meta_failure_op(const c10::Error& e) {
  const std::string what = e.what_without_backtrace();
  if (dynamic_cast<const c10::NotImplementedError*>(&e) != nullptr ||
      what.find("Could not run '") != std::string::npos) {
    return missing_op(what);
  }
  const auto name_at = [&](size_t a) {
    size_t b = a;
    while (b < what.size() && (std::isalnum(static_cast<unsigned char>(what[b])) || what[b] == '_' ||
                               what[b] == ':' || what[b] == '.')) {
      ++b;
    }
    while (b > a && (what[b - 1] == '.' || what[b - 1] == ':')) --b;
    return what.substr(a, b - a);
  };
  if (auto a = what.find("aten::"); a != std::string::npos) return name_at(a);
  if (auto a = what.find("Function "); a != std::string::npos) return name_at(a + 9);
  return "";
}

} // namespace detail

} // namespace trainmem
