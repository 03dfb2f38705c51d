// Audits of real training loops: the PyTorch C++ examples' models
// on synthetic data, several modules and optimizers, TorchScript, offload,
// optimizer-in-backward, threads and long runs. Saved bytes are checked
// against PyTorch's own saved_tensors_hooks (tests/oracle/saved_bytes.py, run
// with the project's .venv Python) where the model exists in Python.

#include "trainmem/audit.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <fstream>
#include <optional>
#include <set>
#include <memory>
#include <string>
#include <thread>

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/jit/serialization/import.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/dropout.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/functional/pooling.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/rnn.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include "trainmem/allocator.h"
#include "trainmem/hooks.h"
#include "trainmem/meter.h"
#include "trainmem/offload.h"
#include "trainmem/optimizer_in_backward.h"
#include "trainmem/planner.h"
#include "trainmem/report.h"
#include "region_planner_check.h"
#include "support/find_bucket.h"
#include "support/mnist_net.h"

namespace {

namespace F = torch::nn::functional;
using trainmem::Category;
using trainmem::testing::MnistNet;
using trainmem::Phase;

// ---- the Python oracle -------------------------------------------------------

bool have_python() {
#ifdef TRAINMEM_PYTHON
  return std::ifstream(TRAINMEM_PYTHON).good();
#else
  return false;
#endif
}

nlohmann::json oracle(const std::string& args) {
#ifdef TRAINMEM_PYTHON
  const std::string cmd = std::string(TRAINMEM_PYTHON) + " " + TRAINMEM_ORACLE + " " + args + " 2>/dev/null";
  FILE* pipe = popen(cmd.c_str(), "r");
  EXPECT_NE(pipe, nullptr) << cmd;
  std::string out;
  std::array<char, 4096> buf{};
  while (pipe != nullptr && fgets(buf.data(), buf.size(), pipe) != nullptr) {
    out += buf.data();
  }
  const int rc = pipe != nullptr ? pclose(pipe) : -1;
  EXPECT_EQ(rc, 0) << cmd << "\n" << out;
  return nlohmann::json::parse(out);
#else
  (void)args;
  return {};
#endif
}

std::vector<int64_t> saved_per_step(const trainmem::AuditReport& r) {
  std::vector<int64_t> v;
  for (const auto& s : r.steps) {
    v.push_back(s.saved_activation_bytes);
  }
  return v;
}

// An audit on its defaults meters the steps that differ
// (AuditOptions::meter_every(0)): over a loop of one shape, the first two
// or three steps (an optimizer makes its state in the first, a carried
// state first appears in the second), and one in ten after. Every other
// step repeated a metered one allocation for allocation, so every step's
// saved bytes are known, and a Python twin's per-step figures check them.
void expect_repeats_known(const trainmem::AuditReport& r) {
  int64_t metered = 0;
  for (const auto& s : r.steps) {
    metered += s.metered ? 1 : 0;
    EXPECT_TRUE(s.metered || s.repeats >= 0) << "step " << s.step << " is neither metered nor a known repeat";
    EXPECT_TRUE(s.repeats < 0 || r.steps[static_cast<size_t>(s.repeats)].metered) << "step " << s.step;
  }
  EXPECT_LE(metered, 4) << "of " << r.steps.size() << " steps";
}

std::vector<std::string> phase_labels(const trainmem::AuditReport& r, int64_t step) {
  std::vector<std::string> v;
  for (const auto& p : r.phases) {
    if (p.step == step) {
      v.push_back(trainmem::span_label(p));
    }
  }
  return v;
}

int64_t at_cat(const trainmem::TimelinePoint& p, Category c) {
  return p.bytes[static_cast<int>(c)];
}

int64_t storage_bytes(const std::vector<at::Tensor>& tensors) {
  std::set<const void*> seen;
  int64_t sum = 0;
  for (const auto& t : tensors) {
    if (t.defined() && seen.insert(t.storage().unsafeGetStorageImpl()).second) {
      sum += static_cast<int64_t>(t.storage().nbytes());
    }
  }
  return sum;
}

// ---- the PyTorch C++ examples' models ----------------------------------------

// pytorch/examples cpp/dcgan.
struct DCGANGeneratorImpl : torch::nn::Module {
  explicit DCGANGeneratorImpl(int64_t noise)
      : conv1(torch::nn::ConvTranspose2dOptions(noise, 256, 4).bias(false)), batch_norm1(256),
        conv2(torch::nn::ConvTranspose2dOptions(256, 128, 3).stride(2).padding(1).bias(false)), batch_norm2(128),
        conv3(torch::nn::ConvTranspose2dOptions(128, 64, 4).stride(2).padding(1).bias(false)), batch_norm3(64),
        conv4(torch::nn::ConvTranspose2dOptions(64, 1, 4).stride(2).padding(1).bias(false)) {
    register_module("conv1", conv1);
    register_module("conv2", conv2);
    register_module("conv3", conv3);
    register_module("conv4", conv4);
    register_module("batch_norm1", batch_norm1);
    register_module("batch_norm2", batch_norm2);
    register_module("batch_norm3", batch_norm3);
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(batch_norm1(conv1(x)));
    x = torch::relu(batch_norm2(conv2(x)));
    x = torch::relu(batch_norm3(conv3(x)));
    return torch::tanh(conv4(x));
  }
  torch::nn::ConvTranspose2d conv1;
  torch::nn::BatchNorm2d batch_norm1;
  torch::nn::ConvTranspose2d conv2;
  torch::nn::BatchNorm2d batch_norm2;
  torch::nn::ConvTranspose2d conv3;
  torch::nn::BatchNorm2d batch_norm3;
  torch::nn::ConvTranspose2d conv4;
};
TORCH_MODULE(DCGANGenerator);

torch::nn::Sequential dcgan_discriminator() {
  using namespace torch::nn;
  return Sequential(Conv2d(Conv2dOptions(1, 64, 4).stride(2).padding(1).bias(false)),
                    LeakyReLU(LeakyReLUOptions().negative_slope(0.2)),
                    Conv2d(Conv2dOptions(64, 128, 4).stride(2).padding(1).bias(false)), BatchNorm2d(128),
                    LeakyReLU(LeakyReLUOptions().negative_slope(0.2)),
                    Conv2d(Conv2dOptions(128, 256, 4).stride(2).padding(1).bias(false)), BatchNorm2d(256),
                    LeakyReLU(LeakyReLUOptions().negative_slope(0.2)),
                    Conv2d(Conv2dOptions(256, 1, 3).stride(1).padding(0).bias(false)), Sigmoid());
}

torch::nn::Sequential seed_mlp() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(32, 256), torch::nn::GELU(), torch::nn::Linear(256, 32));
}
constexpr int64_t kMlpParamBytes = 4 * (32 * 256 + 256 + 256 * 32 + 32);  // 66,688
constexpr int64_t kMlpSavedBytes = 4 * (16 * 32 + 2 * 16 * 256 + 16 * 32); // 36,864

// ---- tests ---------------------------------------------------------------------

