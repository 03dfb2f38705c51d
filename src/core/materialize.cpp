// A module's tensors given other storage in place, each keeping its
// identity: to_meta() (their storage released), to_empty() and materialize()
// (real storage, re-initialized), load_into() (a checkpoint's tensors, one at
// a time).
#include "trainmem/meta.h"

#include <algorithm>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/TensorOptions.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/instancenorm.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/modules/rnn.h>
#include <torch/serialize/input-archive.h>

#include "core/detail/init_record.h"
#include "core/detail/meta_internal.h"

namespace trainmem {
namespace {

// set_data() refuses a CPU -> Meta swap because the key sets differ; the
// shallow copy it would do after that check is exactly what we want: the
// TensorImpl (and so the tensor's identity and autograd metadata) stays, its
// storage, device and key set become the other tensor's.
// A tensor given real storage drops the record of its construction (Note
// [Init replayed on materialize]).
void adopt(const at::Tensor& t, const at::Tensor& from) {
  t.unsafeGetTensorImpl()->shallow_copy_from(from.getIntrusivePtr());
  if (!from.is_meta()) {
    detail::drop_init_record(t);
  }
}

void swap_to_meta(const at::Tensor& t) {
  if (!t.defined() || t.is_meta()) {
    return;
  }
  detail::InitRecordPause not_a_construction;  // its meta storage replays nothing
  adopt(t, at::empty_strided(t.sizes(), t.strides(), t.options().device(at::kMeta)));
}

// A fresh, ordinary tensor (autograd keys included) viewing `storage`.
at::Tensor view_of(const c10::Storage& storage, const at::Tensor& like, c10::Device device) {
  const auto key = c10::computeDispatchKey(like.scalar_type(), like.layout(), device);
  auto t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(storage), c10::DispatchKeySet(key),
                                                    like.dtype());
  t.unsafeGetTensorImpl()->set_sizes_and_strides(like.sizes(), like.strides(),
                                                 like.storage_offset());
  return t;
}

// The modules post-order: children in registration order, then the parent;
// a module registered twice is visited once.
void post_order(torch::nn::Module& m, std::unordered_set<const torch::nn::Module*>& seen,
                std::vector<torch::nn::Module*>& out) {
  if (!seen.insert(&m).second) {
    return;
  }
  for (const auto& child : m.children()) {
    post_order(*child, seen, out);
  }
  out.push_back(&m);
}

template <typename T>
bool try_reset(torch::nn::Module& m) {
  if (auto* p = dynamic_cast<T*>(&m)) {
    p->reset_parameters();
    return true;
  }
  return false;
}

} // namespace

void to_meta(torch::nn::Module& module) {
  register_meta_kernels();
  for (const auto& p : module.parameters(/*recurse=*/true)) {
    swap_to_meta(p);
  }
  for (const auto& b : module.buffers(/*recurse=*/true)) {
    swap_to_meta(b);
  }
}

bool reset_builtin_parameters(torch::nn::Module& m) {
  using namespace torch::nn;
  if (auto* mha = dynamic_cast<MultiheadAttentionImpl*>(&m)) {
    mha->_reset_parameters();
    return true;
  }
  return try_reset<LinearImpl>(m) || try_reset<BilinearImpl>(m) || try_reset<Conv1dImpl>(m) ||
      try_reset<Conv2dImpl>(m) || try_reset<Conv3dImpl>(m) || try_reset<ConvTranspose1dImpl>(m) ||
      try_reset<ConvTranspose2dImpl>(m) || try_reset<ConvTranspose3dImpl>(m) ||
      try_reset<EmbeddingImpl>(m) || try_reset<EmbeddingBagImpl>(m) || try_reset<LayerNormImpl>(m) ||
      try_reset<GroupNormImpl>(m) || try_reset<BatchNorm1dImpl>(m) || try_reset<BatchNorm2dImpl>(m) ||
      try_reset<BatchNorm3dImpl>(m) || try_reset<InstanceNorm1dImpl>(m) ||
      try_reset<InstanceNorm2dImpl>(m) || try_reset<InstanceNorm3dImpl>(m) || try_reset<RNNImpl>(m) ||
      try_reset<LSTMImpl>(m) || try_reset<GRUImpl>(m) || try_reset<RNNCellImpl>(m) ||
      try_reset<LSTMCellImpl>(m) || try_reset<GRUCellImpl>(m);
}

