// plan_regions(): the checkpoint planner (Note [Checkpoint planner]), stage
// by stage. Regions and plans themselves are regions.cpp's.
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
#include "core/detail/checkpoint_state.h"
#include "core/detail/prediction_scope.h"
#include "detail/intercept.h"
#include "detail/optimizer_state.h"
#include "detail/process_library.h"
#include "plan/detail/plan_internal.h"

namespace trainmem {

// Note [Checkpoint planner]
// The step is forward, loss out.pow(2).mean(), backward, AdamW step. Every
// choice c for a block (store, checkpoint, a selective set) or for a run of k
// blocks (one checkpointed region, a segment) is profiled once, alone on
// meta: stored(c) (kept from its forward to its backward, input included,
// plus the region's CPU RNG stash), F(c) (its forward's peak), W(c) (its
// backward's peak above its stored bytes: incoming gradient, recompute, its
// gradients, temporaries) and cost(c). With S_i the bytes stored before
// block i, Z = parameters + buffers + AdamW state + input, G_>i later blocks' gradients:
//   forward of block i   Z + S_i + F_i
//   backward of block i  Z + S_i + stored_i + G_>i + W_i
//   loss head            Z + S_L + (its forward peak, or stored + backward)
//   optimizer step       Z - input + G + AdamW transient
// The step makes its input (RegionModel::input) and nothing holds it past
// backward, which frees it with the graph: in the optimizer step it is gone,
// as it is in predict_step_peak() and on CPU (counting it there would put a
// conv net with a large head, whose peak is Adam's step, an input over the
// CPU's: 2,457,600 B at 8 x 3 x 160 x 160).
// Every term grows with S_i, so a dynamic program over block boundaries
// whose state is S_i, keeping states no other beats in S, cost and peak
// (Pareto), is exact for this model. The cheapest final state within the
// budget wins, ties to the smaller peak: a larger budget never costs more
// recompute, and a smaller one never gives a larger peak (PyTorch's
// activation_memory_budget can do both). Selective candidates: each
// cacheable op call is profiled alone (bytes it adds, recompute it saves),
// ranked by recompute saved per byte, and the ranking's prefixes are profiled
// as sets, so interactions (Note [In-place ops on cached outputs]'s copies)
// are measured, not assumed.
// Note [Boundary storages]
// The meter counts each saved storage once over the whole step. Profiled
// alone, each region counts the tensors at its two boundaries as it sees
// them: its input when it (or the checkpoint) keeps it (a Linear's or a
// conv's input), its output when it keeps that itself (relu, sigmoid, tanh,
// log_softmax save their result). In the step they are one storage: region
// i's output is region i + 1's input, and a view region (flatten, reshape)
// passes its input's storage on. Counting both would count a storage twice
// (MNIST's relu -> conv2 and relu -> view -> fc1, log_softmax -> nll_loss:
// 453,120 B too many). So the DP carries, per state, whether the storage at
// its boundary is counted already (an earlier region kept it, or it is the
// step's input, in the static bytes); a region that keeps its input then
// adds nothing for it, and its forward peak, which includes its input, does
// not count it again. The same holds for the loss head. Only boundaries can
// be shared this way: a region's other tensors are its own.
namespace detail {

namespace {

std::string plan_name(const std::vector<BlockChoice>& blocks) {
  const auto L = static_cast<int64_t>(blocks.size());
  bool any_sel = false, all_store = true, all_ckpt = true;
  for (const auto& b : blocks) {
    any_sel |= b.mode == BlockMode::kSelective;
    all_store &= b.mode == BlockMode::kStore;
    all_ckpt &= b.mode == BlockMode::kCheckpoint;
  }
  bool any_region = false;
  for (const auto& b : blocks) {
    any_region |= b.region_blocks != 1;
  }
  if (all_store) return "none";
  if (any_region) {
    for (int64_t n = 2; n <= L; ++n) {
      const auto seg = BlockCheckpointing::segments(L, n);
      bool match = true;
      for (int64_t i = 0; i < L;) {
        if (seg.blocks[i]) {
          const int64_t k = seg.region_length[i];
          match &= blocks[i].mode == BlockMode::kCheckpoint && blocks[i].region_blocks == k;
          for (int64_t j = i + 1; j < i + k; ++j) {
            match &= blocks[j].region_blocks == 0;
          }
          i += k;
        } else {
          match &= blocks[i].mode == BlockMode::kStore;
          ++i;
        }
      }
      if (match) return n == sqrt_segments(L) ? "sqrt" : "segments_" + std::to_string(n);
    }
    return "segments";
  }
  if (all_ckpt) return "full";
  if (any_sel) {
    bool uniform = true;
    for (const auto& b : blocks) {
      uniform &= b.mode == BlockMode::kSelective && b.saved_ops == blocks.front().saved_ops;
    }
    return uniform ? "selective" : "mixed";
  }
  for (int64_t k = 2; k < L; ++k) {  // every_L and up: block 0 alone, "chosen"
    bool match = true;
    for (int64_t i = 0; i < L; ++i) {
      match &= (blocks[i].mode == BlockMode::kCheckpoint) == (i % k == 0);
    }
    if (match) return "every_" + std::to_string(k);
  }
  return "chosen";
}

// ---------------------------------------------------------------------------
// Stage 2: the shapes between regions

// Region i fails on meta: it runs on CPU to be profiled, and the plan says so.
void fall_back(RegionShapes& shapes, const std::vector<Region>& regions, int64_t i, const c10::Error& e) {
  shapes.cpu[i] = true;
  const std::string op = meta_failure_op(e);
  shapes.cpu_fallbacks.push_back({i, op, first_line(e.what_without_backtrace())});
  const bool missing = dynamic_cast<const c10::NotImplementedError*>(&e) != nullptr ||
      std::string(e.what_without_backtrace()).find("Could not run '") != std::string::npos;
  TORCH_WARN("plan_regions: region ", i, " ('", regions[i].name(), "') runs on CPU to be profiled: ",
             op.empty() ? "it fails on meta: " + first_line(e.what_without_backtrace())
                        : missing ? op + " has no meta kernel"
                                  : op + " fails on meta: " + first_line(e.what_without_backtrace()));
}

void on_cpu(PlanningSwap& swap, const std::vector<Region>& rs, int64_t first, int64_t count, bool on) {
  for (int64_t j = first; j < first + count; ++j) {
    swap.set_cpu(rs[j].modules(), on);
  }
}

// Note [Regions with several tensors]
// Regions of a U-Net pass tensors past each other: an encoder stage's
// features are a decoder stage's skip input. A region may take and return
// several tensors (slots); every tensor between two regions is a slot of
// that boundary, and a region carries a tensor a later one needs by
// returning it unchanged. The planner profiles each region on all of its
// input slots, so a carried tensor is live in its forward as in the step,
// a checkpoint over the region keeps it, and its gradient, made by the
// region that used it, is live through the backward of the regions that
// carry it. Note [Boundary storages] then holds per slot: a slot's storage
// is counted once, by the first region that keeps it (the one whose
// backward frees it last); the DP carries one bit per slot (SlotMask).
// The first region takes the step's input alone, the last returns the
// loss's input alone. Slots that hold one tensor twice are one storage; two
// different tensors on one storage (chunks of one projection) are refused,
// naming the region: a boundary's storages are its slots'.
namespace {

// The boundary after region i from its outputs `ys` on inputs `xs` (run with
// grad): a slot passed on unchanged keeps its gradient flag, any other one
// needs a gradient when a region up to here trains (`needs_grad`) and autograd
// says it does. A floating tensor made from no parameter (a LLaMA's rotary
// tables, carried to every block) needs none: made a leaf that requires one,
// the block would save what multiplies it for its gradient.
BoundarySpec boundary_of(const Region& region, int64_t i, const std::vector<at::Tensor>& xs,
                         const BoundarySpec& in, const std::vector<at::Tensor>& ys, bool needs_grad) {
  TORCH_CHECK(!ys.empty() && static_cast<int64_t>(ys.size()) <= kMaxSlots, "plan_regions: region ", i, " ('",
              region.name(), "') returns ", ys.size(), " tensors; expected 1 to ", kMaxSlots);
  BoundarySpec out;
  for (size_t t = 0; t < ys.size(); ++t) {
    const auto& y = ys[t];
    TORCH_CHECK(y.defined(), "plan_regions: region ", i, " ('", region.name(), "') returns an undefined tensor ",
                "in slot ", t);
    int same = static_cast<int>(t);
    for (size_t u = 0; u < t; ++u) {
      if (ys[u].unsafeGetTensorImpl() == y.unsafeGetTensorImpl()) {
        same = static_cast<int>(u);
        break;
      }
      TORCH_CHECK(!(ys[u].has_storage() && y.has_storage() &&
                    ys[u].storage().unsafeGetStorageImpl() == y.storage().unsafeGetStorageImpl()),
                  "plan_regions: region ", i, " ('", region.name(), "') returns two different tensors on one "
                  "storage (slots ", u, " and ", t, "); return the tensor once and take the view in the region "
                  "that uses it");
    }
    bool grad = needs_grad && y.requires_grad();
    for (size_t s = 0; s < xs.size(); ++s) {
      if (xs[s].unsafeGetTensorImpl() == y.unsafeGetTensorImpl()) {
        grad = in.grad[s];  // passed on unchanged
        break;
      }
    }
    out.slots.push_back(spec_of(y));
    out.same.push_back(same);
    out.grad.push_back(grad);
  }
  return out;
}

} // namespace

// Shapes region by region (no grad, meta); a region that fails on meta
// runs on CPU, and is profiled there.
RegionShapes shape_regions(const std::vector<Region>& regions, PlanningSwap& swap, const StaticTerms& terms) {
  const auto L = static_cast<int64_t>(regions.size());
  RegionShapes shapes;
  shapes.specs.resize(L + 1);
  shapes.specs[0] = one_slot(terms.input);
  shapes.cpu.assign(L, false);
  auto& specs = shapes.specs;
  bool needs_grad = false;
  for (int64_t i = 0; i < L; ++i) {
    TORCH_CHECK(regions[i].takes_tensors() || specs[i].size() == 1, "plan_regions: region ", i, " ('",
                regions[i].name(), "') takes one tensor, but ",
                i == 0 ? std::string("the step's input is") : fmt::format("region {} returns", i - 1), " ",
                specs[i].size(), "; give it a Tensors(Tensors) forward (Note [Regions with several tensors])");
    needs_grad = needs_grad || terms.region_trains[i];
    // With grad (on meta nothing is kept), so that each output says whether
    // it needs a gradient; an input that needs one is not a leaf, as in the
    // step (a region may start in place).
    at::AutoGradMode grad_mode(true);
    auto shape_on = [&](c10::Device device) {
      auto xs = make_tensors(specs[i], device, /*grad=*/true);
      for (int64_t s = 0; s < specs[i].size(); ++s) {
        xs[s] = specs[i].same[s] != s ? xs[specs[i].same[s]] : xs[s].requires_grad() ? xs[s].clone() : xs[s];
      }
      specs[i + 1] = boundary_of(regions[i], i, xs, specs[i], regions[i](xs), needs_grad);
    };
    try {
      shape_on(at::kMeta);
    } catch (const c10::Error& e) {
      if (std::string(e.what_without_backtrace()).rfind("plan_regions:", 0) == 0) {
        throw;
      }
      fall_back(shapes, regions, i, e);
      on_cpu(swap, regions, i, 1, true);
      try {
        shape_on(at::kCPU);
      } catch (...) {
        on_cpu(swap, regions, i, 1, false);
        throw;
      }
      on_cpu(swap, regions, i, 1, false);
    }
  }
  TORCH_CHECK(specs[L].size() == 1, "plan_regions: the last region ('", regions.back().name(), "') returns ",
              specs[L].size(), " tensors; the loss takes one (Note [Regions with several tensors])");
  return shapes;
}

// ---------------------------------------------------------------------------
// Stage 3: the profiles

// Profiles runs of regions (each distinct (regions, input, choice) once, by
// run_key), on meta, or on CPU where a region falls back.
class Profiler {
 public:
  Profiler(const std::vector<Region>& regions, PlanningSwap& swap, RegionShapes& shapes, OpCostFn cost_fn)
      : regions_(regions), swap_(swap), shapes_(shapes), cost_fn_(std::move(cost_fn)) {
    for (size_t i = 0; i < regions.size(); ++i) {
      keys_.push_back(structure_key(regions[i]) + "->" + shapes.specs[i + 1].str());
    }
  }

