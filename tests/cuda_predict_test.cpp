// CUDA step predictions from meta runs. Expected figures are worked by hand
// from the allocator's rules and LibTorch's kernels, in the comments.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include "trainmem/cuda_predict.h"
#include "trainmem/meta.h"
#include "trainmem/planner.h"

namespace {

constexpr int64_t MiB = 1024 * 1024;

torch::nn::Linear meta_linear(int64_t in, int64_t out) {
  trainmem::MetaInitGuard meta;
  return torch::nn::Linear(in, out);
}

TEST(CudaPredictTest, CublasCopiesOperandsItCannotRead) {
  auto m = at::empty({64, 32}, at::kMeta);
  EXPECT_EQ(trainmem::cublas_operand_copy_bytes(m), 0);        // row-major
  EXPECT_EQ(trainmem::cublas_operand_copy_bytes(m.t()), 0);    // column-major
  // A gradient expanded from a scalar (strides 0, 0): cloned, 64 x 32 x 4 B.
  auto expanded = at::empty({}, at::kMeta).expand({64, 32});
  EXPECT_EQ(trainmem::cublas_operand_copy_bytes(expanded), 64 * 32 * 4);
  // Every other column: leading dimension fine, but not unit stride: cloned.
  auto big = at::empty({64, 64}, at::kMeta);
  EXPECT_EQ(trainmem::cublas_operand_copy_bytes(big.slice(1, 0, 64, 2)), 64 * 32 * 4);
  // A batched operand with a zero batch stride (a broadcast weight): cloned.
  auto batch = at::empty({32, 16}, at::kMeta).expand({8, 32, 16});
  EXPECT_EQ(trainmem::cublas_operand_copy_bytes(batch), 8 * 32 * 16 * 4);
}

// Linear(1024, 1024) on x (2048, 1024) without grad, loss y.sum().
// Forward: x 8 MiB; addmm's output 8 MiB (freed after sum) and, as the first
// matmul of the main thread and one cuBLASLt takes (1-d bias), the cuBLAS
// workspace (8,519,680 B) and the cuBLASLt workspace (1 MiB); the loss, 4 B in
// a 512 B block. Backward: the seed gradient (512 B block); SumBackward
// expands it (a view); addmm's weight gradient is grad.t().mm(x).t(): grad is
// expanded, so cuBLAS clones it (8 MiB, freed after the mm), the output is
// 4 MiB, and the backward thread makes its own cuBLAS workspace. At that
// moment the device holds:
//   parameters 4,194,304 + 4,096, workspaces 2 x 8,519,680 + 1,048,576,
//   x 8,388,608, loss and seed 2 x 512, weight gradient 4,194,304,
//   the clone 8,388,608                                  = 43,258,880 B.
TEST(CudaPredictTest, LinearStepByHand) {
  auto lin = meta_linear(1024, 1024);
  const auto p = trainmem::predict_cuda_step_peak(*lin, [&] {
    return lin->forward(at::empty({2048, 1024}, at::kMeta)).sum();
  });
  EXPECT_EQ(p.max_memory_allocated_bytes, 43258880) << trainmem::to_string(p);
  EXPECT_EQ(p.phase, trainmem::Phase::kBackward);
  EXPECT_EQ(p.start_allocated_bytes, 4194304 + 4096);
  EXPECT_EQ(p.terms.param_bytes, 4194304 + 4096);
  EXPECT_EQ(p.terms.workspace_bytes, 2 * 8519680 + 1048576);
  EXPECT_EQ(p.terms.kernel_temporary_bytes, 8388608);
  EXPECT_EQ(p.terms.grad_bytes, 4194304);
  EXPECT_EQ(p.terms.step_bytes, 8388608 + 4 + 4);
  EXPECT_EQ(p.terms.rounding_bytes, 2 * (512 - 4));
  const auto& t = p.terms;
  EXPECT_EQ(t.resident_bytes + t.param_bytes + t.optimizer_state_bytes + t.workspace_bytes + t.grad_bytes +
                t.kernel_temporary_bytes + t.step_bytes + t.rounding_bytes,
            p.max_memory_allocated_bytes);
  EXPECT_TRUE(p.workspaces.cublas_forward && p.workspaces.cublaslt_forward && p.workspaces.cublas_backward);
  EXPECT_FALSE(p.workspaces.cublaslt_backward);
  // Reserved: parameters: the weight takes a 20 MiB large segment (split), the
  // bias a 2 MiB small one; x and addmm's output share the weight's segment's
  // 16 MiB rest; the workspaces (8,519,680 B, < 10 MiB) get a 20 MiB segment
  // each; the cuBLASLt one (1 MiB, small) a 2 MiB one... the peak is
  // whatever the model says, and never below allocated.
  EXPECT_GE(p.max_memory_reserved_bytes, p.max_memory_allocated_bytes);
}

// A parameter used twice: loss (w * w).sum(), w 1 Mi floats (4 MiB), no
// matmul (no workspace). MulBackward0 returns grad * w twice (4 MiB each),
// both for w's AccumulateGrad; the engine adds the second to the first in
// its input buffer, in place on CUDA as on CPU (it holds the only reference:
// input_buffer.cpp, can_accumulate_inplace), and the sum becomes w's gradient.
// Live then: w, the two gradients, the loss and the backward's seed (512 B
// blocks): 3 x 4 MiB + 2 x 512 B. Before the CUDA prediction ran its
// backward as the engine accumulates (Note [Gradient accumulation on meta]),
// the add ran out of place on meta and the peak was one 4 MiB tensor more
// (16,778,240 B, worked by hand, not run).
struct TwiceImpl : torch::nn::Module {
  TwiceImpl() { w = register_parameter("w", at::empty({1 << 20}, at::kMeta)); }
  at::Tensor w;
};
TORCH_MODULE(Twice);

TEST(CudaPredictTest, GradientsOfATensorUsedTwiceAccumulateInPlace) {
  Twice net;
  const auto p = trainmem::predict_cuda_step_peak(*net, [&] { return (net->w * net->w).sum(); });
  EXPECT_EQ(p.max_memory_allocated_bytes, 3 * 4 * MiB + 2 * 512) << trainmem::to_string(p);
  EXPECT_EQ(p.phase, trainmem::Phase::kBackward);
  EXPECT_EQ(p.terms.param_bytes, 4 * MiB);
  // The first gradient's storage holds the sum and becomes w's gradient;
  // the second, the loss and the seed are the step's.
  EXPECT_EQ(p.terms.grad_bytes, 4 * MiB);
  EXPECT_EQ(p.terms.step_bytes, 4 * MiB + 4 + 4);
}

TEST(CudaPredictTest, WorkspacesMadeEarlierAreResidentAndNotMadeAgain) {
  auto lin = meta_linear(1024, 1024);
  trainmem::CudaWorkspaces warm;
  warm.cublas_forward = warm.cublaslt_forward = warm.cublas_backward = true;
  const auto p = trainmem::predict_cuda_step_peak(
      *lin, [&] { return lin->forward(at::empty({2048, 1024}, at::kMeta)).sum(); }, nullptr,
      trainmem::CudaPredictOptions().workspaces(warm));
  EXPECT_EQ(p.max_memory_allocated_bytes, 43258880);  // the same three workspaces, made before
  EXPECT_EQ(p.start_allocated_bytes, 4194304 + 4096 + 2 * 8519680 + 1048576);
  // On Hopper the cuBLAS workspaces are 32 MiB: 2 x (32 MiB - 8,519,680 B) more.
  const auto hopper = trainmem::predict_cuda_step_peak(
      *lin, [&] { return lin->forward(at::empty({2048, 1024}, at::kMeta)).sum(); }, nullptr,
      trainmem::CudaPredictOptions().cublas_workspace_bytes(trainmem::kCublasWorkspaceHopperBytes));
  EXPECT_EQ(hopper.max_memory_allocated_bytes, 43258880 + 2 * (32 * MiB - 8519680));
}

TEST(CudaPredictTest, ResidentTensorsCountFromTheStart) {
  auto lin = meta_linear(1024, 1024);
  const auto resident = at::empty({1000}, at::kMeta);  // 4,000 B in a 4,096 B block
  const auto p = trainmem::predict_cuda_step_peak(
      *lin, [&] { return lin->forward(at::empty({2048, 1024}, at::kMeta)).sum(); }, nullptr,
      trainmem::CudaPredictOptions().resident({resident}));
  EXPECT_EQ(p.max_memory_allocated_bytes, 43258880 + 4096);
  EXPECT_EQ(p.terms.resident_bytes, 4000);
}

TEST(CudaPredictTest, LeavesTheCpuPredictionUnchanged) {
  auto lin = meta_linear(256, 256);
  auto loss = [&] { return lin->forward(at::empty({64, 256}, at::kMeta)).pow(2).mean(); };
  const auto before = trainmem::predict_step_peak(*lin, loss);
  trainmem::predict_cuda_step_peak(*lin, loss);
  const auto after = trainmem::predict_step_peak(*lin, loss);
  EXPECT_EQ(before.peak_bytes, after.peak_bytes);
  EXPECT_GT(after.peak_bytes, 0);
}

// Both predictions observe the one meta allocator for their scope only: a
// prediction whose loss throws (in the forward, with its observer attached)
// leaves the next prediction of either kind as it was.
TEST(CudaPredictTest, AFailedPredictionLeavesTheNextUnchanged) {
  auto lin = meta_linear(256, 256);
  auto loss = [&] { return lin->forward(at::empty({64, 256}, at::kMeta)).pow(2).mean(); };
  auto fails = [&]() -> at::Tensor {
    auto y = lin->forward(at::empty({64, 256}, at::kMeta));
    TORCH_CHECK(false, "a loss that fails");
    return y;
  };
  const auto cpu_before = trainmem::predict_step_peak(*lin, loss);
  const auto cuda_before = trainmem::predict_cuda_step_peak(*lin, loss);
  EXPECT_THROW(trainmem::predict_step_peak(*lin, fails), c10::Error);
  EXPECT_THROW(trainmem::predict_cuda_step_peak(*lin, fails), c10::Error);
  const auto cpu_after = trainmem::predict_step_peak(*lin, loss);
  const auto cuda_after = trainmem::predict_cuda_step_peak(*lin, loss);
  // Measured (Linear(256, 256), a batch of 64, no optimizer): the figures pinned.
  EXPECT_EQ(cpu_before.peak_bytes, 657416);
  EXPECT_EQ(cuda_before.max_memory_allocated_bytes, 18746368);
  EXPECT_EQ(cuda_before.num_events, 23);
  EXPECT_EQ(cpu_after.peak_bytes, cpu_before.peak_bytes);
  EXPECT_EQ(cpu_after.grad_bytes, cpu_before.grad_bytes);
  EXPECT_EQ(cuda_after.max_memory_allocated_bytes, cuda_before.max_memory_allocated_bytes);
  EXPECT_EQ(cuda_after.num_events, cuda_before.num_events);
}

// The loss must be one meta value; the error names what came back.
TEST(CudaPredictTest, RejectsALossThatIsNotAScalar) {
  auto lin = meta_linear(16, 8);
  auto not_scalar = [&] { return lin->forward(at::empty({4, 16}, at::kMeta)); };
  for (bool cuda : {false, true}) {
    try {
      if (cuda) {
        trainmem::predict_cuda_step_peak(*lin, not_scalar);
      } else {
        trainmem::predict_step_peak(*lin, not_scalar);
      }
      ADD_FAILURE() << "no error for a (4, 8) loss, cuda " << cuda;
    } catch (const c10::Error& e) {
      const std::string what = e.what_without_backtrace();
      EXPECT_NE(what.find(cuda ? "predict_cuda_step_peak: loss_fn must return a scalar meta tensor, but got a "
                                 "tensor of shape [4, 8] on meta"
                               : "predict_step_peak: loss_fn must return a scalar meta tensor, but got a "
                                 "tensor of shape [4, 8] on meta"),
                std::string::npos)
          << what;
    }
  }
}

TEST(CudaPredictTest, RejectsParametersOffMeta) {
  torch::nn::Linear cpu(4, 4);
  EXPECT_THROW(trainmem::predict_cuda_step_peak(*cpu, [&] { return cpu->forward(at::ones({2, 4})).sum(); }),
               c10::Error);
}

} // namespace

