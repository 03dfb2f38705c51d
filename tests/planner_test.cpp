// Plan before running: the analytic activation model, exact predictions on
// meta (saved bytes and the step's peak) against the CPU's measurements, and
// the checkpoint planner (budget met at least cost, monotone over budgets).
#include <limits>
#include <set>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include "app/variants.h"
#include "trainmem/allocator.h"
#include "trainmem/checkpoint.h"
#include "trainmem/meta.h"
#include "trainmem/meter.h"
#include "trainmem/models/transformer_plan.h"
#include "trainmem/planner.h"
#include "trainmem/selective.h"
#include "trainmem/models/transformer.h"

namespace {

using trainmem::kReferenceBatch;
using trainmem::kReferenceSeqLen;

using trainmem::BlockCheckpointing;
using trainmem::TransformerOptions;

TEST(PlannerTest, AnalyticModelGivesTheFirstOrderAndKorthikantisFigures) {
  TransformerOptions o;  // the capstone
  const auto first_order = trainmem::analytic_activation_bytes(o, kReferenceBatch, kReferenceSeqLen);
  EXPECT_EQ(first_order.total_bytes, 50331648);
  EXPECT_EQ(first_order.total_bytes, trainmem::predicted_activation_bytes(o, kReferenceBatch, kReferenceSeqLen));
  EXPECT_EQ(first_order.per_layer_bytes, 64 * kReferenceSeqLen * kReferenceBatch * o.d_model());
  int64_t sum = 0;
  for (const auto& t : first_order.terms) sum += t.bytes;
  EXPECT_EQ(sum, first_order.total_bytes);
  // The exact count adds LayerNorm's mean/rstd, SDPA's log-sum-exp, the loss input.
  EXPECT_EQ(trainmem::estimate_activation_bytes(o, kReferenceBatch, kReferenceSeqLen).total_bytes - first_order.total_bytes,
            4 * 4 * 16 * 64 * 6 + 4 * 16 * 4 * 64 * 6 + 4 * 16 * 64 * 128);

  // Korthikanti et al.: 34 s b h + 5 a s^2 b bytes per layer (fp16, dropout, eager).
  const auto k = trainmem::analytic_activation_bytes(o, kReferenceBatch, kReferenceSeqLen, trainmem::AnalyticActivationOptions::korthikanti());
  const int64_t s = 64, b = 16, h = 128, a = 4;
  EXPECT_EQ(k.per_layer_bytes, 34 * s * b * h + 5 * a * s * s * b);
  EXPECT_EQ(k.per_layer_bytes, 5767168);
  EXPECT_EQ(k.total_bytes, 6 * 5767168);
  // fp16, no dropout, fused attention: 32 bytes per token-channel.
  const auto f16 = trainmem::analytic_activation_bytes(o, kReferenceBatch, kReferenceSeqLen, trainmem::AnalyticActivationOptions().element_bytes(2));
  EXPECT_EQ(f16.per_layer_bytes, 32 * s * b * h);
  EXPECT_THROW(trainmem::analytic_activation_bytes(o, kReferenceBatch, kReferenceSeqLen, trainmem::AnalyticActivationOptions().element_bytes(0)),
               c10::Error);
}

TEST(PlannerTest, MetaForwardSavesExactlyWhatTheCpuSaves) {
  torch::manual_seed(0);
  TransformerOptions o;
  const int64_t L = o.num_layers();
  trainmem::Transformer cpu(o);
  auto x = torch::randn({kReferenceBatch, kReferenceSeqLen, o.d_model()});
  trainmem::Transformer meta(o);
  trainmem::to_meta(*meta);
  const std::vector<int64_t> expected = {51052544, 3670016, 27361280, 31981568};
  const auto plans = trainmem::reference_variants(L);
  for (size_t i = 0; i < plans.size(); ++i) {
    const auto measured = trainmem::run_variant(cpu, x, plans[i]).saved;
    const auto predicted = trainmem::predict_saved_activations(*meta, [&] {
      return meta->forward(at::empty({kReferenceBatch, kReferenceSeqLen, o.d_model()}, at::kMeta), plans[i])
          .pow(2)
          .mean();
    });
    EXPECT_EQ(predicted.saved_bytes, expected[i]) << plans[i].name << "\n" << trainmem::to_string(predicted);
    EXPECT_EQ(predicted.saved_bytes, measured.saved_bytes) << plans[i].name;
    EXPECT_EQ(predicted.num_storages, measured.num_storages) << plans[i].name;
  }
  EXPECT_THROW(trainmem::predict_saved_activations(*cpu, [&] { return cpu->forward(x); }), c10::Error);
}

// A stack of residual MLP blocks (the checkpoint experiment's shape of
// examples/explain_cuda_peaks.cpp, scaled down).
struct MlpStackImpl : torch::nn::Module {
  MlpStackImpl(int64_t n, int64_t d) {
    for (int64_t i = 0; i < n; ++i) {
      up.push_back(register_module("up" + std::to_string(i), torch::nn::Linear(d, 4 * d)));
      down.push_back(register_module("down" + std::to_string(i), torch::nn::Linear(4 * d, d)));
    }
  }
  at::Tensor block(size_t i, const at::Tensor& x) {
    return x + down[i]->forward(at::gelu(up[i]->forward(x)));
  }
  at::Tensor forward(at::Tensor x, bool ckpt) {
    for (size_t i = 0; i < up.size(); ++i) {
      x = ckpt ? trainmem::checkpoint([this, i](const at::Tensor& t) { return block(i, t); }, x)
               : block(i, x);
    }
    return x;
  }
  std::vector<torch::nn::Linear> up, down;
};
TORCH_MODULE(MlpStack);

TEST(PlannerTest, MetaForwardOfAnMlpStackMatchesTheCpu) {
  torch::manual_seed(0);
  MlpStack cpu(4, 256), meta(4, 256);
  trainmem::to_meta(*meta);
  for (bool ckpt : {false, true}) {
    trainmem::SavedTensorMeter meter(*cpu);
    {
      trainmem::SavedTensorMeterGuard scope(meter);
      auto loss = cpu->forward(torch::randn({512, 256}), ckpt).pow(2).mean();
    }
    const auto predicted = trainmem::predict_saved_activations(*meta, [&] {
      return meta->forward(at::empty({512, 256}, at::kMeta), ckpt).pow(2).mean();
    });
    EXPECT_EQ(predicted.saved_bytes, meter.report().saved_bytes) << "checkpointed " << ckpt;
    // Per block: input, up output (GELU input), GELU output; plus the loss input.
    const int64_t u = 512 * 256 * 4;
    EXPECT_EQ(predicted.saved_bytes, ckpt ? 5 * u : 4 * (1 + 4 + 4) * u + u);
  }
}

// The MLP stack's step peak (AdamW), stored and checkpointed: meta vs CPU.
TEST(PlannerTest, PredictedStepPeakOfAnMlpStack) {
  trainmem::CpuMemoryTracker::install();
  torch::manual_seed(0);
  MlpStack cpu(4, 256), meta(4, 256);
  trainmem::to_meta(*meta);
  torch::optim::AdamW cpu_opt(cpu->parameters(), torch::optim::AdamWOptions(1e-3));
  torch::optim::AdamW meta_opt(meta->parameters(), torch::optim::AdamWOptions(1e-3));
  for (bool ckpt : {false, true}) {
    const auto measured = trainmem::measure_step_peak(*cpu, [&] {
      return cpu->forward(torch::randn({512, 256}), ckpt).pow(2).mean();
    }, &cpu_opt);
    const auto predicted = trainmem::predict_step_peak(*meta, [&] {
      return meta->forward(at::empty({512, 256}, at::kMeta), ckpt).pow(2).mean();
    }, &meta_opt);
    const double err = static_cast<double>(predicted.peak_bytes - measured.peak_bytes) /
        static_cast<double>(measured.peak_bytes);
    std::cout << "MLP stack, checkpointed " << ckpt << ": predicted " << predicted.peak_bytes
              << " B (" << to_string(predicted.phase) << "), measured " << measured.peak_bytes << " B ("
              << to_string(measured.phase) << "), error " << 100.0 * err << " %\n";
    EXPECT_EQ(predicted.activation_bytes, measured.activation_bytes);
    EXPECT_LT(std::abs(err), 0.005) << "checkpointed " << ckpt;
  }
}

// BatchNorm's running statistics are live all step, as the
// allocator sees them, so the predicted peak counts them (StepPeak::
// buffer_bytes; before, predict_step_peak and measure_step_peak both left
// them out, and a user comparing the prediction with the allocator's real
// peak found it 208 B short on this net). Predicted on meta == measured by
// measure_step_peak == the live bytes above what was live before the model
// was made, read from a PeakWindow over one more step.
torch::nn::Sequential conv_bn_net() {
  return torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3).padding(1)),
                               torch::nn::BatchNorm2d(8), torch::nn::ReLU(),
                               torch::nn::Conv2d(torch::nn::Conv2dOptions(8, 16, 3).padding(1)),
                               torch::nn::BatchNorm2d(16), torch::nn::ReLU());
}

