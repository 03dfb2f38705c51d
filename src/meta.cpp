#include "trainmem/meta.h"

#include <ATen/ops/empty_strided.h>
#include <c10/core/TensorImpl.h>
#include <torch/nn/module.h>

namespace trainmem {
namespace {

// set_data() refuses a CPU -> Meta swap because the key sets differ; the
// shallow copy it would do after that check is exactly what we want: the
// TensorImpl (and so the tensor's identity and autograd metadata) stays, its
// storage, device and key set become the meta tensor's.
void swap_to_meta(const at::Tensor& t) {
  if (!t.defined() || t.is_meta()) {
    return;
  }
  auto meta = at::empty_strided(t.sizes(), t.strides(), t.options().device(at::kMeta));
  t.unsafeGetTensorImpl()->shallow_copy_from(meta.getIntrusivePtr());
}

} // namespace

void to_meta(torch::nn::Module& module) {
  for (const auto& p : module.parameters(/*recurse=*/true)) {
    swap_to_meta(p);
  }
  for (const auto& b : module.buffers(/*recurse=*/true)) {
    swap_to_meta(b);
  }
}

} // namespace trainmem
