#include "app/variants.h"
#include "trainmem/meta.h"

#include <cstdio>
#include <filesystem>
#include <sstream>
#include <thread>

#include <unistd.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/modules/pooling.h>
#include <torch/nn/modules/rnn.h>
#include <torch/nn/utils/rnn.h>
#include <torch/nn/options/normalization.h>
#include <torch/script.h>
#include <torch/serialize.h>

#include "trainmem/accountant.h"
#include "trainmem/allocator.h"
#include "trainmem/checkpoint.h"
#include "trainmem/meter.h"
#include "trainmem/selective.h"
#include "trainmem/models/transformer.h"
#include "support/mnist_net.h"

namespace {

using trainmem::testing::MnistNet;
using trainmem::testing::MnistNetImpl;

std::vector<at::Tensor> tensors_of(torch::nn::Module& m) {
  auto out = m.parameters();
  for (const auto& b : m.buffers()) out.push_back(b);
  return out;
}

std::vector<const c10::TensorImpl*> impls_of(torch::nn::Module& m) {
  std::vector<const c10::TensorImpl*> out;
  for (const auto& t : tensors_of(m)) out.push_back(t.unsafeGetTensorImpl());
  return out;
}

int64_t largest_tensor_bytes(torch::nn::Module& m) {
  int64_t largest = 0;
  for (const auto& t : tensors_of(m)) largest = std::max<int64_t>(largest, t.nbytes());
  return largest;
}

// Factory ops have no tensor argument to take a dispatch key from: this checks
// that they still reach the interceptor when its key is in the TLS set, for
// every device they name.
TEST(MetaTest, FactoryOpsWithoutTensorArgumentsLandOnMeta) {
  const auto cpu = at::TensorOptions().device(at::kCPU);
  std::vector<std::pair<std::string, std::function<at::Tensor()>>> factories = {
      {"empty", [&] { return at::empty({3, 4}, cpu); }},
      {"empty_strided", [&] { return at::empty_strided({3, 4}, {1, 3}, cpu); }},
      {"zeros", [&] { return at::zeros({3, 4}, cpu); }},
      {"ones", [&] { return at::ones({3, 4}, cpu); }},
      {"full", [&] { return at::full({3, 4}, 2.5, cpu); }},
      {"rand", [&] { return at::rand({3, 4}, cpu); }},
      {"randn", [&] { return at::randn({3, 4}, cpu); }},
      {"randint", [&] { return at::randint(10, {3, 4}, cpu.dtype(at::kLong)); }},
      {"randperm", [&] { return at::randperm(12, cpu.dtype(at::kLong)); }},
      {"arange", [&] { return at::arange(12, cpu); }},
      {"linspace", [&] { return at::linspace(0, 1, 12, cpu); }},
      {"eye", [&] { return at::eye(4, cpu); }},
      {"scalar_tensor", [&] { return at::scalar_tensor(3.0, cpu); }},
      {"torch::empty", [] { return torch::empty({3, 4}); }},
      {"torch::randn requires_grad", [] { return torch::randn({3, 4}, torch::requires_grad()); }},
      {"pinned empty", [&] { return at::empty({3, 4}, cpu.pinned_memory(true)); }},
  };
  auto& tracker = trainmem::CpuMemoryTracker::install();
  const auto before = tracker.stats();
  {
    trainmem::MetaInitGuard meta;
    for (const auto& [name, make] : factories) {
      auto t = make();
      EXPECT_TRUE(t.is_meta()) << name << " landed on " << t.device();
    }
    auto g = torch::randn({3, 4}, torch::requires_grad());
    EXPECT_TRUE(g.requires_grad());
    EXPECT_EQ(g.sizes(), (std::vector<int64_t>{3, 4}));
  }
  EXPECT_EQ(tracker.stats().num_allocs - before.num_allocs, 0);
  EXPECT_TRUE(at::zeros({2}).is_cpu());  // the guard is gone
}

TEST(MetaTest, OpsOnRealTensorsStayReal) {
  auto x = torch::ones({4});
  trainmem::MetaInitGuard meta;
  auto y = x * 2 + x;  // not a factory: runs on CPU
  EXPECT_TRUE(y.is_cpu());
  EXPECT_EQ(y.sum().item<float>(), 12.0f);
  EXPECT_TRUE(at::empty_like(x).is_cpu());  // follows its input, not a factory
}

TEST(MetaTest, GuardIsThreadLocal) {
  trainmem::MetaInitGuard meta;
  EXPECT_TRUE(at::zeros({2}).is_meta());
  bool other_is_cpu = false;
  std::thread([&] { other_is_cpu = at::zeros({2}).is_cpu(); }).join();
  EXPECT_TRUE(other_is_cpu);
}

TEST(MetaTest, NestedGuardsRestoreInOrder) {
  {
    trainmem::MetaInitGuard outer;
    {
      trainmem::MetaInitGuard inner;
      EXPECT_TRUE(at::zeros({2}).is_meta());
    }
    EXPECT_TRUE(at::zeros({2}).is_meta());
  }
  EXPECT_TRUE(at::zeros({2}).is_cpu());
}

// A module built on meta never allocates.
TEST(MetaTest, BuildsLibTorchModulesWithoutAllocating) {
  auto& tracker = trainmem::CpuMemoryTracker::install();
  const auto before = tracker.stats();
  torch::nn::Linear lin{nullptr};
  torch::nn::Sequential mixed{nullptr};
  {
    trainmem::MetaInitGuard meta;
    lin = torch::nn::Linear(1000, 1000);
    mixed = torch::nn::Sequential(
        torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 16, 3)), torch::nn::BatchNorm2d(16),
        torch::nn::Embedding(100, 8),
        torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})));
  }
  const auto after = tracker.stats();
  EXPECT_EQ(after.num_allocs - before.num_allocs, 0);
  EXPECT_EQ(after.allocated_bytes - before.allocated_bytes, 0);
  EXPECT_TRUE(lin->weight.is_meta());
  EXPECT_EQ(lin->weight.data_ptr(), nullptr);
  EXPECT_TRUE(lin->weight.requires_grad());
  EXPECT_EQ(trainmem::account(*lin).param_bytes, 4004000);
  for (const auto& t : tensors_of(*mixed)) EXPECT_TRUE(t.is_meta());
  // conv 16*3*3*3 + 16, bn 16 + 16, embedding 100*8, layernorm 8 + 8
  EXPECT_EQ(trainmem::account(*mixed).num_params, 448 + 32 + 800 + 16);
}

