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
#include "core/detail/checkpoint_state.h"
#include "detail/intercept.h"
#include "detail/optimizer_state.h"
#include "detail/process_library.h"
#include "plan/detail/plan_internal.h"

namespace trainmem {

namespace detail {

namespace {

// Raises a state's peak to `bytes`, and its phase to `at`, when `bytes` is higher.
void raise_peak(DpState& state, int64_t bytes, StepPhase at) {
  if (bytes > state.peak) {
    state.peak = bytes;
    state.phase = at;
  }
}

// Drops each state another beats for `goal`. Sorted by stored (then the
// goal's key), a state is dominated exactly when an earlier one is no worse
// in the goal's (primary, secondary) order: one pass, O(n log n).
//   kPeak: (peak), stored no higher and peak no higher;
//   kCost: (cost, peak), stored no higher and cost lower, or equal with a
//          peak no higher.
std::vector<DpState> prune_states_of(std::vector<DpState> next, DpGoal goal) {
  auto key = [goal](const DpState& a) {
    return goal == DpGoal::kPeak ? std::make_tuple(a.stored, static_cast<double>(a.peak), a.cost)
                                 : std::make_tuple(a.stored, a.cost, static_cast<double>(a.peak));
  };
  std::sort(next.begin(), next.end(), [&](const DpState& a, const DpState& b) { return key(a) < key(b); });
  std::vector<DpState> kept;
  double best_primary = std::numeric_limits<double>::infinity();
  int64_t best_peak = std::numeric_limits<int64_t>::max();  // kCost: least peak at best_primary
  for (const auto& n : next) {
    if (goal == DpGoal::kPeak) {
      if (best_peak <= n.peak) {
        continue;
      }
      best_peak = n.peak;
    } else {
      if (best_primary < n.cost || (best_primary == n.cost && best_peak <= n.peak)) {
        continue;
      }
      if (n.cost < best_primary) {
        best_primary = n.cost;
        best_peak = n.peak;
      } else {
        best_peak = std::min(best_peak, n.peak);
      }
    }
    kept.push_back(n);
  }
  return kept;
}

// The states of each value of `counted`, the highest value first.
std::map<SlotMask, std::vector<DpState>, std::greater<>> by_counted(std::vector<DpState> states) {
  std::map<SlotMask, std::vector<DpState>, std::greater<>> classes;
  for (auto& n : states) {
    classes[n.counted].push_back(std::move(n));
  }
  return classes;
}

// Pruning within each value of `counted`: a state whose boundary storages
// are counted already and one where they are not differ in what the next
// region adds, so neither dominates the other by stored bytes alone.
std::vector<DpState> prune_states(std::vector<DpState> next, DpGoal goal) {
  std::vector<DpState> kept;
  for (auto& [mask, cls] : by_counted(std::move(next))) {
    for (auto& n : prune_states_of(std::move(cls), goal)) {
      kept.push_back(std::move(n));
    }
  }
  return kept;
}

// Keeps `n` states of a pruned set (sorted by stored within each value of
// `counted`), evenly spaced, both ends kept: a beam, for bounds only.
void thin_states(std::vector<DpState>& states, size_t n) {
  std::vector<DpState> kept;
  kept.reserve(n + 2);
  const size_t size = states.size();
  for (size_t j = 0; j < n; ++j) {
    kept.push_back(states[j * (size - 1) / (n - 1)]);
  }
  states = std::move(kept);
}

// Note [Bucketed boundaries]
// A boundary's staircase of (stored, cost) states can grow to hundreds of
// thousands (LLaMA-2-7B with selective candidates: 34 regions of dozens of
// choices each). Beyond kMaxBoundaryStates states (per value of `counted`),
// stored bytes are cut into that many buckets of g bytes, and each bucket
// keeps its cheapest state (ties: the smaller peak). The state it drops
// stores at most g bytes less, so its plans' peaks are at most g lower: with
// B the sum of the g's over the boundaries (CheckpointPlan::bucket_bytes),
// the chosen plan costs no more than the cheapest plan with a peak within
// budget - B. Its own peak and bytes are still exact, and the answer is
// exact (B = 0) while every boundary stays under the cap.
constexpr size_t kMaxBoundaryStates = 4096;

// Buckets a pruned set (Note [Bucketed boundaries]); returns g (0: untouched).
int64_t bucket_states(std::vector<DpState>& states, size_t cap) {
  int64_t width = 0;
  std::vector<DpState> kept;
  for (auto& [mask, cls] : by_counted(std::move(states))) {
    if (cls.size() <= cap) {
      kept.insert(kept.end(), cls.begin(), cls.end());
      continue;
    }
    int64_t lo = cls.front().stored, hi = lo;
    for (const auto& st : cls) {
      lo = std::min(lo, st.stored);
      hi = std::max(hi, st.stored);
    }
    const int64_t g = (hi - lo) / static_cast<int64_t>(cap) + 1;
    width = std::max(width, g);
    std::map<int64_t, DpState> buckets;
    for (const auto& st : cls) {
      auto [it, inserted] = buckets.emplace((st.stored - lo) / g, st);
      if (!inserted && std::tie(st.cost, st.peak) < std::tie(it->second.cost, it->second.peak)) {
        it->second = st;
      }
    }
    for (auto& [b, st] : buckets) {
      kept.push_back(st);
    }
  }
  states = std::move(kept);
  return width;
}

// The dynamic program over region boundaries: layers[i] holds the states
// after regions 0 .. i - 1; a segment of k regions moves from i to i + k.
// Under DpGoal::kCost, a state is dropped when its peak exceeds `limit`
// (a peak only rises), when even the fewest bytes the remaining regions
// can store would take it over `limit` (the loss head's backward sees them
// all), or when it costs more than `max_cost`, the cost of a whole plan
// known to fit (a cost only rises). finals: the states after the loss head
// and the optimizer step.
struct DpBounds {
  DpGoal goal = DpGoal::kPeak;
  int64_t limit = 0;
  double max_cost = 0.0;
};

// The state after choice `prof` for the k regions at i, from `st`; false
// when the bounds drop it.
bool extend(const Candidates& cands, const StaticTerms& terms, const DpBounds& b, const DpState& st,
            const BlockProfile& prof, int64_t i, int64_t k, DpState& n) {
  const int64_t Z = terms.static_bytes();
  const auto& ch = prof.choice;
  // Region 0's input is the step's input, already in Z; a later
  // region's input may be in st.stored already (Note [Boundary storages]).
  const int64_t stored = ch.stored_bytes + ch.rng_state_bytes - counted_in_bytes(prof, st.counted, true);
  const int64_t fwd = Z + st.stored + ch.rng_state_bytes + ch.forward_peak_bytes -
      counted_in_bytes(prof, st.counted, false);
  // The step's loss (the caller holds it while backward runs) is
  // live beside every region's backward, as beside the head's.
  const int64_t bwd = Z + st.stored + stored + cands.grads_after[i + k] + ch.backward_transient_bytes +
      cands.profiles->head.loss_bytes;
  n = DpState{};
  n.stored = st.stored + stored;
  n.cost = st.cost + ch.recompute_cost;
  n.peak = st.peak;
  n.phase = st.phase;
  raise_peak(n, fwd, StepPhase::kForward);
  raise_peak(n, bwd, StepPhase::kBackward);
  if (b.goal == DpGoal::kCost &&
      (n.peak > b.limit || n.cost > b.max_cost || Z + n.stored + cands.least_stored_after[i + k] > b.limit)) {
    return false;
  }
  n.region = k;
  n.counted = counted_out(prof, st.counted);
  return true;
}

// Final phases: the loss head and the optimizer step.
void finish(const Candidates& cands, const StaticTerms& terms, const DpBounds& b, DpRun& r) {
  const auto& head = cands.profiles->head;
  const int64_t Z = terms.static_bytes();
  for (auto f : r.layers[cands.regions]) {
    const int64_t in_counted = (f.counted & 1U) != 0 ? head.in_bytes : 0;
    const int64_t head_stored = head.stored_bytes - (head.in_kept ? in_counted : 0);
    raise_peak(f, Z + f.stored + head.forward_peak_bytes - in_counted, StepPhase::kForward);
    raise_peak(f, Z + f.stored + head_stored + head.backward_transient_bytes + head.loss_bytes,
               StepPhase::kBackward);
    if (terms.has_optimizer) {
      // The input is not live any more (Note [Checkpoint planner]).
      raise_peak(f, Z - terms.input_bytes + terms.grad_bytes + terms.optimizer.transient_bytes,
                 StepPhase::kOptimizerStep);
    }
    if (b.goal == DpGoal::kPeak || f.peak <= b.limit) {
      r.finals.push_back(f);
    }
  }
}

DpRun run_dp(const Candidates& cands, const StaticTerms& terms, const DpBounds& b, size_t beam) {
  const int64_t L = cands.regions;
  DpRun r;
  auto& layers = r.layers;
  layers.resize(L + 1);
  layers[0].push_back(DpState{});
  std::vector<std::vector<DpState>> incoming(L + 1);
  for (int64_t i = 0; i < L; ++i) {
    if (i > 0) {
      layers[i] = prune_states(std::move(incoming[i]), b.goal);
      if (beam > 0 && layers[i].size() > beam) {
        thin_states(layers[i], beam);
      } else if (beam == 0 && b.goal == DpGoal::kCost) {
        r.bucket_bytes += bucket_states(layers[i], kMaxBoundaryStates);
      }
    }
    for (int64_t k = 1; k <= cands.max_region && i + k <= L; ++k) {
      const auto c = cands.choices(i, k);
      for (int64_t s = 0; s < static_cast<int64_t>(layers[i].size()); ++s) {
        for (int opt = 0; opt < static_cast<int>(c.size()); ++opt) {
          DpState n;
          if (!extend(cands, terms, b, layers[i][s], *c[opt], i, k, n)) {
            continue;
          }
          n.parent = s;
          n.option = opt;
          incoming[i + k].push_back(n);
        }
      }
    }
    incoming[i].clear();
    incoming[i].shrink_to_fit();
  }
  layers[L] = prune_states(std::move(incoming[L]), b.goal);
  finish(cands, terms, b, r);
  return r;
}

bool by_cost(const DpState& a, const DpState& b) {
  return std::tie(a.cost, a.peak) < std::tie(b.cost, b.peak);
}

bool by_peak(const DpState& a, const DpState& b) {
  return std::tie(a.peak, a.cost) < std::tie(b.peak, b.cost);
}

// The cheapest final state of `from` within `limit`, ties to the smaller peak.
Pick cheapest(const std::vector<const DpRun*>& from, int64_t limit) {
  Pick best;
  for (const auto* r : from) {
    for (int64_t f = 0; f < static_cast<int64_t>(r->finals.size()); ++f) {
      if (r->finals[f].peak <= limit && (best.run == nullptr || by_cost(r->finals[f], best.state()))) {
        best = {r, f};
      }
    }
  }
  return best;
}

} // namespace

// Note [Two 2-D dynamic programs]
// Every later phase's bytes grow with the stored bytes S_i alone, so what a
// boundary state's future can do depends on S_i (and whether its boundary
// storage is counted); the peak and cost so far only add. One DP keeping
// the (stored, peak, cost) Pareto set is exact but the set grows without
// bound (400 layers: 14 s; LLaMA-2-7B with selective candidates: minutes).
// Two DPs, each on a 2-D staircase, give the same answers (exactly, while
// no boundary of the second is bucketed: Note [Bucketed boundaries]):
//   1. the least peak P* (kPeak: a state is beaten by one with stored and
//      peak no higher);
//   2. the least cost within a limit, ties to the smaller peak (kCost:
//      states above the limit dropped, then beaten by one with stored no
//      higher and (cost, peak) no higher in that order), run with the
//      budget (or no limit) and, for the cost of reaching P*, with P*.
// Bounding the cost: whole plans known to fit a limit (the first DP's
// final states, then a beam search's, which keeps a few states per
// boundary) give the cost no state of the exact DP may exceed; a little
// slack, as sums of the same costs in another order may differ in the
// last bit. The cheapest plan of all three runs is taken.
Search::Search(const Candidates& c, const StaticTerms& t) : candidates(c), terms(t) {
  least_peak = &runs.emplace_back(run_dp(c, t, DpBounds{DpGoal::kPeak, 0, 0.0}, 0));
  min_peak = std::min_element(least_peak->finals.begin(), least_peak->finals.end(), by_peak)->peak;
}

Pick cheapest_within(Search& search, int64_t limit) {
  auto slack = [](double c) { return c + 1e-9 * std::abs(c); };
  const auto& c = search.candidates;
  const auto& t = search.terms;
  const DpRun& least_peak = *search.least_peak;
  const DpRun& beam = search.runs.emplace_back(
      run_dp(c, t, DpBounds{DpGoal::kCost, limit, slack(cheapest({&least_peak}, limit).state().cost)}, 16));
  const double bound = slack(cheapest({&least_peak, &beam}, limit).state().cost);
  const DpRun& exact = search.runs.emplace_back(run_dp(c, t, DpBounds{DpGoal::kCost, limit, bound}, 0));
  Pick p = cheapest({&least_peak, &beam, &exact}, limit);
  p.bucket_bytes = exact.bucket_bytes;
  return p;
}

} // namespace detail

} // namespace trainmem