TEST(AuditTrainersTest, MnistExampleMatchesPythonEveryStep) {
  trainmem::CpuMemoryTracker::install();
  constexpr int kSteps = 3;
  torch::manual_seed(0);
  MnistNet model;  // pytorch/examples cpp/mnist (tests/support/mnist_net.h)
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.5));
  auto& tracker = trainmem::CpuMemoryTracker::install();
  trainmem::Audit audit(*model, &opt, torch::kCPU, trainmem::AuditOptions().title("mnist"));
  std::vector<int64_t> process_peaks;
  for (int i = 0; i < kSteps; ++i) {
    auto data = torch::randn({64, 1, 28, 28});
    auto target = torch::randint(0, 10, {64});
    std::optional<trainmem::PeakWindow> window;
    {
      auto step = audit.step();
      window.emplace(tracker);  // the whole process's peak, beside the audit's own
      audit.mark_input(data);
      audit.mark_input(target);
      opt.zero_grad();
      auto loss = torch::nll_loss(model->forward(data), target);
      (void)loss.item<float>();
      loss.backward();
      opt.step();
    }
    process_peaks.push_back(window->peak_bytes());
  }
  const auto r = audit.report();
  // One thread allocates here: the audit's per-thread peak is the process's
  // (intra-op worker threads included, were they to allocate).
  for (int i = 0; i < kSteps; ++i) {
    EXPECT_EQ(r.steps[i].peak_bytes, process_peaks[i]) << "step " << i;
  }
  const int64_t params = storage_bytes(model->parameters());
  for (int i = 0; i < kSteps; ++i) {
    EXPECT_EQ(phase_labels(r, i), (std::vector<std::string>{"forward", "backward", "optimizer step (SGD)"}))
        << "step " << i;
  }
  const auto all = trainmem::live_bytes(audit.timeline());
  EXPECT_EQ(at_cat(all.back(), Category::kParameter), params);
  EXPECT_EQ(at_cat(all.back(), Category::kGradient), params);
  EXPECT_EQ(at_cat(all.back(), Category::kOptimizerState), params);  // momentum buffers
  EXPECT_EQ(at_cat(all.back(), Category::kActivation), 0);
  if (!have_python()) {
    GTEST_SKIP() << "no .venv Python: the saved bytes are not checked against PyTorch";
  }
  const auto py = oracle("mnist " + std::to_string(kSteps));
  EXPECT_EQ(saved_per_step(r), py.at("saved_bytes").get<std::vector<int64_t>>());
  EXPECT_EQ(params, py.at("param_bytes").get<int64_t>());
  EXPECT_EQ(r.buckets[2].bytes, py.at("state_bytes").get<int64_t>());
}

TEST(AuditTrainersTest, DcganHasAPhasePerOptimizerAndItsAdamStateIsOptimizerState) {
  trainmem::CpuMemoryTracker::install();
  constexpr int kSteps = 14, kNoise = 100, kBatch = 64;
  torch::manual_seed(0);
  DCGANGenerator generator(kNoise);
  auto discriminator = dcgan_discriminator();
  torch::optim::Adam g_opt(generator->parameters(), torch::optim::AdamOptions(2e-4).betas({0.5, 0.5}));
  torch::optim::Adam d_opt(discriminator->parameters(), torch::optim::AdamOptions(2e-4).betas({0.5, 0.5}));
  trainmem::Audit audit(generator);  // a module holder
  audit.add_module(discriminator);
  audit.add_optimizer(d_opt, "D");
  audit.add_optimizer(g_opt, "G");
  for (int i = 0; i < kSteps; ++i) {
    auto real_images = torch::randn({kBatch, 1, 28, 28});
    auto step = audit.step();
    audit.mark_input(real_images);
    discriminator->zero_grad();
    auto real_labels = torch::empty(kBatch).uniform_(0.8, 1.0);
    auto real_output = discriminator->forward(real_images).reshape(real_labels.sizes());
    auto d_loss_real = torch::binary_cross_entropy(real_output, real_labels);
    d_loss_real.backward();
    auto noise = torch::randn({kBatch, kNoise, 1, 1});
    auto fake_images = generator->forward(noise);
    auto fake_labels = torch::zeros(kBatch);
    auto fake_output = discriminator->forward(fake_images.detach()).reshape(fake_labels.sizes());
    auto d_loss_fake = torch::binary_cross_entropy(fake_output, fake_labels);
    d_loss_fake.backward();
    auto d_loss = d_loss_real + d_loss_fake;
    d_opt.step();
    generator->zero_grad();
    fake_labels.fill_(1);
    fake_output = discriminator->forward(fake_images).reshape(fake_labels.sizes());
    auto g_loss = torch::binary_cross_entropy(fake_output, fake_labels);
    g_loss.backward();
    g_opt.step();
  }
  const auto r = audit.report();
  // Three backward passes and two optimizers a step; `d_loss = real + fake`
  // builds graph after the second backward, so it is forward.
  const std::vector<std::string> expected = {"forward", "backward", "forward", "backward", "forward",
                                             "optimizer step (D)", "forward", "backward", "optimizer step (G)"};
  for (int i = 0; i < kSteps; ++i) {
    EXPECT_EQ(phase_labels(r, i), expected) << "step " << i;
  }
  const int64_t g_params = storage_bytes(generator->parameters());
  const int64_t d_params = storage_bytes(discriminator->parameters());
  const auto all = trainmem::live_bytes(audit.timeline());
  EXPECT_EQ(at_cat(all.back(), Category::kOptimizerState), 2 * (g_params + d_params));  // exp_avg, exp_avg_sq
  EXPECT_EQ(at_cat(all.back(), Category::kGradient), g_params + d_params);
  EXPECT_EQ(at_cat(all.back(), Category::kActivation), 0);
  for (const auto& p : all) {
    for (auto b : p.bytes) {
      ASSERT_GE(b, 0) << "a category went negative at " << p.time_ns;
    }
  }
  const int64_t state = trainmem::testing::bucket_bytes_of(r, Category::kOptimizerState);
  EXPECT_EQ(state, 2 * (g_params + d_params));
  if (!have_python()) {
    GTEST_SKIP() << "no .venv Python: the saved bytes are not checked against PyTorch";
  }
  const auto py = oracle("dcgan " + std::to_string(kSteps));
  expect_repeats_known(r);
  EXPECT_EQ(saved_per_step(r), py.at("saved_bytes").get<std::vector<int64_t>>());
  EXPECT_EQ(g_params, py.at("g_param_bytes").get<int64_t>());
  EXPECT_EQ(d_params, py.at("d_param_bytes").get<int64_t>());
  EXPECT_EQ(state, py.at("state_bytes").get<int64_t>());
}

// Both networks of a GAN, owning every parameter of the G step (G's loss
// runs through D, whose gradients it also makes).
struct GanImpl : torch::nn::Module {
  GanImpl(DCGANGenerator g, torch::nn::Sequential d)
      : generator(register_module("generator", std::move(g))),
        discriminator(register_module("discriminator", std::move(d))) {}
  DCGANGenerator generator;
  torch::nn::Sequential discriminator;
};
TORCH_MODULE(Gan);

std::vector<trainmem::Region> generator_regions(const DCGANGenerator& g) {
  using trainmem::Region;
  auto block = [](const char* name, torch::nn::ConvTranspose2d conv, torch::nn::BatchNorm2d bn) {
    return Region(name, [conv, bn](const at::Tensor& x) mutable { return torch::relu(bn(conv(x))); },
                  {conv.ptr(), bn.ptr()});
  };
  return {block("g1", g->conv1, g->batch_norm1), block("g2", g->conv2, g->batch_norm2),
          block("g3", g->conv3, g->batch_norm3),
          Region("g4", [c = g->conv4](const at::Tensor& x) mutable { return torch::tanh(c(x)); }, {g->conv4.ptr()})};
}