// materialize() gives the same tensors (identity) the same values a CPU
// construction gives after the same seed: a meta construction draws nothing.
TEST(MetaTest, MaterializeMatchesCpuConstructionAndKeepsIdentity) {
  const auto opts = trainmem::TransformerOptions().num_layers(2).d_model(32).num_heads(4);
  torch::manual_seed(7);
  trainmem::Transformer reference(opts);
  torch::manual_seed(7);
  trainmem::Transformer model{nullptr};
  {
    trainmem::MetaInitGuard meta;
    model = trainmem::Transformer(opts);
  }
  const auto impls = impls_of(*model);
  auto& tracker = trainmem::CpuMemoryTracker::install();
  const auto before = tracker.stats();
  trainmem::to_empty(*model, at::kCPU);
  EXPECT_EQ(tracker.stats().allocated_bytes - before.allocated_bytes,
            trainmem::account(*reference).param_bytes);
  torch::manual_seed(7);
  trainmem::materialize(*model, at::kCPU);  // to_empty again is a no-op
  EXPECT_EQ(impls_of(*model), impls);
  const auto a = model->parameters();
  const auto b = reference->parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(a[i].is_cpu());
    EXPECT_TRUE(a[i].requires_grad());
  }
  EXPECT_EQ(trainmem::max_abs_diff(a, b), 0.0);
  // It trains: a backward reaches every parameter.
  model->forward(torch::randn({2, 5, 32})).pow(2).mean().backward();
  for (const auto& p : model->parameters()) EXPECT_TRUE(p.grad().defined());
}

struct TiedViews : torch::nn::Module {
  TiedViews() {
    auto flat = torch::empty({10});
    a = register_parameter("a", flat.narrow(0, 0, 4));
    b = register_parameter("b", flat.narrow(0, 4, 6));
  }
  at::Tensor a, b;
};

TEST(MetaTest, ToEmptyKeepsSharedStoragesShared) {
  std::shared_ptr<TiedViews> m;
  {
    trainmem::MetaInitGuard meta;
    m = std::make_shared<TiedViews>();
  }
  ASSERT_TRUE(m->a.is_meta());
  trainmem::to_empty(*m, at::kCPU);
  EXPECT_TRUE(m->a.is_cpu());
  EXPECT_EQ(m->a.storage().unsafeGetStorageImpl(), m->b.storage().unsafeGetStorageImpl());
  EXPECT_EQ(m->a.storage().nbytes(), 40u);
  EXPECT_EQ(m->b.storage_offset(), 4);
}

struct OwnParameter : torch::nn::Module {
  OwnParameter() { w = register_parameter("w", torch::randn({3})); }
  at::Tensor w;
};

// Moved to meta, not built there: there is no construction to replay (Note
// [Init replayed on materialize]).
TEST(MetaTest, MaterializeNamesModulesItCannotInitialize) {
  auto m = std::make_shared<OwnParameter>();
  trainmem::to_meta(*m);
  try {
    trainmem::materialize(*m, at::kCPU);
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("OwnParameter"), std::string::npos) << e.what();
  }
  trainmem::materialize(*m, at::kCPU, [](torch::nn::Module& mod) {
    if (auto* own = dynamic_cast<OwnParameter*>(&mod)) {
      own->w.fill_(3.0);
      return true;
    }
    return false;
  });
  EXPECT_EQ(m->w.sum().item<float>(), 9.0f);
}

TEST(MetaTest, MaterializeUnderTheGuardIsAnError) {
  trainmem::MetaInitGuard meta;
  torch::nn::Linear lin(2, 2);
  EXPECT_THROW(trainmem::materialize(*lin, at::kCPU), c10::Error);
}

// A checkpoint loads into a meta-built model one tensor at a time: the peak
// stays at the model's bytes plus at most the largest tensor, never two copies.
TEST(MetaTest, LoadsACheckpointWithoutTwoCopies) {
  const auto opts = trainmem::TransformerOptions().num_layers(4).d_model(128).num_heads(4);
  torch::manual_seed(3);
  trainmem::Transformer saved(opts);
  const auto path = (std::filesystem::temp_directory_path() /
                     ("trainmem_meta_test_" + std::to_string(::getpid()) + ".pt"))
                        .string();
  torch::save(saved, path);
  const int64_t model_bytes = trainmem::account(*saved).param_bytes;
  const int64_t largest = largest_tensor_bytes(*saved);

  trainmem::Transformer model{nullptr};
  {
    trainmem::MetaInitGuard meta;
    model = trainmem::Transformer(opts);
  }
  const auto impls = impls_of(*model);
  auto& tracker = trainmem::CpuMemoryTracker::install();
  const int64_t start = tracker.stats().allocated_bytes;
  trainmem::LoadReport report;
  int64_t peak_above = 0;
  {
    trainmem::PeakWindow window(tracker);
    {
      torch::serialize::InputArchive archive;
      archive.load_from(path);
      report = trainmem::load_into(*model, trainmem::archive_source(archive), at::kCPU);
    }
    peak_above = window.peak_bytes() - start;
  }
  std::remove(path.c_str());
  std::printf("load: peak %lld B above the start, model %lld B, largest tensor %lld B\n",
              static_cast<long long>(peak_above), static_cast<long long>(model_bytes),
              static_cast<long long>(largest));
  EXPECT_LE(peak_above, model_bytes + largest) << "model " << model_bytes << " largest " << largest;
  EXPECT_EQ(tracker.stats().allocated_bytes - start, model_bytes);
  EXPECT_EQ(report.num_loaded, 4 * 12);
  EXPECT_EQ(report.num_adopted, 4 * 12);
  EXPECT_EQ(report.loaded_bytes, model_bytes);
  EXPECT_TRUE(report.missing.empty());
  EXPECT_EQ(impls_of(*model), impls);
  EXPECT_EQ(trainmem::max_abs_diff(model->parameters(), saved->parameters()), 0.0);
}

// A source that converts (here fp64 -> fp32) holds at most one source tensor
// and its converted copy at a time.
TEST(MetaTest, LoadConvertsOneTensorAtATime) {
  const auto opts = trainmem::TransformerOptions().num_layers(2).d_model(128).num_heads(4);
  trainmem::Transformer model{nullptr};
  {
    trainmem::MetaInitGuard meta;
    model = trainmem::Transformer(opts);
  }
  const int64_t model_bytes = trainmem::account(*model).param_bytes;
  const int64_t largest = largest_tensor_bytes(*model);
  auto& tracker = trainmem::CpuMemoryTracker::install();
  const int64_t start = tracker.stats().allocated_bytes;
  trainmem::PeakWindow window(tracker);
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& p : model->named_parameters()) shapes[p.key()] = p.value().sizes().vec();
  auto report = trainmem::load_into(*model, [&](const std::string& name) {
    return torch::full(shapes.at(name), 0.5, torch::kFloat64);
  }, at::kCPU);
  const int64_t peak_above = window.peak_bytes() - start;
  std::printf("convert: peak %lld B above the start, model %lld B, largest fp32 tensor %lld B\n",
              static_cast<long long>(peak_above), static_cast<long long>(model_bytes),
              static_cast<long long>(largest));
  EXPECT_EQ(report.num_copied, 2 * 12);
  EXPECT_LE(peak_above, model_bytes + 2 * largest);  // the largest tensor's fp64 source
  EXPECT_EQ(tracker.stats().allocated_bytes - start, model_bytes);
  for (const auto& p : model->parameters()) {
    EXPECT_EQ(p.scalar_type(), at::kFloat);
    EXPECT_EQ(p.max().item<float>(), 0.5f);
  }
}