void to_empty(torch::nn::Module& module, c10::Device device) {
  TORCH_CHECK(detail::meta_init_guards() == 0,
              "to_empty: called under a MetaInitGuard, which would make its storage meta "
              "again; end the guard first");
  TORCH_CHECK(device.type() != c10::kMeta, "to_empty: expected a real device, but got ", device);
  // Meta storage -> (the meta storage, held so its address is not reused while
  // we map by it; the real storage that replaces it).
  std::unordered_map<const c10::StorageImpl*, std::pair<c10::Storage, c10::Storage>> storages;
  std::unordered_set<const c10::TensorImpl*> done;
  auto give_storage = [&](const at::Tensor& t) {
    if (!t.defined() || !t.is_meta() || !done.insert(t.unsafeGetTensorImpl()).second) {
      return;
    }
    const c10::Storage& meta = t.storage();
    auto& [held, real] = storages[meta.unsafeGetStorageImpl()];
    if (!real) {
      held = meta;
      real = at::empty({static_cast<int64_t>(meta.nbytes())},
                       at::TensorOptions().dtype(at::kByte).device(device))
                 .storage();
    }
    adopt(t, view_of(real, t, real.device()));
  };
  for (const auto& p : module.parameters(/*recurse=*/true)) {
    give_storage(p);
    // A meta gradient (a meta step's) holds no values and would meet the
    // real parameter in the next step: "found at least two devices, meta
    // and cpu". The parameter starts with none, as a new one does.
    if (p.grad().defined() && p.grad().is_meta()) {
      p.mutable_grad().reset();
    }
  }
  for (const auto& b : module.buffers(/*recurse=*/true)) {
    give_storage(b);
  }
}

void materialize(torch::nn::Module& module, c10::Device device, const ModuleInit& init) {
  TORCH_CHECK(detail::meta_init_guards() == 0,
              "materialize: called under a MetaInitGuard, which would make its storage meta "
              "again; end the guard first");
  TORCH_CHECK(device.type() != c10::kMeta, "materialize: expected a real device, but got ", device);
  std::unordered_set<const torch::nn::Module*> seen;
  std::vector<torch::nn::Module*> order;
  post_order(module, seen, order);

  // The meta tensors a construction under a MetaInitGuard made are replayed
  // (Note [Init replayed on materialize]); the modules that own other meta
  // tensors are re-initialized as before. A module owning both is refused.
  std::vector<std::pair<std::string, at::Tensor>> recorded;
  std::unordered_set<const c10::TensorImpl*> listed;
  auto list = [&](const std::string& name, const at::Tensor& t) {
    if (detail::has_init_record(t) && listed.insert(t.unsafeGetTensorImpl()).second) {
      recorded.emplace_back(name, t);
    }
  };
  for (const auto& p : module.named_parameters(/*recurse=*/true)) {
    list(p.key(), p.value());
  }
  for (const auto& b : module.named_buffers(/*recurse=*/true)) {
    list(b.key(), b.value());
  }
  std::vector<torch::nn::Module*> to_reset;
  for (torch::nn::Module* m : order) {
    std::string replayed;
    std::string not_recorded;
    auto see = [&](const std::string& name, const at::Tensor& t) {
      if (!t.defined() || !t.is_meta()) {
        return;
      }
      (listed.count(t.unsafeGetTensorImpl()) > 0 ? replayed : not_recorded) = name;
    };
    for (const auto& p : m->named_parameters(/*recurse=*/false)) {
      see(p.key(), p.value());
    }
    for (const auto& b : m->named_buffers(/*recurse=*/false)) {
      see(b.key(), b.value());
    }
    TORCH_CHECK(replayed.empty() || not_recorded.empty(), "materialize: ", m->name(), " owns ", replayed,
                ", made under a MetaInitGuard (its construction is replayed), and ", not_recorded,
                ", which was not (moved with to_meta() or made under another module's guard and assigned); "
                "it cannot be both replayed and re-initialized: build the module under one MetaInitGuard");
    // With nothing recorded, every module is re-initialized, as before;
    // else only those owning meta tensors that were not recorded (a parent's
    // reset_parameters() would draw again over its replayed children).
    if (recorded.empty() || !not_recorded.empty()) {
      to_reset.push_back(m);
    }
  }
  if (!recorded.empty()) {
    const std::vector<at::Tensor> real = detail::replay_init(recorded, device);
    for (size_t i = 0; i < recorded.size(); ++i) {
      const at::Tensor& t = recorded[i].second;
      adopt(t, view_of(real[i].storage(), real[i], real[i].device()));
      if (t.grad().defined() && t.grad().is_meta()) {
        t.mutable_grad().reset();  // as to_empty() does
      }
    }
  }
  to_empty(module, device);
  at::NoGradGuard no_grad;
  std::vector<std::string> unknown;
  for (torch::nn::Module* m : to_reset) {
    if (init && init(*m)) {
      continue;
    }
    if (auto* r = dynamic_cast<Reinitializable*>(m)) {
      r->reset_parameters();
      continue;
    }
    if (reset_builtin_parameters(*m)) {
      continue;
    }
    if (!m->named_parameters(/*recurse=*/false).is_empty() ||
        !m->named_buffers(/*recurse=*/false).is_empty()) {
      unknown.push_back(m->name());
    }
  }
  TORCH_CHECK(unknown.empty(), "materialize: no way to re-initialize the tensors of ",
              fmt::format("{}", fmt::join(unknown, ", ")),
              " (allocated, left uninitialized; not built under a MetaInitGuard, so there is no construction "
              "to replay); pass an init function or implement trainmem::Reinitializable");
}

