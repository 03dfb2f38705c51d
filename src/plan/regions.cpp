// The planner's regions and plans: Region, regions_of(), run_regions(),
// a CheckpointPlan's checkpointing() and its printing, to_string(). The
// planning itself, plan_regions(), is planner.cpp's.
#include "trainmem/planner.h"

#include <algorithm>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "trainmem/checkpoint.h"
#include "trainmem/format.h"
#include "trainmem/selective.h"
#include "core/detail/prediction_scope.h"
#include "plan/detail/plan_internal.h"

namespace trainmem {

Region::Region(std::string name, ListForward forward, std::vector<std::shared_ptr<torch::nn::Module>> modules)
    : name_(std::move(name)),
      forward_(std::make_shared<ListForward>(std::move(forward))),
      modules_(std::move(modules)),
      takes_tensors_(true) {
  TORCH_CHECK(static_cast<bool>(*forward_), "Region: the forward function of '", name_, "' is empty");
  for (size_t i = 0; i < modules_.size(); ++i) {
    TORCH_CHECK(modules_[i] != nullptr, "Region: module ", i, " of '", name_, "' is null");
  }
}

namespace {

// A one-tensor forward as a Tensors(Tensors) one (empty if `f` is).
Region::ListForward over_tensors(Region::Forward f, const std::string& name) {
  if (!f) {
    return {};
  }
  return [f = std::move(f), name](const Region::Tensors& xs) -> Region::Tensors {
    TORCH_CHECK(xs.size() == 1, "Region '", name, "' takes one tensor, but was given ", xs.size(),
                " (the region before it returns them all; give '", name,
                "' a Tensors(Tensors) forward to take several)");
    return {f(xs[0])};
  };
}

} // namespace

Region::Region(std::string name, Forward forward, std::vector<std::shared_ptr<torch::nn::Module>> modules)
    : Region(name, over_tensors(std::move(forward), name), std::move(modules)) {
  takes_tensors_ = false;
}

Region::Region(torch::nn::AnyModule module)
    : Region(module.ptr()->name(),
             [m = std::make_shared<torch::nn::AnyModule>(module)](const at::Tensor& x) {
               return m->forward<at::Tensor>(x);
             },
             {module.ptr()}) {}

at::Tensor Region::operator()(const at::Tensor& input) const {
  auto out = (*forward_)({input});
  TORCH_CHECK(out.size() == 1, "Region '", name_, "' returned ", out.size(),
              " tensors where one was expected (the last region returns the loss's input alone)");
  return std::move(out[0]);
}

Region::Tensors Region::operator()(const Tensors& inputs) const {
  return (*forward_)(inputs);
}

std::vector<Region> regions_of(const torch::nn::Sequential& sequential) {
  TORCH_CHECK(sequential, "regions_of: the Sequential is empty (null)");
  std::vector<Region> regions;
  for (const auto& m : *sequential) {
    regions.emplace_back(m);
  }
  return regions;
}

std::vector<Region> regions_of(const torch::nn::ModuleList& list) {
  TORCH_CHECK(list, "regions_of: the ModuleList is empty (null)");
  std::vector<Region> regions;
  for (size_t i = 0; i < list->size(); ++i) {
    auto seq = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(list->ptr(i));
    TORCH_CHECK(seq != nullptr, "regions_of: element ", i, " of the ModuleList is a ", list->ptr(i)->name(),
                ", whose forward is unknown here; use regions_of<", list->ptr(i)->name(), ">(list)");
    regions.emplace_back(seq);
  }
  return regions;
}

namespace detail {

std::vector<at::Tensor> run_span(const std::vector<Region>& regions, int64_t first, int64_t count,
                                 std::vector<at::Tensor> xs) {
  for (int64_t j = first; j < first + count; ++j) {
    xs = regions[j](xs);
  }
  return xs;
}

} // namespace detail

at::Tensor run_regions(const std::vector<Region>& regions, const at::Tensor& input,
                       const BlockCheckpointing& plan) {
  const auto L = static_cast<int64_t>(regions.size());
  TORCH_CHECK(static_cast<int64_t>(plan.blocks.size()) == L, "run_regions: the plan '", plan.name,
              "' has ", plan.blocks.size(), " blocks, but there are ", L, " regions");
  TORCH_CHECK(plan.region_length.empty() || static_cast<int64_t>(plan.region_length.size()) == L,
              "run_regions: the plan '", plan.name, "' has ", plan.region_length.size(),
              " region lengths, expected 0 or ", L);
  std::vector<at::Tensor> xs = {input};
  for (int64_t i = 0; i < L;) {
    const int64_t k = plan.region_length.empty() ? 1 : std::max<int64_t>(1, plan.region_length[i]);
    if (!plan.blocks[i]) {
      xs = regions[i](xs);
      ++i;
      continue;
    }
    TORCH_CHECK(i + k <= L, "run_regions: the segment of ", k, " regions at region ", i, " of plan '",
                plan.name, "' runs past the last region (", L, ")");
    // The recompute runs in backward, after this returns: the closure keeps
    // its own copies of the regions (they share callables and modules).
    std::vector<Region> run(regions.begin() + i, regions.begin() + i + k);
    xs = checkpoint(
        [run = std::move(run)](const std::vector<at::Tensor>& ts) {
          return detail::run_span(run, 0, static_cast<int64_t>(run.size()), ts);
        },
        xs, plan.options_for(i));
    i += k;
  }
  TORCH_CHECK(xs.size() == 1, "run_regions: the last region '", regions.back().name(), "' returned ", xs.size(),
              " tensors; the loss takes one");
  return std::move(xs[0]);
}

at::Tensor run_regions(const std::vector<Region>& regions, const at::Tensor& input,
                       const CheckpointPlan& plan) {
  return run_regions(regions, input, plan.checkpointing());
}

BlockCheckpointing CheckpointPlan::checkpointing() const {
  const auto L = static_cast<int64_t>(blocks.size());
  TORCH_CHECK(L >= 1, "CheckpointPlan::checkpointing: the plan has no blocks");
  auto plan = BlockCheckpointing::none(L);
  for (int64_t i = 0; i < L; ++i) {
    if (blocks[i].mode == BlockMode::kSelective) {
      plan.set_block_policy(i, save_op_calls_policy(blocks[i].saved_ops));
    }
  }
  for (int64_t i = 0; i < L; ++i) {
    if (blocks[i].mode == BlockMode::kCheckpoint && blocks[i].region_blocks >= 1) {
      plan.blocks[i] = true;
      if (blocks[i].region_blocks > 1) {
        if (plan.region_length.empty()) {
          plan.region_length.assign(L, 1);
        }
        plan.region_length[i] = blocks[i].region_blocks;
      }
    }
  }
  plan.name = name;
  return plan;
}

std::string to_string(BlockMode mode) {
  switch (mode) {
    case BlockMode::kStore: return "store";
    case BlockMode::kCheckpoint: return "checkpoint";
    case BlockMode::kSelective: return "selective";
  }
  return "unknown";
}

std::string to_string(const CheckpointPlan& p) {
  std::ostringstream os;
  os << fmt::format("checkpoint plan '{}' for a budget of {} B: {}\n", p.name,
                    p.budget_bytes > 0 ? with_commas(p.budget_bytes) : std::string("(none)"),
                    p.feasible ? "fits" : "NO PLAN FITS");
  // Each row: its index and the name the caller gave its region. Left out:
  // "block" (the reference model's), the index itself, and a C++ type name
  // (a module holder's default, "torch::nn::LinearImpl": no name was given).
  std::vector<std::string> labels;
  size_t width = 6;
  for (size_t i = 0; i < p.blocks.size(); ++i) {
    const std::string name = i < p.region_names.size() ? p.region_names[i] : std::string();
    const bool given = !name.empty() && name != "block" && name != std::to_string(i) &&
        name.find("::") == std::string::npos;
    labels.push_back(given ? fmt::format("{} {}", i, name) : std::to_string(i));
    width = std::max(width, labels.back().size() + 2);
  }
  os << fmt::format("  {:<{}}{:<14}{:>16}{:>18}{:>16}  {}\n", "block", width, "mode", "stored B",
                    "bwd transient B", "recompute", "saved ops");
  for (size_t i = 0; i < p.blocks.size(); ++i) {
    const auto& b = p.blocks[i];
    std::string ops;
    for (const auto& s : b.saved_ops) {
      ops += (ops.empty() ? "" : " ") + s;
    }
    const std::string mode = b.region_blocks == 0 ? "  (region)"
        : b.region_blocks > 1 ? to_string(b.mode) + " x" + std::to_string(b.region_blocks)
                              : to_string(b.mode);
    os << fmt::format("  {:<{}}{:<14}{:>16}{:>18}{:>16.4g}  {}\n", labels[i], width, mode,
                      with_commas(b.stored_bytes), with_commas(b.backward_transient_bytes), b.recompute_cost,
                      ops);
  }
  os << fmt::format("  predicted peak     {:>16} B ({})\n", with_commas(p.predicted_peak_bytes),
                    to_string(p.peak_phase));
  if (p.composed_peak_bytes > 0) {
    os << fmt::format("    the whole step on meta; composed from the regions {} B ({} plan{} weighed by "
                      "their whole step)\n",
                      with_commas(p.composed_peak_bytes), p.whole_step_rounds, p.whole_step_rounds == 1 ? "" : "s");
  }
  os << fmt::format("    static (params, optimizer state, input) {} B, gradients {} B, "
                    "activations at the start of backward {} B\n",
                    with_commas(p.static_bytes), with_commas(p.grad_bytes), with_commas(p.activation_bytes));
  os << fmt::format("  recompute cost     {:>16.6g} ({:.1f} % of a forward)\n", p.recompute_cost,
                    p.forward_cost > 0 ? 100.0 * p.recompute_cost / p.forward_cost : 0.0);
  os << fmt::format("  smallest reachable peak {} B, at a recompute cost of {:.6g}\n",
                    with_commas(p.min_peak_bytes), p.min_peak_cost);
  // Unavailable choices, one line per region and reason: the single
  // region's and the segments' that start there together.
  for (size_t u = 0; u < p.unavailable.size();) {
    const auto& first = p.unavailable[u];
    std::vector<std::string> what;
    size_t v = u;
    for (; v < p.unavailable.size() && p.unavailable[v].region == first.region &&
           p.unavailable[v].reason == first.reason;
         ++v) {
      const auto& x = p.unavailable[v];
      what.push_back(x.blocks > 1 ? fmt::format("{} x{}", to_string(x.mode), x.blocks) : to_string(x.mode));
    }
    // Named as the rows above name it (a given name only).
    const std::string name = static_cast<size_t>(first.region) < p.region_names.size()
        ? p.region_names[first.region] : std::string();
    const bool given = !name.empty() && name != "block" && name != std::to_string(first.region) &&
        name.find("::") == std::string::npos;
    os << fmt::format("  region {}{}: {} unavailable: {}\n", first.region, given ? " '" + name + "'" : std::string(),
                      fmt::join(what, ", "), first.reason);
    u = v;
  }
  if (p.bucket_bytes > 0) {
    os << fmt::format("  the search bucketed stored bytes: no plan is cheaper within the budget less {} B\n",
                      with_commas(p.bucket_bytes));
  }
  os << detail::scalar_reads_line(p.scalar_reads);  // Note [Scalar reads inside a prediction]
  return os.str();
}

} // namespace trainmem