TEST(MetaTest, LoadReportsMissingNamesAndShapeMismatches) {
  torch::nn::Linear lin{nullptr};
  {
    trainmem::MetaInitGuard meta;
    lin = torch::nn::Linear(3, 2);
  }
  auto only_weight = [](const std::string& name) {
    return name == "weight" ? torch::ones({2, 3}) : at::Tensor();
  };
  try {
    trainmem::load_into(*lin, only_weight, at::kCPU);
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("no tensor for 1 names (bias)"), std::string::npos) << e.what();
  }
  auto r = trainmem::load_into(*lin, only_weight, at::kCPU, /*strict=*/false);
  EXPECT_EQ(r.missing, std::vector<std::string>{"bias"});
  auto wrong = [](const std::string&) { return torch::ones({5}); };
  try {
    trainmem::load_into(*lin, wrong, at::kCPU);
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("weight has shape [2, 3]"), std::string::npos) << e.what();
  }
}

// The one interceptor serves both features at once: a selective region inside
// a meta guard caches matmuls, and factory ops inside it still land on meta.
// A TorchScript encoder (image captioning's): torch::jit::load cannot build
// under the guard (it reads storages on CPU), and the guard says what to do;
// loaded with a meta device it runs on meta and saves what the CPU saves; a
// CPU-loaded one meeting a meta input is named as not on meta.
TEST(MetaTest, TorchScriptLoadsOntoMetaAndTheGuardSaysHow) {
  torch::manual_seed(0);
  torch::jit::Module enc("Encoder");
  enc.register_parameter("w", torch::randn({8, 3, 3, 3}), /*is_buffer=*/false);
  enc.register_parameter("b", torch::randn({8}), false);
  enc.define(R"(
    def forward(self, x):
        return torch.relu(torch.conv2d(x, self.w, self.b)).flatten(1)
  )");
  const auto path = (std::filesystem::temp_directory_path() / ("trainmem_enc_" + std::to_string(::getpid()) + ".pt")).string();
  enc.save(path);
  try {
    trainmem::MetaInitGuard guard;
    torch::jit::load(path);
    ADD_FAILURE() << "torch::jit::load under the guard did not throw";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("torch::jit::load(path, c10::Device(c10::kMeta))"), std::string::npos)
        << e.what();
  }
  auto saved_on = [&](c10::Device device) {
    auto m = torch::jit::load(path, device);
    for (const auto& p : m.parameters()) EXPECT_EQ(p.device(), device);
    auto x = device.is_meta() ? at::empty({2, 3, 10, 10}, at::kMeta).requires_grad_()
                              : at::randn({2, 3, 10, 10}).requires_grad_();
    trainmem::SavedTensorMeter meter;
    at::Tensor y;
    {
      trainmem::SavedTensorMeterGuard scope(meter);
      y = m.forward({x}).toTensor();
    }
    EXPECT_EQ(y.sizes(), at::IntArrayRef({2, 8 * 8 * 8}));
    return meter.report().saved_bytes;
  };
  const int64_t cpu = saved_on(at::kCPU);
  EXPECT_EQ(saved_on(at::kMeta), cpu);
  EXPECT_GT(cpu, 2 * 8 * 8 * 8 * 4);  // at least relu's output
  auto on_cpu = torch::jit::load(path);
  try {
    trainmem::find_missing_meta_kernel([&] { on_cpu.forward({at::empty({2, 3, 10, 10}, at::kMeta)}); });
    ADD_FAILURE() << "a CPU module on a meta input ran";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("the module is not on the meta device"), std::string::npos) << e.what();
  }
  std::filesystem::remove(path);
}

TEST(MetaTest, SelectiveRegionInsideTheGuardComposes) {
  auto stats = std::make_shared<trainmem::SelectiveCheckpointStats>();
  auto opts = trainmem::CheckpointOptions().context_fn(
      trainmem::create_selective_checkpoint_contexts(trainmem::save_matmuls_policy(), stats));
  trainmem::MetaInitGuard meta;
  auto w = torch::randn({8, 8}, torch::requires_grad());
  auto x = torch::randn({4, 8}, torch::requires_grad());
  ASSERT_TRUE(w.is_meta());
  at::Tensor made;
  auto y = trainmem::checkpoint([&](const at::Tensor& in) {
    made = at::ones({4, 8});
    return at::mm(in, w).relu() + made;
  }, x, opts);
  EXPECT_TRUE(made.is_meta());
  EXPECT_TRUE(y.is_meta());
  EXPECT_EQ(stats->op("aten::mm.default").num_cached, 1);
  EXPECT_EQ(stats->op("aten::ones.default").num_forward, 1);
}

// ---------------------------------------------------------------------------
// Meta kernels for conv nets: each module's forward and backward on meta
// saves exactly what the CPU's saves, and its outputs and gradients have the
// CPU's sizes, strides and dtypes (Note [Meta kernels for conv nets]).

std::string layout_of(const at::Tensor& t) {
  if (!t.defined()) return "undefined";
  std::ostringstream os;
  os << t.sizes() << " strides " << t.strides() << " " << t.scalar_type();
  return os.str();
}

// What one forward (under a meter) and backward (torch::autograd::grad, so the
// gradients are the ops' own, not AccumulateGrad's copies) produced.
struct Trace {
  trainmem::SavedTensorReport saved;
  std::vector<std::string> outputs;
  std::vector<std::string> grads;
};

using MakeModule = std::function<std::shared_ptr<torch::nn::Module>()>;
// Inputs on `device`; the float ones require grad.
using MakeInputs = std::function<std::vector<at::Tensor>(c10::Device)>;
using Forward = std::function<std::vector<at::Tensor>(torch::nn::Module&, const std::vector<at::Tensor>&)>;

Trace trace(torch::nn::Module& m, c10::Device device, const MakeInputs& make_inputs,
            const Forward& forward) {
  Trace r;
  auto inputs = make_inputs(device);
  trainmem::SavedTensorMeter meter(m);
  std::vector<at::Tensor> outs;
  {
    trainmem::SavedTensorMeterGuard scope(meter);
    outs = forward(m, inputs);
  }
  r.saved = meter.report();
  for (const auto& o : outs) r.outputs.push_back(layout_of(o));
  std::vector<at::Tensor> wrt;
  for (const auto& i : inputs) {
    if (i.requires_grad()) wrt.push_back(i);
  }
  for (const auto& p : m.parameters()) {
    if (p.requires_grad()) wrt.push_back(p);
  }
  auto grads = torch::autograd::grad({outs[0]}, wrt, {at::ones_like(outs[0])},
                                     /*retain_graph=*/false, /*create_graph=*/false,
                                     /*allow_unused=*/true);
  for (const auto& g : grads) r.grads.push_back(layout_of(g));
  return r;
}

std::string by_node_of(const trainmem::SavedTensorReport& r) {
  std::string s;
  for (const auto& n : r.by_node) {
    s += n.node + " " + std::to_string(n.bytes) + " B / " + std::to_string(n.num_tensors) + "; ";
  }
  return s;
}