namespace {

// Issue: a prediction left meta behind (Adam's exp_avg on meta, meta .grad
// from a probe's backward kept by materialize()), and the next real step
// failed with "found at least two devices, meta and cpu". Each API leaves
// the module and the optimizer as it found them; a real step follows.
torch::nn::Sequential meta_mlp() {
  trainmem::MetaInitGuard meta;
  return torch::nn::Sequential(torch::nn::Linear(16, 32), torch::nn::ReLU(), torch::nn::Linear(32, 4));
}

void expect_untouched(torch::nn::Sequential& net, torch::optim::Optimizer& opt, const char* after) {
  EXPECT_TRUE(opt.state().empty()) << "optimizer state left by " << after;
  for (const auto& p : net->parameters()) {
    EXPECT_FALSE(p.grad().defined()) << "a gradient left by " << after;
  }
}

void expect_real_step_runs(torch::nn::Sequential& net, torch::optim::Adam& opt) {
  trainmem::materialize(*net, at::kCPU);
  for (const auto& p : net->parameters()) {
    EXPECT_FALSE(p.grad().defined());
  }
  for (int i = 0; i < 2; ++i) {
    opt.zero_grad();
    net->forward(at::randn({8, 16})).pow(2).mean().backward();
    opt.step();
  }
  ASSERT_EQ(opt.state().size(), 4u);
  for (const auto& [key, state] : opt.state()) {
    const auto& s = static_cast<const torch::optim::AdamParamState&>(*state);
    EXPECT_TRUE(s.exp_avg().is_cpu());
    EXPECT_EQ(s.step(), 2);
  }
}

} // namespace