  std::string run_key(int64_t first, int64_t count) const {
    const auto& s = shapes_;
    std::string k = fmt::format("{}{}{}|", first == 0 ? "S" : "", s.specs[first].str(), s.cpu[first] ? "C" : "");
    for (int64_t j = first; j < first + count; ++j) {
      k += keys_[j] + (s.cpu[j] ? "C|" : "|");
    }
    return k;
  }

  BlockProfile profile(int64_t first, int64_t count, BlockMode mode, const std::vector<std::string>& ops) {
    RunSpec run;
    run.regions = &regions_;
    run.first = first;
    run.count = count;
    run.input = shapes_.specs[first];
    run.input_is_static = first == 0;
    for (int64_t j = first; j < first + count; ++j) {
      run.cpu = run.cpu || shapes_.cpu[j];
    }
    ++num_profiles_;
    if (!run.cpu) {
      try {
        return profile_run(run, mode, ops, cost_fn_);
      } catch (const c10::Error& e) {
        if (count != 1 || mode != BlockMode::kStore) {
          // Its regions each ran on meta alone, or the region's stored run
          // did: not a missing meta kernel (a checkpoint that fails is an
          // unavailable choice: Note [Regions that start in place]).
          throw;
        }
        fall_back(shapes_, regions_, first, e);  // backward has no meta kernel
        run.cpu = true;
      }
    }
    on_cpu(swap_, regions_, first, count, true);
    try {
      auto p = profile_run(run, mode, ops, cost_fn_);
      on_cpu(swap_, regions_, first, count, false);
      return p;
    } catch (...) {
      on_cpu(swap_, regions_, first, count, false);
      throw;
    }
  }