// The DCGAN's two steps, each planned (check_model: every plan's saved bytes
// exact, its peak within 0.5 % of the CPU's, in budget, gradients
// bit-identical): D's loss on G's detached output (D's regions, Adam over
// D), and G's loss through D (G's regions then D's, Adam over G). Their
// store-everything plans save what PyTorch's saved_tensors_hooks count in
// the same steps (oracle mode gan).
TEST(AuditTrainersTest, DcganDiscriminatorAndGeneratorStepsArePlanned) {
  trainmem::CpuMemoryTracker::install();
  constexpr int64_t kNoise = 100, kBatch = 64;
  torch::manual_seed(0);
  Gan gan(DCGANGenerator(kNoise), dcgan_discriminator());
  torch::optim::Adam g_opt(gan->generator->parameters(), torch::optim::AdamOptions(2e-4).betas({0.5, 0.5}));
  torch::optim::Adam d_opt(gan->discriminator->parameters(), torch::optim::AdamOptions(2e-4).betas({0.5, 0.5}));
  auto bce_to = [](double label) {
    return [label](const at::Tensor& y) {
      return torch::binary_cross_entropy(y.reshape({kBatch}), at::full({kBatch}, label, y.options()));
    };
  };
  // D's step: its input is G's output, detached (no gradient reaches G).
  trainmem::RegionModel d_step;
  d_step.regions = trainmem::regions_of(gan->discriminator);
  d_step.input = [](c10::Device d) { return at::randn({kBatch, 1, 28, 28}, at::TensorOptions().device(d)); };
  d_step.loss = bce_to(0.0);
  d_step.optimizer = &d_opt;
  const auto d_plan = trainmem::plan_regions(d_step, trainmem::PlanOptions().selective(false));
  trainmem::testing::check_model("DCGAN D on detached fakes", *gan->discriminator, d_step, &d_opt);
  // G's step: noise -> G -> D -> loss against "real".
  trainmem::RegionModel g_step;
  g_step.regions = generator_regions(gan->generator);
  for (auto& r : trainmem::regions_of(gan->discriminator)) g_step.regions.push_back(r);
  g_step.input = [](c10::Device d) { return at::randn({kBatch, kNoise, 1, 1}, at::TensorOptions().device(d)); };
  g_step.loss = bce_to(1.0);
  g_step.optimizer = &g_opt;
  const auto g_plan = trainmem::plan_regions(g_step, trainmem::PlanOptions().selective(false));
  trainmem::testing::check_model("DCGAN G through D", *gan, g_step, &g_opt);
  std::cout << to_string(d_plan) << to_string(g_plan);
  EXPECT_EQ(d_plan.name, "none");
  EXPECT_EQ(g_plan.name, "none");
  // Measured (the CPU meter equals the plans: check_model).
  EXPECT_EQ(d_plan.activation_bytes, 13'213'184);
  EXPECT_EQ(g_plan.activation_bytes, 24'973'312);
  if (!have_python()) {
    GTEST_SKIP() << "no .venv Python: the saved bytes are not checked against PyTorch";
  }
  const auto py = oracle("gan 1");
  EXPECT_EQ(d_plan.activation_bytes, py.at("d_saved_bytes").at(0).get<int64_t>());
  EXPECT_EQ(g_plan.activation_bytes, py.at("g_saved_bytes").at(0).get<int64_t>());
}

TEST(AuditTrainersTest, AnOptimizerIsCheckedWhenAdded) {
  trainmem::CpuMemoryTracker::install();
  DCGANGenerator generator(100);
  auto discriminator = dcgan_discriminator();
  torch::optim::Adam d_opt(discriminator->parameters(), torch::optim::AdamOptions(2e-4));
  trainmem::Audit audit(generator);
  try {
    audit.add_optimizer(d_opt);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    const std::string msg = e.what();
    const auto n = std::to_string(discriminator->parameters().size());  // 4 convs, 2 batch norms: 8
    EXPECT_NE(msg.find("Audit::add_optimizer: " + n + " of the optimizer's " + n +
                       " parameters are not parameters of an audited module"),
              std::string::npos)
        << msg;
  }
  audit.add_module(discriminator);
  audit.add_optimizer(d_opt);
  EXPECT_NO_THROW(audit.add_optimizer(d_opt));  // twice: still one optimizer (audit_lifetime_test.cpp)
  audit.begin_step();
  EXPECT_THROW(audit.add_module(*discriminator), c10::Error);  // inside a step
  audit.end_step();
}

TEST(AuditTrainersTest, ScriptedTrunkAndCppHeadMatchPythonEveryStep) {
  if (!have_python()) {
    GTEST_SKIP() << "the scripted trunk is made by .venv's Python (torch.jit.script(...).save())";
  }
  trainmem::CpuMemoryTracker::install();
  constexpr int kSteps = 14;
  const std::string path = ::testing::TempDir() + "trainmem_trunk.pt";
  const auto py = oracle("trunk " + std::to_string(kSteps) + " " + path);
  auto trunk = torch::jit::load(path);
  torch::manual_seed(0);
  torch::nn::Linear head(64, 10);
  std::vector<at::Tensor> trunk_params;
  for (const auto& p : trunk.parameters()) {
    trunk_params.push_back(p);
  }
  torch::optim::SGD trunk_opt(trunk_params, 0.001);
  torch::optim::Adam head_opt(head->parameters(), 1e-3);
  trainmem::Audit audit(trunk);  // a torch::jit::Module
  audit.add_module(head);
  audit.add_optimizer(trunk_opt, "trunk");
  audit.add_optimizer(head_opt, "head");
  for (int i = 0; i < kSteps; ++i) {
    auto x = torch::randn({32, 3, 32, 32});
    auto y = torch::randint(0, 10, {32});
    auto step = audit.step();
    trunk_opt.zero_grad();
    head_opt.zero_grad();
    auto features = trunk.forward({x}).toTensor();
    auto loss = torch::nll_loss(torch::log_softmax(head->forward(features), 1), y);
    loss.backward();
    trunk_opt.step();
    head_opt.step();
  }
  const auto r = audit.report();
  // The trunk's weights are PARAMETER, never saved activations.
  expect_repeats_known(r);
  EXPECT_EQ(saved_per_step(r), py.at("saved_bytes").get<std::vector<int64_t>>());
  EXPECT_EQ(storage_bytes(trunk_params), py.at("trunk_param_bytes").get<int64_t>());
  EXPECT_EQ(r.buckets[0].bytes, py.at("trunk_param_bytes").get<int64_t>() + py.at("head_param_bytes").get<int64_t>());
  for (int i = 0; i < kSteps; ++i) {
    EXPECT_EQ(phase_labels(r, i), (std::vector<std::string>{"forward", "backward", "optimizer step (trunk)",
                                                            "optimizer step (head)"}))
        << "step " << i;
  }
  std::string nodes;
  for (const auto& n : r.saved_by_node) {
    nodes += n.node + " " + std::to_string(n.bytes) + "\n";
  }
  for (const auto& n : r.saved_by_node) {
    EXPECT_EQ(n.node.find("CppFunction"), std::string::npos) << "a TorchScript node is unnamed:\n" << nodes;
  }
  // The trunk's two differentiable graphs (torch.jit.last_executed_optimized_graph()
  // in Python shows them), named by their ops, with what each keeps: relu's
  // output [32,16,30,30] f32 and max_pool's indices [32,16,15,15] i64; the
  // flattened features [32,3600] f32 and relu's output [32,64] f32.
  auto bytes_of = [&](const std::string& node) {
    for (const auto& n : r.saved_by_node) {
      if (n.node == node) {
        return n.bytes;
      }
    }
    return int64_t{-1};
  };
  EXPECT_EQ(bytes_of("DifferentiableGraphBackward(aten::relu, aten::max_pool2d_with_indices)"),
            32 * 16 * 30 * 30 * 4 + 32 * 16 * 15 * 15 * 8)
      << nodes;
  EXPECT_EQ(bytes_of("DifferentiableGraphBackward(aten::linear, aten::relu)"), 32 * 3600 * 4 + 32 * 64 * 4) << nodes;
}