TEST(PlannerTest, PredictedStepPeakOfABatchNormNetCountsItsBuffers) {
  auto& tracker = trainmem::CpuMemoryTracker::install();
  constexpr int64_t kBuffers = (2 * 8 * 4 + 8) + (2 * 16 * 4 + 8);  // running mean, var; num_batches_tracked
  torch::manual_seed(0);
  auto meta = conv_bn_net();
  trainmem::to_meta(*meta);
  torch::optim::AdamW meta_opt(meta->parameters(), torch::optim::AdamWOptions(1e-3));
  auto loss_of = [](torch::nn::Sequential& net, const at::Tensor& x) { return net->forward(x).pow(2).mean(); };
  const auto predicted = trainmem::predict_step_peak(*meta, [&] {
    return loss_of(meta, at::empty({8, 3, 32, 32}, at::kMeta));
  }, &meta_opt);

  const int64_t base = tracker.stats().allocated_bytes;
  auto cpu = conv_bn_net();
  torch::optim::AdamW cpu_opt(cpu->parameters(), torch::optim::AdamWOptions(1e-3));
  const auto measured = trainmem::measure_step_peak(*cpu, [&] {
    return loss_of(cpu, torch::randn({8, 3, 32, 32}));
  }, &cpu_opt);
  int64_t window_peak = 0;
  {
    for (auto& p : cpu->parameters()) {
      p.mutable_grad().reset();
    }
    trainmem::PeakWindow window(tracker);
    loss_of(cpu, torch::randn({8, 3, 32, 32})).backward();
    cpu_opt.step();
    window_peak = window.peak_bytes() - base;
  }
  std::cout << trainmem::to_string(predicted) << "measured " << measured.peak_bytes << " B, window "
            << window_peak << " B\n";
  EXPECT_EQ(predicted.buffer_bytes, kBuffers);
  EXPECT_EQ(measured.buffer_bytes, kBuffers);
  EXPECT_EQ(predicted.peak_bytes, measured.peak_bytes);
  EXPECT_EQ(predicted.peak_bytes, window_peak);
  EXPECT_EQ(predicted.phase, measured.phase);
  // 3,786,008 B in backward, all three equal. Off the
  // peak, the forward and optimizer-step peaks are 12 B below the CPU's
  // (2,213,140 vs 2,213,152 B, 32,464 vs 32,476 B): a small CPU allocation
  // the meta run does not see, not looked into.
  EXPECT_EQ(predicted.backward_peak_bytes, measured.backward_peak_bytes);
  EXPECT_EQ(predicted.phase, trainmem::StepPhase::kBackward);
  EXPECT_EQ(predicted.activation_bytes, measured.activation_bytes);
  // The decomposition stays exact with the buffers a term of their own.
  const int64_t activations = predicted.phase == trainmem::StepPhase::kOptimizerStep ? 0 : predicted.activation_bytes;
  EXPECT_EQ(predicted.transient_bytes, predicted.peak_bytes - predicted.param_bytes - predicted.buffer_bytes -
                                           predicted.optimizer_state_bytes - predicted.grad_bytes - activations);
  EXPECT_NE(trainmem::to_string(predicted).find("  buffers                            208 B"), std::string::npos)
      << trainmem::to_string(predicted);
}

