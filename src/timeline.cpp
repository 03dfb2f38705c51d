#include "trainmem/timeline.h"

#include <algorithm>

#include <c10/util/Exception.h>

namespace trainmem {

const char* category_name(Category category) {
  switch (category) {
    case Category::kParameter: return "PARAMETER";
    case Category::kGradient: return "GRADIENT";
    case Category::kOptimizerState: return "OPTIMIZER_STATE";
    case Category::kActivation: return "ACTIVATION";
    case Category::kTemporary: return "TEMPORARY";
    case Category::kInput: return "INPUT";
    case Category::kUnknown: return "unknown";
  }
  return "unknown";
}

const char* phase_name(Phase phase) {
  switch (phase) {
    case Phase::kForward: return "forward";
    case Phase::kBackward: return "backward";
    case Phase::kOptimizerStep: return "optimizer step";
  }
  return "unknown";
}

int64_t TimelinePoint::total_bytes() const {
  int64_t sum = 0;
  for (auto b : bytes) {
    sum += b;
  }
  return sum;
}

std::vector<TimelinePoint> live_bytes(const Timeline& timeline, int64_t max_points) {
  TORCH_CHECK(max_points >= 0, "live_bytes: expected max_points >= 0, but got ", max_points);
  std::vector<TimelinePoint> all;
  all.reserve(timeline.events.size() + 1);
  TimelinePoint p;
  p.time_ns = timeline.events.empty() ? 0 : timeline.events.front().time_ns;
  p.bytes = timeline.baseline_bytes;
  all.push_back(p);
  for (const auto& e : timeline.events) {
    p.time_ns = e.time_ns;
    p.bytes[static_cast<int>(e.category)] += e.bytes;
    all.push_back(p);
  }
  if (max_points <= 0 || static_cast<int64_t>(all.size()) <= max_points) {
    return all;
  }
  // Keep the first and last points, and the fullest point of each stretch:
  // a plot of the thinned series still shows every peak's height.
  std::vector<TimelinePoint> out;
  const size_t stretches = static_cast<size_t>(std::max<int64_t>(max_points - 2, 1));
  const size_t n = all.size() - 2;
  out.push_back(all.front());
  for (size_t s = 0; s < stretches; ++s) {
    const size_t lo = 1 + s * n / stretches;
    const size_t hi = 1 + (s + 1) * n / stretches;
    if (lo >= hi) {
      continue;
    }
    auto best = std::max_element(all.begin() + lo, all.begin() + hi,
        [](const auto& a, const auto& b) { return a.total_bytes() < b.total_bytes(); });
    out.push_back(*best);
  }
  out.push_back(all.back());
  return out;
}

} // namespace trainmem
