#include "trainmem/meta.h"

#include <mutex>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/WrapDimMinimal.h>
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
#include <torch/library.h>
#include <torch/serialize/input-archive.h>

#include "detail/intercept.h"

// Note [Construction on the meta device]
// LibTorch modules allocate in reset(), with no device argument. Python's
// `with torch.device("meta")` is a TorchFunctionMode; torchdistx fakes every
// op. We rewrite at the one op interceptor below autograd (Note [One
// interception key]): while a MetaInitGuard is alive, an op whose schema has a
// `device` argument and no tensor argument is a factory, and its device
// becomes Meta before it runs further down (BackendSelect then picks the meta
// kernel). Factory ops have no tensor to take a dispatch key from, so their
// key set is the thread-local included set plus BackendSelect: the interceptor
// key, which sits above BackendSelect, sees them. Every other op runs
// unchanged: in-place initializers on meta tensors are meta kernels that do
// nothing (and draw no random numbers), ops on real tensors stay real.

namespace trainmem {
namespace {

thread_local int tls_meta_guards = 0;

// set_data() refuses a CPU -> Meta swap because the key sets differ; the
// shallow copy it would do after that check is exactly what we want: the
// TensorImpl (and so the tensor's identity and autograd metadata) stays, its
// storage, device and key set become the other tensor's.
void adopt(const at::Tensor& t, const at::Tensor& from) {
  t.unsafeGetTensorImpl()->shallow_copy_from(from.getIntrusivePtr());
}

void swap_to_meta(const at::Tensor& t) {
  if (!t.defined() || t.is_meta()) {
    return;
  }
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

bool mentions_tensor(const c10::TypePtr& type) {
  if (type->kind() == c10::TypeKind::TensorType) {
    return true;
  }
  for (const auto& inner : type->containedTypes()) {
    if (mentions_tensor(inner)) {
      return true;
    }
  }
  return false;
}

// A factory op's device argument becomes Meta (and pin_memory false).
void rewrite_factory(const c10::FunctionSchema& schema, torch::jit::Stack* stack) {
  const auto& args = schema.arguments();
  const size_t base = stack->size() - args.size();
  int64_t device_at = -1;
  int64_t pin_at = -1;
  for (size_t i = 0; i < args.size(); ++i) {
    if (mentions_tensor(args[i].real_type())) {
      return;
    }
    if (args[i].name() == "device") {
      device_at = static_cast<int64_t>(i);
    } else if (args[i].name() == "pin_memory") {
      pin_at = static_cast<int64_t>(i);
    }
  }
  if (device_at < 0) {
    return;
  }
  (*stack)[base + device_at] = c10::IValue(c10::Device(c10::kMeta));
  if (pin_at >= 0 && (*stack)[base + pin_at].isBool()) {
    (*stack)[base + pin_at] = c10::IValue(false);
  }
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

// Note [Meta kernels LibTorch lacks]
// Python registers meta kernels for many ops from Python; LibTorch's C++ has
// none for a few that models built here need (Embedding's index_select, relu,
// randperm). We add them on the Meta key, each only if the op still has no
// Meta kernel (a LibTorch that gains one keeps its own).
at::Tensor index_select_meta(const at::Tensor& self, int64_t dim, const at::Tensor& index) {
  TORCH_CHECK(index.dim() <= 1, "index_select(): Index is supposed to be a vector, but got ",
              index.dim(), " dimensions");
  auto sizes = self.sizes().vec();
  if (!sizes.empty()) {
    sizes[c10::maybe_wrap_dim(dim, self.dim())] = index.numel();
  }
  return at::empty(sizes, self.options());
}

at::Tensor relu_meta(const at::Tensor& self) {
  return at::empty_like(self);
}

at::Tensor& randperm_out_meta(int64_t n, std::optional<at::Generator>, at::Tensor& out) {
  TORCH_CHECK(n >= 0, "randperm: expected n >= 0, but got ", n);
  out.resize_({n});
  return out;
}

void register_missing_meta_kernels() {
  static std::once_flag once;
  std::call_once(once, [] {
    auto missing = [](const char* name, const char* overload) {
      auto op = c10::Dispatcher::singleton().findOp({name, overload});
      return op.has_value() && !op->hasKernelForDispatchKey(c10::DispatchKey::Meta);
    };
    try {
      // Never destroyed: the kernels live as long as the process.
      auto* lib = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::Meta, __FILE__,
                                     __LINE__);
      if (missing("aten::index_select", "")) {
        lib->impl("index_select", TORCH_FN(index_select_meta));
      }
      if (missing("aten::relu", "")) {
        lib->impl("relu", TORCH_FN(relu_meta));
      }
      if (missing("aten::randperm", "generator_out")) {
        lib->impl("randperm.generator_out", TORCH_FN(randperm_out_meta));
      }
    } catch (const std::exception& e) {
      TORCH_WARN("trainmem: could not add meta kernels (", e.what(), "); ops without one throw on meta");
    }
  });
}

} // namespace

void register_meta_kernels() {
  register_missing_meta_kernels();
}

struct MetaInitGuard::Impl : detail::InterceptHandler {
  void handle(const detail::InterceptScope& scope, const c10::OperatorHandle& op,
              c10::DispatchKeySet ks, torch::jit::Stack* stack) override {
    rewrite_factory(op.schema(), stack);
    scope.call_next(op, ks, stack);
  }
  std::optional<detail::InterceptScope> scope;
};

MetaInitGuard::MetaInitGuard() : impl_(std::make_unique<Impl>()) {
  detail::register_intercept_fallback();
  register_missing_meta_kernels();
  impl_->scope.emplace(*impl_);
  ++tls_meta_guards;
}

MetaInitGuard::~MetaInitGuard() {
  --tls_meta_guards;
  impl_->scope.reset();
}

void to_meta(torch::nn::Module& module) {
  register_missing_meta_kernels();
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
  TORCH_CHECK(tls_meta_guards == 0,
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
  }
  for (const auto& b : module.buffers(/*recurse=*/true)) {
    give_storage(b);
  }
}

void materialize(torch::nn::Module& module, c10::Device device, const ModuleInit& init) {
  to_empty(module, device);
  std::unordered_set<const torch::nn::Module*> seen;
  std::vector<torch::nn::Module*> order;
  post_order(module, seen, order);
  at::NoGradGuard no_grad;
  std::vector<std::string> unknown;
  for (torch::nn::Module* m : order) {
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
              " (allocated, left uninitialized); pass an init function or implement "
              "trainmem::Reinitializable");
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
  TORCH_CHECK(tls_meta_guards == 0,
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
