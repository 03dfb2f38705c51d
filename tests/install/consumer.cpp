// A user's program: links trainmem::trainmem and meters a Linear's saved
// tensors. Shared by the find_package and add_subdirectory consumer projects.
#include <cstdio>

#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>
#include <trainmem/trainmem.h>

int main() {
  torch::nn::Linear lin(32, 64);
  auto x = torch::randn({16, 32}).requires_grad_();
  trainmem::SavedTensorMeter meter(*lin);
  at::Tensor loss;
  {
    trainmem::SavedTensorMeterGuard scope(meter);
    loss = at::gelu(lin->forward(x)).sum();
  }
  loss.backward();
  const auto r = meter.report();
  std::printf("trainmem %s: saved %lld B\n", trainmem::kVersion,
              static_cast<long long>(r.saved_bytes));
  return r.saved_bytes == 4 * (16 * 32 + 16 * 64) ? 0 : 1;
}