// The checkpoint experiment's residual stack (examples/explain_cuda_peaks.cpp):
// x + Linear(GELU(Linear(x))) per block, h.sum().
struct ResidualMlpStack : torch::nn::Module {
  ResidualMlpStack(int64_t blocks, int64_t d) {
    for (int64_t i = 0; i < blocks; ++i) {
      l1.push_back(register_module("l1_" + std::to_string(i), torch::nn::Linear(d, d)));
      l2.push_back(register_module("l2_" + std::to_string(i), torch::nn::Linear(d, d)));
    }
  }
  at::Tensor run(const at::Tensor& x, bool ckpt) {
    at::Tensor h = x;
    for (size_t i = 0; i < l1.size(); ++i) {
      auto block = [this, i](const at::Tensor& t) { return t + l2[i]->forward(at::gelu(l1[i]->forward(t))); };
      h = ckpt ? trainmem::checkpoint(block, h) : block(h);
    }
    return h.sum();
  }
  std::vector<torch::nn::Linear> l1, l2;
};

// The checkpoint experiment scaled down (residual Linear-GELU-Linear blocks, X
// requiring grad, loss h.sum(), no optimizer), store-all and one checkpoint
// per block: the meta prediction is the CPU's peak to the byte. Both peaks
// fall in the last block's backward, while a CPU matmul holds its contiguous
// clone of h.sum()'s expanded gradient (rows x d fp32); the checkpointed run
// also holds each block's CPU RNG stash (Note [CPU matmul operand copies on
// meta], Note [Checkpoint RNG copies on meta]).
TEST(PlannerTest, PredictedStepPeakOfTheResidualMlpStackIsExact) {
  trainmem::CpuMemoryTracker::install();
  constexpr int64_t kBlocks = 4, kD = 64, kRows = 4096;
  torch::manual_seed(0);
  ResidualMlpStack cpu(kBlocks, kD), meta(kBlocks, kD);
  trainmem::to_meta(meta);
  auto xc = torch::randn({kRows, kD}).requires_grad_(true);
  auto xm = at::empty({kRows, kD}, at::kMeta).requires_grad_(true);
  const int64_t t = kRows * kD * 4;
  for (bool ckpt : {false, true}) {
    xc.mutable_grad().reset();
    xm.mutable_grad().reset();
    const auto measured = trainmem::measure_step_peak(cpu, [&] { return cpu.run(xc, ckpt); });
    const auto predicted = trainmem::predict_step_peak(meta, [&] { return meta.run(xm, ckpt); });
    std::cout << "residual MLP stack, checkpointed " << ckpt << ": predicted " << predicted.peak_bytes
              << " B, measured " << measured.peak_bytes << " B\n";
    EXPECT_EQ(predicted.peak_bytes, measured.peak_bytes) << "checkpointed " << ckpt;
    EXPECT_EQ(predicted.phase, trainmem::StepPhase::kBackward);
    EXPECT_EQ(measured.phase, trainmem::StepPhase::kBackward);
    // The peak holds one clone of the expanded gradient beyond the step's tensors:
    // the prediction is above the saved activations plus parameters by more than t.
    EXPECT_GT(predicted.peak_bytes, predicted.param_bytes + predicted.activation_bytes + t) << ckpt;
  }
}