TEST(CudaPredictTest, PredictionsLeaveModuleAndOptimizerAsFound) {
  auto net = meta_mlp();
  torch::optim::Adam opt(net->parameters(), 1e-3);
  auto loss = [&] { return net->forward(at::empty({8, 16}, at::kMeta)).pow(2).mean(); };
  const auto p = trainmem::predict_step_peak(*net, loss, &opt);
  EXPECT_EQ(p.optimizer_state_bytes, 2 * 4 * (16 * 32 + 32 + 32 * 4 + 4));  // measured with state
  expect_untouched(net, opt, "predict_step_peak");
  trainmem::predict_cuda_step_peak(*net, loss, &opt);
  expect_untouched(net, opt, "predict_cuda_step_peak");
  EXPECT_FALSE(trainmem::find_missing_meta_kernel([&] { loss().backward(); }));
  expect_untouched(net, opt, "find_missing_meta_kernel");
  expect_real_step_runs(net, opt);
}

TEST(CudaPredictTest, MaterializeDropsMetaGradients) {
  auto net = meta_mlp();
  torch::optim::Adam opt(net->parameters(), 1e-3);
  net->forward(at::empty({8, 16}, at::kMeta)).sum().backward();  // the user's own meta backward
  for (const auto& p : net->parameters()) {
    ASSERT_TRUE(p.grad().defined() && p.grad().is_meta());
  }
  expect_real_step_runs(net, opt);
}
