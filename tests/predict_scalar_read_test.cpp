// Reads of values inside a predicted step (Note [Scalar reads inside a
// prediction]): a PPO update that logs loss.item() and stops early on the
// approximate KL predicts on meta, its peak that of the same update without
// the reads, and lists them; outside a prediction a meta .item() throws.
#include "trainmem/planner.h"

#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include "trainmem/allocator.h"
#include "trainmem/meta.h"
#include "trainmem/meter.h"

namespace {

struct MlpPolicyImpl : torch::nn::Module {
  MlpPolicyImpl() {
    body = register_module("body", torch::nn::Linear(8, 32));
    pi = register_module("pi", torch::nn::Linear(32, 4));
    v = register_module("v", torch::nn::Linear(32, 1));
  }
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& x) {
    auto h = torch::tanh(body(x));
    return {pi(h), v(h)};
  }
  torch::nn::Linear body{nullptr}, pi{nullptr}, v{nullptr};
};
TORCH_MODULE(MlpPolicy);

struct Rollout {
  at::Tensor obs, actions, old_logp, adv, ret;  // (32, 8), (32,), (32,), (32,), (32,)
};

constexpr int kEpochs = 2;
constexpr int kMinibatches = 2;
constexpr int64_t kMinibatch = 16;

// A PPO update as RL libraries write it: epochs x minibatches, one Adam step
// each, the loss logged with .item() and an early stop on the approximate KL.
void ppo_update(MlpPolicy& policy, torch::optim::Adam& adam, const Rollout& r, std::vector<double>& logged,
                bool read_values = true) {
  for (int epoch = 0; epoch < kEpochs; ++epoch) {
    for (int mb = 0; mb < kMinibatches; ++mb) {
      const int64_t at = mb * kMinibatch;
      auto [logits, value] = policy->forward(r.obs.narrow(0, at, kMinibatch));
      auto logp = torch::log_softmax(logits, -1).gather(1, r.actions.narrow(0, at, kMinibatch).unsqueeze(1)).squeeze(1);
      auto ratio = (logp - r.old_logp.narrow(0, at, kMinibatch)).exp();
      auto adv = r.adv.narrow(0, at, kMinibatch);
      auto surrogate = torch::min(ratio * adv, ratio.clamp(0.8, 1.2) * adv);
      auto loss = -surrogate.mean() + 0.5 * (value.squeeze(1) - r.ret.narrow(0, at, kMinibatch)).pow(2).mean();
      adam.zero_grad();
      loss.backward();
      adam.step();
      if (!read_values) {
        continue;
      }
      logged.push_back(loss.item<double>());
      auto approx_kl = (r.old_logp.narrow(0, at, kMinibatch) - logp).mean();
      if (approx_kl.item<double>() > 0.5) {
        return;  // early stop
      }
    }
  }
}