// Runs the same module (built on CPU, and built on meta with nothing
// allocated) on CPU and on meta; returns the CPU's saved bytes.
int64_t expect_meta_matches_cpu(const std::string& name, const MakeModule& make,
                                const MakeInputs& inputs, const Forward& forward,
                                bool eval = false) {
  SCOPED_TRACE(name);
  torch::manual_seed(0);
  auto cpu = make();
  std::shared_ptr<torch::nn::Module> meta;
  {
    trainmem::MetaInitGuard guard;
    meta = make();
  }
  for (const auto& p : meta->parameters()) EXPECT_TRUE(p.is_meta());
  if (eval) {
    cpu->eval();
    meta->eval();
  }
  const auto c = trace(*cpu, at::kCPU, inputs, forward);
  const auto m = trace(*meta, at::kMeta, inputs, forward);
  EXPECT_EQ(m.saved.saved_bytes, c.saved.saved_bytes) << "meta " << by_node_of(m.saved) << "\ncpu " << by_node_of(c.saved);
  EXPECT_EQ(m.saved.num_tensors, c.saved.num_tensors);
  EXPECT_EQ(m.saved.num_storages, c.saved.num_storages);
  EXPECT_EQ(by_node_of(m.saved), by_node_of(c.saved));
  EXPECT_EQ(m.outputs, c.outputs);
  EXPECT_EQ(m.grads, c.grads);
  EXPECT_GT(c.saved.num_tensors, 0);
  std::printf("%-28s saved %lld B on CPU and on meta\n", name.c_str(),
              static_cast<long long>(c.saved.saved_bytes));
  return c.saved.saved_bytes;
}

at::Tensor float_input(c10::Device device, std::vector<int64_t> sizes,
                       at::MemoryFormat format = at::MemoryFormat::Contiguous) {
  auto opts = at::TensorOptions().device(device);
  auto t = device.is_meta() ? at::empty(sizes, opts.memory_format(format))
                            : at::randn(sizes, opts).contiguous(format);
  return t.requires_grad_();
}

at::Tensor index_input(c10::Device device, std::vector<int64_t> sizes, int64_t high) {
  auto opts = at::TensorOptions().device(device).dtype(at::kLong);
  return device.is_meta() ? at::empty(sizes, opts) : at::randint(high, sizes, opts);
}

template <typename M>
MakeModule module_of(std::function<M()> make) {
  return [make] { return make().ptr(); };
}

MakeInputs one_input(std::vector<int64_t> sizes, at::MemoryFormat format = at::MemoryFormat::Contiguous) {
  return [=](c10::Device d) { return std::vector<at::Tensor>{float_input(d, sizes, format)}; };
}

template <typename Impl>
Forward forward_of() {
  return [](torch::nn::Module& m, const std::vector<at::Tensor>& in) {
    return std::vector<at::Tensor>{dynamic_cast<Impl&>(m).forward(in[0])};
  };
}

TEST(MetaKernelTest, ConvolutionMatchesCpu) {
  using namespace torch::nn;
  expect_meta_matches_cpu("conv1d", module_of<Conv1d>([] { return Conv1d(Conv1dOptions(3, 4, 3)); }),
                          one_input({2, 3, 10}), forward_of<Conv1dImpl>());
  expect_meta_matches_cpu(
      "conv2d stride 2 pad 1",
      module_of<Conv2d>([] { return Conv2d(Conv2dOptions(3, 8, 3).stride(2).padding(1)); }),
      one_input({2, 3, 16, 16}), forward_of<Conv2dImpl>());
  expect_meta_matches_cpu(
      "conv2d dilated no bias",
      module_of<Conv2d>([] { return Conv2d(Conv2dOptions(3, 8, 3).dilation(2).bias(false)); }),
      one_input({2, 3, 16, 16}), forward_of<Conv2dImpl>());
  expect_meta_matches_cpu(
      "conv2d groups 2",
      module_of<Conv2d>([] { return Conv2d(Conv2dOptions(4, 6, 3).groups(2)); }),
      one_input({2, 4, 9, 9}), forward_of<Conv2dImpl>());
  expect_meta_matches_cpu(
      "conv2d depthwise",
      module_of<Conv2d>([] { return Conv2d(Conv2dOptions(4, 4, 3).groups(4).padding(1)); }),
      one_input({2, 4, 9, 9}), forward_of<Conv2dImpl>());
  expect_meta_matches_cpu("conv2d 1x1",
                          module_of<Conv2d>([] { return Conv2d(Conv2dOptions(3, 5, 1)); }),
                          one_input({1, 3, 7, 7}), forward_of<Conv2dImpl>());
  expect_meta_matches_cpu(
      "conv2d channels-last",
      module_of<Conv2d>([] { return Conv2d(Conv2dOptions(3, 8, 3)); }),
      one_input({2, 3, 10, 10}, at::MemoryFormat::ChannelsLast), forward_of<Conv2dImpl>());
  expect_meta_matches_cpu(
      "conv2d padding same",
      module_of<Conv2d>([] { return Conv2d(Conv2dOptions(3, 4, 4).padding(torch::kSame)); }),
      one_input({2, 3, 8, 8}), forward_of<Conv2dImpl>());
  expect_meta_matches_cpu("conv3d", module_of<Conv3d>([] { return Conv3d(Conv3dOptions(2, 4, 3)); }),
                          one_input({2, 2, 6, 6, 6}), forward_of<Conv3dImpl>());
  expect_meta_matches_cpu(
      "conv3d channels-last",
      module_of<Conv3d>([] { return Conv3d(Conv3dOptions(2, 4, 3).stride(2)); }),
      one_input({2, 2, 7, 7, 7}, at::MemoryFormat::ChannelsLast3d), forward_of<Conv3dImpl>());
}

TEST(MetaKernelTest, TransposedConvolutionMatchesCpu) {
  using namespace torch::nn;
  auto fwd1 = [](torch::nn::Module& m, const std::vector<at::Tensor>& in) {
    return std::vector<at::Tensor>{dynamic_cast<ConvTranspose1dImpl&>(m).forward(in[0])};
  };
  auto fwd2 = [](torch::nn::Module& m, const std::vector<at::Tensor>& in) {
    return std::vector<at::Tensor>{dynamic_cast<ConvTranspose2dImpl&>(m).forward(in[0])};
  };
  auto fwd3 = [](torch::nn::Module& m, const std::vector<at::Tensor>& in) {
    return std::vector<at::Tensor>{dynamic_cast<ConvTranspose3dImpl&>(m).forward(in[0])};
  };
  expect_meta_matches_cpu(
      "conv_transpose1d",
      module_of<ConvTranspose1d>([] { return ConvTranspose1d(ConvTranspose1dOptions(4, 3, 3).stride(2)); }),
      one_input({2, 4, 7}), fwd1);
  expect_meta_matches_cpu(
      "conv_transpose2d groups 2",
      module_of<ConvTranspose2d>([] {
        return ConvTranspose2d(
            ConvTranspose2dOptions(4, 6, 3).stride(2).groups(2).padding(1).output_padding(1));
      }),
      one_input({2, 4, 5, 5}), fwd2);
  expect_meta_matches_cpu(
      "conv_transpose2d dcgan",
      module_of<ConvTranspose2d>([] {
        return ConvTranspose2d(ConvTranspose2dOptions(16, 8, 4).stride(2).padding(1).bias(false));
      }),
      one_input({3, 16, 4, 4}), fwd2);
  expect_meta_matches_cpu(
      "conv_transpose3d",
      module_of<ConvTranspose3d>([] { return ConvTranspose3d(ConvTranspose3dOptions(2, 3, 2).stride(2)); }),
      one_input({1, 2, 3, 3, 3}), fwd3);
}