// A TorchScript module's parameters as an nn::Module's, the same tensors
// (registered by name, dots made underscores): what a Region lists so the
// planner counts them, moves them to meta in place while planning (the
// scripted module then runs on meta with them) and sums their gradients.
struct ScriptedParamsImpl : torch::nn::Module {
  explicit ScriptedParamsImpl(const torch::jit::Module& scripted) {
    for (const auto& p : scripted.named_parameters(/*recurse=*/true)) {
      std::string name = p.name;
      std::replace(name.begin(), name.end(), '.', '_');
      register_parameter(name, p.value);
    }
  }
};
TORCH_MODULE(ScriptedParams);

// The scripted trunk and its C++ head, planned: the trunk is one region that
// calls the TorchScript module (planned on meta, run on CPU), the head
// another; check_model runs every plan on CPU (saved bytes exact, peak
// within 0.5 %, in budget, gradients bit-identical), and the
// store-everything plan saves what PyTorch's hooks count for the step.
TEST(AuditTrainersTest, ScriptedTrunkAndCppHeadArePlanned) {
  if (!have_python()) {
    GTEST_SKIP() << "the scripted trunk is made by .venv's Python (torch.jit.script(...).save())";
  }
  trainmem::CpuMemoryTracker::install();
  const std::string path = ::testing::TempDir() + "trainmem_trunk_planned.pt";
  const auto py = oracle("trunk 1 " + path);
  auto trunk = std::make_shared<torch::jit::Module>(torch::jit::load(path));
  torch::manual_seed(0);
  struct Net : torch::nn::Module {
    ScriptedParams trunk_params{nullptr};
    torch::nn::Linear head{nullptr};
  };
  auto net = std::make_shared<Net>();
  net->trunk_params = net->register_module("trunk", ScriptedParams(*trunk));
  net->head = net->register_module("head", torch::nn::Linear(64, 10));
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-3));
  trainmem::RegionModel m;
  m.regions = {trainmem::Region("trunk", [trunk](const at::Tensor& x) { return trunk->forward({x}).toTensor(); },
                                {net->trunk_params.ptr()}),
               trainmem::Region("head", [head = net->head](const at::Tensor& f) mutable {
                 return torch::log_softmax(head->forward(f), 1);
               }, {net->head.ptr()})};
  m.input = [](c10::Device d) { return at::randn({32, 3, 32, 32}, at::TensorOptions().device(d)); };
  m.loss = [](const at::Tensor& logp) {
    return torch::nll_loss(logp, at::zeros({logp.size(0)}, logp.options().dtype(at::kLong)));
  };
  m.optimizer = &opt;
  const auto plan = trainmem::plan_regions(m, trainmem::PlanOptions().selective(false));
  std::cout << to_string(plan);
  EXPECT_TRUE(plan.cpu_fallbacks.empty()) << to_string(plan);
  EXPECT_EQ(plan.name, "none");
  trainmem::testing::check_model("scripted trunk + C++ head", *net, m, &opt);
  EXPECT_EQ(plan.activation_bytes, 3'628'548);  // measured on CPU by check_model
  EXPECT_EQ(plan.activation_bytes, py.at("saved_bytes").at(0).get<int64_t>());
}

TEST(AuditTrainersTest, MeterCountsThroughOffloadAndUserHooks) {
  trainmem::CpuMemoryTracker::install();
  auto mlp = seed_mlp();
  auto x = torch::randn({16, 32});
  auto meter_with = [&](const std::function<void()>& forward) {
    trainmem::SavedTensorMeter meter(*mlp);
    {
      trainmem::SavedTensorMeterGuard scope(meter);
      forward();
    }
    return meter.report();
  };
  // Offload inside the meter's scope, and outside it: the meter sees all.
  at::Tensor loss;
  auto r = meter_with([&] {
    trainmem::SaveOnCpuGuard offload(*mlp, trainmem::SaveOnCpuOptions().copy_cpu_tensors(true).min_offload_bytes(0));
    loss = mlp->forward(x).pow(2).sum();
  });
  EXPECT_EQ(r.saved_bytes, kMlpSavedBytes);
  EXPECT_EQ(r.host_bytes, kMlpSavedBytes);
  EXPECT_EQ(r.device_bytes, 0);
  loss.backward();
  {
    trainmem::SaveOnCpuGuard offload(*mlp, trainmem::SaveOnCpuOptions().copy_cpu_tensors(true).min_offload_bytes(0));
    r = meter_with([&] { loss = mlp->forward(x).pow(2).sum(); });
    EXPECT_GT(offload.stats().offloaded_bytes, 0);  // the meter did not shadow the offload
  }
  EXPECT_EQ(r.saved_bytes, kMlpSavedBytes);
  EXPECT_EQ(r.host_bytes, kMlpSavedBytes);
  // SaveOnCpuGuard leaves CPU tensors where they are by default.
  r = meter_with([&] {
    trainmem::SaveOnCpuGuard offload(*mlp);
    loss = mlp->forward(x).pow(2).sum();
  });
  EXPECT_EQ(r.saved_bytes, kMlpSavedBytes);
  EXPECT_EQ(r.device_bytes, kMlpSavedBytes);
  EXPECT_EQ(r.host_bytes, 0);
  // A user's own hooks: counted, and they still run.
  int64_t packs = 0;
  r = meter_with([&] {
    trainmem::SavedTensorHooksGuard hooks(
        [&](const at::Tensor& t) -> std::any {
          ++packs;
          return t.tensor_data();
        },
        [](const std::any& p) { return std::any_cast<at::Tensor>(p); });
    loss = mlp->forward(x).pow(2).sum();
  });
  EXPECT_EQ(packs, 5);  // x, h, gelu(h), W2.T, out (addmm keeps W1.T only when x needs grad): every save went through the user's pack
  EXPECT_EQ(r.saved_bytes, kMlpSavedBytes);
  EXPECT_EQ(r.device_bytes, kMlpSavedBytes);
  loss.backward();
}

TEST(AuditTrainersTest, AuditReportsOffloadedBytesAsHostBytes) {
  trainmem::CpuMemoryTracker::install();
  auto mlp = seed_mlp();
  torch::optim::SGD opt(mlp->parameters(), 0.01);
  trainmem::Audit audit(mlp, &opt);
  {
    auto step = audit.step();
    auto x = torch::randn({16, 32});
    at::Tensor loss;
    {
      trainmem::SaveOnCpuGuard offload(*mlp, trainmem::SaveOnCpuOptions().copy_cpu_tensors(true).min_offload_bytes(0));
      loss = mlp->forward(x).pow(2).sum();
    }
    loss.backward();
    opt.step();
  }
  const auto r = audit.report();
  EXPECT_EQ(r.saved_activation_bytes, kMlpSavedBytes);
  EXPECT_EQ(r.saved_host_bytes, kMlpSavedBytes);
  EXPECT_EQ(r.saved_device_bytes, 0);
  EXPECT_NE(trainmem::to_text(r).find("0 B on the device, 36,864 B offloaded to the host"), std::string::npos)
      << trainmem::to_text(r);
  const auto back = trainmem::report_from_json(trainmem::to_json(r));
  EXPECT_EQ(back.saved_host_bytes, kMlpSavedBytes);
}