TEST(PredictScalarReadTest, PpoUpdateWithItemAndEarlyStopPredictsAsWithoutTheReads) {
  trainmem::CpuMemoryTracker::install();
  torch::manual_seed(0);
  MlpPolicy cpu;
  torch::optim::Adam cpu_adam(cpu->parameters(), torch::optim::AdamOptions(1e-4));
  Rollout real;
  real.obs = torch::randn({32, 8});
  real.actions = torch::randint(4, {32}, torch::kLong);
  {
    torch::NoGradGuard no_grad;
    real.old_logp = torch::log_softmax(cpu->forward(real.obs).first, -1).gather(1, real.actions.unsqueeze(1)).squeeze(1);
  }
  real.adv = torch::randn({32});
  real.ret = torch::randn({32});
  MlpPolicy meta{nullptr};
  {
    trainmem::MetaInitGuard guard;
    meta = MlpPolicy();
  }
  torch::optim::Adam meta_adam(meta->parameters(), torch::optim::AdamOptions(1e-4));
  auto on_meta = [](const at::Tensor& t) { return at::empty(t.sizes(), t.options().device(at::kMeta)); };
  const Rollout shapes{on_meta(real.obs), on_meta(real.actions), on_meta(real.old_logp), on_meta(real.adv),
                       on_meta(real.ret)};

  std::vector<double> cpu_logged;
  const auto measured =
      trainmem::measure_step_function({cpu.get()}, {&cpu_adam}, [&] { ppo_update(cpu, cpu_adam, real, cpu_logged); });
  // The CPU run took every minibatch (no early stop): the branch 0 takes on meta.
  ASSERT_EQ(cpu_logged.size(), 2u * kEpochs * kMinibatches);
  std::vector<double> meta_logged;
  const auto predicted = trainmem::predict_step_function(
      {meta.get()}, {&meta_adam}, [&] { ppo_update(meta, meta_adam, shapes, meta_logged); });
  // The reads cost nothing and change nothing: the same update without them
  // predicts the same bytes, and measures the same on the CPU.
  std::vector<double> unused;
  const auto predicted_plain = trainmem::predict_step_function(
      {meta.get()}, {&meta_adam}, [&] { ppo_update(meta, meta_adam, shapes, unused, false); });
  const auto measured_plain = trainmem::measure_step_function(
      {cpu.get()}, {&cpu_adam}, [&] { ppo_update(cpu, cpu_adam, real, unused, false); });
  EXPECT_EQ(predicted.peak_bytes, predicted_plain.peak_bytes)
      << "with reads " << predicted.peak_bytes << " B, without " << predicted_plain.peak_bytes << " B";
  EXPECT_EQ(predicted.end_bytes, predicted_plain.end_bytes);
  EXPECT_EQ(measured.peak_bytes, measured_plain.peak_bytes);
  EXPECT_TRUE(predicted_plain.scalar_reads.empty());
  // And the CPU's, to the byte, with and without the reads (the shared body's
  // two gradients sum in place on meta as on the CPU: Note [References held
  // above the interceptor]; before, 14,808 B against 13,016 B).
  EXPECT_EQ(predicted.start_bytes, measured.start_bytes);
  EXPECT_EQ(predicted.peak_bytes, measured.peak_bytes)
      << "predicted " << predicted.peak_bytes << " B, measured " << measured.peak_bytes << " B";
  EXPECT_EQ(predicted.end_bytes, measured.end_bytes);
  EXPECT_EQ(predicted_plain.peak_bytes, measured_plain.peak_bytes)
      << "predicted " << predicted_plain.peak_bytes << " B, measured " << measured_plain.peak_bytes << " B";
  EXPECT_EQ(predicted_plain.end_bytes, measured_plain.end_bytes);
  // Each read listed: two per minibatch, in the warm-up step and the measured one.
  ASSERT_EQ(predicted.scalar_reads.size(), 1u);
  EXPECT_EQ(predicted.scalar_reads[0].op, "aten::_local_scalar_dense");
  EXPECT_EQ(predicted.scalar_reads[0].value, "0");
  EXPECT_EQ(predicted.scalar_reads[0].num_reads, 2 * 2 * kEpochs * kMinibatches);
  EXPECT_EQ(meta_logged, std::vector<double>(2u * kEpochs * kMinibatches, 0.0));
  EXPECT_TRUE(measured.scalar_reads.empty());
  EXPECT_NE(trainmem::to_string(predicted).find("values read from meta (a real run's control flow may differ): 16 x "
                                                "aten::_local_scalar_dense -> 0"),
            std::string::npos)
      << trainmem::to_string(predicted);
}

// `.all()` in an `if` reads false, a scalar moved to the CPU reads zeros;
// each kind is listed with its count.
TEST(PredictScalarReadTest, AllInAnIfAndToCpuAreListed) {
  MlpPolicy meta{nullptr};
  {
    trainmem::MetaInitGuard guard;
    meta = MlpPolicy();
  }
  int num_finite = 0;
  at::Tensor on_cpu;
  const auto predicted = trainmem::predict_step_peak(*meta, [&] {
    auto loss = meta->forward(at::empty({4, 8}, at::kMeta)).first.pow(2).mean();
    if (torch::isfinite(loss).all().item<bool>()) {
      ++num_finite;
    }
    on_cpu = loss.detach().to(at::kCPU);
    return loss;
  });
  EXPECT_EQ(num_finite, 0);  // false on meta
  ASSERT_TRUE(on_cpu.is_cpu());
  EXPECT_EQ(on_cpu.item<float>(), 0.0f);
  ASSERT_EQ(predicted.scalar_reads.size(), 2u);
  EXPECT_EQ(predicted.scalar_reads[0].op, "aten::_local_scalar_dense");
  EXPECT_EQ(predicted.scalar_reads[0].value, "false");
  EXPECT_EQ(predicted.scalar_reads[0].num_reads, 1);
  EXPECT_EQ(predicted.scalar_reads[1].op, "aten::_to_copy");
  EXPECT_EQ(predicted.scalar_reads[1].value, "zeros");
  EXPECT_EQ(predicted.scalar_reads[1].num_reads, 1);
}