TEST(MetaKernelTest, BatchNormMatchesCpuInTrainingAndEval) {
  using namespace torch::nn;
  for (bool eval : {false, true}) {
    const std::string mode = eval ? " eval" : " train";
    expect_meta_matches_cpu("batch_norm1d (N, C)" + mode,
                            module_of<BatchNorm1d>([] { return BatchNorm1d(6); }),
                            one_input({8, 6}), forward_of<BatchNorm1dImpl>(), eval);
    expect_meta_matches_cpu("batch_norm1d (N, C, L)" + mode,
                            module_of<BatchNorm1d>([] { return BatchNorm1d(6); }),
                            one_input({4, 6, 5}), forward_of<BatchNorm1dImpl>(), eval);
    expect_meta_matches_cpu("batch_norm2d" + mode,
                            module_of<BatchNorm2d>([] { return BatchNorm2d(3); }),
                            one_input({2, 3, 5, 5}), forward_of<BatchNorm2dImpl>(), eval);
    expect_meta_matches_cpu("batch_norm2d channels-last" + mode,
                            module_of<BatchNorm2d>([] { return BatchNorm2d(3); }),
                            one_input({2, 3, 5, 5}, at::MemoryFormat::ChannelsLast),
                            forward_of<BatchNorm2dImpl>(), eval);
    expect_meta_matches_cpu(
        "batch_norm2d no affine" + mode,
        module_of<BatchNorm2d>([] { return BatchNorm2d(BatchNormOptions(3).affine(false)); }),
        one_input({2, 3, 5, 5}), forward_of<BatchNorm2dImpl>(), eval);
    expect_meta_matches_cpu("batch_norm3d" + mode,
                            module_of<BatchNorm3d>([] { return BatchNorm3d(2); }),
                            one_input({2, 2, 3, 3, 3}), forward_of<BatchNorm3dImpl>(), eval);
  }
}

TEST(MetaKernelTest, PoolingMatchesCpu) {
  using namespace torch::nn;
  auto none = [] { return std::make_shared<torch::nn::Module>(); };
  auto fn = [](std::function<at::Tensor(const at::Tensor&)> f) -> Forward {
    return [f](torch::nn::Module&, const std::vector<at::Tensor>& in) {
      return std::vector<at::Tensor>{f(in[0])};
    };
  };
  namespace F = torch::nn::functional;
  expect_meta_matches_cpu("max_pool1d", none, one_input({2, 3, 9}),
                          fn([](const at::Tensor& x) { return at::max_pool1d(x, {2}); }));
  expect_meta_matches_cpu("max_pool2d", none, one_input({2, 3, 9, 9}),
                          fn([](const at::Tensor& x) { return at::max_pool2d(x, {3, 3}, {2, 2}); }));
  expect_meta_matches_cpu(
      "max_pool2d ceil pad", none, one_input({2, 3, 9, 9}),
      fn([](const at::Tensor& x) { return at::max_pool2d(x, {3, 3}, {2, 2}, {1, 1}, {1, 1}, true); }));
  expect_meta_matches_cpu("max_pool2d channels-last", none,
                          one_input({2, 3, 8, 8}, at::MemoryFormat::ChannelsLast),
                          fn([](const at::Tensor& x) { return at::max_pool2d(x, {2, 2}); }));
  expect_meta_matches_cpu("max_pool3d", none, one_input({2, 3, 5, 5, 5}),
                          fn([](const at::Tensor& x) { return at::max_pool3d(x, {2, 2, 2}); }));
  expect_meta_matches_cpu(
      "max_pool3d ceil pad", none, one_input({1, 2, 5, 6, 7}),
      fn([](const at::Tensor& x) { return at::max_pool3d(x, {3, 3, 3}, {2, 2, 2}, {1, 1, 1}, {1, 1, 1}, true); }));
  expect_meta_matches_cpu("max_pool3d channels-last", none,
                          one_input({2, 3, 4, 4, 4}, at::MemoryFormat::ChannelsLast3d),
                          fn([](const at::Tensor& x) { return at::max_pool3d(x, {2, 2, 2}); }));
  // With indices: the module's forward_with_indices (both outputs compared).
  expect_meta_matches_cpu(
      "max_pool2d with indices", module_of<MaxPool2d>([] { return MaxPool2d(MaxPool2dOptions(2)); }),
      one_input({2, 3, 8, 8}), [](torch::nn::Module& m, const std::vector<at::Tensor>& in) {
        auto [y, i] = dynamic_cast<MaxPool2dImpl&>(m).forward_with_indices(in[0]);
        return std::vector<at::Tensor>{y, i};
      });
  expect_meta_matches_cpu(
      "max_pool3d with indices", module_of<MaxPool3d>([] { return MaxPool3d(MaxPool3dOptions(2)); }),
      one_input({2, 3, 4, 4, 4}), [](torch::nn::Module& m, const std::vector<at::Tensor>& in) {
        auto [y, i] = dynamic_cast<MaxPool3dImpl&>(m).forward_with_indices(in[0]);
        return std::vector<at::Tensor>{y, i};
      });
  expect_meta_matches_cpu("avg_pool1d", none, one_input({2, 3, 9}),
                          fn([](const at::Tensor& x) { return at::avg_pool1d(x, {3}, {2}); }));
  expect_meta_matches_cpu("avg_pool2d", none, one_input({2, 3, 9, 9}),
                          fn([](const at::Tensor& x) { return at::avg_pool2d(x, {3, 3}, {2, 2}, {1, 1}); }));
  expect_meta_matches_cpu("avg_pool3d", none, one_input({2, 3, 4, 4, 4}),
                          fn([](const at::Tensor& x) { return at::avg_pool3d(x, {2, 2, 2}); }));
  expect_meta_matches_cpu("adaptive_avg_pool2d 3x3", none, one_input({2, 3, 8, 8}),
                          fn([](const at::Tensor& x) { return at::adaptive_avg_pool2d(x, {3, 3}); }));
  // 1x1 is a mean (saves nothing): a sigmoid first, so the bytes compared are not all zero.
  expect_meta_matches_cpu(
      "adaptive_avg_pool2d 1x1", none, one_input({2, 3, 8, 8}),
      fn([](const at::Tensor& x) { return at::adaptive_avg_pool2d(x.sigmoid(), {1, 1}); }));
  expect_meta_matches_cpu("adaptive_avg_pool3d", none, one_input({2, 3, 4, 4, 4}),
                          fn([](const at::Tensor& x) { return at::adaptive_avg_pool3d(x, {2, 3, 2}); }));
  expect_meta_matches_cpu(
      "adaptive_max_pool2d", none, one_input({2, 3, 8, 8}),
      fn([](const at::Tensor& x) { return std::get<0>(at::adaptive_max_pool2d(x, {3, 3})); }));
}