  // Note [Regions that start in place]
  // A region whose first op writes its input in place (ReLU(inplace) right
  // after a cut, as VGG-style nets and MLPs are written) runs stored, but a
  // checkpoint of it cannot: the checkpoint keeps the input for its
  // recompute, the forward then writes it, and backward throws on CPU as in
  // PyTorch ("one of the variables needed for gradient computation has been
  // modified by an inplace operation"; a selective region and a segment
  // starting there keep the same input). profile_run() sees the write (the
  // input's version moved in a checkpointed forward) and names the op; any
  // other failure of a checkpointed run whose regions ran stored is taken the
  // same way. Such a profile is an unavailable choice: the DP never weighs
  // it, and the plan lists it (CheckpointPlan::unavailable, printed by
  // to_string). The forward cost still comes from the checkpoint's forward,
  // which ran. Profiling needs the input to be a non-leaf too (an in-place
  // op on a leaf that requires grad throws): see profile_run().
  BlockProfile profile_or_unavailable(int64_t first, int64_t count, BlockMode mode,
                                      const std::vector<std::string>& ops = {}) {
    BlockProfile p;
    try {
      p = profile(first, count, mode, ops);
    } catch (const c10::Error& e) {
      p = BlockProfile{};
      p.choice.mode = mode;
      p.choice.region_blocks = count;
      p.unavailable = first_line(e.what_without_backtrace());
    }
    return p;
  }

