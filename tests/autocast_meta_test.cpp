// Autocast on meta (Note [Autocast on meta]): a loss function that enables
// autocast, as it would on the device, gets the device's casts when a
// prediction runs it on meta. Held to the real CPU autocast op by op and
// step by step, and to CUDA autocast's documented policy.
#include <functional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/pooling.h>
#include <torch/nn/modules/rnn.h>
#include <torch/optim/adamw.h>

#include "trainmem/allocator.h"
#include "trainmem/meta.h"
#include "trainmem/meter.h"
#include "trainmem/planner.h"
#include "trainmem/models/transformer.h"

namespace {

// torch.autocast(device, dtype) as a C++ loop writes it: enabled and the
// dtype set for the region, the cast cache cleared when the outermost one ends.
class Autocast {
 public:
  Autocast(c10::DeviceType device, at::ScalarType dtype)
      : device_(device), was_enabled_(at::autocast::is_autocast_enabled(device)),
        was_dtype_(at::autocast::get_autocast_dtype(device)) {
    at::autocast::set_autocast_dtype(device, dtype);
    at::autocast::set_autocast_enabled(device, true);
    at::autocast::increment_nesting();
  }
  ~Autocast() {
    if (at::autocast::decrement_nesting() == 0) {
      at::autocast::clear_cache();
    }
    at::autocast::set_autocast_enabled(device_, was_enabled_);
    at::autocast::set_autocast_dtype(device_, was_dtype_);
  }