// Measured and predicted step peaks (AdamW, second step), printed side by side.
TEST(PlannerTest, PredictedStepPeakIsWithinTolerance) {
  trainmem::CpuMemoryTracker::install();
  torch::manual_seed(0);
  TransformerOptions o;
  const int64_t L = o.num_layers();
  trainmem::Transformer cpu(o);
  torch::optim::AdamW cpu_opt(cpu->parameters(), torch::optim::AdamWOptions(1e-3));
  trainmem::Transformer meta(o);
  trainmem::to_meta(*meta);
  torch::optim::AdamW meta_opt(meta->parameters(), torch::optim::AdamWOptions(1e-3));
  for (const auto& plan : trainmem::reference_variants(L)) {
    const auto measured = trainmem::measure_step_peak(*cpu, [&] {
      return cpu->forward(torch::randn({kReferenceBatch, kReferenceSeqLen, o.d_model()}), plan).pow(2).mean();
    }, &cpu_opt);
    const auto predicted = trainmem::predict_step_peak(*meta, [&] {
      return meta->forward(at::empty({kReferenceBatch, kReferenceSeqLen, o.d_model()}, at::kMeta), plan)
          .pow(2)
          .mean();
    }, &meta_opt);
    const double err = static_cast<double>(predicted.peak_bytes - measured.peak_bytes) /
        static_cast<double>(measured.peak_bytes);
    std::cout << plan.name << ": predicted " << predicted.peak_bytes << " B (" << to_string(predicted.phase)
              << "), measured " << measured.peak_bytes << " B (" << to_string(measured.phase)
              << "), error " << 100.0 * err << " %\n"
              << trainmem::to_string(predicted) << "measured:\n" << trainmem::to_string(measured);
    EXPECT_EQ(predicted.activation_bytes, measured.activation_bytes) << plan.name;
    EXPECT_EQ(predicted.param_bytes + predicted.optimizer_state_bytes + predicted.grad_bytes +
                  predicted.activation_bytes + predicted.transient_bytes,
              predicted.peak_bytes);
    EXPECT_GE(predicted.transient_bytes, 0) << plan.name;
    EXPECT_EQ(predicted.phase, measured.phase) << plan.name;
    if (plan.name == "none") {
      // In the last block's backward: its gradients (793,088 B + its LayerNorm
      // and bias vectors) are the ones written; the rest is that block's
      // gradient buffers.
      EXPECT_EQ(predicted.phase, trainmem::StepPhase::kBackward);
      EXPECT_GT(predicted.grad_bytes, 0);
      EXPECT_LE(predicted.grad_bytes, 4758528 / 6);
    }
    // Measured 0.00 % (none) to 0.06 % (selective): the CPU kernels' scratch.
    EXPECT_LT(std::abs(err), 0.005) << plan.name;
  }
}

