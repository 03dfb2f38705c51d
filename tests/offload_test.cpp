#include "trainmem/offload.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>

namespace {

// On a CPU-only machine save-on-CPU copies nothing: every saved tensor is
// already on the host.
TEST(OffloadTest, IsANoOpForCpuTensors) {
  torch::manual_seed(0);
  torch::nn::Linear lin(64, 64);
  auto x = torch::randn({32, 64}).requires_grad_();
  at::Tensor loss;
  trainmem::OffloadStats stats;
  {
    trainmem::SaveOnCpuGuard offload(*lin);
    loss = at::gelu(lin->forward(x)).sum();
    stats = offload.stats();
  }
  EXPECT_EQ(stats.num_offloaded, 0);
  EXPECT_EQ(stats.offloaded_bytes, 0);
  EXPECT_EQ(stats.num_kept, stats.num_packed);
  EXPECT_GE(stats.num_packed, 3);  // x, W.T, the Linear output
  loss.backward();
}

// With copy_cpu_tensors the copy path runs: a storage shared by views is
// copied once each way, parameters and small tensors are never copied, and
// gradients are identical.
TEST(OffloadTest, CopiesSharedStoragesOnceWithIdenticalGradients) {
  torch::manual_seed(0);
  torch::nn::Linear lin(16, 48);
  auto x = torch::randn({8, 16}).requires_grad_();
  auto run = [&](bool offload, trainmem::OffloadStats* stats) {
    lin->zero_grad();
    if (x.grad().defined()) x.mutable_grad().reset();
    at::Tensor loss;
    {
      std::unique_ptr<trainmem::SaveOnCpuGuard> g;
      if (offload) {
        g = std::make_unique<trainmem::SaveOnCpuGuard>(
            *lin, trainmem::SaveOnCpuOptions().copy_cpu_tensors(true).min_offload_bytes(64));
      }
      auto qkv = lin->forward(x).view({8, 3, 16});     // one (8, 48) buffer
      auto q = qkv.select(1, 0), k = qkv.select(1, 1), v = qkv.select(1, 2);
      auto small = torch::randn({2}).requires_grad_();  // 8 B: below the threshold
      loss = (q * k * v).sum() + (small * small).sum();
      if (g) *stats = g->stats();
    }
    loss.backward();
    return std::vector<at::Tensor>{x.grad().clone(), lin->weight.grad().clone(), lin->bias.grad().clone()};
  };
  const auto ref = run(false, nullptr);
  trainmem::OffloadStats stats;
  const auto got = run(true, &stats);
  for (size_t i = 0; i < ref.size(); ++i) EXPECT_TRUE(ref[i].equal(got[i])) << "gradient " << i;
  // Saved: x (512 B), W.T (parameter: kept), q, k (views of qkv), q*k (512 B),
  // v (view of qkv), small twice (kept). Copies: x, qkv (1,536 B), q*k.
  EXPECT_EQ(stats.num_storage_copies, 3);
  EXPECT_EQ(stats.offloaded_bytes, 512 + 1536 + 512);
  EXPECT_EQ(stats.num_offloaded, 5);
  EXPECT_EQ(stats.num_kept, 3);
}

TEST(OffloadTest, RejectsANegativeThreshold) {
  EXPECT_THROW(trainmem::SaveOnCpuGuard(trainmem::SaveOnCpuOptions().min_offload_bytes(-1)), c10::Error);
}

} // namespace

namespace {

// On a GPU: CUDA activations go to (pinned) host memory and come back; the
// gradients equal the plain run's. Skipped without CUDA.
TEST(OffloadCudaTest, OffloadsCudaActivationsWithIdenticalGradients) {
  if (!at::hasCUDA()) {
    GTEST_SKIP() << "no CUDA device";
  }
  torch::manual_seed(0);
  torch::nn::Linear lin(256, 256);
  lin->to(at::kCUDA);
  auto x = torch::randn({64, 256}, at::TensorOptions().device(at::kCUDA)).requires_grad_();
  at::gelu(lin->forward(x)).sum().backward();
  const auto ref = lin->weight.grad().clone();
  lin->zero_grad();
  at::Tensor loss;
  trainmem::OffloadStats stats;
  {
    trainmem::SaveOnCpuGuard offload(*lin, trainmem::SaveOnCpuOptions().pin_memory(true));
    loss = at::gelu(lin->forward(x)).sum();
    stats = offload.stats();
  }
  // x and the Linear output (64 x 256 fp32 each) went to the host; W.T stayed.
  EXPECT_EQ(stats.offloaded_bytes, 2 * 64 * 256 * 4);
  EXPECT_EQ(stats.num_kept, 1);
  loss.backward();
  EXPECT_TRUE(lin->weight.grad().equal(ref));
}

} // namespace