TensorSource archive_source(torch::serialize::InputArchive& archive) {
  return [&archive](const std::string& name) -> at::Tensor {
    torch::serialize::InputArchive* current = &archive;
    torch::serialize::InputArchive nested;
    size_t start = 0;
    for (size_t dot = name.find('.'); dot != std::string::npos; dot = name.find('.', start)) {
      torch::serialize::InputArchive child;
      if (!current->try_read(name.substr(start, dot - start), child)) {
        return {};
      }
      nested = std::move(child);
      current = &nested;
      start = dot + 1;
    }
    at::Tensor t;
    if (!current->try_read(name.substr(start), t)) {
      return {};
    }
    return t;
  };
}

LoadReport load_into(torch::nn::Module& module, const TensorSource& source, c10::Device device,
                     bool strict) {
  TORCH_CHECK(static_cast<bool>(source), "load_into: the source is empty");
  TORCH_CHECK(detail::meta_init_guards() == 0,
              "load_into: called under a MetaInitGuard; end the guard first");
  TORCH_CHECK(device.type() != c10::kMeta, "load_into: expected a real device, but got ", device);
  LoadReport report;
  std::unordered_set<const c10::TensorImpl*> done;
  auto load = [&](const std::string& name, const at::Tensor& t) {
    if (!t.defined() || !done.insert(t.unsafeGetTensorImpl()).second) {
      return;
    }
    at::Tensor src = source(name);
    if (!src.defined()) {
      report.missing.push_back(name);
      return;
    }
    TORCH_CHECK(src.sizes() == t.sizes(), "load_into: ", name, " has shape ", t.sizes(),
                " in the module, but ", src.sizes(), " in the source");
    const bool same_device =
        src.device().type() == device.type() && (!device.has_index() || src.device() == device);
    at::NoGradGuard no_grad;
    if (same_device && src.scalar_type() == t.scalar_type() && !src.is_meta()) {
      adopt(t, view_of(src.storage(), src, src.device()));
      ++report.num_adopted;
    } else {
      TORCH_CHECK(!src.is_meta(), "load_into: the source gave a meta tensor for ", name);
      auto converted = src.to(device, t.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
      src.reset(); // released before the next tensor is asked for
      adopt(t, view_of(converted.storage(), converted, converted.device()));
      ++report.num_copied;
    }
    ++report.num_loaded;
    report.loaded_bytes += t.numel() * static_cast<int64_t>(t.element_size());
  };
  for (const auto& p : module.named_parameters(/*recurse=*/true)) {
    load(p.key(), p.value());
  }
  for (const auto& b : module.named_buffers(/*recurse=*/true)) {
    load(b.key(), b.value());
  }
  if (strict && !report.missing.empty()) {
    const size_t shown = std::min<size_t>(report.missing.size(), 5);
    std::vector<std::string> first(report.missing.begin(), report.missing.begin() + shown);
    TORCH_CHECK(false, "load_into: the source has no tensor for ", report.missing.size(),
                " names (", fmt::format("{}", fmt::join(first, ", ")),
                report.missing.size() > shown ? ", ..." : "",
                "); the others were loaded. Pass strict = false to allow this");
  }
  return report;
}

} // namespace trainmem
