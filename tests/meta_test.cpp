#include "trainmem/meta.h"

#include <cstdio>
#include <filesystem>
#include <thread>

#include <unistd.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/options/normalization.h>
#include <torch/serialize.h>

#include "trainmem/accountant.h"
#include "trainmem/allocator.h"
#include "trainmem/checkpoint.h"
#include "trainmem/selective.h"
#include "trainmem/transformer.h"

namespace {

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

// Seed fence 2 without the CPU detour: the module never allocates.
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

TEST(MetaTest, MaterializeNamesModulesItCannotInitialize) {
  std::shared_ptr<OwnParameter> m;
  {
    trainmem::MetaInitGuard meta;
    m = std::make_shared<OwnParameter>();
  }
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

} // namespace
