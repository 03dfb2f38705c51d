// Which steps the saved-tensor meter runs in, what the steps it skipped are
// known to repeat, and what the report says of them.
#include "audit/detail/audit_impl.h"

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

namespace trainmem {
namespace {

// Note [Metering the steps that differ]: on its default schedule the meter
// runs at least once in this many steps, however steady the loop.
constexpr int64_t kMeterAtLeastEvery = 10;

} // namespace

// Note [Metering the steps that differ]: whether the meter runs in the
// step about to begin.
bool Audit::Impl::meters_next_step() const {
  if (!meter) {
    return false;
  }
  const int64_t every = options.meter_every();
  if (every >= 1) {
    return step_index % every == 0;
  }
  return !(recorder && steady && step_index - last_metered_step < kMeterAtLeastEvery);
}

// After a step: its record says whether it repeated the last metered step;
// whether the loop is steady is updated.
void Audit::Impl::judge_shape(StepRecord& rec) {
  if (!meter) {
    return;
  }
  std::optional<detail::AllocationShape> shape;
  if (recorder) {
    shape = recorder->take_shape();
  }
  if (metering) {
    // The step before was metered, or repeated the last metered one.
    const bool previous_known = !steps.empty() && (steps.back().metered || steps.back().repeats >= 0);
    steady = shape && previous_known && *shape == metered_shape && same_saves(step_saved, last_saved);
    metered_shape = shape.value_or(detail::AllocationShape{});
    last_saved = step_saved;
    last_metered_step = step_index;
  } else if (shape && last_metered_step >= 0 && *shape == metered_shape) {
    rec.repeats = last_metered_step;
  } else {
    steady = false;
  }
}

// What the report says of the steps the meter skipped, if any.
std::optional<std::string> Audit::Impl::meter_note() const {
  if (!meter) {
    return std::nullopt;
  }
  int64_t metered = 0;
  int64_t repeated = 0;
  std::vector<int64_t> unknown;
  for (const auto& st : steps) {
    metered += st.metered ? 1 : 0;
    repeated += st.repeats >= 0 ? 1 : 0;
    if (!st.metered && st.repeats < 0) {
      unknown.push_back(st.step);
    }
  }
  if (metered == static_cast<int64_t>(steps.size())) {
    return std::nullopt;
  }
  const int64_t every = options.meter_every();
  std::string out = fmt::format(
      "the meter ran on {} of {} steps (AuditOptions::meter_every({}): {}); ", metered, steps.size(), every,
      every == 0 ? std::string("the steps that differ") : fmt::format("steps 0, {}, {}, ...", every, 2 * every));
  if (repeated > 0) {
    out += fmt::format(
        "{} more repeated the metered step before them allocation for allocation, so their saved bytes are its; ",
        repeated);
  }
  if (!unknown.empty()) {
    std::string list;
    for (size_t i = 0; i < std::min<size_t>(unknown.size(), 8); ++i) {
      list += fmt::format("{}{}", i == 0 ? "" : ", ", unknown[i]);
    }
    if (unknown.size() > 8) {
      list += ", ...";
    }
    out += fmt::format(
        "{} step{} ({}) did not, and {} saved bytes are not known; ", unknown.size(),
        unknown.size() == 1 ? "" : "s", list, unknown.size() == 1 ? "its" : "their");
  }
  return out + fmt::format("the saved bytes shown are step {}'s", last_metered_step);
}

bool Audit::Impl::same_saves(const SavedTensorReport& a, const SavedTensorReport& b) {
  return a.saved_bytes == b.saved_bytes && a.device_bytes == b.device_bytes && a.host_bytes == b.host_bytes &&
      a.num_tensors == b.num_tensors && a.num_storages == b.num_storages &&
      a.excluded_param_bytes == b.excluded_param_bytes && a.num_param_tensors == b.num_param_tensors &&
      a.unowned_leaf_bytes == b.unowned_leaf_bytes;
}

// The meter covers forward only, one micro-batch at a time: a step's
// saved bytes are its largest micro-batch's, what backward holds at once.
int64_t Audit::Impl::close_meter(detail::WaitingSaves waiting) {
  if (!meter_guard) {
    return -1;
  }
  meter_guard.reset();
  auto r = meter->report();
  const int64_t saved = r.saved_bytes;
  if (r.saved_bytes >= step_saved.saved_bytes) {
    step_saved = std::move(r);
    step_saved_waiting = std::move(waiting);
  }
  meter->reset();
  return saved;
}

namespace {

// Adds `named` to `by_node` (one entry per node), sorted as a meter's report.
void merge_by_node(std::vector<NodeSavedBytes>& by_node, const std::vector<detail::NamedSaves>& named) {
  for (const auto& n : named) {
    auto it = std::find_if(by_node.begin(), by_node.end(), [&](const auto& e) { return e.node == n.node; });
    if (it == by_node.end()) {
      by_node.push_back({n.node, n.bytes, n.tensors});
    } else {
      it->bytes += n.bytes;
      it->num_tensors += n.tensors;
    }
  }
  std::sort(by_node.begin(), by_node.end(), [](const auto& a, const auto& b) {
    return a.bytes != b.bytes ? a.bytes > b.bytes : a.node < b.node;
  });
}

} // namespace

// Note [Saves named by a later backward]
// A step with several backward passes (a GAN's discriminator step, then its
// generator step) saves in one forward what only a later backward reaches:
// the generator's activations, saved while the discriminator's loss is
// built on a detached copy of its output. The meter names a save's node by
// a walk from the roots when a backward begins (Note [Naming nodes by
// sequence number]); what the first backward does not reach is taken out of
// the meter unnamed, kept with the micro-batch's report, and named by each
// later backward of the step. Only what no backward of the step reaches is
// "(unattributed)" when the step ends.
void Audit::Impl::name_waiting_saves(const torch::autograd::edge_list& roots) {
  if (!step_saved_waiting.saves.empty()) {
    merge_by_node(step_saved.by_node, detail::name_waiting_saves(step_saved_waiting, roots));
  }
}

void Audit::Impl::finish_step_saved() {
  detail::NamedSaves left{"(unattributed)", 0, 0};
  for (const auto& w : step_saved_waiting.saves) {
    left.bytes += w.bytes;
    left.tensors += w.tensors;
  }
  step_saved_waiting = {};
  if (left.tensors > 0) {
    merge_by_node(step_saved.by_node, {left});
  }
}

} // namespace trainmem