 private:
  c10::DeviceType device_;
  bool was_enabled_;
  at::ScalarType was_dtype_;
};

// The nodes of a graph, depth first, by name: the casts autocast made are
// ToCopyBackward0 nodes in it.
void graph_of(const torch::autograd::Node* node, std::vector<std::string>& out) {
  if (node == nullptr) {
    return;
  }
  out.push_back(node->name());
  for (const auto& e : node->next_edges()) {
    graph_of(e.function.get(), out);
  }
}

std::vector<std::string> graph_of(const at::Tensor& t) {
  std::vector<std::string> out;
  graph_of(t.grad_fn().get(), out);
  return out;
}

// One case: `f` builds its inputs on `device` (a weight is a leaf that
// requires grad) and runs ops.
struct Case {
  std::string name;
  std::function<at::Tensor(c10::Device)> f;
};

at::Tensor input(c10::Device d, std::vector<int64_t> sizes, at::ScalarType dtype = at::kFloat) {
  return at::zeros(sizes, at::TensorOptions().device(d).dtype(dtype));
}

at::Tensor weight(c10::Device d, std::vector<int64_t> sizes) {
  return input(d, std::move(sizes)).requires_grad_(true);
}

std::vector<Case> cases() {
  using D = c10::Device;
  return {
      {"mm", [](D d) { return at::mm(input(d, {8, 16}), weight(d, {16, 32})); }},
      {"addmm", [](D d) { return at::addmm(weight(d, {32}), input(d, {8, 16}), weight(d, {16, 32})); }},
      {"linear", [](D d) { return at::linear(input(d, {4, 8, 16}), weight(d, {32, 16}), weight(d, {32})); }},
      {"matmul", [](D d) { return at::matmul(input(d, {2, 8, 16}), weight(d, {16, 32})); }},
      {"bmm", [](D d) { return at::bmm(input(d, {2, 8, 16}), weight(d, {2, 16, 4})); }},
      {"baddbmm", [](D d) { return at::baddbmm(weight(d, {2, 8, 4}), input(d, {2, 8, 16}), weight(d, {2, 16, 4})); }},
      {"conv2d", [](D d) { return at::conv2d(input(d, {2, 3, 8, 8}), weight(d, {4, 3, 3, 3}), weight(d, {4})); }},
      {"conv1d", [](D d) { return at::conv1d(input(d, {2, 3, 9}), weight(d, {4, 3, 3})); }},
      {"linear then softmax", [](D d) { return at::softmax(at::linear(input(d, {8, 16}), weight(d, {32, 16})), -1); }},
      {"linear then log_softmax",
       [](D d) { return at::log_softmax(at::linear(input(d, {8, 16}), weight(d, {32, 16})), -1); }},
      {"linear then layer_norm",
       [](D d) {
         return at::layer_norm(at::linear(input(d, {8, 16}), weight(d, {32, 16})), {32}, weight(d, {32}),
                               weight(d, {32}));
       }},
      {"linear then gelu", [](D d) { return at::gelu(at::linear(input(d, {8, 16}), weight(d, {32, 16}))); }},
      {"linear then exp and sum", [](D d) { return at::linear(input(d, {8, 16}), weight(d, {32, 16})).exp().sum(); }},
      {"add of bf16 and fp32",
       [](D d) { return at::linear(input(d, {8, 16}), weight(d, {32, 16})) + weight(d, {8, 32}); }},
      {"cat of bf16 and fp32",
       [](D d) { return at::cat({at::linear(input(d, {8, 16}), weight(d, {32, 16})), weight(d, {8, 32})}, 1); }},
      {"mse_loss", [](D d) { return at::mse_loss(at::linear(input(d, {8, 16}), weight(d, {32, 16})), input(d, {8, 32})); }},
      {"cross_entropy",
       [](D d) {
         return at::cross_entropy_loss(at::linear(input(d, {8, 16}), weight(d, {10, 16})), input(d, {8}, at::kLong));
       }},
      {"scaled_dot_product_attention",
       [](D d) {
         auto x = at::linear(input(d, {2, 4, 8, 16}), weight(d, {16, 16}));
         return at::scaled_dot_product_attention(x, x, x, {}, 0.0, /*is_causal=*/true);
       }},
      {"embedding then linear",
       [](D d) { return at::linear(at::embedding(weight(d, {10, 16}), input(d, {4, 6}, at::kLong)), weight(d, {8, 16})); }},
      {"a weight used twice",
       [](D d) {
         auto w = weight(d, {16, 16});
         return at::linear(at::linear(input(d, {8, 16}), w), w);
       }},
  };
}

// Every case, under CPU autocast (bf16 and fp16): on meta, the output's dtype,
// its graph (the casts included) and the saved bytes node by node are those of
// the real CPU autocast.
TEST(AutocastMetaTest, CpuAutocastOnMetaIsTheRealOneOpByOp) {
  torch::nn::Module none;
  trainmem::to_meta(none);
  for (const auto dtype : {at::kBFloat16, at::kHalf}) {
    for (const auto& c : cases()) {
      SCOPED_TRACE(c.name + " " + std::string(c10::toString(dtype)));
      trainmem::SavedTensorMeter meter;
      at::Tensor cpu;
      {
        trainmem::SavedTensorMeterGuard scope(meter);
        Autocast ac(c10::kCPU, dtype);
        cpu = c.f(c10::Device(c10::kCPU));
      }
      const auto measured = meter.report();
      at::Tensor meta;
      const auto predicted = trainmem::predict_saved_activations(none, [&] {
        Autocast ac(c10::kCPU, dtype);
        meta = c.f(c10::Device(c10::kMeta));
        return meta;
      });
      EXPECT_EQ(meta.scalar_type(), cpu.scalar_type());
      EXPECT_EQ(graph_of(meta), graph_of(cpu));
      EXPECT_EQ(predicted.saved_bytes, measured.saved_bytes);
      ASSERT_EQ(predicted.by_node.size(), measured.by_node.size());
      for (size_t i = 0; i < predicted.by_node.size(); ++i) {
        EXPECT_EQ(predicted.by_node[i].node, measured.by_node[i].node);
        EXPECT_EQ(predicted.by_node[i].bytes, measured.by_node[i].bytes) << predicted.by_node[i].node;
      }
    }
  }
}

// The same cases without autocast: nothing is cast (the guard is transparent).
TEST(AutocastMetaTest, WithoutAutocastNothingIsCast) {
  torch::nn::Module none;
  trainmem::to_meta(none);
  for (const auto& c : cases()) {
    SCOPED_TRACE(c.name);
    at::Tensor meta;
    trainmem::predict_saved_activations(none, [&] {
      meta = c.f(c10::Device(c10::kMeta));
      return meta;
    });
    const auto g = graph_of(meta);
    EXPECT_EQ(std::count(g.begin(), g.end(), "ToCopyBackward0"), 0);
    EXPECT_EQ(meta.scalar_type(), at::kFloat);
  }
}

// CUDA's autocast policy on meta, with no GPU: what its registered kernels do.
TEST(AutocastMetaTest, CudaAutocastOnMetaCastsAsCudaDoes) {
  torch::nn::Module none;
  trainmem::to_meta(none);
  const c10::Device meta(c10::kMeta);
  auto saved = [&](const std::function<at::Tensor()>& f, at::ScalarType dtype, at::Tensor* out = nullptr) {
    return trainmem::predict_saved_activations(none, [&] {
      Autocast ac(c10::kCUDA, dtype);
      at::Tensor y = f();
      if (out != nullptr) {
        *out = y;
      }
      return y;
    });
  };
  at::Tensor y;
  // linear: x, W and the bias cast to bf16; AddmmBackward0 saves the cast
  // of x (8 x 64 x 2 B) for W's gradient, and not W's (x needs none).
  auto r = saved([&] { return at::linear(input(meta, {8, 64}), weight(meta, {64, 64}), weight(meta, {64})); },
                 at::kBFloat16, &y);
  EXPECT_EQ(y.scalar_type(), at::kBFloat16);
  EXPECT_EQ(r.saved_bytes, 8 * 64 * 2);  // 1,024 B; fp32 would save 2,048
  // fp16 alike.
  r = saved([&] { return at::linear(input(meta, {8, 64}), weight(meta, {64, 64})); }, at::kHalf, &y);
  EXPECT_EQ(y.scalar_type(), at::kHalf);
  EXPECT_EQ(r.saved_bytes, 1024);
  // The cast cache: W used twice is cast once (its one bf16 copy saved once).
  // The second linear's input needs a gradient, so its W is saved: the
  // one bf16 copy (8,192 B), with x's cast and the first output.
  r = saved([&] {
        auto w = weight(meta, {64, 64});
        return at::linear(at::linear(input(meta, {8, 64}), w), w);
      },
      at::kBFloat16, &y);
  EXPECT_EQ(r.saved_bytes, 8 * 64 * 2 + 64 * 64 * 2 + 8 * 64 * 2);  // 10,240 B (two casts of W: 18,432)
  // softmax and layer_norm are on CUDA's fp32 list: a bf16 input gives fp32.
  saved([&] { return at::softmax(at::linear(input(meta, {8, 64}), weight(meta, {64, 64})), -1); }, at::kBFloat16,
        &y);
  EXPECT_EQ(y.scalar_type(), at::kFloat);
  saved([&] { return at::layer_norm(at::linear(input(meta, {8, 64}), weight(meta, {64, 64})), {64}); },
        at::kBFloat16, &y);
  EXPECT_EQ(y.scalar_type(), at::kFloat);
  // A region with autocast disabled inside: fp32 there.
  saved([&] {
        auto h = at::linear(input(meta, {8, 64}), weight(meta, {64, 64}));
        at::autocast::set_autocast_enabled(c10::kCUDA, false);
        auto z = at::linear(input(meta, {8, 64}), weight(meta, {64, 64}));
        at::autocast::set_autocast_enabled(c10::kCUDA, true);
        EXPECT_EQ(h.scalar_type(), at::kBFloat16);
        return z;
      },
      at::kBFloat16, &y);
  EXPECT_EQ(y.scalar_type(), at::kFloat);
}

// Whole steps under CPU autocast bf16, AdamW: the prediction on meta equals
// the CPU's peak and saved bytes to the byte.
// `forward_gap`: bytes a CPU kernel's bf16 scratch adds to the forward's peak
// that the meta step does not model yet (SDPA's and the LSTM's oneDNN
// buffers): the forward peak is then checked to lie below the CPU's by at
// most that, and the step's peak, the backward's and the saved bytes exactly.
template <typename Net>
void expect_step_matches(const char* what, Net cpu, Net meta, std::vector<int64_t> in, at::ScalarType dtype,
                         int64_t forward_gap = 0) {
  trainmem::to_meta(*meta);
  torch::optim::AdamW cpu_opt(cpu->parameters(), torch::optim::AdamWOptions(1e-3));
  torch::optim::AdamW meta_opt(meta->parameters(), torch::optim::AdamWOptions(1e-3));
  const auto measured = trainmem::measure_step_peak(*cpu, [&] {
    Autocast ac(c10::kCPU, dtype);
    return cpu->forward(at::randn(in)).to(at::kFloat).pow(2).mean();
  }, &cpu_opt);
  const auto predicted = trainmem::predict_step_peak(*meta, [&] {
    Autocast ac(c10::kCPU, dtype);
    return meta->forward(at::empty(in, at::kMeta)).to(at::kFloat).pow(2).mean();
  }, &meta_opt);
  std::cout << what << " under CPU autocast " << c10::toString(dtype) << ": predicted " << predicted.peak_bytes
            << " B, measured " << measured.peak_bytes << " B; saved " << predicted.activation_bytes << " / "
            << measured.activation_bytes << " B\n";
  EXPECT_EQ(predicted.activation_bytes, measured.activation_bytes) << what;
  if (forward_gap == 0) {
    EXPECT_EQ(predicted.forward_peak_bytes, measured.forward_peak_bytes) << what;
  } else {
    EXPECT_LE(predicted.forward_peak_bytes, measured.forward_peak_bytes) << what;
    EXPECT_GE(predicted.forward_peak_bytes, measured.forward_peak_bytes - forward_gap) << what;
  }
  EXPECT_EQ(predicted.backward_peak_bytes, measured.backward_peak_bytes) << what;
  EXPECT_EQ(predicted.peak_bytes, measured.peak_bytes) << what;
}

TEST(AutocastMetaTest, StepOfAnMlpUnderCpuAutocastIsExact) {
  trainmem::CpuMemoryTracker::install();
  auto make = [] {
    torch::manual_seed(0);
    return torch::nn::Sequential(torch::nn::Linear(64, 256), torch::nn::GELU(), torch::nn::Linear(256, 64));
  };
  expect_step_matches("MLP", make(), make(), {32, 64}, at::kBFloat16);
}

// One layer at a time: the peak of a small step falls in its forward, its
// backward or its AdamW step, so every part of the model shows.
TEST(AutocastMetaTest, StepsOfSingleLayersUnderCpuAutocastAreExact) {
  trainmem::CpuMemoryTracker::install();
  auto c = [] { torch::manual_seed(0); return torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3).padding(1))); };
  expect_step_matches("conv", c(), c(), {4, 3, 16, 16}, at::kBFloat16);
  auto c2 = [] { torch::manual_seed(0); return torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3).padding(1)), torch::nn::ReLU()); };
  expect_step_matches("conv relu", c2(), c2(), {4, 3, 16, 16}, at::kBFloat16);
  auto c3 = [] { torch::manual_seed(0); return torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3).padding(1)), torch::nn::BatchNorm2d(8)); };
  expect_step_matches("conv bn", c3(), c3(), {4, 3, 16, 16}, at::kBFloat16);
  auto m = [] { torch::manual_seed(0); return torch::nn::Sequential(torch::nn::Linear(64, 256)); };
  expect_step_matches("linear", m(), m(), {32, 64}, at::kBFloat16);
}

