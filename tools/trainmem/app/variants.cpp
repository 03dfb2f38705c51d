#include "app/variants.h"

#include <algorithm>
#include <optional>

#include <ATen/TensorOperators.h>
#include <ATen/ops/abs.h>
#include <ATen/ops/max.h>
#include <ATen/ops/mean.h>
#include <ATen/ops/pow.h>
#include <c10/util/Exception.h>
#include <torch/optim/adamw.h>

#include "trainmem/allocator.h"
#include "trainmem/optimizer_in_backward.h"
#include "trainmem/selective.h"

namespace trainmem {

std::vector<BlockCheckpointing> reference_variants(int64_t n) {
  return {BlockCheckpointing::none(n), BlockCheckpointing::full(n), BlockCheckpointing::every(n, 2),
          BlockCheckpointing::selective(n, save_matmuls_policy())};
}

VariantRun run_variant(Transformer& model, const at::Tensor& x, const BlockCheckpointing& plan) {
  VariantRun run;
  run.name = plan.name;
  for (auto& p : model->parameters()) {
    p.mutable_grad().reset();  // compare this step's gradients alone
  }
  SavedTensorMeter meter(*model);
  std::optional<PeakWindow> window;
  if (CpuMemoryTracker::installed()) {
    window.emplace(CpuMemoryTracker::install());
  }
  at::Tensor loss;
  {
    SavedTensorMeterGuard scope(meter);
    loss = model->forward(x, plan).pow(2).mean();
  }
  run.saved = meter.report();
  loss.backward();
  loss = at::Tensor();
  if (window) {
    run.peak_bytes = window->peak_bytes();
    run.peak_above_start_bytes = window->peak_bytes() - window->start_bytes();
  }
  for (auto& p : model->parameters()) {
    run.grads.push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
    p.mutable_grad().reset();
  }
  return run;
}

OptimizerInBackwardPeaks measure_optimizer_in_backward(const TransformerOptions& o, int64_t batch, int64_t seq_len) {
  TORCH_CHECK(CpuMemoryTracker::installed(),
              "measure_optimizer_in_backward: install the CpuMemoryTracker first");
  auto& tracker = CpuMemoryTracker::install();
  const auto adamw = torch::optim::AdamWOptions(1e-3);
  auto measure = [&](bool in_backward) {
    torch::manual_seed(0);
    Transformer model(o);
    auto x = torch::randn({batch, seq_len, o.d_model()});
    int64_t peak = 0;
    std::unique_ptr<OptimizerInBackward> oib;
    std::unique_ptr<torch::optim::AdamW> opt;
    if (in_backward) {
      oib = std::make_unique<OptimizerInBackward>(model->parameters(), [adamw](std::vector<at::Tensor> p) {
        return std::make_unique<torch::optim::AdamW>(p, adamw);
      });
    } else {
      opt = std::make_unique<torch::optim::AdamW>(model->parameters(), adamw);
    }
    for (int step = 0; step < 2; ++step) {  // the first step is the warm-up
      PeakWindow window(tracker);
      if (opt) {
        opt->zero_grad();
      }
      model->forward(x).pow(2).mean().backward();
      if (opt) {
        opt->step();
      }
      peak = window.peak_bytes();
    }
    return peak;
  };
  OptimizerInBackwardPeaks r;
  r.plain_peak_bytes = measure(false);
  r.peak_bytes = measure(true);
  r.grad_bytes = 4 * transformer_num_params(o);
  return r;
}

double max_abs_diff(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  TORCH_CHECK(a.size() == b.size(), "max_abs_diff: expected lists of the same length, but got ",
              a.size(), " and ", b.size());
  double worst = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    TORCH_CHECK(a[i].defined() == b[i].defined(), "max_abs_diff: tensor ", i,
                " is defined in one list only");
    if (!a[i].defined()) {
      continue;
    }
    TORCH_CHECK(a[i].sizes() == b[i].sizes(), "max_abs_diff: tensor ", i, " has shape ",
                a[i].sizes(), " in one list and ", b[i].sizes(), " in the other");
    worst = std::max(worst, (a[i] - b[i]).abs().max().item<double>());
  }
  return worst;
}

} // namespace trainmem