// predict_saved_activations lists the reads of its forward too, and the
// branch taken (0 reads as false) saves what a real run on that branch saves.
TEST(PredictScalarReadTest, SavedActivationsListTheReads) {
  MlpPolicy meta{nullptr};
  {
    trainmem::MetaInitGuard guard;
    meta = MlpPolicy();
  }
  const auto r = trainmem::predict_saved_activations(*meta, [&] {
    auto [logits, value] = meta->forward(at::empty({4, 8}, at::kMeta));
    if (value.mean().item<double>() > 0.0) {
      return value.pow(2).mean();  // not taken on meta
    }
    return logits.pow(2).mean();
  });
  ASSERT_EQ(r.scalar_reads.size(), 1u);
  EXPECT_EQ(r.scalar_reads[0].op, "aten::_local_scalar_dense");
  EXPECT_EQ(r.scalar_reads[0].value, "0");
  EXPECT_EQ(r.scalar_reads[0].num_reads, 1);
  // The branch taken: body's input (4 x 8), the tanh output (4 x 32, saved by
  // tanh and both heads once), the logits (pow saves its input): 128 + 512 + 64 B.
  EXPECT_EQ(r.saved_bytes, 4 * 8 * 4 + 4 * 32 * 4 + 4 * 4 * 4);
  EXPECT_NE(trainmem::to_string(r).find("values read from meta (a real run's control flow may differ): 1 x "
                                        "aten::_local_scalar_dense -> 0"),
            std::string::npos)
      << trainmem::to_string(r);
  // A meter's own report lists none.
  trainmem::SavedTensorMeter meter;
  EXPECT_TRUE(meter.report().scalar_reads.empty());
}

// plan_regions lists the reads its loss made while planning (a loss that
// logs itself), and plans as without them.
TEST(PredictScalarReadTest, PlanRegionsListsTheReads) {
  torch::manual_seed(0);
  torch::nn::Sequential net(torch::nn::Linear(32, 64), torch::nn::Tanh(), torch::nn::Linear(64, 8));
  trainmem::RegionModel m;
  m.regions = trainmem::regions_of(net);
  m.input = [](c10::Device device) { return at::empty({16, 32}, at::TensorOptions().device(device)); };
  m.loss = [](const at::Tensor& y) { return y.pow(2).mean(); };
  const auto plain = trainmem::plan_regions(m);
  EXPECT_TRUE(plain.scalar_reads.empty());
  std::vector<double> logged;
  m.loss = [&](const at::Tensor& y) {
    auto loss = y.pow(2).mean();
    logged.push_back(loss.item<double>());
    return loss;
  };
  const auto plan = trainmem::plan_regions(m);
  ASSERT_EQ(plan.scalar_reads.size(), 1u);
  EXPECT_EQ(plan.scalar_reads[0].op, "aten::_local_scalar_dense");
  EXPECT_EQ(plan.scalar_reads[0].value, "0");
  EXPECT_EQ(plan.scalar_reads[0].num_reads, static_cast<int64_t>(logged.size()));
  EXPECT_EQ(plan.predicted_peak_bytes, plain.predicted_peak_bytes);
  EXPECT_NE(trainmem::to_string(plan).find("values read from meta (a real run's control flow may differ): "),
            std::string::npos)
      << trainmem::to_string(plan);
}

// Outside a prediction a meta .item() throws, as in LibTorch, and
// find_missing_meta_kernel() names the op.
TEST(PredictScalarReadTest, MetaItemOutsideAPredictionThrows) {
  trainmem::register_meta_kernels();
  const auto t = at::zeros({1}, at::TensorOptions().device(at::kMeta));
  try {
    (void)t.item<double>();
    FAIL() << "a meta .item() returned outside a prediction";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("trainmem: aten::_local_scalar_dense has no meta kernel and its output "
                                         "shape depends on values"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW((void)t.to(at::kCPU), c10::Error);
  const auto missing = trainmem::find_missing_meta_kernel([&] { (void)t.item<double>(); });
  ASSERT_TRUE(missing.has_value());
  EXPECT_EQ(missing->op, "aten::_local_scalar_dense");
}

} // namespace
