// What the audit can name by storage: its modules' parameters and buffers,
// their gradients, the optimizers' state and labelled tensors (the static
// buckets, and the categories of blocks live at a step's end); the tables
// from storage to optimizer that the op watcher reads; and the optimizers'
// reads (Note [Optimizers that come and go]).
#include "audit/detail/audit_impl.h"

#include <algorithm>
#include <map>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/jit/api/module.h>

#include "trainmem/accountant.h"

#include "core/detail/optimizer_state_walk.h"

namespace trainmem {

std::vector<at::Tensor> Audit::Impl::parameters() const {
  std::vector<at::Tensor> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  auto add = [&](const at::Tensor& p) {
    if (p.defined() && seen.insert(p.unsafeGetTensorImpl()).second) {
      out.push_back(p);
    }
  };
  for (const auto& am : modules) {
    if (const auto* m = am.get()) {
      for (const auto& p : m->parameters()) {
        add(p);
      }
    }
  }
  for (const auto& w : jit_modules) {
    if (auto obj = w.lock()) {
      for (const auto& p : torch::jit::Module(std::move(obj)).parameters()) {
        add(p);
      }
    }
  }
  return out;
}

// Buffers (BatchNorm's running statistics): BUFFER on the timeline and a
// bucket of their own, so that the peak's categories and the static
// buckets name the same bytes.
std::vector<at::Tensor> Audit::Impl::buffers() const {
  std::vector<at::Tensor> out;
  for (const auto& am : modules) {
    if (const auto* m = am.get()) {
      for (const auto& b : m->buffers()) {
        out.push_back(b);
      }
    }
  }
  for (const auto& w : jit_modules) {
    if (auto obj = w.lock()) {
      for (const auto& b : torch::jit::Module(std::move(obj)).buffers()) {
        out.push_back(b);
      }
    }
  }
  return out;
}

// Every parameter in one module, so that the accountant can read
// optimizers whose parameters span several audited modules.
std::shared_ptr<torch::nn::Module> Audit::Impl::union_module() const {
  auto u = std::make_shared<torch::nn::Module>("audited");
  int64_t i = 0;
  for (const auto& p : parameters()) {
    u->register_parameter(fmt::format("p{}", i++), p, p.requires_grad());
  }
  // Optimized inputs: for their gradients and optimizer state (their
  // bytes are their own bucket, taken out of the parameters' below).
  for (const auto& t : optimized_inputs) {
    u->register_parameter(fmt::format("p{}", i++), t, true);
  }
  // Buffers, for the buffer bucket (the accountant counts a storage that a
  // parameter holds once, as a parameter).
  int64_t j = 0;
  for (const auto& b : buffers()) {
    if (b.defined()) {
      u->register_buffer(fmt::format("b{}", j++), b);
    }
  }
  return u;
}

// Parameters and gradients of every module, state summed over optimizers,
// labelled tensors.
StaticBuckets Audit::Impl::buckets() const {
  const auto u = union_module();
  auto b = account(*u);
  for (const auto& t : optimized_inputs) {  // a bucket of their own (labels)
    b.param_bytes -= static_cast<int64_t>(t.storage().nbytes());
    b.num_params -= t.numel();
    b.num_trainable_params -= t.numel();
  }
  std::map<std::string, StateBytes> by_name;
  for (const auto& o : optimizers) {
    if (o.retired) {
      continue;  // gone by the last step: a note says what it held
    }
    const auto& ob = o.figures;  // never read here (Note [Optimizers that come and go])
    b.optimizer_state_bytes += ob.optimizer_state_bytes;
    for (const auto& st : ob.state_by_name) {
      auto& e = by_name[st.name];
      e.name = st.name;
      e.bytes += st.bytes;
      e.num_tensors += st.num_tensors;
    }
  }
  b.state_by_name.clear();
  for (const auto& [name, st] : by_name) {
    b.state_by_name.push_back(st);
  }
  return b;
}

// Storages we can name now: category by block address.
std::unordered_map<uint64_t, Category> Audit::Impl::owners() const {
  std::unordered_map<uint64_t, Category> o;
  for (const auto& t : held_state()) {
    o[storage_address(t)] = Category::kOptimizerState;
  }
  for (const auto& l : labels) {
    if (auto s = l.storage.lock()) {
      o[reinterpret_cast<uint64_t>(s->data_ptr().get())] = l.category;
    }
  }
  for (const auto& b : buffers()) {  // before the parameters: a shared storage is a parameter
    o[storage_address(b)] = Category::kBuffer;
  }
  for (const auto& p : parameters()) {
    o[storage_address(p)] = Category::kParameter;
    if (p.grad().defined()) {
      o[storage_address(p.grad())] = Category::kGradient;
    }
  }
  for (const auto& t : optimized_inputs) {
    o[storage_address(t)] = Category::kInput;
    if (t.grad().defined()) {
      o[storage_address(t.grad())] = Category::kGradient;
    }
  }
  o.erase(0);
  return o;
}

// Note [Optimizer state inferred from lifetimes]: with no live optimizer,
// the audited modules' parameters are the inferred step's.
bool Audit::Impl::infers_optimizer() const {
  return std::all_of(optimizers.begin(), optimizers.end(), [](const auto& o) { return o.retired; });
}

void Audit::Impl::refresh_grad_owners() {
  grad_owner.clear();
  if (infers_optimizer()) {
    for (const auto& p : parameters()) {
      if (p.grad().defined()) {
        grad_owner[storage_key(p.grad())] = kInferredOptimizer;
      }
    }
  }
  for (size_t i = 0; i < optimizers.size(); ++i) {
    if (optimizers[i].retired) {
      continue;
    }
    for_each_param(optimizers[i], [&](const at::Tensor& p) {
      if (p.grad().defined()) {
        grad_owner[storage_key(p.grad())] = static_cast<int64_t>(i);
      }
    });
  }
  grad_owner.erase(nullptr);
}

void Audit::Impl::refresh_param_owners() {
  param_owner.clear();
  for (size_t i = 0; i < optimizers.size(); ++i) {
    auto& o = optimizers[i];
    o.stepped = false;
    if (o.retired) {
      continue;
    }
    if (state_gone(o)) {
      retire(o, "destroyed");
      continue;
    }
    for_each_param(o, [&](const at::Tensor& p) { param_owner[storage_key(p)] = static_cast<int64_t>(i); });
  }
  if (infers_optimizer()) {
    for (const auto& p : parameters()) {
      param_owner[storage_key(p)] = kInferredOptimizer;
    }
  }
  param_owner.erase(nullptr);
  refresh_grad_owners();
}

// The gradients of the optimizers' parameters, seen at a backward's end.
void Audit::Impl::sight_grads(int64_t t) {
  for (const auto& [key, owner] : grad_owner) {
    grad_sightings.add(reinterpret_cast<uint64_t>(key->data_ptr().get()), t);
  }
}

void Audit::Impl::Sightings::seal() {
  std::sort(seen.begin(), seen.end());
  filter.fill(0);
  for (const auto& s : seen) {
    filter[bit(s.address) / 64] |= uint64_t{1} << (bit(s.address) % 64);
  }
}

bool Audit::Impl::Sightings::seen_between(uint64_t address, int64_t from, int64_t to) const {
  const size_t b = bit(address);
  if ((filter[b / 64] & (uint64_t{1} << (b % 64))) == 0) {
    return false;
  }
  const auto it = std::lower_bound(seen.begin(), seen.end(), Sighting{address, from});
  return it != seen.end() && it->address == address && it->time_ns <= to;
}

// Every state tensor it held at its last read is gone: it was destroyed.
bool Audit::Impl::state_gone(const NamedOptimizer& o) {
  if (o.state_refs.empty()) {
    return false;  // stateless: cannot tell
  }
  return std::all_of(o.state_refs.begin(), o.state_refs.end(), [](const auto& w) { return w.expired(); });
}

void Audit::Impl::retire(NamedOptimizer& o, const char* why) {
  o.retired = true;
  o.retired_before = step_index;
  o.retired_why = why;
  o.state_refs.clear();
  o.params.clear();
}

// Reads a live optimizer: its parameters, its state tensors and, when
// they changed, its state figures (Note [Optimizers that come and go]).
void Audit::Impl::read_optimizer(NamedOptimizer& o, bool force_figures) {
  const auto& opt = *o.optimizer;
  o.params.clear();
  for (const auto& g : opt.param_groups()) {
    for (const auto& p : g.params()) {
      if (p.defined()) {
        o.params.emplace_back(p.getIntrusivePtr());
      }
    }
  }
  if (o.plain_sgd) {
    return;
  }
  std::vector<const c10::TensorImpl*> impls;
  std::vector<at::Tensor> held;
  bool unknown = false;
  detail::for_each_state_tensor(
      opt,
      [&](const std::string&, const at::Tensor& t) {
        if (t.defined()) {
          impls.push_back(t.unsafeGetTensorImpl());
          held.push_back(t);
        }
      },
      [&](const torch::optim::OptimizerParamState&) { unknown = true; });
  o.unknown_state = unknown;
  if (!force_figures && !unknown && impls == o.state_impls) {
    return;
  }
  o.state_impls = std::move(impls);
  o.state_refs.clear();
  for (const auto& t : held) {
    o.state_refs.emplace_back(t.getIntrusivePtr());
  }
  try {
    o.figures = account(*union_module(), opt);
  } catch (const c10::Error& e) {
    TORCH_WARN("trainmem audit: the state of optimizer '", o.name, "' was not read: ", e.what_without_backtrace());
  }
}

// At a step's end: the optimizers whose state may have changed are read
// again, those whose state is gone retired.
void Audit::Impl::read_optimizers_after_step() {
  for (auto& o : optimizers) {
    if (o.retired || o.plain_sgd) {
      continue;
    }
    if (state_gone(o)) {
      retire(o, "destroyed");
    } else if (o.stepped || o.state_impls.empty() || o.unknown_state) {
      read_optimizer(o, /*force_figures=*/false);
    }
  }
}

// The optimizers retired during the audit, by name (Note [Optimizers that
// come and go]).
std::optional<std::string> Audit::Impl::retired_note() const {
  std::map<std::string, std::vector<const NamedOptimizer*>> by_name;
  for (const auto& o : optimizers) {
    if (o.retired) {
      by_name[o.name].push_back(&o);
    }
  }
  if (by_name.empty()) {
    return std::nullopt;
  }
  std::vector<std::string> parts;
  for (const auto& [name, list] : by_name) {
    std::vector<std::string> when;
    for (const auto* o : list) {
      if (when.size() == 4 && list.size() > 5) {
        when.push_back("...");
        break;
      }
      when.push_back(fmt::format("before step {} ({}; its state then {} B)", o->retired_before, o->retired_why,
                                 with_commas(o->figures.optimizer_state_bytes)));
    }
    parts.push_back(fmt::format("'{}' {} time{}: {}", name, list.size(), list.size() == 1 ? "" : "s",
                                fmt::join(when, ", ")));
  }
  return fmt::format("optimizers were replaced or destroyed during the audit, and are read no more: {}; the "
                     "buckets count the optimizers alive at the last step",
                     fmt::join(parts, "; "));
}

// The state tensors the optimizers held at their last read, still alive.
std::vector<at::Tensor> Audit::Impl::held_state() const {
  std::vector<at::Tensor> out;
  for (const auto& o : optimizers) {
    if (o.retired) {
      continue;
    }
    for (const auto& w : o.state_refs) {
      if (auto impl = w.lock()) {
        out.emplace_back(std::move(impl));
      }
    }
  }
  return out;
}

} // namespace trainmem
