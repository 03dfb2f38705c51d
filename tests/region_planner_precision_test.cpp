// The region planner with a GradScaler and with fp32 master weights
// (RegionModel::grad_scaler, master_weights; Note [Planned steps with a
// scaler or master weights]), on config-file models (model_regions): the
// plan's predicted peak, for the plan without a budget and for a budgeted
// one, equals the same step run on CPU to the byte; the gradients under the
// plan equal the plain run's bit for bit; and plan_regions_cuda's step,
// planned without checkpointing, predicts the allocated peak that
// estimate_model predicts for the model as a whole.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include "trainmem/allocator.h"
#include "trainmem/cuda_predict.h"
#include "trainmem/grad_scaler.h"
#include "trainmem/master_weights.h"
#include "trainmem/meta.h"
#include "trainmem/models/estimate.h"
#include "trainmem/planner.h"
#include "region_planner_check.h"

namespace {

using trainmem::CheckpointPlan;
using trainmem::PlanOptions;
using trainmem::Precision;
using trainmem::RegionModel;

std::string data(const std::string& name) {
  return std::string(TRAINMEM_TEST_DATA_DIR) + "/" + name;
}

std::vector<at::Tensor> trainable_of(torch::nn::Module& module) {
  std::vector<at::Tensor> t;
  for (const auto& p : module.parameters()) {
    if (p.requires_grad()) t.push_back(p);
  }
  return t;
}

// AdamW over what it is given (the masters, or the trainable parameters).
std::unique_ptr<torch::optim::Optimizer> adamw(std::vector<at::Tensor> params) {
  return std::make_unique<torch::optim::AdamW>(std::move(params), torch::optim::AdamWOptions(1e-3));
}

int64_t bytes_of(const std::vector<at::Tensor>& ts) {
  int64_t b = 0;
  for (const auto& t : ts) b += static_cast<int64_t>(t.storage().nbytes());
  return b;
}

// The plan without a budget and one for a budget halfway down to the
// smallest reachable peak.
std::vector<CheckpointPlan> plans_of(const RegionModel& m) {
  const auto free_plan = trainmem::plan_regions(m);
  EXPECT_TRUE(free_plan.feasible);
  EXPECT_EQ(free_plan.name, "none") << to_string(free_plan);
  EXPECT_EQ(free_plan.whole_step_rounds, 1);
  const int64_t mid = (free_plan.predicted_peak_bytes + free_plan.min_peak_bytes) / 2;
  const auto mid_plan = trainmem::plan_regions(m, PlanOptions().budget_bytes(mid));
  EXPECT_TRUE(mid_plan.feasible) << to_string(mid_plan);
  EXPECT_NE(mid_plan.name, "none");
  EXPECT_LE(mid_plan.predicted_peak_bytes, mid);
  return {free_plan, mid_plan};
}

// Gradients under the plan equal the plain run's, bit for bit.
void expect_same_grads(torch::nn::Module& module, const RegionModel& m, const CheckpointPlan& plan,
                       const std::string& what) {
  const auto x = m.input(at::kCPU);
  const auto n = static_cast<int64_t>(m.regions.size());
  trainmem::testing::expect_equal_grads(trainmem::testing::grads_under(module, m, x, trainmem::BlockCheckpointing::none(n)),
                                        trainmem::testing::grads_under(module, m, x, plan.checkpointing()),
                                        what + " " + plan.name);
}

TEST(RegionPlannerPrecisionTest, Fp16AutocastWithAGradScalerEqualsTheCpuStep) {
  trainmem::CpuMemoryTracker::install();
  const auto config = trainmem::load_hf_config(data("tiny_llama.json"));
  const auto o = trainmem::ModelEstimateOptions().batch(8).seq_len(64).precision(Precision::kFp16Autocast);
  torch::manual_seed(0);
  auto model = trainmem::build_model(config, o);
  auto m = trainmem::model_regions(model, o, c10::kCPU);
  ASSERT_TRUE(m.grad_scaler.has_value());
  ASSERT_FALSE(m.master_weights);
  // A scale whose fp16 gradients stay finite, so the CPU step is taken, as
  // the step on meta always is (the default 65536 overflows on this model's
  // first steps and the scaler skips them: no AdamW state, another step).
  m.grad_scaler = trainmem::GradScalerOptions().init_scale(1.0);
  m.make_optimizer = adamw;
  for (const auto& plan : plans_of(m)) {
    expect_same_grads(*model.module, m, plan, "fp16-autocast");
    // The step as a user writes it with trainmem's GradScaler (the loss live
    // to the end of the step, the scaled loss freed after backward).
    torch::optim::AdamW opt(trainable_of(*model.module), torch::optim::AdamWOptions(1e-3));
    trainmem::GradScaler scaler(*m.grad_scaler);
    const auto checkpointing = plan.checkpointing();
    int64_t steps_taken = 0;
    const auto measured = trainmem::measure_step_function({model.module.get()}, {&opt}, [&] {
      for (auto& p : model.module->parameters()) p.mutable_grad().reset();
      const at::Tensor loss = m.loss(trainmem::run_regions(m.regions, m.input(at::kCPU), checkpointing));
      scaler.scale(loss).backward();
      scaler.unscale_(opt);
      steps_taken += scaler.step(opt) ? 1 : 0;
      scaler.update();
    });
    EXPECT_EQ(steps_taken, 2) << "a CPU step was skipped (inf/NaN gradients)";
    // The scaler's scale and growth tracker, made in the warm-up step, live
    // through the measured one (measure_step_function's start leaves them out).
    const int64_t scaler_bytes = bytes_of(scaler.tensors());
    EXPECT_EQ(scaler_bytes, 8);
    std::printf("fp16-autocast '%s' (budget %lld B): predicted %lld B (%s), measured %lld B + scaler %lld B\n",
                plan.name.c_str(), static_cast<long long>(plan.budget_bytes),
                static_cast<long long>(plan.predicted_peak_bytes), trainmem::to_string(plan.peak_phase).c_str(),
                static_cast<long long>(measured.peak_bytes), static_cast<long long>(scaler_bytes));
    EXPECT_EQ(plan.predicted_peak_bytes, measured.peak_bytes + scaler_bytes) << to_string(plan);
    if (plan.budget_bytes > 0) {
      EXPECT_LE(measured.peak_bytes + scaler_bytes, plan.budget_bytes);
    }
  }
}

TEST(RegionPlannerPrecisionTest, Bf16WithFp32MasterWeightsEqualsTheCpuStep) {
  trainmem::CpuMemoryTracker::install();
  const auto config = trainmem::load_hf_config(data("tiny_llama.json"));
  const auto o = trainmem::ModelEstimateOptions().batch(8).seq_len(64).precision(Precision::kBf16Master);
  torch::manual_seed(0);
  auto model = trainmem::build_model(config, o);  // in bf16
  auto m = trainmem::model_regions(model, o, c10::kCPU);
  ASSERT_TRUE(m.master_weights);
  ASSERT_FALSE(m.grad_scaler.has_value());
  m.make_optimizer = adamw;
  for (const auto& plan : plans_of(m)) {
    expect_same_grads(*model.module, m, plan, "bf16-master");
    trainmem::MasterWeights masters(trainable_of(*model.module));
    torch::optim::AdamW opt(masters->optimized(), torch::optim::AdamWOptions(1e-3));
    const auto checkpointing = plan.checkpointing();
    const auto measured = trainmem::measure_step_function({model.module.get(), masters.get()}, {&opt}, [&] {
      for (auto& p : model.module->parameters()) p.mutable_grad().reset();
      {
        // Named, so the logits are freed before backward, as in the planned
        // step (a temporary would keep them to the end of the statement).
        const at::Tensor loss = m.loss(trainmem::run_regions(m.regions, m.input(at::kCPU), checkpointing));
        loss.backward();
      }  // the loss freed
      masters->step(opt);
    });
    std::printf("bf16-master '%s' (budget %lld B): predicted %lld B (%s), measured %lld B (parameters and masters "
                "%lld B, AdamW state %lld B)\n",
                plan.name.c_str(), static_cast<long long>(plan.budget_bytes),
                static_cast<long long>(plan.predicted_peak_bytes), trainmem::to_string(plan.peak_phase).c_str(),
                static_cast<long long>(measured.peak_bytes), static_cast<long long>(measured.param_bytes),
                static_cast<long long>(measured.optimizer_state_bytes));
    EXPECT_EQ(plan.predicted_peak_bytes, measured.peak_bytes) << to_string(plan);
    if (plan.budget_bytes > 0) {
      EXPECT_LE(measured.peak_bytes, plan.budget_bytes);
    }
  }
}

// A master-weight step needs an optimizer made over the masters: refused,
// named, when given one over the model's own parameters.
TEST(RegionPlannerPrecisionTest, RefusesWhatItCannotPlan) {
  const auto config = trainmem::load_hf_config(data("tiny_llama.json"));
  const auto o = trainmem::ModelEstimateOptions().batch(2).seq_len(24).precision(Precision::kBf16Master);
  trainmem::HfModel model;
  {
    trainmem::MetaInitGuard meta;
    model = trainmem::build_model(config, o);
  }
  auto m = trainmem::model_regions(model, o, c10::kCPU);
  const auto error_of = [&](const RegionModel& rm) -> std::string {
    try {
      (void)trainmem::plan_regions(rm);
    } catch (const c10::Error& e) {
      return e.what_without_backtrace();
    }
    return "";
  };
  torch::optim::AdamW opt(model.module->parameters(), torch::optim::AdamWOptions(1e-3));
  m.optimizer = &opt;
  EXPECT_NE(error_of(m).find("master_weights needs make_optimizer"), std::string::npos) << error_of(m);
}

// plan_regions_cuda with a budget that needs no checkpointing predicts the
// allocated and reserved peaks estimate_model predicts for the whole model,
// on its own path (the model's loss, not the regions), in every precision:
// fp16 autocast with a GradScaler, bf16 weights with fp32 masters, bf16
// autocast, a bf16 model, an fp16 model, fp16 weights with fp32 masters and
// a GradScaler, fp32. The LLaMA family's regions carry the rotary
// tables from the embedding to every block as the model shares them; before,
// each block made its own and the plan was 3,072 B (tiny_llama, fp16
// autocast) and 4,096 B (tiny_qwen3) above the estimate.
TEST(RegionPlannerPrecisionTest, CudaPlanWithoutCheckpointingEqualsTheCudaEstimate) {
  struct Case {
    const char* config;
    Precision precision;
    int64_t allocated;
  };
  for (const auto& c : {Case{"tiny_gpt2.json", Precision::kFp16Autocast, 20553728},
                        Case{"tiny_gpt2.json", Precision::kBf16Master, 20411392},
                        Case{"tiny_llama.json", Precision::kBf16Master, 19431936},
                        Case{"tiny_llama.json", Precision::kFp16Autocast, 19283968},
                        Case{"tiny_llama.json", Precision::kBf16Autocast, 19282432},
                        Case{"tiny_qwen3.json", Precision::kFp16Autocast, 18550272},
                        Case{"tiny_qwen3.json", Precision::kBf16, 17933824},
                        Case{"tiny_llama.json", Precision::kFp16, 18247168},
                        Case{"tiny_llama.json", Precision::kFp16Master, 19433472},
                        Case{"tiny_llama_mha5.json", Precision::kFp32, 19468800}}) {
    const auto config = trainmem::load_hf_config(data(c.config));
    const auto o = trainmem::ModelEstimateOptions().batch(2).seq_len(24).precision(c.precision).cuda(
        trainmem::CudaPredictOptions());
    const auto e = trainmem::estimate_model(config, o);
    ASSERT_TRUE(e.cuda.has_value());
    trainmem::HfModel model;
    {
      trainmem::MetaInitGuard meta;
      model = trainmem::build_model(config, o);
    }
    auto m = trainmem::model_regions(model, o, c10::kCUDA);
    m.make_optimizer = c.precision == Precision::kBf16Master || c.precision == Precision::kFp16Master
                           ? trainmem::OptimizerFactory(adamw)
                           : trainmem::OptimizerFactory([](std::vector<at::Tensor> p) {
                               std::vector<at::Tensor> t;
                               for (auto& x : p) if (x.requires_grad()) t.push_back(x);
                               return adamw(std::move(t));
                             });
    const auto r = trainmem::plan_regions_cuda(m, *model.module, PlanOptions().budget_bytes(int64_t{1} << 30),
                                               trainmem::CudaBudgetKind::kAllocated, trainmem::CudaPredictOptions());
    std::printf("%s %s on CUDA: plan '%s' %lld B allocated, %lld B reserved; estimate %lld B, %lld B\n", c.config,
                trainmem::precision_name(c.precision), r.plan.name.c_str(),
                static_cast<long long>(r.cuda.max_memory_allocated_bytes),
                static_cast<long long>(r.cuda.max_memory_reserved_bytes),
                static_cast<long long>(e.cuda->max_memory_allocated_bytes),
                static_cast<long long>(e.cuda->max_memory_reserved_bytes));
    EXPECT_TRUE(r.feasible);
    EXPECT_EQ(r.plan.name, "none");
    EXPECT_EQ(r.cuda.max_memory_allocated_bytes, e.cuda->max_memory_allocated_bytes) << c.config;
    EXPECT_EQ(r.cuda.max_memory_reserved_bytes, e.cuda->max_memory_reserved_bytes) << c.config;
    EXPECT_EQ(r.cuda.max_memory_allocated_bytes, c.allocated) << c.config;
  }
}

} // namespace
