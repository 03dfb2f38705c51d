// The generic meta path's outputs: a call's result made meta tensors on the
// stack, written arguments resized, fresh storages from the meta allocator
// (Note [A meta path for ops without a meta kernel] in meta_fallback.cpp).

#include "core/detail/meta_fallback_internal.h"

#include <vector>

#include <ATen/EmptyTensor.h>
#include <ATen/core/stack.h>
#include <c10/core/Allocator.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>

#include "core/detail/cpu_probe.h"

namespace trainmem::detail::meta_fallback_impl {
namespace {

// ---------------------------------------------------------------------------
// The meta call

at::Tensor meta_tensor(c10::Storage storage, const Layout& l) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(c10::DispatchKey::Meta),
                                                   c10::scalarTypeToTypeMeta(l.dtype));
  impl->set_sizes_and_strides(l.sizes, l.strides, l.offset);
  return at::Tensor(std::move(impl));
}

// A meta storage grows as resize_bytes_cpu grows a CPU one: a block of the
// new size from the meta allocator, the old block freed (Note [Meta storages
// that grow] in src/plan/detail/meta_allocator.cpp: nothing is left to grow).
void grow_to(const at::Tensor& t, int64_t bytes) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  if (bytes <= static_cast<int64_t>(s->nbytes())) {
    return;
  }
  TORCH_CHECK(s->resizable(), "Trying to resize storage that is not resizable");
  s->set_data_ptr_noswap(c10::GetAllocator(c10::kMeta)->allocate(static_cast<size_t>(bytes)));
  s->set_nbytes(static_cast<size_t>(bytes));
}

} // namespace

void apply(const Call& call, const Result& r, torch::jit::Stack* stack) {
  // The CPU kernel's scratch, held while the outputs are made (its peak is
  // theirs and the scratch's), then freed: Note [CPU convolution scratch].
  const auto held = probing_enabled() ? hold_meta_bytes(r.scratch_bytes) : at::Tensor();
  for (const auto& m : r.mutations) {
    const at::Tensor& t = call.tensors[m.arg].tensor;
    const int64_t needed =
        c10::multiply_integers(m.layout.sizes) == 0
            ? 0
            : static_cast<int64_t>(at::detail::computeStorageNbytes(m.layout.sizes, m.layout.strides,
                                                                    t.dtype().itemsize(), m.layout.offset));
    grow_to(t, needed);
    t.unsafeGetTensorImpl()->set_sizes_and_strides(m.layout.sizes, m.layout.strides, m.layout.offset);
  }
  std::vector<c10::Storage> fresh;
  fresh.reserve(r.fresh_bytes.size());
  for (const int64_t bytes : r.fresh_bytes) {
    fresh.emplace_back(c10::Storage::use_byte_size_t(), static_cast<size_t>(bytes), c10::GetAllocator(c10::kMeta),
                       /*resizable=*/true);
  }
  auto make = [&](const Output& o) -> at::Tensor {
    switch (o.kind) {
      case Output::Kind::kNone:
        return at::Tensor();
      case Output::Kind::kArg:
        return call.tensors[o.index].tensor;
      case Output::Kind::kView:
        return meta_tensor(call.tensors[o.index].tensor.storage(), o.layout);
      case Output::Kind::kFresh:
        return meta_tensor(fresh[o.index], o.layout);
    }
    return at::Tensor();
  };
  torch::jit::drop(*stack, call.op->schema().arguments().size());
  const auto& returns = call.op->schema().returns();
  for (size_t i = 0; i < r.returns.size(); ++i) {
    const Return& ret = r.returns[i];
    if (ret.is_list) {
      c10::List<at::Tensor> list;
      for (const auto& o : ret.items) {
        list.push_back(make(o));
      }
      stack->emplace_back(std::move(list));
    } else if (ret.items[0].kind == Output::Kind::kNone && returns[i].type()->kind() == c10::TypeKind::OptionalType) {
      stack->emplace_back();
    } else {
      stack->emplace_back(make(ret.items[0]));
    }
  }
}

} // namespace trainmem::detail::meta_fallback_impl