  int64_t num_profiles() const { return num_profiles_; }

 private:
  const std::vector<Region>& regions_;
  PlanningSwap& swap_;
  RegionShapes& shapes_;
  OpCostFn cost_fn_;
  std::vector<std::string> keys_;
  int64_t num_profiles_ = 0;
};

// Region i's selective candidates (Note [Checkpoint planner]): each cacheable
// op call of its checkpoint `ckpt` profiled alone, ranked by recompute saved
// per byte added, and the ranking's prefixes profiled as sets.
void add_selective(Profiler& profiler, int64_t i, const BlockProfile& ckpt, std::vector<BlockProfile>& out) {
  struct Ranked {
    std::string call;
    double saved_cost;
    int64_t added_bytes;
  };
  std::vector<Ranked> ranked;
  for (const auto& [call, cost, cacheable] : ckpt.calls) {
    if (!cacheable) {
      continue;
    }
    auto one = profiler.profile_or_unavailable(i, 1, BlockMode::kSelective, {call});
    if (!one.unavailable.empty()) {
      continue;
    }
    const double saved = ckpt.choice.recompute_cost - one.choice.recompute_cost;
    if (saved <= 0) {
      continue;  // not recomputed anyway (early stop), or free
    }
    ranked.push_back({call, saved, one.choice.stored_bytes - ckpt.choice.stored_bytes});
  }
  std::stable_sort(ranked.begin(), ranked.end(), [](const Ranked& a, const Ranked& b) {
    const double ra = a.saved_cost / static_cast<double>(std::max<int64_t>(a.added_bytes, 1));
    const double rb = b.saved_cost / static_cast<double>(std::max<int64_t>(b.added_bytes, 1));
    return ra > rb;
  });
  std::vector<std::string> prefix;
  for (const auto& r : ranked) {
    prefix.push_back(r.call);
    out.push_back(profiler.profile_or_unavailable(i, 1, BlockMode::kSelective, prefix));
  }
}

// Per region: store, checkpoint, selective prefixes; regions alike share them.
void profile_singles(Profiler& profiler, int64_t L, bool selective, Profiles& out) {
  std::unordered_map<std::string, std::shared_ptr<const std::vector<BlockProfile>>> cache;
  out.singles.resize(L);
  for (int64_t i = 0; i < L; ++i) {
    const std::string key = profiler.run_key(i, 1);
    if (auto it = cache.find(key); it != cache.end()) {
      out.singles[i] = it->second;
      continue;
    }
    auto c = std::make_shared<std::vector<BlockProfile>>();
    c->push_back(profiler.profile(i, 1, BlockMode::kStore, {}));
    c->push_back(profiler.profile_or_unavailable(i, 1, BlockMode::kCheckpoint));
    if (selective && (*c)[1].unavailable.empty()) {
      const auto ckpt = (*c)[1];
      add_selective(profiler, i, ckpt, *c);
    }
    out.singles[i] = c;
    cache.emplace(key, c);
  }
}

// Segments: k consecutive regions checkpointed as one.
void profile_segments(Profiler& profiler, int64_t L, int64_t max_region, Profiles& out) {
  std::unordered_map<std::string, std::shared_ptr<const BlockProfile>> cache;
  out.segments.resize(L);
  for (int64_t i = 0; i < L; ++i) {
    for (int64_t k = 2; k <= max_region && i + k <= L; ++k) {
      const std::string key = profiler.run_key(i, k);
      auto it = cache.find(key);
      if (it == cache.end()) {
        auto p = std::make_shared<const BlockProfile>(profiler.profile_or_unavailable(i, k, BlockMode::kCheckpoint));
        it = cache.emplace(key, std::move(p)).first;
      }
      out.segments[i].push_back(it->second);
    }
  }
}

// The unavailable choices, per region (Note [Regions that start in place]).
void list_unavailable(Profiles& p) {
  for (int64_t i = 0; i < static_cast<int64_t>(p.singles.size()); ++i) {
    for (const auto& s : *p.singles[i]) {
      if (!s.unavailable.empty()) {
        p.unavailable.push_back({i, 1, s.choice.mode, s.unavailable});
      }
    }
    for (const auto& s : p.segments[i]) {
      if (!s->unavailable.empty()) {
        p.unavailable.push_back({i, s->choice.region_blocks, s->choice.mode, s->unavailable});
      }
    }
  }
}

// The loss head, on the last output (on CPU where it fails on meta).
HeadProfile profile_loss(const RegionModel& model, RegionShapes& shapes) {
  const auto L = static_cast<int64_t>(model.regions.size());
  try {
    return profile_head(model.loss, shapes.specs[L].slots[0], /*cpu=*/false);
  } catch (const c10::Error& e) {
    const std::string op = meta_failure_op(e);
    shapes.cpu_fallbacks.push_back({L, op, first_line(e.what_without_backtrace())});
    TORCH_WARN("plan_regions: the loss runs on CPU to be profiled: ",
               op.empty() ? std::string("it fails on meta") : op + " has no meta kernel");
    return profile_head(model.loss, shapes.specs[L].slots[0], /*cpu=*/true);
  }
}

Profiles profile_regions(const RegionModel& model, const PlanOptions& options, Profiler& profiler,
                         RegionShapes& shapes, int64_t max_region) {
  const auto L = static_cast<int64_t>(model.regions.size());
  Profiles p;
  profile_singles(profiler, L, options.selective(), p);
  profile_segments(profiler, L, max_region, p);
  list_unavailable(p);
  p.head = profile_loss(model, shapes);
  p.num_profiles = profiler.num_profiles();
  return p;
}

// ---------------------------------------------------------------------------
// Stage 4: the candidates

Candidates candidates(const Profiles& profiles, const StaticTerms& terms, int64_t max_region) {
  Candidates c;
  c.profiles = &profiles;
  c.regions = static_cast<int64_t>(profiles.singles.size());
  c.max_region = max_region;
  const int64_t L = c.regions;
  c.grads_after.assign(L + 1, 0);
  for (int64_t i = L - 1; i >= 0; --i) {
    c.grads_after[i] = c.grads_after[i + 1] + terms.region_grad_bytes[i];
  }
  c.least_stored_after.assign(L + 1, 0);
  for (int64_t i = L - 1; i >= 0; --i) {
    int64_t least = std::numeric_limits<int64_t>::max();
    for (int64_t k = 1; k <= max_region && i + k <= L; ++k) {
      for (const auto* prof : c.choices(i, k)) {
        const auto& ch = prof->choice;
        const int64_t added = ch.stored_bytes + ch.rng_state_bytes - counted_in_bytes(*prof, kAllSlots, true);
        least = std::min(least, added + c.least_stored_after[i + k]);
      }
    }
    c.least_stored_after[i] = least;
  }
  for (int64_t i = 0; i < L; ++i) {
    for (int64_t k = 1; k <= max_region && i + k <= L; ++k) {
      c.num_candidates += static_cast<int64_t>(c.choices(i, k).size());
    }
  }
  return c;
}

// ---------------------------------------------------------------------------
// Stage 6: the plan

// The plan's blocks from the chosen final state back to region 0, and the
// profile each block's choice came from (null inside a segment).
std::vector<const BlockProfile*> trace_back(const Candidates& cands, const Pick& chosen, CheckpointPlan& plan) {
  const int64_t L = cands.regions;
  const auto& layers = chosen.run->layers;
  plan.blocks.resize(L);
  int64_t s = -1;  // the index in layers[i] of the state the plan passes through
  std::vector<const BlockProfile*> chosen_profiles(L, nullptr);
  for (int64_t i = L; i >= 1;) {
    const auto& st = i == L ? chosen.state() : layers[i][s];
    const int64_t start = i - st.region;
    chosen_profiles[start] = cands.choices(start, st.region)[st.option];
    plan.blocks[start] = chosen_profiles[start]->choice;
    for (int64_t j = start + 1; j < i; ++j) {  // inside the segment: nothing of their own
      plan.blocks[j] = BlockChoice{};
      plan.blocks[j].mode = BlockMode::kCheckpoint;
      plan.blocks[j].region_blocks = 0;
    }
    s = st.parent;
    i = start;
  }
  return chosen_profiles;
}

// What the meter counts: each kept storage once, the step's input
// included when saved. A block's stored_bytes leaves out a boundary
// storage the block before it counted (Note [Boundary storages]).
void count_activations(const std::vector<const BlockProfile*>& chosen_profiles, const HeadProfile& head,
                       CheckpointPlan& plan) {
  plan.activation_bytes = 0;
  SlotMask counted = 0;
  for (size_t i = 0; i < chosen_profiles.size(); ++i) {
    const auto* prof = chosen_profiles[i];
    if (prof == nullptr) {
      continue;  // inside a segment
    }
    auto& b = plan.blocks[i];
    b.stored_bytes -= counted_in_bytes(*prof, counted, /*kept_only=*/true);
    plan.activation_bytes += b.stored_bytes;
    counted = counted_out(*prof, counted);
  }
  plan.activation_bytes += head.stored_bytes - ((counted & 1U) != 0 && head.in_kept ? head.in_bytes : 0);
}

// The plan within the budget if one fits, else the least-peak one.
CheckpointPlan assemble(const RegionModel& model, const PlanOptions& options, RegionShapes shapes,
                        const Profiles& profiles, const Candidates& cands, const StaticTerms& terms,
                        int64_t limit, const Pick& within, const Pick& at_min_peak) {
  CheckpointPlan plan;
  plan.cpu_fallbacks = std::move(shapes.cpu_fallbacks);
  plan.unavailable = profiles.unavailable;
  plan.feasible = within.state().peak <= limit;
  plan.budget_bytes = options.budget_bytes();
  plan.min_peak_bytes = at_min_peak.state().peak;
  plan.min_peak_cost = at_min_peak.state().cost;
  const Pick chosen = plan.feasible ? within : at_min_peak;
  plan.bucket_bytes = chosen.bucket_bytes;
  plan.predicted_peak_bytes = chosen.state().peak;
  plan.peak_phase = chosen.state().phase;
  plan.recompute_cost = chosen.state().cost;
  for (const auto& single : profiles.singles) {
    plan.forward_cost += (*single)[1].forward_cost;
  }
  plan.static_bytes = terms.static_bytes();
  plan.grad_bytes = terms.grad_bytes;
  plan.num_candidates = cands.num_candidates;
  plan.num_profiles = profiles.num_profiles;
  count_activations(trace_back(cands, chosen, plan), profiles.head, plan);
  for (const auto& r : model.regions) {
    plan.region_names.push_back(r.name());
  }
  plan.name = plan_name(plan.blocks);
  return plan;
}

// Whether a boundary between regions holds several tensors.
bool carries_tensors(const RegionShapes& shapes) {
  return std::any_of(shapes.specs.begin(), shapes.specs.end(), [](const BoundarySpec& b) { return b.size() > 1; });
}

// The whole step of `plan` on meta: the input, the regions under the plan,
// the loss, backward and the optimizer (a warm-up step first), as
// predict_step_peak runs it, over a module holding the regions' modules.
StepPeak whole_step_on_meta(const RegionModel& model, const StaticTerms& terms, const CheckpointPlan& plan) {
  torch::nn::Module all;
  std::unordered_set<const torch::nn::Module*> seen;
  for (const auto& r : model.regions) {
    for (const auto& m : r.modules()) {
      if (seen.insert(m.get()).second) {
        all.register_module(fmt::format("m{}", seen.size()), m);
      }
    }
  }
  std::unique_ptr<torch::optim::Optimizer> made;
  torch::optim::Optimizer* opt = model.optimizer;
  if (opt == nullptr && model.make_optimizer && !RecipeStep::wanted(model)) {
    made = model.make_optimizer(terms.params);
    opt = made.get();
  }
  const auto checkpointing = plan.checkpointing();
  const auto forward = [&] { return model.loss(run_regions(model.regions, model.input(at::kMeta), checkpointing)); };
  if (RecipeStep::wanted(model)) {
    return recipe_step_on_meta(model, all, terms.params, forward);
  }
  return predict_step_peak_locked(all, forward, opt);
}

} // namespace

std::vector<const BlockProfile*> Candidates::choices(int64_t i, int64_t k) const {
  // Unavailable choices (Note [Regions that start in place]) left out: a
  // run may have none (a segment), never a single region (it runs stored).
  std::vector<const BlockProfile*> c;
  if (k == 1) {
    for (const auto& p : *profiles->singles[i]) {
      if (p.unavailable.empty()) c.push_back(&p);
    }
  } else if (profiles->segments[i][k - 2]->unavailable.empty()) {
    c.push_back(profiles->segments[i][k - 2].get());
  }
  return c;
}

} // namespace detail

namespace {

// The plan with the values its profiling and whole-step runs read from meta
// (Note [Scalar reads inside a prediction]).
CheckpointPlan with_reads(CheckpointPlan plan, const detail::PredictionScope& prediction) {
  plan.scalar_reads = prediction.scalar_reads();
  return plan;
}

} // namespace

CheckpointPlan plan_regions(const RegionModel& model, const PlanOptions& options) {
  using namespace detail;
  TORCH_CHECK(options.budget_bytes() >= 0,
              "plan_regions: expected budget_bytes >= 0, but got ", options.budget_bytes());
  TORCH_CHECK(!model.regions.empty(), "plan_regions: the model has no regions");
  TORCH_CHECK(static_cast<bool>(model.input),
              "plan_regions: RegionModel::input is empty (it makes the sample input on a device)");
  TORCH_CHECK(static_cast<bool>(model.loss),
              "plan_regions: RegionModel::loss is empty (it makes the scalar loss of the output)");
  TORCH_CHECK(model.optimizer == nullptr || !model.make_optimizer,
              "plan_regions: give RegionModel::optimizer or make_optimizer, not both");
  TORCH_CHECK(!model.master_weights || (model.optimizer == nullptr && static_cast<bool>(model.make_optimizer)),
              "plan_regions: RegionModel::master_weights needs make_optimizer (called with the masters' "
              "optimized() tensors), not an optimizer over the model's own parameters");
  TORCH_CHECK(!model.grad_scaler || model.optimizer != nullptr || static_cast<bool>(model.make_optimizer),
              "plan_regions: RegionModel::grad_scaler needs an optimizer (RegionModel::optimizer or "
              "make_optimizer) for the scaler to step");
  enable_cpu_meta_kernels();
  std::lock_guard<std::mutex> lock(prediction_mutex());
  PredictionScope prediction;  // Note [Init replayed on materialize]: nothing recorded
  const OpCostFn cost_fn = options.op_cost() ? options.op_cost() : OpCostFn(flop_cost);
  const auto& regions = model.regions;
  const auto L = static_cast<int64_t>(regions.size());
  const int64_t max_region = std::clamp<int64_t>(options.max_region_blocks(), 1, L);
  PlanningSwap swap(regions);  // Note [Planning a live model]

  const StaticTerms terms = account_regions(model);
  RegionShapes shapes = shape_regions(regions, swap, terms);
  Profiler profiler(regions, swap, shapes, cost_fn);
  const Profiles profiles = profile_regions(model, options, profiler, shapes, max_region);
  const Candidates cands = candidates(profiles, terms, max_region);
  Search search(cands, terms);
  const int64_t limit = options.budget_bytes() > 0 ? options.budget_bytes() : std::numeric_limits<int64_t>::max();
  Pick within = cheapest_within(search, std::max(limit, search.min_peak));
  const Pick at_min_peak = limit <= search.min_peak ? within : cheapest_within(search, search.min_peak);
  CheckpointPlan plan = assemble(model, options, shapes, profiles, cands, terms, limit, within, at_min_peak);
  const bool recipe = RecipeStep::wanted(model);
  if (!carries_tensors(shapes) && !recipe) {
    return with_reads(std::move(plan), prediction);
  }
  // Note [Regions with several tensors]: the plan weighed by its whole step
  // on meta; while that is over the budget, the DP's limit is lowered by the
  // excess (at most 4 rounds).
  int64_t dp_limit = limit;
  for (int round = 1;; ++round) {
    StepPeak whole;
    try {
      whole = whole_step_on_meta(model, terms, plan);
    } catch (const c10::Error& e) {
      // Note [Planned steps with a scaler or master weights]: no composition
      // stands in for the scaler's or the masters' step.
      TORCH_CHECK(!recipe, "plan_regions: the planned step with its ",
                  model.grad_scaler ? "GradScaler" : "fp32 master weights",
                  " has no meta path as a whole (", first_line(e.what_without_backtrace()),
                  "), and the regions' composition leaves its bytes out: not planned");
      TORCH_WARN("plan_regions: the planned step has no meta path as a whole (",
                 first_line(e.what_without_backtrace()), "); its peak is the regions' composition");
      return with_reads(std::move(plan), prediction);
    }
    plan.composed_peak_bytes = plan.predicted_peak_bytes;
    plan.whole_step_rounds = round;
    plan.predicted_peak_bytes = whole.peak_bytes;
    plan.peak_phase = whole.phase;
    const bool over = options.budget_bytes() > 0 && whole.peak_bytes > options.budget_bytes();
    const bool composed_fits = plan.feasible;  // else it is the least-peak plan already
    plan.feasible = composed_fits && !over;
    if (recipe && !composed_fits) {
      // The least-peak plan's own whole step: the smallest peak reported
      // with the scaler's or the masters' bytes (Note [Planned steps with a
      // scaler or master weights]).
      plan.min_peak_bytes = whole.peak_bytes;
    }
    if (!over || !composed_fits || round == 4 ||
        dp_limit - (whole.peak_bytes - options.budget_bytes()) < search.min_peak) {
      return with_reads(std::move(plan), prediction);
    }
    dp_limit -= whole.peak_bytes - options.budget_bytes();
    within = cheapest_within(search, dp_limit);
    plan = assemble(model, options, shapes, profiles, cands, terms, dp_limit, within, at_min_peak);
  }
}

} // namespace trainmem