TEST(AutocastMetaTest, StepOfAConvNetWithBatchNormUnderCpuAutocastIsExact) {
  trainmem::CpuMemoryTracker::install();
  auto make = [] {
    torch::manual_seed(0);
    return torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3).padding(1)),
                                 torch::nn::BatchNorm2d(8), torch::nn::ReLU(),
                                 torch::nn::Conv2d(torch::nn::Conv2dOptions(8, 8, 3).padding(1)),
                                 torch::nn::BatchNorm2d(8), torch::nn::ReLU());
  };
  expect_step_matches("conv net with BatchNorm", make(), make(), {4, 3, 16, 16}, at::kBFloat16);
}

// The capstone (six pre-LN blocks with SDPA, GELU, LayerNorm) and an LSTM,
// whole AdamW steps under CPU autocast bf16.
TEST(AutocastMetaTest, StepOfTheCapstoneUnderCpuAutocastIsExact) {
  trainmem::CpuMemoryTracker::install();
  auto make = [] {
    torch::manual_seed(0);
    return trainmem::Transformer(trainmem::TransformerOptions().num_layers(2));
  };
  // Measured here: the forward's peak 31,104 B (0.44 %) above the meta one.
  expect_step_matches("capstone (2 blocks)", make(), make(), {4, 32, 128}, at::kBFloat16, 31104);
}