// The planner's composed prediction equals the whole step simulated on meta
// for the four variants (to the loss scalar's 4 bytes), and the whole-block
// plans it reaches are those the capstone's variants name (none, full,
// every_2).
TEST(PlannerTest, PlanWithoutBudgetIsNoneAndItsSmallestPeakIsCheckpointingAllButTheLast) {
  TransformerOptions o;
  const auto plan = trainmem::plan_checkpointing(o, kReferenceBatch, kReferenceSeqLen);
  std::cout << trainmem::to_string(plan);
  EXPECT_TRUE(plan.feasible);
  EXPECT_EQ(plan.name, "none");
  EXPECT_EQ(plan.recompute_cost, 0.0);
  EXPECT_EQ(plan.activation_bytes, 51052544);  // the meter's count, from the block profiles
  EXPECT_EQ(plan.static_bytes, 4758528 + 2 * 4758528 + 524288);
  // The step simulated on meta peaks at 67,687,944 B too: the loss scalar's
  // 4 B, live through backward, is counted.
  EXPECT_EQ(plan.predicted_peak_bytes, 67687944);
  EXPECT_EQ(plan.peak_phase, trainmem::StepPhase::kBackward);
  // The smallest peak: every block checkpointed but the last (its backward
  // comes first, with nothing else to free). Measured for full on CPU:
  // 29,551,560 B = the meta step's 29,546,504 B + block 0's CPU RNG state
  // (5,056 B), which the planner counts: the same to the byte.
  EXPECT_EQ(plan.min_peak_bytes, 29546504 + 5056);
  const auto tight = trainmem::plan_checkpointing(o, kReferenceBatch, kReferenceSeqLen, trainmem::PlanOptions().budget_bytes(plan.min_peak_bytes));
  ASSERT_TRUE(tight.feasible);
  for (int64_t i = 0; i + 1 < o.num_layers(); ++i) {
    EXPECT_EQ(tight.blocks[i].mode, trainmem::BlockMode::kCheckpoint) << i;
  }
  EXPECT_EQ(tight.blocks.back().mode, trainmem::BlockMode::kStore);
  EXPECT_EQ(tight.recompute_cost, plan.min_peak_cost);
}