TEST(AuditTrainersTest, OptimizerStateMadeInBackwardIsOptimizerState) {
  trainmem::CpuMemoryTracker::install();
  auto mlp = seed_mlp();
  trainmem::OptimizerInBackward oib(mlp->parameters(), [](std::vector<at::Tensor> p) {
    return std::make_unique<torch::optim::AdamW>(p, torch::optim::AdamWOptions(1e-3));
  });
  trainmem::Audit audit(mlp);
  audit.add_optimizer(oib);
  for (int i = 0; i < 2; ++i) {
    auto step = audit.step();
    mlp->forward(torch::randn({16, 32})).pow(2).sum().backward();
  }
  const auto all = trainmem::live_bytes(audit.timeline());
  EXPECT_EQ(at_cat(all.back(), Category::kOptimizerState), 2 * kMlpParamBytes);
  EXPECT_EQ(at_cat(all.back(), Category::kGradient), 0);  // freed in backward
  EXPECT_EQ(at_cat(all.back(), Category::kUnknown), 0);
  const auto r = audit.report();
  const int64_t state = trainmem::testing::bucket_bytes_of(r, Category::kOptimizerState);
  EXPECT_EQ(state, 2 * kMlpParamBytes);
}

// One thread's loop, audited: what each step must show, exactly.
struct StepFigures {
  int64_t saved = 0;
  std::vector<std::string> phases;
  int64_t peak_above_baseline = 0;
  int64_t gradient = 0, state = 0, activation = 0, temporary_end = 0;
  bool operator==(const StepFigures&) const = default;
};

// The model and optimizer are the caller's, alive until both threads are
// done: a thread's audit counts what was live when it began (the other
// thread's model) as "before the audit" until it is freed (Note [A
// recorder's baseline]), so a model freed while the other thread still
// steps would lower that thread's later peaks.
std::vector<StepFigures> run_mlp_loop(int steps, torch::nn::Sequential& mlp, torch::optim::SGD& opt) {
  trainmem::Audit audit(mlp, &opt);
  for (int i = 0; i < steps; ++i) {
    auto step = audit.step();
    opt.zero_grad();
    auto x = torch::randn({16, 32});
    mlp->forward(x).pow(2).sum().backward();
    opt.step();
  }
  const auto r = audit.report();
  const auto& t = audit.timeline();
  int64_t baseline = 0;
  for (auto b : t.baseline_bytes) {
    baseline += b;
  }
  std::vector<StepFigures> out(static_cast<size_t>(steps));
  for (int i = 0; i < steps; ++i) {
    out[i].saved = r.steps[i].saved_activation_bytes;
    out[i].phases = phase_labels(r, i);
    out[i].peak_above_baseline = r.steps[i].peak_bytes - baseline;
  }
  // Live bytes by category at each step's end.
  trainmem::CategoryBytes live = t.baseline_bytes;
  size_t e = 0;
  for (int i = 0; i < steps; ++i) {
    const int64_t end = r.phases[static_cast<size_t>(3 * i + 2)].end_ns;
    while (e < t.events.size() && t.events[e].time_ns <= end) {
      live[static_cast<int>(t.events[e].category)] += t.events[e].bytes;
      ++e;
    }
    out[i].gradient = live[static_cast<int>(Category::kGradient)];
    out[i].state = live[static_cast<int>(Category::kOptimizerState)];
    out[i].activation = live[static_cast<int>(Category::kActivation)];
    out[i].temporary_end = live[static_cast<int>(Category::kTemporary)];
  }
  return out;
}