TEST(MetaKernelTest, DropoutEmbeddingAndLossesMatchCpu) {
  using namespace torch::nn;
  namespace F = torch::nn::functional;
  expect_meta_matches_cpu("dropout", module_of<Dropout>([] { return Dropout(0.5); }),
                          one_input({4, 16}), forward_of<DropoutImpl>());
  expect_meta_matches_cpu("dropout2d", module_of<Dropout2d>([] { return Dropout2d(0.25); }),
                          one_input({2, 4, 5, 5}), forward_of<Dropout2dImpl>());
  expect_meta_matches_cpu("dropout eval", module_of<Dropout>([] { return Dropout(0.5); }),
                          [](c10::Device d) {  // something must be saved: a relu first
                            return std::vector<at::Tensor>{float_input(d, {4, 16})};
                          },
                          [](torch::nn::Module& m, const std::vector<at::Tensor>& in) {
                            return std::vector<at::Tensor>{dynamic_cast<DropoutImpl&>(m).forward(in[0].relu())};
                          },
                          /*eval=*/true);
  expect_meta_matches_cpu(
      "embedding", module_of<Embedding>([] { return Embedding(100, 16); }),
      [](c10::Device d) { return std::vector<at::Tensor>{index_input(d, {2, 5}, 100)}; },
      [](torch::nn::Module& m, const std::vector<at::Tensor>& in) {
        return std::vector<at::Tensor>{dynamic_cast<EmbeddingImpl&>(m).forward(in[0]).tanh()};
      });
  auto logits_and_target = [](std::vector<int64_t> logits, std::vector<int64_t> target) -> MakeInputs {
    return [=](c10::Device d) {
      return std::vector<at::Tensor>{float_input(d, logits), index_input(d, target, logits[1])};
    };
  };
  auto none = [] { return std::make_shared<torch::nn::Module>(); };
  auto loss = [](std::function<at::Tensor(const at::Tensor&, const at::Tensor&)> f) -> Forward {
    return [f](torch::nn::Module&, const std::vector<at::Tensor>& in) {
      return std::vector<at::Tensor>{f(in[0], in[1])};
    };
  };
  expect_meta_matches_cpu("cross_entropy", none, logits_and_target({8, 10}, {8}),
                          loss([](const at::Tensor& x, const at::Tensor& t) { return F::cross_entropy(x, t); }));
  expect_meta_matches_cpu(
      "cross_entropy label smoothing", none, logits_and_target({8, 10}, {8}),
      loss([](const at::Tensor& x, const at::Tensor& t) {
        return F::cross_entropy(x, t, F::CrossEntropyFuncOptions().label_smoothing(0.1));
      }));
  expect_meta_matches_cpu(
      "cross_entropy sum", none, logits_and_target({8, 10}, {8}),
      loss([](const at::Tensor& x, const at::Tensor& t) {
        return F::cross_entropy(x, t, F::CrossEntropyFuncOptions().reduction(torch::kSum));
      }));
  expect_meta_matches_cpu("cross_entropy 4-D", none, logits_and_target({2, 5, 3, 3}, {2, 3, 3}),
                          loss([](const at::Tensor& x, const at::Tensor& t) { return F::cross_entropy(x, t); }));
  expect_meta_matches_cpu(
      "cross_entropy 4-D none", none, logits_and_target({2, 5, 3, 3}, {2, 3, 3}),
      loss([](const at::Tensor& x, const at::Tensor& t) {
        return F::cross_entropy(x, t, F::CrossEntropyFuncOptions().reduction(torch::kNone));
      }));
  expect_meta_matches_cpu(
      "nll_loss of log_softmax", none, logits_and_target({8, 10}, {8}),
      loss([](const at::Tensor& x, const at::Tensor& t) { return F::nll_loss(x.log_softmax(1), t); }));
  expect_meta_matches_cpu(
      "mse_loss", none, one_input({4, 5}),
      [](torch::nn::Module&, const std::vector<at::Tensor>& in) {
        return std::vector<at::Tensor>{F::mse_loss(in[0], at::zeros_like(in[0]))};
      });
  expect_meta_matches_cpu(
      "binary_cross_entropy", none, one_input({4, 5}),
      [](torch::nn::Module&, const std::vector<at::Tensor>& in) {
        return std::vector<at::Tensor>{F::binary_cross_entropy(in[0].sigmoid(), at::zeros_like(in[0]))};
      });
}

// The PyTorch C++ examples' MNIST convnet (tests/support/mnist_net.h).
TEST(MetaKernelTest, MnistConvnetSavesTheCpuBytesOnMeta) {
  const int64_t saved = expect_meta_matches_cpu(
      "mnist convnet + nll", [] { return MnistNet().ptr(); },
      [](c10::Device d) {
        return std::vector<at::Tensor>{float_input(d, {16, 1, 28, 28}), index_input(d, {16}, 10)};
      },
      [](torch::nn::Module& m, const std::vector<at::Tensor>& in) {
        auto out = dynamic_cast<MnistNetImpl&>(m).forward(in[0]);
        return std::vector<at::Tensor>{torch::nn::functional::nll_loss(out, in[1]), out};
      });
  EXPECT_GT(saved, 16 * 10 * 24 * 24 * 4);  // at least conv1's output
}

// A conv net with BatchNorm (AlexNet/ResNet style) and a DCGAN generator.
TEST(MetaKernelTest, ResidualBatchNormNetAndGeneratorMatchCpu) {
  using namespace torch::nn;
  expect_meta_matches_cpu(
      "conv-bn-relu-pool stack",
      [] {
        return Sequential(Conv2d(Conv2dOptions(3, 8, 3).padding(1).bias(false)), BatchNorm2d(8),
                          ReLU(), MaxPool2d(MaxPool2dOptions(2)),
                          Conv2d(Conv2dOptions(8, 16, 3).padding(1).bias(false)), BatchNorm2d(16),
                          ReLU(), AdaptiveAvgPool2d(AdaptiveAvgPool2dOptions({1, 1})), Flatten(),
                          Linear(16, 10))
            .ptr();
      },
      one_input({4, 3, 16, 16}), forward_of<SequentialImpl>());
  expect_meta_matches_cpu(
      "dcgan generator",
      [] {
        return Sequential(
                   ConvTranspose2d(ConvTranspose2dOptions(16, 32, 4).bias(false)), BatchNorm2d(32),
                   ReLU(),
                   ConvTranspose2d(ConvTranspose2dOptions(32, 16, 3).stride(2).padding(1).bias(false)),
                   BatchNorm2d(16), ReLU(),
                   ConvTranspose2d(ConvTranspose2dOptions(16, 1, 4).stride(2).padding(1).bias(false)),
                   Tanh())
            .ptr();
      },
      one_input({4, 16, 1, 1}), forward_of<SequentialImpl>());
  // The DCGAN discriminator (LeakyReLU, BatchNorm, a sigmoid and BCE against ones).
  expect_meta_matches_cpu(
      "dcgan discriminator + bce",
      [] {
        return Sequential(Conv2d(Conv2dOptions(1, 8, 4).stride(2).padding(1).bias(false)),
                          LeakyReLU(LeakyReLUOptions().negative_slope(0.2)),
                          Conv2d(Conv2dOptions(8, 16, 4).stride(2).padding(1).bias(false)), BatchNorm2d(16),
                          LeakyReLU(LeakyReLUOptions().negative_slope(0.2)),
                          Conv2d(Conv2dOptions(16, 1, 4).stride(1).padding(0).bias(false)), Sigmoid())
            .ptr();
      },
      one_input({4, 1, 16, 16}), [](torch::nn::Module& m, const std::vector<at::Tensor>& in) {
        auto p = dynamic_cast<SequentialImpl&>(m).forward(in[0]).view({-1});
        return std::vector<at::Tensor>{torch::nn::functional::binary_cross_entropy(p, at::ones_like(p)), p};
      });
}