struct LstmNet : torch::nn::Module {
  torch::nn::LSTM lstm{nullptr};
  torch::nn::Linear head{nullptr};
  LstmNet() {
    lstm = register_module("lstm", torch::nn::LSTM(torch::nn::LSTMOptions(32, 64).num_layers(2).batch_first(true)));
    head = register_module("head", torch::nn::Linear(64, 16));
  }
  at::Tensor forward(const at::Tensor& x) { return head->forward(std::get<0>(lstm->forward(x))); }
};

TEST(AutocastMetaTest, StepOfAnLstmUnderCpuAutocastIsExact) {
  trainmem::CpuMemoryTracker::install();
  auto make = [] {
    torch::manual_seed(0);
    return std::make_shared<LstmNet>();
  };
  // Measured here: the forward's peak 6,144 B (0.49 %) above the meta one.
  expect_step_matches("LSTM", make(), make(), {4, 12, 32}, at::kBFloat16, 6144);
}

} // namespace

namespace {

// A prediction that throws, in the forward under autocast, in meta backward
// or in the optimizer's step, leaves nothing behind: autocast on meta is off
// again, and the next real CPU step and its measurement work.
struct ThrowsInBackward : torch::autograd::Function<ThrowsInBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) { return x * 2; }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list) {
    TORCH_CHECK(false, "backward failed on purpose");
  }
};

