// The PyTorch C++ examples' MNIST convnet (pytorch/examples cpp/mnist's Net),
// the one definition the tests share (meta_test.cpp, audit_trainers_test.cpp,
// region_planner_conv_test.cpp). The examples (examples/mnist_audit.cpp,
// examples/plan_your_model.cpp) keep their own copy: each is read as a
// standalone program.
//
// Modules are made and registered in the order conv1, conv2, conv2_drop, fc1,
// fc2, as in each of the three copies this replaces: a seeded construction
// draws the same weights, and the forward calls the same ops, so every figure
// the tests measured is unchanged.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/functional/dropout.h>
#include <torch/nn/functional/pooling.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

namespace trainmem::testing {

struct MnistNetImpl : torch::nn::Module {
  MnistNetImpl()
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 10, 5)))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(10, 20, 5)))),
        conv2_drop(register_module("conv2_drop", torch::nn::Dropout2d())),
        fc1(register_module("fc1", torch::nn::Linear(320, 50))),
        fc2(register_module("fc2", torch::nn::Linear(50, 10))) {}

  // (N, 1, 28, 28) -> (N, 10) log-probabilities.
  at::Tensor forward(at::Tensor x) {
    namespace F = torch::nn::functional;
    x = at::relu(F::max_pool2d(conv1->forward(x), F::MaxPool2dFuncOptions(2)));                     // (N, 10, 12, 12)
    x = at::relu(F::max_pool2d(conv2_drop->forward(conv2->forward(x)), F::MaxPool2dFuncOptions(2)));  // (N, 20, 4, 4)
    x = at::relu(fc1->forward(x.view({-1, 320})));                                                 // (N, 50)
    x = F::dropout(x, F::DropoutFuncOptions().p(0.5).training(is_training()));
    return at::log_softmax(fc2->forward(x), /*dim=*/1);
  }

  torch::nn::Conv2d conv1;
  torch::nn::Conv2d conv2;
  torch::nn::Dropout2d conv2_drop;
  torch::nn::Linear fc1;
  torch::nn::Linear fc2;
};
TORCH_MODULE(MnistNet);

}  // namespace trainmem::testing
