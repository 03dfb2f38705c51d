// CUDA predictions for a named GPU: its cuBLAS workspace and the backend
// scaled_dot_product_attention takes on it (Note [SDPA's backend on CUDA]).
// Expected figures are worked by hand from LibTorch's sources, in comments.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>
#include <torch/version.h>

#include "trainmem/cuda_predict.h"
#include "trainmem/meta.h"
#include "trainmem/models/estimate.h"
#include "support/error_of.h"

namespace {

using trainmem::testing::error_of;

TEST(CudaGpuTest, GpusByName) {
  EXPECT_EQ(trainmem::cuda_gpu("h100").compute_capability, 90);
  EXPECT_EQ(trainmem::cuda_gpu("H100").name, "H100");
  EXPECT_EQ(trainmem::cuda_gpu("rtx-4090").compute_capability, 89);
  EXPECT_EQ(trainmem::cuda_gpu("RTX 3090").compute_capability, 86);
  EXPECT_EQ(trainmem::cuda_gpu("a100").compute_capability, 80);
  EXPECT_EQ(trainmem::cuda_gpu("t4").compute_capability, 75);
  EXPECT_EQ(trainmem::cuda_gpu("b200").compute_capability, 100);
  const auto e = error_of([] { trainmem::cuda_gpu("h800"); });
  EXPECT_NE(e.find("unknown GPU 'h800'"), std::string::npos) << e;
  EXPECT_NE(e.find("H100, H200"), std::string::npos) << e;
}

// CublasHandlePool.cpp's parseChosenWorkspaceSize: 4096 KiB x 8 on sm 9.x,
// 10.x and 12.x, else 4096 KiB x 2 + 16 KiB x 8; from LibTorch 2.11 cuBLASLt
// uses the handle's cuBLAS workspace (unified_cublas_and_lt_workspaces).
TEST(CudaGpuTest, WorkspacesOfTheInstalledLibTorch) {
  const auto h100 = trainmem::cuda_options_for(trainmem::cuda_gpu("h100"));
  EXPECT_EQ(h100.cublas_workspace_bytes(), 33554432);
  EXPECT_EQ(h100.compute_capability(), 90);
  EXPECT_EQ(h100.gpu_name(), "H100");
  EXPECT_EQ(trainmem::cuda_options_for(trainmem::cuda_gpu("b200")).cublas_workspace_bytes(), 33554432);
  EXPECT_EQ(trainmem::cuda_options_for(trainmem::cuda_gpu("a100")).cublas_workspace_bytes(), 8519680);
  EXPECT_EQ(trainmem::cuda_options_for(trainmem::cuda_gpu("l4")).cublas_workspace_bytes(), 8519680);
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 11)
  EXPECT_EQ(h100.cublaslt_workspace_bytes(), 0);
#endif
  // The allocator settings given are kept.
  const auto base = trainmem::CudaPredictOptions().allocator(
      trainmem::CudaAllocatorConfig::parse("expandable_segments:True"));
  EXPECT_TRUE(trainmem::cuda_options_for(trainmem::cuda_gpu("h100"), base).allocator().expandable_segments());
  const auto e = error_of([] { trainmem::cuda_options_for(trainmem::CudaGpu{"K80", 37}); });
  EXPECT_NE(e.find("compute capability 37 of 'K80'"), std::string::npos) << e;
}

// CudaPredictTest.LinearStepByHand on an H100: the same moment of backward
// (the clone of the expanded gradient alive), with each thread's one
// workspace now 32 MiB and no cuBLASLt workspace of its own:
// 43,258,880 - (2 x 8,519,680 + 1,048,576) + 2 x 33,554,432 = 92,279,808 B.
TEST(CudaGpuTest, LinearStepOnAnH100) {
  torch::nn::Linear lin{nullptr};
  {
    trainmem::MetaInitGuard meta;
    lin = torch::nn::Linear(1024, 1024);
  }
  auto options = trainmem::cuda_options_for(trainmem::cuda_gpu("h100"));
  options.cublaslt_workspace_bytes(0);  // as LibTorch 2.11+ runs, whatever this build is
  const auto p = trainmem::predict_cuda_step_peak(*lin, [&] {
    return lin->forward(at::empty({2048, 1024}, at::kMeta)).sum();
  }, nullptr, options);
  EXPECT_EQ(p.max_memory_allocated_bytes, 92279808) << trainmem::to_string(p);
  EXPECT_EQ(p.terms.workspace_bytes, 2 * 33554432);
}

// One causal self-attention: x (B, T, 3 H hd) -> q, k, v (B, H, T, hd), SDPA,
// the sum. `dtype` runs it under CUDA autocast in that dtype (kFloat: none).
struct Attention {
  int64_t B = 2, T = 1000, H = 4, hd = 16;
  at::ScalarType dtype = at::kFloat;
  bool with_mask = false;
  bool grouped = false;  // two KV heads for the four query heads