// A ResNet basic block: conv-BN-ReLU-conv-BN plus a strided 1x1 conv-BN shortcut, then ReLU.
struct BasicBlock : torch::nn::Module {
  BasicBlock()
      : conv1(torch::nn::Conv2dOptions(4, 8, 3).stride(2).padding(1).bias(false)),
        bn1(8),
        conv2(torch::nn::Conv2dOptions(8, 8, 3).padding(1).bias(false)),
        bn2(8),
        down(torch::nn::Conv2dOptions(4, 8, 1).stride(2).bias(false)),
        down_bn(8) {
    register_module("conv1", conv1);
    register_module("bn1", bn1);
    register_module("conv2", conv2);
    register_module("bn2", bn2);
    register_module("down", down);
    register_module("down_bn", down_bn);
  }
  at::Tensor forward(const at::Tensor& x) {
    auto h = at::relu(bn1->forward(conv1->forward(x)));
    h = bn2->forward(conv2->forward(h));
    return at::relu(h + down_bn->forward(down->forward(x)));
  }
  torch::nn::Conv2d conv1;
  torch::nn::BatchNorm2d bn1;
  torch::nn::Conv2d conv2;
  torch::nn::BatchNorm2d bn2;
  torch::nn::Conv2d down;
  torch::nn::BatchNorm2d down_bn;
};

TEST(MetaKernelTest, ResNetBasicBlockMatchesCpu) {
  for (auto format : {at::MemoryFormat::Contiguous, at::MemoryFormat::ChannelsLast}) {
    for (bool eval : {false, true}) {
      expect_meta_matches_cpu(
          std::string("resnet basic block") + (format == at::MemoryFormat::ChannelsLast ? " channels-last" : "") +
              (eval ? " eval" : " train"),
          [] { return std::make_shared<BasicBlock>(); }, one_input({2, 4, 8, 8}, format),
          [](torch::nn::Module& m, const std::vector<at::Tensor>& in) {
            return std::vector<at::Tensor>{dynamic_cast<BasicBlock&>(m).forward(in[0])};
          },
          eval);
    }
  }
}

// bf16: a bf16 conv net, and BatchNorm with bf16 input and fp32 parameters
// (the CPU's mixed-type kernel: statistics and parameter grads in fp32).
// ---------------------------------------------------------------------------
// Recurrent nets (Note [Meta RNNs follow the CPU's kernel]): on CPU an LSTM
// runs oneDNN and saves its workspace; on meta it now does the same. GRU,
// RNN and the cells run the same composite ops on both.

template <typename Impl>
Forward rnn_forward() {
  return [](torch::nn::Module& m, const std::vector<at::Tensor>& in) {
    auto r = dynamic_cast<Impl&>(m).forward(in[0]);
    return std::vector<at::Tensor>{std::get<0>(r)};
  };
}

TEST(MetaKernelTest, LstmSavesTheCpuOneDnnWorkspaceOnMeta) {
  using namespace torch::nn;
  // The issue's 2-layer LSTM(28, 128) on MNIST rows: the composite cells
  // saved 21,817,600 B on meta against the CPU's 47,982,848 B.
  const int64_t saved = expect_meta_matches_cpu(
      "lstm 2 layers batch_first",
      [] { return LSTM(LSTMOptions(28, 128).num_layers(2).batch_first(true)).ptr(); }, one_input({100, 28, 28}),
      rnn_forward<LSTMImpl>());
  EXPECT_EQ(saved, 47982848);
  expect_meta_matches_cpu(
      "lstm bidirectional, dropout between layers",
      [] { return LSTM(LSTMOptions(16, 32).num_layers(3).bidirectional(true).dropout(0.25)).ptr(); },
      one_input({12, 5, 16}), rnn_forward<LSTMImpl>());
  expect_meta_matches_cpu("lstm without biases",
                          [] { return LSTM(LSTMOptions(8, 24).bias(false)).ptr(); }, one_input({7, 3, 8}),
                          rnn_forward<LSTMImpl>());
  // Projections: the CPU takes the composite path, and so does meta.
  expect_meta_matches_cpu("lstm with projections",
                          [] { return LSTM(LSTMOptions(8, 24).proj_size(6)).ptr(); }, one_input({7, 3, 8}),
                          rnn_forward<LSTMImpl>());
}

TEST(MetaKernelTest, GruRnnAndCellsMatchCpu) {
  using namespace torch::nn;
  expect_meta_matches_cpu(
      "gru bidirectional batch_first",
      [] { return GRU(GRUOptions(16, 32).num_layers(2).bidirectional(true).batch_first(true)).ptr(); },
      one_input({5, 12, 16}), rnn_forward<GRUImpl>());
  expect_meta_matches_cpu("rnn relu, dropout", [] {
    return RNN(RNNOptions(16, 32).num_layers(2).nonlinearity(torch::kReLU).dropout(0.5)).ptr();
  }, one_input({12, 5, 16}), rnn_forward<RNNImpl>());
  // A decoder's cells unrolled over steps, the state carried.
  struct Cells : Module {
    LSTMCell lstm{register_module("lstm", LSTMCell(16, 32))};
    GRUCell gru{register_module("gru", GRUCell(32, 32))};
  };
  expect_meta_matches_cpu(
      "lstm cell + gru cell, 6 steps", [] { return std::make_shared<Cells>(); }, one_input({6, 4, 16}),
      [](Module& m, const std::vector<at::Tensor>& in) {
        auto& c = dynamic_cast<Cells&>(m);
        std::optional<std::tuple<at::Tensor, at::Tensor>> state;
        at::Tensor h2, sum;
        for (int64_t t = 0; t < in[0].size(0); ++t) {
          state = c.lstm->forward(in[0][t], state);
          h2 = c.gru->forward(std::get<0>(*state), h2);
          sum = sum.defined() ? sum + h2 : h2;
        }
        return std::vector<at::Tensor>{sum};
      });
}