TEST(AuditTrainersTest, TwoThreadsTwoHundredStepsEachAreExactEveryStep) {
  trainmem::CpuMemoryTracker::install();
  constexpr int kSteps = 200;
  auto mlp = [] { return seed_mlp(); };
  auto sgd = [](torch::nn::Sequential& m) {
    return std::make_unique<torch::optim::SGD>(m->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  };
  auto solo_mlp = mlp();
  auto solo_opt = sgd(solo_mlp);
  const auto solo = run_mlp_loop(3, solo_mlp, *solo_opt);
  ASSERT_EQ(solo[1], solo[2]);  // steady state from step 1 on
  EXPECT_EQ(solo[1].saved, kMlpSavedBytes);
  EXPECT_EQ(solo[1].phases, (std::vector<std::string>{"forward", "backward", "optimizer step (SGD)"}));
  EXPECT_EQ(solo[1].gradient, kMlpParamBytes);
  EXPECT_EQ(solo[1].state, kMlpParamBytes);
  EXPECT_EQ(solo[1].activation, 0);
  std::vector<StepFigures> a, b;
  auto mlp_a = mlp(), mlp_b = mlp();
  auto opt_a = sgd(mlp_a), opt_b = sgd(mlp_b);
  std::thread ta([&] { a = run_mlp_loop(kSteps, mlp_a, *opt_a); });
  std::thread tb([&] { b = run_mlp_loop(kSteps, mlp_b, *opt_b); });
  ta.join();
  tb.join();
  for (int i = 0; i < kSteps; ++i) {
    const auto& want = solo[std::min(i, 2)];
    ASSERT_EQ(a[i], want) << "thread a, step " << i << ": peak " << a[i].peak_above_baseline << " vs "
                          << want.peak_above_baseline << ", saved " << a[i].saved;
    ASSERT_EQ(b[i], want) << "thread b, step " << i << ": peak " << b[i].peak_above_baseline << " vs "
                          << want.peak_above_baseline << ", saved " << b[i].saved;
  }
}

TEST(AuditTrainersTest, AuditDestroyedOnAnotherThreadMidStepIsSafe) {
  trainmem::CpuMemoryTracker::install();
  auto mlp = seed_mlp();
  torch::optim::SGD opt(mlp->parameters(), 0.01);
  auto audit = std::make_unique<trainmem::Audit>(mlp, &opt);
  audit->begin_step();
  auto loss = mlp->forward(torch::randn({16, 32})).pow(2).sum();
  std::thread([&] { audit.reset(); }).join();  // the step is open, on this thread
  // The loop goes on unaudited; nothing dangles.
  loss.backward();
  opt.step();
  EXPECT_EQ(trainmem::num_active_saved_tensor_hooks(), 0);
  mlp->forward(torch::randn({16, 32})).pow(2).sum().backward();
  // A meter guard ended on another thread stops counting at once.
  trainmem::SavedTensorMeter meter(*mlp);
  auto guard = std::make_unique<trainmem::SavedTensorMeterGuard>(meter);
  std::thread([&] { guard.reset(); }).join();
  mlp->forward(torch::randn({16, 32})).pow(2).sum().backward();
  EXPECT_EQ(meter.report().saved_bytes, 0);
  trainmem::SavedTensorMeterGuard again(meter);  // usable again on this thread
  (void)mlp->forward(torch::randn({16, 32})).pow(2).sum();
}

TEST(AuditTrainersTest, BytesBeforeTheAuditAreABaselineAndLabelsNameThem) {
  auto& tracker = trainmem::CpuMemoryTracker::install();
  auto mlp = seed_mlp();
  torch::optim::SGD opt(mlp->parameters(), 0.01);
  auto data_set = torch::randn({1000, 32});   // a data set held in memory
  auto cache = torch::randn({250, 32});       // something nobody names
  auto run = [&](bool labelled) {
    trainmem::Audit audit(mlp, &opt);
    if (labelled) {
      audit.label(data_set, "data set", Category::kInput);
    }
    {
      auto step = audit.step();
      opt.zero_grad();
      auto x = data_set.narrow(0, 0, 16);
      mlp->forward(x).pow(2).sum().backward();
      opt.step();
    }
    return std::make_pair(audit.timeline().baseline_bytes, audit.report());
  };
  const int64_t live_before = tracker.stats().allocated_bytes;
  const auto [plain, plain_report] = run(false);
  const auto [named, named_report] = run(true);
  const int64_t set_bytes = 1000 * 32 * 4;
  EXPECT_EQ(plain[static_cast<int>(Category::kInput)], 0);
  EXPECT_EQ(named[static_cast<int>(Category::kInput)], set_bytes);
  EXPECT_EQ(named[static_cast<int>(Category::kBeforeAudit)], plain[static_cast<int>(Category::kBeforeAudit)] - set_bytes);
  EXPECT_GE(plain[static_cast<int>(Category::kBeforeAudit)], set_bytes + 250 * 32 * 4);
  EXPECT_EQ(plain[static_cast<int>(Category::kUnknown)], 0);
  EXPECT_LE(plain[static_cast<int>(Category::kBeforeAudit)] + plain[static_cast<int>(Category::kParameter)],
            live_before);
  EXPECT_EQ(named_report.buckets.back().name, "data set");
  EXPECT_EQ(named_report.buckets.back().bytes, set_bytes);
  // The data set is no saved activation once labelled (x is a view of it).
  EXPECT_EQ(plain_report.saved_activation_bytes - named_report.saved_activation_bytes, set_bytes);
  // The HTML page can hide the baseline, without any script.
  const auto html = trainmem::to_html(plain_report);
  EXPECT_NE(html.find("id=\"hide-baseline\""), std::string::npos);
  EXPECT_EQ(html.find("<script"), std::string::npos);
}

TEST(AuditTrainersTest, MarkedPhasesNameWhatDetectionCannotSee) {
  trainmem::CpuMemoryTracker::install();
  auto mlp = seed_mlp();
  torch::optim::SGD opt(mlp->parameters(), 0.01);
  trainmem::Audit audit(mlp, &opt);
  std::vector<at::Tensor> ema;
  for (const auto& p : mlp->parameters()) {
    ema.push_back(p.detach().clone());
  }
  {
    auto step = audit.step();
    opt.zero_grad();
    mlp->forward(torch::randn({16, 32})).pow(2).sum().backward();
    opt.step();
    {
      auto phase = audit.phase(Phase::kOptimizerStep, "EMA");
      torch::NoGradGuard no_grad;
      const auto params = mlp->parameters();
      for (size_t i = 0; i < ema.size(); ++i) {
        ema[i].mul_(0.99).add_(params[i], 0.01);
      }
    }
    EXPECT_THROW(audit.end_phase(), c10::Error);
  }
  const auto r = audit.report();
  EXPECT_EQ(phase_labels(r, 0), (std::vector<std::string>{"forward", "backward", "optimizer step (SGD)",
                                                          "optimizer step (EMA)", "forward"}));
  EXPECT_THROW(audit.begin_phase(Phase::kForward), c10::Error);  // outside a step
}

TEST(AuditTrainersTest, EventLogIsCappedInsideAStepAndMemoryStaysFlat) {
  trainmem::CpuMemoryTracker::install();
  auto mlp = seed_mlp();
  torch::optim::SGD opt(mlp->parameters(), 0.01);
  constexpr int64_t kCap = 500;
  trainmem::Audit audit(mlp, &opt, torch::kCPU, trainmem::AuditOptions().max_events(kCap));
  {
    auto step = audit.step();
    for (int i = 0; i < 5000; ++i) {  // one step with many allocations
      (void)torch::randn({4});
    }
  }
  EXPECT_EQ(static_cast<int64_t>(audit.timeline().events.size()), kCap);
  EXPECT_GE(audit.timeline().num_dropped_events, 2 * 5000 - kCap);
  auto rss_kb = [] {
    std::ifstream f("/proc/self/statm");
    int64_t size = 0, resident = 0;
    f >> size >> resident;
    return resident * 4;
  };
  auto train = [&](int n) {
    for (int i = 0; i < n; ++i) {
      auto step = audit.step();
      opt.zero_grad();
      mlp->forward(torch::randn({16, 32})).pow(2).sum().backward();
      opt.step();
    }
  };
  train(50);
  const int64_t before = rss_kb();
  train(500);
  const int64_t after = rss_kb();
  EXPECT_EQ(static_cast<int64_t>(audit.timeline().events.size()), kCap);
#if defined(__SANITIZE_ADDRESS__)
  // AddressSanitizer keeps freed blocks in its quarantine (256 MB by default):
  // RSS grows under it whatever the audit does; the event cap is checked above.
  (void)before;
  (void)after;
#else
  EXPECT_LT(after - before, 2048) << "RSS grew by " << after - before << " kB over 500 steps past the cap";
#endif
}

TEST(AuditTrainersTest, LongRunsAreSummarizedNotListed) {
  trainmem::CpuMemoryTracker::install();
  auto mlp = seed_mlp();
  torch::optim::SGD opt(mlp->parameters(), 0.01);
  trainmem::Audit audit(mlp, &opt, torch::kCPU, trainmem::AuditOptions().timeline(false));
  for (int i = 0; i < 20; ++i) {
    auto step = audit.step();
    opt.zero_grad();
    mlp->forward(torch::randn({16, 32})).pow(2).sum().backward();
    opt.step();
  }
  const auto r = audit.report();
  const auto sum = trainmem::summarize_steps(r.steps);
  EXPECT_EQ(sum.num_steps, 20);
  std::vector<int64_t> peaks;
  for (const auto& s : r.steps) {
    peaks.push_back(s.peak_bytes);
  }
  std::sort(peaks.begin(), peaks.end());
  EXPECT_EQ(sum.peak_bytes.min, peaks.front());
  EXPECT_EQ(sum.peak_bytes.median, peaks[9]);
  EXPECT_EQ(sum.peak_bytes.max, peaks.back());
  const auto text = trainmem::to_text(r);
  EXPECT_NE(text.find("20 steps in all"), std::string::npos) << text;
  EXPECT_NE(text.find("median"), std::string::npos);
  EXPECT_EQ(text.find("\n  19 "), std::string::npos) << "one row per step past kMaxStepRows:\n" << text;
  // Hand-made figures: min, lower median, max.
  std::vector<trainmem::StepRecord> steps(4);
  const int64_t v[] = {5, 1, 3, 2};
  for (int i = 0; i < 4; ++i) {
    steps[i].peak_bytes = v[i];
  }
  const auto s4 = trainmem::summarize_steps(steps);
  EXPECT_EQ(s4.peak_bytes.min, 1);
  EXPECT_EQ(s4.peak_bytes.median, 2);
  EXPECT_EQ(s4.peak_bytes.max, 5);
  EXPECT_THROW(trainmem::summarize_steps({}), c10::Error);
}

// ---- recurrent loops: each audited against its Python twin and planned

// word_language_model's shape: Embedding -> 2-layer LSTM -> Linear, truncated
// BPTT with the state carried (detached) from step to step.
struct WordLmImpl : torch::nn::Module {
  torch::nn::Embedding emb{register_module("emb", torch::nn::Embedding(1000, 64))};
  torch::nn::LSTM lstm{register_module("lstm", torch::nn::LSTM(torch::nn::LSTMOptions(64, 128).num_layers(2).dropout(0.2)))};
  torch::nn::Linear out{register_module("out", torch::nn::Linear(128, 1000))};
};
TORCH_MODULE(WordLm);

TEST(AuditTrainersTest, TruncatedBpttWithCarriedStateMatchesPythonAndPlans) {
  auto& tracker = trainmem::CpuMemoryTracker::install();
  constexpr int kSteps = 14;
  torch::manual_seed(0);
  WordLm model;
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  trainmem::Audit audit(*model, &opt, torch::kCPU);
  std::optional<std::tuple<at::Tensor, at::Tensor>> state;
  std::vector<int64_t> process_peaks;
  for (int i = 0; i < kSteps; ++i) {
    auto x = torch::randint(0, 1000, {20, 8});
    auto y = torch::randint(0, 1000, {20 * 8});
    if (state) state = std::make_tuple(std::get<0>(*state).detach(), std::get<1>(*state).detach());
    std::optional<trainmem::PeakWindow> window;
    {
      auto audited = audit.step();
      window.emplace(tracker);
      opt.zero_grad();
      auto [h, next] = model->lstm->forward(model->emb->forward(x), state);
      state = next;
      auto loss = torch::cross_entropy_loss(model->out->forward(h).flatten(0, 1), y);
      loss.backward();
      opt.step();
    }
    process_peaks.push_back(window->peak_bytes());
  }
  const auto r = audit.report();
  for (int i = 0; i < kSteps; ++i) {
    // The carried state (made in the step before) is no second count: the
    // step's peak never exceeds the allocator's over the same window.
    EXPECT_LE(r.steps[i].peak_bytes, process_peaks[i]) << "step " << i;
  }
  // The plan of the same model (a fresh zero state), region by region.
  trainmem::RegionModel m;
  m.regions = {trainmem::Region("emb", [model](const at::Tensor& t) mutable { return model->emb->forward(t); },
                                {model->emb.ptr()}),
               trainmem::Region("lstm", [model](const at::Tensor& t) mutable { return std::get<0>(model->lstm->forward(t)); },
                                {model->lstm.ptr()}),
               trainmem::Region("out", [model](const at::Tensor& t) mutable { return model->out->forward(t).flatten(0, 1); },
                                {model->out.ptr()})};
  m.input = [](c10::Device d) {
    return d.is_meta() ? at::empty({20, 8}, at::TensorOptions().dtype(at::kLong).device(d))
                       : at::randint(1000, {20, 8}, at::TensorOptions().dtype(at::kLong));
  };
  m.loss = [](const at::Tensor& logits) {
    return at::cross_entropy_loss(logits, at::zeros({logits.size(0)}, logits.options().dtype(at::kLong)));
  };
  m.optimizer = &opt;
  trainmem::testing::check_model("word LM", *model, m, &opt);
  if (!have_python()) {
    GTEST_SKIP() << "no .venv Python: the saved bytes are not checked against PyTorch";
  }
  const auto py = oracle("bptt " + std::to_string(kSteps));
  expect_repeats_known(r);
  EXPECT_EQ(saved_per_step(r), py.at("saved_bytes").get<std::vector<int64_t>>());
  EXPECT_EQ(storage_bytes(model->parameters()), py.at("param_bytes").get<int64_t>());
}

// Image captioning's decoder: an LSTMCell unrolled over a 12-step caption.
struct DecoderImpl : torch::nn::Module {
  torch::nn::Linear embed{register_module("embed", torch::nn::Linear(16, 48))};
  torch::nn::LSTMCell cell{register_module("cell", torch::nn::LSTMCell(48, 48))};
  torch::nn::Linear head{register_module("head", torch::nn::Linear(48, 10))};
  at::Tensor unroll(const at::Tensor& x) {
    std::optional<std::tuple<at::Tensor, at::Tensor>> state;
    std::vector<at::Tensor> hs;
    for (int64_t t = 0; t < x.size(1); ++t) {
      state = cell->forward(x.select(1, t), state);
      hs.push_back(std::get<0>(*state));
    }
    return at::stack(hs, 1);
  }
};
TORCH_MODULE(Decoder);

TEST(AuditTrainersTest, RecurrentDecoderMatchesPythonAndPlans) {
  auto& tracker = trainmem::CpuMemoryTracker::install();
  constexpr int kSteps = 14;
  torch::manual_seed(0);
  Decoder model;
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-3));
  trainmem::Audit audit(*model, &opt, torch::kCPU);
  std::vector<int64_t> process_peaks;
  for (int i = 0; i < kSteps; ++i) {
    auto x = torch::randn({32, 12, 16});
    auto y = torch::randint(0, 10, {32});
    std::optional<trainmem::PeakWindow> window;
    {
      auto audited = audit.step();
      window.emplace(tracker);
      opt.zero_grad();
      auto h = model->unroll(torch::tanh(model->embed->forward(x)));
      auto loss = torch::cross_entropy_loss(model->head->forward(h.mean(1)), y);
      loss.backward();
      opt.step();
    }
    process_peaks.push_back(window->peak_bytes());
  }
  const auto r = audit.report();
  for (int i = 0; i < kSteps; ++i) EXPECT_LE(r.steps[i].peak_bytes, process_peaks[i]) << "step " << i;
  trainmem::RegionModel m;
  m.regions = {
      trainmem::Region("embed", [model](const at::Tensor& t) mutable { return torch::tanh(model->embed->forward(t)); },
                       {model->embed.ptr()}),
      trainmem::Region("decoder", [model](const at::Tensor& t) mutable { return model->unroll(t); },
                       {model->cell.ptr()}),
      trainmem::Region("head", [model](const at::Tensor& t) mutable { return model->head->forward(t.mean(1)); },
                       {model->head.ptr()})};
  m.input = [](c10::Device d) { return at::randn({32, 12, 16}, at::TensorOptions().device(d)); };
  m.loss = [](const at::Tensor& logits) {
    return at::cross_entropy_loss(logits, at::zeros({logits.size(0)}, logits.options().dtype(at::kLong)));
  };
  m.optimizer = &opt;
  trainmem::testing::check_model("decoder", *model, m, &opt);
  if (!have_python()) {
    GTEST_SKIP() << "no .venv Python: the saved bytes are not checked against PyTorch";
  }
  const auto py = oracle("decoder " + std::to_string(kSteps));
  expect_repeats_known(r);
  EXPECT_EQ(saved_per_step(r), py.at("saved_bytes").get<std::vector<int64_t>>());
  EXPECT_EQ(storage_bytes(model->parameters()), py.at("param_bytes").get<int64_t>());
  // Adam's exp_avg and exp_avg_sq, a bucket each.
  const int64_t state = trainmem::testing::bucket_bytes_of(r, Category::kOptimizerState);
  EXPECT_EQ(state, py.at("state_bytes").get<int64_t>());
}

} // namespace