TEST(PlannerTest, ImpossibleBudgetSaysTheSmallestReachablePeakAndItsCost) {
  TransformerOptions o;
  const auto plan = trainmem::plan_checkpointing(o, kReferenceBatch, kReferenceSeqLen, trainmem::PlanOptions().budget_bytes(20 << 20));
  EXPECT_FALSE(plan.feasible);
  EXPECT_EQ(plan.min_peak_bytes, 29546504 + 5056);
  EXPECT_EQ(plan.predicted_peak_bytes, plan.min_peak_bytes);  // the plan given is that one
  EXPECT_EQ(plan.recompute_cost, plan.min_peak_cost);
  EXPECT_GT(plan.min_peak_cost, 0.0);
  EXPECT_NE(trainmem::to_string(plan).find("NO PLAN FITS"), std::string::npos);
  EXPECT_THROW(trainmem::plan_checkpointing(o, kReferenceBatch, kReferenceSeqLen, trainmem::PlanOptions().budget_bytes(-1)), c10::Error);
}

// Raising the budget never raises the recompute cost; lowering it never
// raises the peak; every plan fits its budget.
TEST(PlannerTest, PlansAreMonotoneInTheBudget) {
  TransformerOptions o;
  double last_cost = std::numeric_limits<double>::infinity();
  int64_t last_peak = 0;
  int num_feasible = 0;
  std::set<std::string> names;
  for (int64_t mib = 26; mib <= 68; mib += 3) {
    const int64_t budget = mib << 20;
    for (bool selective : {true, false}) {
      const auto plan = trainmem::plan_checkpointing(
          o, kReferenceBatch, kReferenceSeqLen, trainmem::PlanOptions().budget_bytes(budget).selective(selective));
      if (!plan.feasible) {
        EXPECT_GT(plan.min_peak_bytes, budget);
        continue;
      }
      EXPECT_LE(plan.predicted_peak_bytes, budget) << mib << " MiB";
      if (selective) {
        ++num_feasible;
        names.insert(plan.name);
        EXPECT_LE(plan.recompute_cost, last_cost) << mib << " MiB";
        EXPECT_GE(plan.predicted_peak_bytes, last_peak) << mib << " MiB";
        last_cost = plan.recompute_cost;
        last_peak = plan.predicted_peak_bytes;
        std::cout << mib << " MiB: '" << plan.name << "' peak " << plan.predicted_peak_bytes
                  << " B, recompute " << plan.recompute_cost << " FLOPs\n";
      }
    }
  }
  EXPECT_GE(num_feasible, 12);
  EXPECT_GE(names.size(), 2u);  // "mixed" (per-block choices) below 65 MiB, "none" above
  EXPECT_EQ(last_cost, 0.0);  // 68 MiB fits storing everything
}

// A planned step, run for real: the measured peak is within 0.5 % of the
// prediction (the CPU kernels' scratch is the difference) and the gradients
// are the plain step's.
TEST(PlannerTest, PlannedStepRunsAsPredicted) {
  trainmem::CpuMemoryTracker::install();
  TransformerOptions o;
  torch::manual_seed(0);
  trainmem::Transformer model(o);
  auto x = torch::randn({kReferenceBatch, kReferenceSeqLen, o.d_model()});
  const auto plain = trainmem::run_variant(model, x, BlockCheckpointing::none(o.num_layers()));
  for (int64_t budget : {int64_t{40} << 20, int64_t{32} << 20}) {
    const auto plan = trainmem::plan_checkpointing(o, kReferenceBatch, kReferenceSeqLen, trainmem::PlanOptions().budget_bytes(budget));
    ASSERT_TRUE(plan.feasible) << budget;
    const auto checkpointing = plan.checkpointing();
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
    const auto measured = trainmem::measure_step_peak(*model, [&] {
      return model->forward(x.clone(), checkpointing).pow(2).mean();
    }, &opt);
    const double err = static_cast<double>(measured.peak_bytes - plan.predicted_peak_bytes) /
        static_cast<double>(plan.predicted_peak_bytes);
    std::cout << trainmem::to_string(plan) << "measured " << measured.peak_bytes << " B ("
              << to_string(measured.phase) << "), " << 100.0 * err << " % from the prediction\n";
    EXPECT_LT(std::abs(err), 0.005) << budget;
    EXPECT_EQ(measured.activation_bytes, plan.activation_bytes) << budget;
    torch::manual_seed(0);
    trainmem::Transformer fresh(o);
    const auto run = trainmem::run_variant(fresh, x, checkpointing);
    EXPECT_LT(trainmem::max_abs_diff(plain.grads, run.grads), 1e-5) << budget;
  }
}

