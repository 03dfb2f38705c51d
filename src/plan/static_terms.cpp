// plan_regions()' first stage: the static terms of a planned step
// (parameters, gradients, buffers, the optimizer and the input; Note
// [Checkpoint planner]).
#include "trainmem/planner.h"

#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "detail/backward_on_meta.h"
#include "detail/optimizer_state.h"
#include "plan/detail/plan_internal.h"

namespace trainmem::detail {
namespace {

// Parameters, each once, owned by the last region that uses it: its
// gradient exists from that region's backward on.
// Note [Parameters no gradient reaches]
// A region's modules may hold parameters that require a gradient but that no
// loss reaches (an encoder head the model does not use, attention blocks a
// decoder skips): on the device they never get a gradient, and an optimizer
// makes no state for them. Counting gradients and AdamW state for every
// parameter that requires one plans a U-Net with 626,991 such parameters
// 1.82 % over its measured step. So the whole step's forward and backward
// run once on meta first, and only the parameters that then hold a gradient
// count as trained. Where that run fails (an op without a meta kernel: such
// regions are profiled on CPU), every parameter that requires a gradient
// counts.
std::unordered_set<const c10::TensorImpl*> trained_params(const RegionModel& model,
                                                          const std::vector<at::Tensor>& params) {
  std::unordered_set<const c10::TensorImpl*> trained;
  std::vector<at::Tensor> before;
  for (const auto& p : params) {
    before.push_back(p.grad());
    p.mutable_grad().reset();
  }
  try {
    const auto ys = run_span(model.regions, 0, static_cast<int64_t>(model.regions.size()), {model.input(at::kMeta)});
    TORCH_CHECK(ys.size() == 1, "the last region returns ", ys.size(), " tensors");
    const at::Tensor loss = model.loss(ys[0]);
    if (loss.requires_grad()) {
      detail::BackwardOnMeta::run(loss);
    }
    for (const auto& p : params) {
      if (p.grad().defined()) {
        trained.insert(p.unsafeGetTensorImpl());
      }
    }
  } catch (const c10::Error&) {
    trained.clear();
    for (const auto& p : params) {
      if (p.requires_grad()) {
        trained.insert(p.unsafeGetTensorImpl());
      }
    }
  }
  for (size_t i = 0; i < params.size(); ++i) {
    params[i].mutable_grad() = before[i];
  }
  return trained;
}

void own_params(const std::vector<Region>& regions, StaticTerms& t) {
  const auto L = static_cast<int64_t>(regions.size());
  std::unordered_map<const c10::TensorImpl*, int64_t> owner;
  for (int64_t i = 0; i < L; ++i) {
    for (const auto& m : regions[i].modules()) {
      for (const auto& p : m->parameters(/*recurse=*/true)) {
        auto [it, inserted] = owner.emplace(p.unsafeGetTensorImpl(), i);
        if (inserted) {
          t.params.push_back(p);
        }
        it->second = i;
      }
    }
  }
  t.region_grad_bytes.assign(L, 0);
  t.region_trains.assign(L, false);
  std::unordered_set<const c10::StorageImpl*> storages;
  for (const auto& p : t.params) {
    if (storages.insert(p.storage().unsafeGetStorageImpl()).second) {
      t.param_bytes += storage_bytes(p);
    }
  }
  for (auto b : t.region_grad_bytes) t.grad_bytes += b;
}

// The gradient bytes of each region's owned parameters that train (Note
// [Parameters no gradient reaches]).
void count_grads(const std::vector<Region>& regions, const std::unordered_set<const c10::TensorImpl*>& trained,
                 StaticTerms& t) {
  const auto L = static_cast<int64_t>(regions.size());
  std::unordered_map<const c10::TensorImpl*, int64_t> owner;
  for (int64_t i = 0; i < L; ++i) {
    for (const auto& m : regions[i].modules()) {
      for (const auto& p : m->parameters(/*recurse=*/true)) {
        owner[p.unsafeGetTensorImpl()] = i;
        t.region_trains[i] = t.region_trains[i] || p.requires_grad();
      }
    }
  }
  for (const auto& p : t.params) {
    if (trained.count(p.unsafeGetTensorImpl()) != 0) {
      t.region_grad_bytes[owner[p.unsafeGetTensorImpl()]] += storage_bytes(p);
    }
  }
  t.grad_bytes = 0;
  for (auto b : t.region_grad_bytes) t.grad_bytes += b;
}

// Buffers (BatchNorm's running statistics), each storage once and none a
// parameter holds: live all step, as the accountant's buffer bucket.
int64_t buffer_bytes_of(const std::vector<Region>& regions, const std::vector<at::Tensor>& params) {
  int64_t bytes = 0;
  std::unordered_set<const c10::StorageImpl*> storages;
  for (const auto& p : params) {
    storages.insert(p.storage().unsafeGetStorageImpl());
  }
  for (const auto& region : regions) {
    for (const auto& m : region.modules()) {
      for (const auto& b : m->buffers(/*recurse=*/true)) {
        if (b.defined() && b.has_storage() && storages.insert(b.storage().unsafeGetStorageImpl()).second) {
          bytes += storage_bytes(b);
        }
      }
    }
  }
  return bytes;
}

// The optimizer phase of a step with a scaler or master weights (Note
// [Planned steps with a scaler or master weights]): state_bytes is what
// lives all step beside the parameters (the scaler's tensors, or the
// masters, and the optimizer's state), transient_bytes the highest live
// bytes of the step after backward above the gradients it starts from.
OptimizerProfile profile_recipe(const RegionModel& model, const std::vector<at::Tensor>& params,
                                const std::vector<at::Tensor>& trained) {
  auto& counter = MetaAllocator::get();
  const int64_t before = counter.live_bytes();
  RecipeStep recipe(model, params, "plan_regions");
  recipe.prime(at::kMeta);
  const auto make_grads = [&] {
    for (const auto& p : trained) {
      p.mutable_grad() = at::empty_like(p);
    }
  };
  const auto grads_left = [&] {
    int64_t bytes = 0;
    for (const auto& p : trained) {
      if (p.grad().defined()) bytes += storage_bytes(p.grad());
    }
    return bytes;
  };
  OptimizerProfile r;
  make_grads();
  recipe.optimizer_step();  // creates the state
  r.state_bytes = counter.live_bytes() - before - grads_left();
  make_grads();
  const int64_t base = counter.live_bytes();
  counter.reset_peak();
  recipe.optimizer_step();
  r.transient_bytes = counter.peak_bytes() - base;
  reset_grads(trained);
  return r;
}

} // namespace

// Parameters, buffers, the optimizer (its state, live all step, and its
// step's transient) and the step's input.
StaticTerms account_regions(const RegionModel& model) {
  StaticTerms t;
  own_params(model.regions, t);
  const auto trained = trained_params(model, t.params);
  count_grads(model.regions, trained, t);
  std::vector<at::Tensor> trained_list;
  for (const auto& p : t.params) {
    if (trained.count(p.unsafeGetTensorImpl()) != 0) {
      trained_list.push_back(p);
    }
  }
  t.buffer_bytes = buffer_bytes_of(model.regions, t.params);
  t.has_optimizer = model.optimizer != nullptr || static_cast<bool>(model.make_optimizer);
  if (RecipeStep::wanted(model)) {
    std::optional<detail::OptimizerStateAside> aside;
    if (model.optimizer != nullptr) {
      aside.emplace(*model.optimizer);
    }
    t.optimizer = profile_recipe(model, t.params, trained_list);
  } else if (model.optimizer != nullptr) {
    detail::OptimizerStateAside aside(*model.optimizer);
    t.optimizer = profile_optimizer(*model.optimizer, trained_list);
  } else if (model.make_optimizer) {
    auto opt = model.make_optimizer(t.params);
    TORCH_CHECK(opt != nullptr, "plan_regions: RegionModel::make_optimizer returned null");
    t.optimizer = profile_optimizer(*opt, trained_list);
  }
  at::Tensor input = model.input(at::kMeta);
  TORCH_CHECK(input.defined() && input.is_meta(),
              "plan_regions: RegionModel::input(kMeta) must return a meta tensor, but got ",
              input.defined() ? c10::str(input.device()) : std::string("an undefined tensor"));
  t.input_bytes = storage_bytes(input);
  t.input = spec_of(input);
  return t;
}

} // namespace trainmem::detail
