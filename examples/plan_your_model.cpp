// Planning your own model, step by step (docs/api.md): the MNIST convnet of
// the PyTorch C++ examples, split into regions, planned for a memory budget
// before it runs, then run under the plan; the measured peak and gradients
// are printed beside the prediction.
//
//   plan_your_model [--batch N]

#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/dropout.h>
#include <torch/nn/functional/pooling.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "trainmem/allocator.h"
#include "trainmem/planner.h"
#include "trainmem/report.h"

namespace F = torch::nn::functional;

// The model, as in pytorch/examples cpp/mnist.
struct Net : torch::nn::Module {
  Net()
      : conv1(torch::nn::Conv2dOptions(1, 10, /*kernel_size=*/5)),
        conv2(torch::nn::Conv2dOptions(10, 20, /*kernel_size=*/5)),
        fc1(320, 50),
        fc2(50, 10) {
    register_module("conv1", conv1);
    register_module("conv2", conv2);
    register_module("conv2_drop", conv2_drop);
    register_module("fc1", fc1);
    register_module("fc2", fc2);
  }
  torch::nn::Conv2d conv1;
  torch::nn::Conv2d conv2;
  torch::nn::Dropout2d conv2_drop;
  torch::nn::Linear fc1;
  torch::nn::Linear fc2;
};

int main(int argc, char** argv) {
  int64_t batch = 256;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--batch") == 0 && i + 1 < argc) {
      batch = std::atoll(argv[++i]);
    } else {
      std::cerr << "usage: plan_your_model [--batch N]\n";
      return 2;
    }
  }
  if (batch < 1) {
    std::cerr << "plan_your_model: expected --batch >= 1, but got " << batch << "\n";
    return 2;
  }
  trainmem::CpuMemoryTracker::install();  // to measure the planned step afterwards
  torch::manual_seed(1);
  auto net = std::make_shared<Net>();
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.5));

  // Step 1: the model as regions, in order; each a Tensor(Tensor) callable
  // with the modules it uses. Net::forward, cut where it is cheap to keep.
  using Modules = std::vector<std::shared_ptr<torch::nn::Module>>;
  trainmem::RegionModel m;
  m.regions = {
      trainmem::Region("conv1", [net](const at::Tensor& x) {
        return at::relu(F::max_pool2d(net->conv1->forward(x), F::MaxPool2dFuncOptions(2)));
      }, Modules{net->conv1.ptr()}),
      trainmem::Region("conv2", [net](const at::Tensor& x) {
        return at::relu(F::max_pool2d(net->conv2_drop->forward(net->conv2->forward(x)),
                                      F::MaxPool2dFuncOptions(2)));
      }, Modules{net->conv2.ptr(), net->conv2_drop.ptr()}),
      trainmem::Region("fc1", [net](const at::Tensor& x) {
        auto h = at::relu(net->fc1->forward(x.view({-1, 320})));
        return F::dropout(h, F::DropoutFuncOptions().p(0.5).training(net->is_training()));
      }, Modules{net->fc1.ptr()}),
      trainmem::Region("fc2", [net](const at::Tensor& x) {
        return at::log_softmax(net->fc2->forward(x), /*dim=*/1);
      }, Modules{net->fc2.ptr()}),
  };
  // Step 2: a sample input on any device (shape and dtype are what matter),
  // the loss of the output, and the optimizer.
  m.input = [batch](c10::Device device) {
    return at::empty({batch, 1, 28, 28}, at::TensorOptions().device(device));
  };
  m.loss = [](const at::Tensor& out) {
    return at::nll_loss(out, at::zeros({out.size(0)}, out.options().dtype(at::kLong)));
  };
  m.optimizer = &sgd;

  // Step 3: plan. Without a budget first (store everything), then for a
  // budget between that and the smallest reachable peak.
  const auto free_plan = trainmem::plan_regions(m);
  const int64_t budget = (free_plan.predicted_peak_bytes + free_plan.min_peak_bytes) / 2;
  const auto plan = trainmem::plan_regions(m, trainmem::PlanOptions().budget_bytes(budget));
  std::cout << fmt::format("MNIST convnet, batch {}, SGD with momentum\n", batch);
  std::cout << fmt::format("store everything: predicted peak {} B; smallest reachable {} B\n",
                           trainmem::with_commas(free_plan.predicted_peak_bytes),
                           trainmem::with_commas(free_plan.min_peak_bytes));
  std::cout << trainmem::to_string(plan);

  // Step 4: run one step under the plan, measured; and compare gradients
  // with the plain step's.
  auto x = at::randn({batch, 1, 28, 28});
  auto step_grads = [&](const trainmem::BlockCheckpointing& how) {
    torch::manual_seed(7);  // the same dropout masks in both runs
    sgd.zero_grad();
    m.loss(trainmem::run_regions(m.regions, x, how)).backward();
    std::vector<at::Tensor> g;
    for (const auto& p : net->parameters()) g.push_back(p.grad().clone());
    sgd.zero_grad();
    return g;
  };
  const auto plain = step_grads(trainmem::BlockCheckpointing::none(4));
  const auto planned = step_grads(plan.checkpointing());
  bool equal = true;
  for (size_t i = 0; i < plain.size(); ++i) equal = equal && at::equal(plain[i], planned[i]);
  const auto checkpointing = plan.checkpointing();
  const auto measured = trainmem::measure_step_peak(*net, [&] {
    return m.loss(trainmem::run_regions(m.regions, x.clone(), checkpointing));
  }, &sgd);
  const double err = 100.0 * static_cast<double>(measured.peak_bytes - plan.predicted_peak_bytes) /
      static_cast<double>(plan.predicted_peak_bytes);
  std::cout << fmt::format("measured step peak {} B ({:+.2f} % from the prediction): {}\n",
                           trainmem::with_commas(measured.peak_bytes), err,
                           measured.peak_bytes <= budget ? "within the budget" : "OVER THE BUDGET");
  const bool saved_equal = plan.activation_bytes == measured.activation_bytes;
  std::cout << fmt::format("saved for backward: predicted {} B, measured {} B: {}\n",
                           trainmem::with_commas(plan.activation_bytes),
                           trainmem::with_commas(measured.activation_bytes), saved_equal ? "equal" : "DIFFERENT");
  std::cout << "gradients under the plan " << (equal ? "equal" : "DIFFER FROM") << " the plain step's\n";
  return equal && saved_equal && measured.peak_bytes <= budget && plan.feasible ? 0 : 1;
}