// Chen et al.'s segments: one kept input per region of several blocks. On
// the capstone sqrt(6) = 2 segments: blocks 0-2 one region, 3-5 stored.
TEST(PlannerTest, SegmentsKeepOneInputPerRegion) {
  torch::manual_seed(0);
  TransformerOptions o;
  trainmem::Transformer model(o);
  auto x = torch::randn({kReferenceBatch, kReferenceSeqLen, o.d_model()});
  const auto plain = trainmem::run_variant(model, x, BlockCheckpointing::none(6));
  const auto sqrt6 = BlockCheckpointing::sqrt(6);
  EXPECT_EQ(sqrt6.name, "sqrt");
  EXPECT_EQ(sqrt6.blocks, (std::vector<bool>{true, false, false, false, false, false}));
  EXPECT_EQ(sqrt6.region_length[0], 3);
  const auto run = trainmem::run_variant(model, x, sqrt6);
  const int64_t unit = 4 * 16 * 64 * 128;
  const int64_t extras = 4 * 4 * 16 * 64 + 4 * 16 * 4 * 64;  // LayerNorm stats, log-sum-exp
  EXPECT_EQ(run.saved.saved_bytes, (1 + 3 * 16 + 1) * unit + 3 * extras) << trainmem::to_string(run.saved);
  EXPECT_LT(trainmem::max_abs_diff(plain.grads, run.grads), 1e-5);
  trainmem::Transformer meta(o);
  trainmem::to_meta(*meta);
  const auto predicted = trainmem::predict_saved_activations(*meta, [&] {
    return meta->forward(at::empty({16, 64, 128}, at::kMeta), sqrt6).pow(2).mean();
  });
  EXPECT_EQ(predicted.saved_bytes, run.saved.saved_bytes);
  EXPECT_THROW(BlockCheckpointing::segments(6, 7), c10::Error);
}

int64_t per_block_min(const TransformerOptions& o, int64_t batch, int64_t seq_len) {
  return trainmem::plan_checkpointing(o, batch, seq_len, trainmem::PlanOptions().max_region_blocks(1)).min_peak_bytes;
}

// 64 thin blocks (activations dominate): segments of several blocks beat
// per-block checkpoints on memory (64 / k + 16 k units against 64 + 16); the
// planner uses them for its smallest peak, and its composed prediction agrees
// with the whole step simulated on meta.
TEST(PlannerTest, DeepStackUsesSegmentsForItsSmallestPeak) {
  const auto o = TransformerOptions().num_layers(64).d_model(32).num_heads(2);
  const int64_t batch = 32, seq_len = 128;
  const auto unlimited = trainmem::plan_checkpointing(o, batch, seq_len);
  const auto plan = trainmem::plan_checkpointing(o, batch, seq_len, trainmem::PlanOptions().budget_bytes(unlimited.min_peak_bytes));
  std::cout << trainmem::to_string(plan) << "per-block choices alone: " << per_block_min(o, batch, seq_len) << " B\n";
  ASSERT_TRUE(plan.feasible);
  int64_t longest = 0;
  for (const auto& b : plan.blocks) longest = std::max(longest, b.region_blocks);
  EXPECT_GT(longest, 1);
  const auto per_block = trainmem::plan_checkpointing(
      o, batch, seq_len, trainmem::PlanOptions().budget_bytes(unlimited.min_peak_bytes).max_region_blocks(1));
  EXPECT_FALSE(per_block.feasible);  // per-block choices alone cannot reach it
  trainmem::Transformer meta(o);
  trainmem::to_meta(*meta);
  torch::optim::AdamW opt(meta->parameters(), torch::optim::AdamWOptions(1e-3));
  const auto checkpointing = plan.checkpointing();
  const auto simulated = trainmem::predict_step_peak(*meta, [&] {
    return meta->forward(at::empty({batch, seq_len, o.d_model()}, at::kMeta), checkpointing).pow(2).mean();
  }, &opt);
  // The composed peak also counts the regions' CPU RNG states alive at the
  // peak (5,056 B each), which the meta step does not see.
  int64_t num_regions = 0;
  for (const auto& b : plan.blocks) num_regions += b.region_blocks >= 1 && b.mode != trainmem::BlockMode::kStore;
  std::cout << "composed " << plan.predicted_peak_bytes << " B, simulated " << simulated.peak_bytes
            << " B, " << num_regions << " regions\n";
  EXPECT_GE(plan.predicted_peak_bytes + 4, simulated.peak_bytes);
  EXPECT_LE(plan.predicted_peak_bytes, simulated.peak_bytes + num_regions * 5056);
  EXPECT_EQ(simulated.activation_bytes, plan.activation_bytes);
}

