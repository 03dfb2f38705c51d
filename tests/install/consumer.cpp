// A user's program: links trainmem::trainmem and meters what autograd saves
// for a small matmul+gelu. Shared by the find_package and add_subdirectory
// consumer projects. Kept on ATen's core headers (no <torch/torch.h>, no
// torch::nn) so that compiling it costs a fraction of a LibTorch program's
// usual translation unit: these tests check the packaging, not the API.
#include <cstdio>

#include <ATen/ops/gelu.h>
#include <ATen/ops/randn.h>
#include <trainmem/meter.h>
#include <trainmem/version.h>

int main() {
  auto x = at::randn({16, 32}).requires_grad_();
  auto w = at::randn({32, 64}).requires_grad_();  // a "parameter"
  trainmem::SavedTensorMeter meter;
  meter.exclude(w);
  at::Tensor loss;
  {
    trainmem::SavedTensorMeterGuard scope(meter);
    loss = at::gelu(x.matmul(w)).sum();  // saves x (for w's grad) and gelu's input
  }
  loss.backward();
  const auto r = meter.report();
  std::printf("trainmem %s: saved %lld B\n", trainmem::kVersion,
              static_cast<long long>(r.saved_bytes));
  return r.saved_bytes == 4 * (16 * 32 + 16 * 64) ? 0 : 1;
}