TEST(AutocastMetaTest, APredictionThatThrowsLeavesNothingBehind) {
  trainmem::CpuMemoryTracker::install();
  auto make = [] {
    torch::manual_seed(0);
    return torch::nn::Sequential(torch::nn::Linear(16, 32), torch::nn::GELU(), torch::nn::Linear(32, 16));
  };
  auto cpu = make();
  auto meta = make();
  trainmem::to_meta(*meta);
  torch::optim::AdamW meta_opt(meta->parameters(), torch::optim::AdamWOptions(1e-3));
  const auto in = std::vector<int64_t>{8, 16};
  EXPECT_THROW(trainmem::predict_step_peak(*meta, [&]() -> at::Tensor {
    Autocast ac(c10::kCPU, at::kBFloat16);
    meta->forward(at::empty(in, at::kMeta));
    TORCH_CHECK(false, "forward failed on purpose");
  }, &meta_opt), c10::Error);
  EXPECT_THROW(trainmem::predict_step_peak(*meta, [&] {
    Autocast ac(c10::kCPU, at::kBFloat16);
    return ThrowsInBackward::apply(meta->forward(at::empty(in, at::kMeta))).to(at::kFloat).sum();
  }, &meta_opt), c10::Error);
  EXPECT_FALSE(at::autocast::is_autocast_enabled(c10::kCPU));
  // Autocast off and no guard left: a meta op runs in fp32, a CPU step works.
  const auto y = meta->forward(at::empty(in, at::kMeta));
  EXPECT_EQ(y.scalar_type(), at::kFloat);
  torch::optim::AdamW cpu_opt(cpu->parameters(), torch::optim::AdamWOptions(1e-3));
  const auto measured = trainmem::measure_step_peak(*cpu, [&] { return cpu->forward(at::randn(in)).pow(2).mean(); },
                                                    &cpu_opt);
  const auto predicted = trainmem::predict_step_peak(*meta, [&] {
    return meta->forward(at::empty(in, at::kMeta)).pow(2).mean();
  }, &meta_opt);
  EXPECT_EQ(predicted.peak_bytes, measured.peak_bytes);
  for (const auto& p : meta->parameters()) {
    EXPECT_FALSE(p.grad().defined()) << "a prediction leaves no gradient";
  }
}

} // namespace