// Per-op costs may be measured times instead of FLOPs (no time is asserted).
TEST(PlannerTest, MeasuredOpTimesDriveThePlanToo) {
  TransformerOptions o;
  torch::manual_seed(0);
  trainmem::Transformer model(o);
  auto x = torch::randn({kReferenceBatch, kReferenceSeqLen, o.d_model()});
  const auto cost = trainmem::measured_op_cost([&] { model->forward(x); }, 2);
  auto a = at::empty({1024, 128}, at::kMeta), w = at::empty({128, 384}, at::kMeta);
  std::vector<c10::IValue> args = {a, w};
  EXPECT_GT(cost(trainmem::SelectiveOp{"aten::mm", "default", args}), 0.0);  // the QKV matmul, timed
  auto big = at::empty({4096, 4096}, at::kMeta);
  std::vector<c10::IValue> unseen = {big, big};
  EXPECT_GT(cost(trainmem::SelectiveOp{"aten::mm", "default", unseen}), 0.0);  // FLOPs x s/FLOP
  const auto plan = trainmem::plan_checkpointing(o, kReferenceBatch, kReferenceSeqLen, trainmem::PlanOptions().budget_bytes(40 << 20).op_cost(cost));
  ASSERT_TRUE(plan.feasible);
  EXPECT_LE(plan.predicted_peak_bytes, 40 << 20);
  EXPECT_GT(plan.recompute_cost, 0.0);
  EXPECT_THROW(trainmem::measured_op_cost([] {}, 0), c10::Error);
}

TEST(PlannerTest, FlopCostAndOpCallPolicy) {
  auto a = at::empty({8, 16}, at::kMeta), b = at::empty({16, 32}, at::kMeta);
  std::vector<c10::IValue> args = {a, b};
  trainmem::SelectiveOp mm{"aten::mm", "default", args};
  EXPECT_EQ(trainmem::flop_cost(mm), 2.0 * 8 * 16 * 32);
  std::vector<c10::IValue> targs = {a, int64_t{0}, int64_t{1}};
  trainmem::SelectiveOp t{"aten::transpose", "int", targs};
  EXPECT_EQ(trainmem::flop_cost(t), 0.0);
  auto policy = trainmem::save_op_calls_policy({"aten::mm.default#1"});
  trainmem::SelectiveContext fwd{false}, rec{true};
  EXPECT_EQ(policy(fwd, mm), trainmem::CheckpointPolicy::kPreferRecompute);
  EXPECT_EQ(policy(fwd, mm), trainmem::CheckpointPolicy::kMustSave);
  EXPECT_EQ(policy(rec, mm), trainmem::CheckpointPolicy::kPreferRecompute);
  EXPECT_EQ(policy(rec, mm), trainmem::CheckpointPolicy::kMustSave);
  auto plan = BlockCheckpointing::none(3).set_block_policy(1, trainmem::save_matmuls_policy());
  EXPECT_EQ(plan.blocks, (std::vector<bool>{false, true, false}));
  EXPECT_TRUE(static_cast<bool>(plan.options_for(1).context_fn()));
  EXPECT_FALSE(static_cast<bool>(plan.options_for(0).context_fn()));
  EXPECT_THROW(plan.set_block_policy(3, trainmem::save_matmuls_policy()), c10::Error);
}

} // namespace