  trainmem::CudaStepPrediction predict(int64_t compute_capability) const {
    torch::nn::Linear lin{nullptr};
    const int64_t kv = grouped ? H / 2 : H;
    {
      trainmem::MetaInitGuard meta;
      lin = torch::nn::Linear(8, (H + 2 * kv) * hd);
    }
    const auto options = trainmem::CudaPredictOptions().compute_capability(compute_capability).forward_only(true);
    return trainmem::predict_cuda_step_peak(*lin, [&] {
      auto attend = [&] {
        auto qkv = lin->forward(at::empty({B, T, 8}, at::kMeta));
        auto q = qkv.narrow(2, 0, H * hd).view({B, T, H, hd}).transpose(1, 2);
        auto k = qkv.narrow(2, H * hd, kv * hd).view({B, T, kv, hd}).transpose(1, 2);
        auto v = qkv.narrow(2, (H + kv) * hd, kv * hd).view({B, T, kv, hd}).transpose(1, 2);
        std::optional<at::Tensor> mask;
        if (with_mask) {
          mask = at::empty({T, T}, at::TensorOptions().device(at::kMeta).dtype(at::kBool));
        }
        return at::scaled_dot_product_attention(q, k, v, mask, 0.0, /*is_causal=*/!with_mask, std::nullopt,
                                                /*enable_gqa=*/grouped);
      };
      return dtype == at::kFloat ? attend() : trainmem::run_under_autocast(at::kCUDA, dtype, attend);
    }, nullptr, options);
  }
};

TEST(CudaGpuTest, AttentionBackendByGpuAndDtype) {
  Attention a;
  auto fp32 = a.predict(80);  // fp32: memory-efficient attention (flash takes 16-bit types only)
  EXPECT_EQ(fp32.efficient_attention_calls, 1);
  EXPECT_EQ(fp32.flash_attention_calls, 0);
  a.dtype = at::kBFloat16;
  auto bf16 = a.predict(90);
  EXPECT_EQ(bf16.flash_attention_calls, 1);
  EXPECT_EQ(bf16.efficient_attention_calls, 0);
  // fp16 on an A100 takes flash, on a T4 (sm 7.5, no flash) memory-efficient
  // attention: the same forward but for the log-sum-exp, (B, H, T) fp32 =
  // 32,000 B (a 32,256 B block) against (B, H, T rounded up to 32) = 32,768 B.
  a.dtype = at::kHalf;
  const auto a100 = a.predict(80);
  const auto t4 = a.predict(75);
  EXPECT_EQ(a100.flash_attention_calls, 1);
  EXPECT_EQ(t4.efficient_attention_calls, 1);
  EXPECT_EQ(t4.max_memory_allocated_bytes - a100.max_memory_allocated_bytes, 32768 - 32256)
      << trainmem::to_string(t4) << trainmem::to_string(a100);
  // Grouped KV heads: flash takes them; memory-efficient attention over them
  // (fp16 on a T4, fp32 anywhere) is not modelled.
  a.grouped = true;
  EXPECT_EQ(a.predict(80).flash_attention_calls, 1);
  auto e = error_of([&] { a.predict(75); });
  EXPECT_NE(e.find("4 query and 2 KV heads, on compute capability 7.5: memory-efficient attention over grouped KV "
                   "heads is not modelled"),
            std::string::npos) << e;
}

TEST(CudaGpuTest, AttentionNoModelledBackendTakesIsRefused) {
  Attention a;
  a.dtype = at::kBFloat16;
  auto e = error_of([&] { a.predict(75); });
  EXPECT_NE(e.find("BFloat16 attention, head dim 16, 4 query and 4 KV heads, on compute capability 7.5"),
            std::string::npos) << e;
  EXPECT_NE(e.find("no bf16 attention kernel"), std::string::npos) << e;
  // fp16 with a head dim of 12: flash on an A100 (padded to 16), but no
  // GEMM alignment of 8 for memory-efficient attention on a T4.
  a.dtype = at::kHalf;
  a.hd = 12;
  EXPECT_EQ(a.predict(80).flash_attention_calls, 1);
  e = error_of([&] { a.predict(75); });
  EXPECT_NE(e.find("math backend"), std::string::npos) << e;
  // A mask: memory-efficient attention, which reads the float mask SDPA
  // made (T x T, rows of 1,000 elements) in place; with rows of 999 it would
  // copy it into a padded one, not modelled.
  a.hd = 16;
  a.with_mask = true;
  const auto masked = a.predict(90);
  EXPECT_EQ(masked.efficient_attention_calls, 1);
  EXPECT_EQ(masked.flash_attention_calls, 0);
  a.T = 999;
  e = error_of([&] { a.predict(90); });
  EXPECT_NE(e.find("with a mask, on compute capability 9.0: memory-efficient attention copies a mask whose strides "
                   "are not multiples of 8"),
            std::string::npos) << e;
}

} // namespace
