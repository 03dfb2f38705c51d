// predict_step_function (planner.h): a user's whole training step, written as
// in their loop, predicted on meta and held to the same function run on CPU
// (measure_step_function: real allocations, the CpuMemoryTracker). Each loop
// shape is one that predict_step_peak's zero_grad/forward/backward/step
// cannot express; the step lambdas make their data without a device, as the
// trainers they are modelled on do.
#include "trainmem/planner.h"

#include <cstdio>
#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "trainmem/allocator.h"
#include "trainmem/cuda_predict.h"
#include "trainmem/grad_scaler.h"
#include "trainmem/meta.h"
#include "trainmem/models/estimate.h"
#include "support/error_of.h"

namespace {

using trainmem::testing::error_of;

void expect_equal(const trainmem::StepFunctionPeak& predicted, const trainmem::StepFunctionPeak& measured,
                  const char* what) {
  std::printf("%s: predicted peak %lld B, end %lld B, start %lld B (grads %lld, state %lld); measured peak %lld B, "
              "end %lld B\n",
              what, static_cast<long long>(predicted.peak_bytes), static_cast<long long>(predicted.end_bytes),
              static_cast<long long>(predicted.start_bytes), static_cast<long long>(predicted.grad_bytes),
              static_cast<long long>(predicted.optimizer_state_bytes), static_cast<long long>(measured.peak_bytes),
              static_cast<long long>(measured.end_bytes));
  EXPECT_EQ(predicted.param_bytes, measured.param_bytes) << what;
  EXPECT_EQ(predicted.grad_bytes, measured.grad_bytes) << what;
  EXPECT_EQ(predicted.optimizer_state_bytes, measured.optimizer_state_bytes) << what;
  EXPECT_EQ(predicted.peak_bytes, measured.peak_bytes) << what;
  EXPECT_EQ(predicted.end_bytes, measured.end_bytes) << what;
}

// A char-level GPT block as minGPT-style C++ trainers write it: the causal
// mask built in forward from torch::ones without a device, positions from
// torch::arange(T); the loop calls zero_grad() after the forward, so the
// last step's gradients live through it.
struct TinyGptImpl : torch::nn::Module {
  TinyGptImpl(int64_t vocab, int64_t d) : d(d) {
    tok = register_module("tok", torch::nn::Embedding(vocab, d));
    pos = register_module("pos", torch::nn::Embedding(64, d));
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    qkv = register_module("qkv", torch::nn::Linear(d, 3 * d));
    proj = register_module("proj", torch::nn::Linear(d, d));
    head = register_module("head", torch::nn::Linear(d, vocab));
  }
  at::Tensor forward(const at::Tensor& idx) {
    const int64_t B = idx.size(0), T = idx.size(1);
    auto x = tok->forward(idx) + pos->forward(torch::arange(T).to(idx.device()));
    auto parts = qkv->forward(ln->forward(x)).chunk(3, -1);
    auto att = torch::matmul(parts[0], parts[1].transpose(-2, -1)) / std::sqrt(static_cast<double>(d));
    auto mask = torch::tril(torch::ones({T, T})).to(idx.device());  // no device given
    att = att.masked_fill(mask.view({1, T, T}) == 0, -1e9).softmax(-1);
    x = x + proj->forward(torch::matmul(att, parts[2]));
    return head->forward(x).view({B * T, -1});
  }
  int64_t d;
  torch::nn::Embedding tok{nullptr}, pos{nullptr};
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, head{nullptr};
};
TORCH_MODULE(TinyGpt);

TEST(StepFunctionTest, ZeroGradAfterTheForwardWithAMaskMadeWithoutADevice) {
  trainmem::CpuMemoryTracker::install();
  const int64_t vocab = 65, d = 32, B = 4, T = 16;
  auto run = [&](TinyGpt& model, torch::optim::AdamW& opt) {
    auto idx = torch::randint(vocab, {B, T}).to(model->tok->weight.device());
    auto targets = torch::randint(vocab, {B * T}).to(model->tok->weight.device());
    auto loss = torch::nn::functional::cross_entropy(model->forward(idx), targets);
    opt.zero_grad();  // after the forward: the previous gradients were alive through it
    loss.backward();
    opt.step();
  };
  torch::manual_seed(0);
  TinyGpt cpu(vocab, d);
  torch::optim::AdamW cpu_opt(cpu->parameters(), torch::optim::AdamWOptions(1e-3));
  TinyGpt meta{nullptr};
  {
    trainmem::MetaInitGuard guard;
    meta = TinyGpt(vocab, d);
  }
  torch::optim::AdamW meta_opt(meta->parameters(), torch::optim::AdamWOptions(1e-3));
  const auto measured = trainmem::measure_step_function({cpu.get()}, {&cpu_opt}, [&] { run(cpu, cpu_opt); });
  const auto predicted = trainmem::predict_step_function({meta.get()}, {&meta_opt}, [&] { run(meta, meta_opt); });
  expect_equal(predicted, measured, "GPT, zero_grad after the forward");
  EXPECT_GT(predicted.grad_bytes, 0);  // the last step's gradients, live at the start
  // Nothing is left behind on the meta model: no gradients, no state.
  for (const auto& p : meta->parameters()) EXPECT_FALSE(p.grad().defined());
  EXPECT_TRUE(meta_opt.state().empty());
}

// predict_step_peak's own step (zero_grad, forward, backward, step) with the
// same model: the mask and positions made without a device count, as on the
// CPU (they were left out before: -0.09 % on a char-level GPT).
TEST(StepFunctionTest, PredictStepPeakCountsTensorsMadeWithoutADevice) {
  trainmem::CpuMemoryTracker::install();
  const int64_t vocab = 65, d = 32, B = 4, T = 16;
  torch::manual_seed(0);
  TinyGpt cpu(vocab, d);
  torch::optim::AdamW cpu_opt(cpu->parameters(), torch::optim::AdamWOptions(1e-3));
  TinyGpt meta{nullptr};
  {
    trainmem::MetaInitGuard guard;
    meta = TinyGpt(vocab, d);
  }
  torch::optim::AdamW meta_opt(meta->parameters(), torch::optim::AdamWOptions(1e-3));
  auto loss = [&](TinyGpt& m) {
    auto idx = torch::randint(vocab, {B, T}).to(m->tok->weight.device());
    return torch::nn::functional::cross_entropy(m->forward(idx), torch::zeros({B * T}, at::kLong).to(idx.device()));
  };
  trainmem::measure_step_peak(*cpu, [&] { return loss(cpu); }, &cpu_opt);
  const auto measured = trainmem::measure_step_peak(*cpu, [&] { return loss(cpu); }, &cpu_opt);
  const auto predicted = trainmem::predict_step_peak(*meta, [&] { return loss(meta); }, &meta_opt);
  std::printf("predict_step_peak: %lld B, measured %lld B\n", static_cast<long long>(predicted.peak_bytes),
              static_cast<long long>(measured.peak_bytes));
  EXPECT_EQ(predicted.activation_bytes, measured.activation_bytes);
  EXPECT_EQ(predicted.peak_bytes, measured.peak_bytes);
}

// The DCGAN loop: D on a real batch and on G's fakes (detached), one D step;
// then G through D, one G step: three backward passes, two optimizers.
TEST(StepFunctionTest, AGanStepWithThreeBackwardPassesAndTwoOptimizers) {
  trainmem::CpuMemoryTracker::install();
  const int64_t B = 16, z = 24, img = 96;
  auto make = [&] {
    auto G = torch::nn::Sequential(torch::nn::Linear(z, 64), torch::nn::BatchNorm1d(64), torch::nn::ReLU(),
                                   torch::nn::Linear(64, img), torch::nn::Tanh());
    auto D = torch::nn::Sequential(torch::nn::Linear(img, 64), torch::nn::LeakyReLU(), torch::nn::Linear(64, 1),
                                   torch::nn::Sigmoid());
    return std::make_pair(G, D);
  };
  auto run = [&](torch::nn::Sequential& G, torch::nn::Sequential& D, torch::optim::Adam& og,
                 torch::optim::Adam& od) {
    const auto dev = G->parameters()[0].device();
    auto real = torch::rand({B, img}).to(dev);
    auto noise = torch::randn({B, z}).to(dev);
    auto ones = torch::ones({B, 1}).to(dev), zeros = torch::zeros({B, 1}).to(dev);
    D->zero_grad();
    torch::nn::functional::binary_cross_entropy(D->forward(real), ones).backward();
    auto fake = G->forward(noise);
    torch::nn::functional::binary_cross_entropy(D->forward(fake.detach()), zeros).backward();
    od.step();
    G->zero_grad();
    torch::nn::functional::binary_cross_entropy(D->forward(fake), ones).backward();
    og.step();
  };
  torch::manual_seed(0);
  auto [G, D] = make();
  torch::optim::Adam og(G->parameters(), torch::optim::AdamOptions(2e-4));
  torch::optim::Adam od(D->parameters(), torch::optim::AdamOptions(2e-4));
  torch::nn::Sequential mG{nullptr}, mD{nullptr};
  {
    trainmem::MetaInitGuard guard;
    std::tie(mG, mD) = make();
  }
  torch::optim::Adam mog(mG->parameters(), torch::optim::AdamOptions(2e-4));
  torch::optim::Adam mod(mD->parameters(), torch::optim::AdamOptions(2e-4));
  const auto measured =
      trainmem::measure_step_function({G.ptr().get(), D.ptr().get()}, {&og, &od}, [&] { run(G, D, og, od); });
  const auto predicted = trainmem::predict_step_function({mG.ptr().get(), mD.ptr().get()}, {&mog, &mod},
                                                         [&] { run(mG, mD, mog, mod); });
  expect_equal(predicted, measured, "GAN");
}

// Gradient accumulation over three micro-batches, a conv net with BatchNorm
// and a parameter no loss reaches (it never gets a gradient or state), SGD
// with momentum.
TEST(StepFunctionTest, GradientAccumulationWithAnUnusedParameter) {
  trainmem::CpuMemoryTracker::install();
  struct NetImpl : torch::nn::Module {
    NetImpl() {
      conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3).padding(1)));
      bn = register_module("bn", torch::nn::BatchNorm2d(8));
      fc = register_module("fc", torch::nn::Linear(8, 10));
      unused = register_module("unused", torch::nn::Linear(256, 256));
    }
    at::Tensor forward(const at::Tensor& x) {
      return fc->forward(torch::relu(bn->forward(conv->forward(x))).mean({2, 3}));
    }
    torch::nn::Conv2d conv{nullptr};
    torch::nn::BatchNorm2d bn{nullptr};
    torch::nn::Linear fc{nullptr}, unused{nullptr};
  };
  auto run = [&](NetImpl& net, torch::optim::SGD& opt) {
    const auto dev = net.fc->weight.device();
    opt.zero_grad();
    for (int i = 0; i < 3; ++i) {
      auto x = torch::randn({4, 3, 12, 12}).to(dev);
      auto y = torch::randint(10, {4}).to(dev);
      (torch::nn::functional::cross_entropy(net.forward(x), y) / 3).backward();
    }
    opt.step();
  };
  torch::manual_seed(0);
  auto cpu = std::make_shared<NetImpl>();
  torch::optim::SGD cpu_opt(cpu->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  std::shared_ptr<NetImpl> meta;
  {
    trainmem::MetaInitGuard guard;
    meta = std::make_shared<NetImpl>();
  }
  torch::optim::SGD meta_opt(meta->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  const auto measured = trainmem::measure_step_function({cpu.get()}, {&cpu_opt}, [&] { run(*cpu, cpu_opt); });
  const auto predicted =
      trainmem::predict_step_function({meta.get()}, {&meta_opt}, [&] { run(*meta, meta_opt); });
  expect_equal(predicted, measured, "accumulation x 3, conv + BatchNorm, an unused layer");
  EXPECT_EQ(predicted.grad_bytes, (8 * 3 * 9 + 8 + 8 + 8 + 80 + 10) * 4);  // no gradient for `unused`
}

// fp16 autocast with trainmem's GradScaler, as the README's loop: scale,
// backward, unscale_ before clipping, step, update. On meta the scaler's
// found_inf has no value and the step is taken.
TEST(StepFunctionTest, Fp16AutocastWithAGradScaler) {
  trainmem::CpuMemoryTracker::install();
  auto make = [] {
    return torch::nn::Sequential(torch::nn::Linear(64, 128), torch::nn::GELU(), torch::nn::Linear(128, 16));
  };
  auto run = [&](torch::nn::Sequential& net, torch::optim::AdamW& opt, trainmem::GradScaler& scaler) {
    const auto dev = net->parameters()[0].device();
    auto x = torch::randn({32, 64}).to(dev);
    opt.zero_grad();
    auto loss = trainmem::run_under_autocast(at::kCPU, at::kHalf, [&] { return net->forward(x).to(at::kFloat).pow(2).mean(); });
    scaler.scale(loss).backward();
    scaler.unscale_(opt);
    scaler.step(opt);
    scaler.update();
  };
  torch::manual_seed(0);
  auto cpu = make();
  torch::optim::AdamW cpu_opt(cpu->parameters(), torch::optim::AdamWOptions(1e-3));
  trainmem::GradScaler cpu_scaler;
  torch::nn::Sequential meta{nullptr};
  {
    trainmem::MetaInitGuard guard;
    meta = make();
  }
  torch::optim::AdamW meta_opt(meta->parameters(), torch::optim::AdamWOptions(1e-3));
  trainmem::GradScaler meta_scaler;
  const auto measured =
      trainmem::measure_step_function({cpu.ptr().get()}, {&cpu_opt}, [&] { run(cpu, cpu_opt, cpu_scaler); });
  const auto predicted = trainmem::predict_step_function({meta.ptr().get()}, {&meta_opt},
                                                         [&] { run(meta, meta_opt, meta_scaler); });
  expect_equal(predicted, measured, "fp16 autocast + GradScaler");
}

// On CUDA: the plain loop written as a step function gives what
// predict_cuda_step_peak gives for it (the same trace, replayed the same way);
// the GAN's step is predicted with its three backward passes.
TEST(StepFunctionTest, OnCudaThePlainLoopEqualsPredictCudaStepPeak) {
  torch::nn::Sequential meta{nullptr};
  {
    trainmem::MetaInitGuard guard;
    meta = torch::nn::Sequential(torch::nn::Linear(256, 512), torch::nn::GELU(), torch::nn::Linear(512, 256));
  }
  torch::optim::AdamW opt(meta->parameters(), torch::optim::AdamWOptions(1e-3));
  auto loss = [&] { return meta->forward(at::empty({64, 256}, at::kMeta)).pow(2).mean(); };
  const auto options = trainmem::CudaPredictOptions();
  const auto plain = trainmem::predict_cuda_step_peak(*meta, loss, &opt, options);
  const auto function = trainmem::predict_cuda_step_function({meta.ptr().get()}, {&opt}, [&] {
    for (auto& p : meta->parameters()) p.mutable_grad().reset();
    opt.zero_grad();
    loss().backward();
    opt.step();
  }, options);
  std::printf("CUDA: predict_cuda_step_peak %lld / %lld B, step function %lld / %lld B (%s)\n",
              static_cast<long long>(plain.max_memory_allocated_bytes),
              static_cast<long long>(plain.max_memory_reserved_bytes),
              static_cast<long long>(function.max_memory_allocated_bytes),
              static_cast<long long>(function.max_memory_reserved_bytes), trainmem::to_string(function).c_str());
  EXPECT_EQ(function.max_memory_allocated_bytes, plain.max_memory_allocated_bytes);
  EXPECT_EQ(function.max_memory_reserved_bytes, plain.max_memory_reserved_bytes);
  EXPECT_EQ(function.terms.optimizer_state_bytes, plain.terms.optimizer_state_bytes);
  EXPECT_EQ(function.terms.workspace_bytes, plain.terms.workspace_bytes);
  EXPECT_EQ(function.phase == trainmem::Phase::kBackward, plain.phase == trainmem::Phase::kBackward);
  EXPECT_FALSE(function.phases_split);
  for (const auto& p : meta->parameters()) EXPECT_FALSE(p.grad().defined());
  EXPECT_TRUE(opt.state().empty());
}

TEST(StepFunctionTest, BadArgumentsAreNamed) {
  torch::nn::Linear cpu(2, 2);
  torch::nn::Linear meta{nullptr};
  {
    trainmem::MetaInitGuard guard;
    meta = torch::nn::Linear(2, 2);
  }
  EXPECT_NE(error_of([&] { trainmem::predict_step_function({meta.get()}, {}, {}); }).find("the step function is empty"),
            std::string::npos);
  EXPECT_NE(error_of([&] { trainmem::predict_step_function({}, {}, [] {}); }).find("at least one module"),
            std::string::npos);
  EXPECT_NE(error_of([&] { trainmem::predict_step_function({nullptr}, {}, [] {}); }).find("module 0 is null"),
            std::string::npos);
  EXPECT_NE(error_of([&] { trainmem::predict_step_function({meta.get()}, {}, [] {}, -1); })
                .find("warmup_steps >= 0, but got -1"),
            std::string::npos);
  EXPECT_NE(error_of([&] { trainmem::predict_step_function({cpu.get()}, {}, [] {}); })
                .find("parameter 'weight' is on cpu, not on the meta device"),
            std::string::npos);
}

// A step that throws on meta leaves the modules and optimizers as they
// were: the next real step and the next prediction work.
TEST(StepFunctionTest, AStepThatThrowsLeavesNothingBehind) {
  trainmem::CpuMemoryTracker::install();
  torch::nn::Linear meta{nullptr};
  {
    trainmem::MetaInitGuard guard;
    meta = torch::nn::Linear(8, 8);
  }
  torch::optim::AdamW opt(meta->parameters(), torch::optim::AdamWOptions(1e-3));
  int calls = 0;
  auto step = [&] {
    opt.zero_grad();
    meta->forward(torch::randn({4, 8})).pow(2).mean().backward();
    opt.step();
    if (++calls == 2) throw std::runtime_error("the user's step failed");
  };
  EXPECT_THROW(trainmem::predict_step_function({meta.get()}, {&opt}, step), std::runtime_error);
  for (const auto& p : meta->parameters()) EXPECT_FALSE(p.grad().defined());
  EXPECT_TRUE(opt.state().empty());
  calls = -10;
  const auto p = trainmem::predict_step_function({meta.get()}, {&opt}, step);
  EXPECT_EQ(p.optimizer_state_bytes, 2 * (64 + 8) * 4);
}

}  // namespace