TEST(MetaKernelTest, EmbeddingLstmLanguageModelAndPackedSequencesMatchCpu) {
  using namespace torch::nn;
  struct Lm : Module {
    Embedding emb{register_module("emb", Embedding(1000, 64))};
    LSTM lstm{register_module("lstm", LSTM(LSTMOptions(64, 96).num_layers(2).dropout(0.2)))};
    Linear out{register_module("out", Linear(96, 1000))};
  };
  expect_meta_matches_cpu(
      "embedding + lstm lm", [] { return std::make_shared<Lm>(); },
      [](c10::Device d) {
        return std::vector<at::Tensor>{index_input(d, {20, 8}, 1000), index_input(d, {20 * 8}, 1000)};
      },
      [](Module& m, const std::vector<at::Tensor>& in) {
        auto& lm = dynamic_cast<Lm&>(m);
        auto h = std::get<0>(lm.lstm->forward(lm.emb->forward(in[0])));
        auto logits = lm.out->forward(h).flatten(0, 1);
        return std::vector<at::Tensor>{at::cross_entropy_loss(logits, in[1]), logits};
      });
  // Packed sequences take the composite path on CPU (no oneDNN): meta too.
  expect_meta_matches_cpu(
      "lstm on a packed sequence", [] { return LSTM(LSTMOptions(8, 16)).ptr(); }, one_input({6, 3, 8}),
      [](Module& m, const std::vector<at::Tensor>& in) {
        namespace rnn = torch::nn::utils::rnn;
        const auto lengths = at::tensor(std::vector<int64_t>{6, 4, 2});
        auto packed = rnn::pack_padded_sequence(in[0], lengths);
        auto out = std::get<0>(dynamic_cast<LSTMImpl&>(m).forward_with_packed_input(packed));
        return std::vector<at::Tensor>{std::get<0>(rnn::pad_packed_sequence(out))};
      });
}

TEST(MetaKernelTest, Bf16ConvolutionAndMixedBatchNormMatchCpu) {
  using namespace torch::nn;
  auto bf16_input = [](std::vector<int64_t> sizes, at::MemoryFormat format) -> MakeInputs {
    return [=](c10::Device d) {
      auto opts = at::TensorOptions().device(d).dtype(at::kBFloat16);
      auto t = d.is_meta() ? at::empty(sizes, opts.memory_format(format))
                           : at::randn(sizes, opts).contiguous(format);
      return std::vector<at::Tensor>{t.requires_grad_()};
    };
  };
  auto bf16 = [](MakeModule make) -> MakeModule {
    return [make] {
      auto m = make();
      m->to(at::kBFloat16);
      return m;
    };
  };
  for (auto format : {at::MemoryFormat::Contiguous, at::MemoryFormat::ChannelsLast}) {
    const std::string f = format == at::MemoryFormat::Contiguous ? "" : " channels-last";
    expect_meta_matches_cpu("bf16 conv2d" + f,
                            bf16(module_of<Conv2d>([] { return Conv2d(Conv2dOptions(3, 8, 3).padding(1)); })),
                            bf16_input({2, 3, 8, 8}, format), forward_of<Conv2dImpl>());
    expect_meta_matches_cpu("bf16 conv_transpose2d" + f,
                            bf16(module_of<ConvTranspose2d>([] {
                              return ConvTranspose2d(ConvTranspose2dOptions(3, 4, 4).stride(2).padding(1));
                            })),
                            bf16_input({2, 3, 5, 5}, format),
                            [](torch::nn::Module& m, const std::vector<at::Tensor>& in) {
                              return std::vector<at::Tensor>{dynamic_cast<ConvTranspose2dImpl&>(m).forward(in[0])};
                            });
    for (bool eval : {false, true}) {
      expect_meta_matches_cpu("bf16 input, fp32 batch_norm2d" + f + (eval ? " eval" : " train"),
                              module_of<BatchNorm2d>([] { return BatchNorm2d(3); }),
                              bf16_input({2, 3, 5, 5}, format), forward_of<BatchNorm2dImpl>(), eval);
    }
  }
}

// The meta kernels check their arguments as the CPU's do, naming the values.
TEST(MetaKernelTest, BadShapesOnMetaNameTheValues) {
  trainmem::register_meta_kernels();
  const auto opts = at::TensorOptions().device(at::kMeta);
  auto message = [](const std::function<void()>& f) -> std::string {
    try {
      f();
    } catch (const c10::Error& e) {
      return e.what_without_backtrace();
    }
    return "no error";
  };
  const auto channels = message([&] { at::conv2d(at::empty({1, 3, 8, 8}, opts), at::empty({4, 2, 3, 3}, opts)); });
  EXPECT_NE(channels.find("[4, 2, 3, 3]"), std::string::npos) << channels;
  EXPECT_NE(channels.find("[1, 3, 8, 8]"), std::string::npos) << channels;
  const auto small = message([&] { at::conv2d(at::empty({1, 2, 2, 2}, opts), at::empty({4, 2, 3, 3}, opts)); });
  EXPECT_NE(small.find("too small"), std::string::npos) << small;
  const auto pool = message([&] { at::max_pool3d(at::empty({2, 3, 4, 4}, opts), {5, 5, 5}); });
  EXPECT_NE(pool.find("max_pool3d"), std::string::npos) << pool;
}

TEST(MetaKernelTest, FindsTheOpWithNoMetaKernel) {
  // An op with a CPU kernel only (histc) runs on meta through the fallback
  // (Note [A meta path for ops without a meta kernel]); one whose output's
  // shape depends on values cannot, and is named.
  EXPECT_FALSE(trainmem::find_missing_meta_kernel([] {
    at::histc(at::empty({4, 5}, at::TensorOptions().device(at::kMeta)), 10);
  }).has_value());
  auto missing = trainmem::find_missing_meta_kernel([] {
    auto x = at::empty({4, 5}, at::TensorOptions().device(at::kMeta));
    at::nonzero(x);
  });
  ASSERT_TRUE(missing.has_value());
  EXPECT_EQ(missing->op, "aten::nonzero") << missing->message;
  EXPECT_NE(missing->message.find("has no meta kernel"), std::string::npos) << missing->message;
  // LibTorch's own wording, for an op with no CPU kernel either (CUDA only).
  auto cuda_only = trainmem::find_missing_meta_kernel([] {
    at::_fused_dropout(at::empty({4, 5}, at::TensorOptions().device(at::kMeta)), 0.5);
  });
  ASSERT_TRUE(cuda_only.has_value());
  EXPECT_EQ(cuda_only->op, "aten::_fused_dropout") << cuda_only->message;
  EXPECT_NE(cuda_only->message.find("Meta"), std::string::npos) << cuda_only->message;
  // A conv net's whole step runs on meta: nothing is missing.
  std::shared_ptr<MnistNetImpl> net;
  {
    trainmem::MetaInitGuard meta;
    net = MnistNet().ptr();
  }
  EXPECT_FALSE(trainmem::find_missing_meta_kernel([&] {
                 net->forward(at::empty({4, 1, 28, 28}, at::TensorOptions().device(at::kMeta)))
                     .sum()
                     .backward();
               }).has_value());
  // A composite kernel's wording ("convolution_overrideable not implemented").
  auto composite = trainmem::find_missing_meta_kernel([] {
    auto opts = at::TensorOptions().device(at::kMeta);
    at::convolution_overrideable(at::empty({1, 2, 5, 5}, opts), at::empty({3, 2, 3, 3}, opts), std::nullopt,
                                 {1, 1}, {0, 0}, {1, 1}, false, {0, 0}, 1);
  });
  ASSERT_TRUE(composite.has_value());
  EXPECT_EQ(composite->op, "aten::convolution") << composite->message;
  // Other errors are not a missing kernel: they propagate.
  EXPECT_THROW(trainmem::find_missing_meta_kernel([] { TORCH_CHECK(false, "not about meta"); }),
               c10::Error);
}

} // namespace
