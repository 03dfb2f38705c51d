// A classic LibTorch training loop (the MNIST convnet of the PyTorch C++
// examples, on synthetic data so it runs anywhere) audited by trainmem.
// The lines marked "trainmem" are all it takes.
//
//   mnist_audit [--html FILE] [--steps N]

#include <cstring>
#include <fstream>
#include <iostream>
#include <string>

#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/dropout.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/functional/pooling.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <torch/types.h>
#include <torch/utils.h>

#include "trainmem/allocator.h"
#include "trainmem/audit.h"
#include "trainmem/report.h"

namespace F = torch::nn::functional;

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

  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(F::max_pool2d(conv1->forward(x), F::MaxPool2dFuncOptions(2)));
    x = torch::relu(F::max_pool2d(conv2_drop->forward(conv2->forward(x)), F::MaxPool2dFuncOptions(2)));
    x = x.view({-1, 320});
    x = torch::relu(fc1->forward(x));
    x = F::dropout(x, F::DropoutFuncOptions().p(0.5).training(is_training()));
    x = fc2->forward(x);
    return torch::log_softmax(x, /*dim=*/1);
  }

  torch::nn::Conv2d conv1;
  torch::nn::Conv2d conv2;
  torch::nn::Dropout2d conv2_drop;
  torch::nn::Linear fc1;
  torch::nn::Linear fc2;
};

int main(int argc, char** argv) {
  std::string html;
  int steps = 3;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--html") == 0 && i + 1 < argc) {
      html = argv[++i];
    } else if (std::strcmp(argv[i], "--steps") == 0 && i + 1 < argc) {
      steps = std::stoi(argv[++i]);
    } else {
      std::cerr << "usage: mnist_audit [--html FILE] [--steps N]\n";
      return 2;
    }
  }
  trainmem::CpuMemoryTracker::install();  // trainmem: first, so the model's bytes are seen

  torch::manual_seed(1);
  Net model;
  torch::optim::SGD optimizer(model.parameters(), torch::optim::SGDOptions(0.01).momentum(0.5));
  trainmem::Audit audit(model, &optimizer, torch::kCPU, trainmem::AuditOptions().title("MNIST convnet"));  // trainmem

  model.train();
  for (int step = 0; step < steps; ++step) {
    auto data = torch::randn({64, 1, 28, 28});  // a batch of synthetic digits
    auto target = torch::randint(0, 10, {64}, torch::kLong);
    auto audited = audit.step();                 // trainmem: this step is audited
    audit.mark_input(data);                      // trainmem (optional): colour the batch as INPUT
    optimizer.zero_grad();
    auto output = model.forward(data);
    auto loss = F::nll_loss(output, target);
    loss.backward();
    optimizer.step();
  }

  const auto report = audit.report();             // trainmem
  std::cout << trainmem::to_text(report);         // trainmem
  if (!html.empty()) {
    std::ofstream(html) << trainmem::to_html(report);
  }
  return 0;
}