namespace {

// Style transfer's loop (tests/audit_test.cpp OptimizedInputHasItsOwnBucket):
// frozen conv features, Adam over the input image. The image, as a module's
// parameter, is how plan_regions() takes an optimized input: the first
// region ignores the step's (empty) input and returns the image, so the
// planner counts it as a parameter (static bytes, never an activation, as
// the audit's "optimized input" bucket and PyTorch's hooks with it
// excluded), its gradient and the optimizer's state over it (docs/api.md,
// RegionModel).
struct ImageImpl : torch::nn::Module {
  at::Tensor image = register_parameter("image", torch::rand({1, 3, 32, 32}));
};
TORCH_MODULE(Image);

struct StyleImpl : torch::nn::Module {
  StyleImpl() {
    for (auto& p : features->parameters()) p.requires_grad_(false);  // frozen, as VGG is
  }
  torch::nn::Sequential features = register_module(
      "features", torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3)), torch::nn::ReLU(),
                                        torch::nn::Conv2d(torch::nn::Conv2dOptions(8, 8, 3))));
  Image input = register_module("input", Image());
};
TORCH_MODULE(Style);

TEST(AuditTrainersTest, OptimizedInputMatchesPythonAndPlans) {
  trainmem::CpuMemoryTracker::install();
  constexpr int kSteps = 2;
  torch::manual_seed(0);
  Style style;
  const auto image = style->input->image;
  torch::optim::Adam opt({image}, torch::optim::AdamOptions(0.01));
  auto loss = [&] { return style->features->forward(image).pow(2).mean(); };
  trainmem::Audit audit(*style->features);
  audit.add_optimized_input(image, "image");
  audit.add_optimizer(opt);
  for (int i = 0; i < kSteps; ++i) {
    auto audited = audit.step();
    opt.zero_grad();
    loss().backward();
    opt.step();
  }
  const auto r = audit.report();
  auto bucket = [&](const std::string& name) { return trainmem::testing::find_bucket(r, name).bytes; };
  const int64_t state = trainmem::testing::bucket_bytes_of(r, Category::kOptimizerState);
  // Measured: the image 1 x 3 x 32 x 32 f32, its gradient, Adam's two
  // moments of it; the frozen convs' parameters; saved: relu's output
  // [1,8,30,30] and pow's input [1,8,28,28] (the image, conv1's input, is
  // the optimized input's bucket).
  EXPECT_EQ(bucket("optimized input (image)"), 12'288);
  EXPECT_EQ(bucket("gradients"), 12'288);
  EXPECT_EQ(bucket("parameters"), 3'232);
  EXPECT_EQ(state, 24'576);
  EXPECT_EQ(saved_per_step(r), (std::vector<int64_t>{53'888, 53'888}));
  // Planned: the image as region 0.
  trainmem::RegionModel m;
  m.regions = {trainmem::Region("image", [img = style->input](const at::Tensor&) { return img->image; },
                                {style->input.ptr()})};
  for (auto& region : trainmem::regions_of(style->features)) m.regions.push_back(region);
  m.input = [](c10::Device d) { return at::empty({0}, at::TensorOptions().device(d)); };
  m.loss = [](const at::Tensor& y) { return y.pow(2).mean(); };
  m.optimizer = &opt;
  const auto plan = trainmem::plan_regions(m);
  std::cout << to_string(plan);
  EXPECT_EQ(plan.name, "none");
  EXPECT_EQ(plan.activation_bytes, 53'888);
  EXPECT_EQ(plan.static_bytes, 3'232 + 12'288 + 24'576);  // parameters with the image, Adam's state
  EXPECT_EQ(plan.grad_bytes, 12'288);
  trainmem::testing::check_model("style transfer's optimized image", *style, m, &opt);
  if (!have_python()) {
    GTEST_SKIP() << "no .venv Python: the figures are not checked against PyTorch";
  }
  const auto py = oracle("style " + std::to_string(kSteps));
  EXPECT_EQ(saved_per_step(r), py.at("saved_bytes").get<std::vector<int64_t>>());
  EXPECT_EQ(bucket("optimized input (image)"), py.at("image_bytes").get<int64_t>());
  EXPECT_EQ(bucket("gradients"), py.at("grad_bytes").get<int64_t>());
  EXPECT_EQ(bucket("parameters"), py.at("param_bytes").get<int64_t>());
  EXPECT_EQ(state, py.at("state_bytes").get<int64_t>());
  EXPECT_EQ(plan.activation_bytes, py.at("saved_bytes").at(0).get<int64_t>());
  EXPECT_EQ(plan.grad_bytes, py.at("grad_bytes").get<int64_t>());
}

} // namespace

// The op watcher leaves once forward shows itself and once the only
// optimizer's step does (Note [Optimizer phases from ops]); allocations call
// it back. Two forward/backward/step rounds in one step, and the step's
// first allocation made inside the optimizer (Adam's state) or by forward.
TEST(AuditTrainersTest, PhasesAreFoundWithAQuietWatcher) {
  trainmem::CpuMemoryTracker::install();
  auto mlp = seed_mlp();
  torch::optim::Adam opt(mlp->parameters(), 1e-3);
  trainmem::Audit audit(mlp, &opt);
  for (int i = 0; i < 2; ++i) {
    auto step = audit.step();
    for (int round = 0; round < 2; ++round) {
      opt.zero_grad();
      mlp->forward(torch::randn({16, 32})).pow(2).sum().backward();
      opt.step();
    }
  }
  const auto r = audit.report();
  const std::vector<std::string> expected = {"forward", "backward", "optimizer step (Adam)",
                                             "forward", "backward", "optimizer step (Adam)"};
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(phase_labels(r, i), expected) << "step " << i;
  }
  // Adam's state (two moments per parameter) is optimizer state, made in its step.
  const int64_t params = storage_bytes(mlp->parameters());
  const int64_t state = trainmem::testing::bucket_bytes_of(r, Category::kOptimizerState);
  EXPECT_EQ(state, 2 * params);
  const auto all = trainmem::live_bytes(audit.timeline());
  EXPECT_EQ(at_cat(all.back(), Category::kOptimizerState), 2 * params);
  EXPECT_EQ(at_cat(all.back(), Category::kGradient), params);
  EXPECT_EQ(at_cat(all.back(), Category::kActivation), 0);
}

// A frozen encoder (captioning's pretrained CNN) runs with grad and builds no
// graph. The step began in forward, so its first op is evidence enough: the
// watcher leaves there, not at the decoder's first op, and the phases are
// the same. A step that begins with the optimizer is still seen.
TEST(AuditTrainersTest, AFrozenEncoderSendsTheWatcherAway) {
  trainmem::CpuMemoryTracker::install();
  torch::manual_seed(0);
  torch::nn::Linear encoder(32, 32);
  for (auto& p : encoder->parameters()) {
    p.requires_grad_(false);
  }
  auto mlp = seed_mlp();
  torch::optim::Adam opt(mlp->parameters(), 1e-3);
  // No meter: its TorchScript callback would be a thread-local callback too.
  trainmem::Audit audit(torch::kCPU, trainmem::AuditOptions().meter(false));
  audit.add_module(*mlp);
  audit.add_optimizer(opt);
  ASSERT_FALSE(at::hasThreadLocalCallbacks());
  for (int i = 0; i < 3; ++i) {
    const auto x = torch::randn({16, 32});  // the batch, made before the step
    auto step = audit.step();
    if (i == 2) {
      opt.step();  // this loop's order: the last step's update first
    }
    if (i < 2) {
      EXPECT_TRUE(at::hasThreadLocalCallbacks()) << "step " << i;  // the watcher looks at the step's first ops
    }
    const auto h = encoder->forward(x);
    ASSERT_FALSE(h.requires_grad());
    if (i < 2) {
      EXPECT_FALSE(at::hasThreadLocalCallbacks()) << "step " << i;  // and left at the encoder's
    }
    opt.zero_grad();
    mlp->forward(h).pow(2).sum().backward();
    if (i < 2) {
      opt.step();
    }
  }
  const auto r = audit.report();
  const std::vector<std::string> expected = {"forward", "backward", "optimizer step (Adam)"};
  EXPECT_EQ(phase_labels(r, 0), expected);
  EXPECT_EQ(phase_labels(r, 1), expected);
  // The step's first instants, before Adam's first op on a gradient, stay
  // forward; after backward the guess is an optimizer step (none came).
  EXPECT_EQ(phase_labels(r, 2), (std::vector<std::string>{"forward", "optimizer step (Adam)", "forward", "backward",
                                                          "optimizer step"}));
  const int64_t params = storage_bytes(mlp->parameters());
  EXPECT_EQ(trainmem::testing::bucket_bytes_of(r, Category::kOptimizerState), 2 * params);
}
