// A ResNet basic block: conv 3x3 + BatchNorm + ReLU, conv 3x3 + BatchNorm,
// the shortcut (a 1x1 conv + BatchNorm projection where the stride or the
// width changes), ReLU. The one definition the region planner's tests share
// (region_planner_conv_test.cpp's ResNet-style net, region_planner_skip_test.cpp's
// U-Net encoder). Modules are registered conv1, bn1, conv2, bn2, down: a
// seeded construction draws the same weights as each copy it replaces.
#pragma once

#include <cstdint>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/pimpl.h>

namespace trainmem::testing {

struct BasicBlockImpl : torch::nn::Module {
  BasicBlockImpl(int64_t in, int64_t out, int64_t stride)
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3)
                                                             .stride(stride).padding(1).bias(false)))),
        bn1(register_module("bn1", torch::nn::BatchNorm2d(out))),
        conv2(register_module("conv2",
                              torch::nn::Conv2d(torch::nn::Conv2dOptions(out, out, 3).padding(1).bias(false)))),
        bn2(register_module("bn2", torch::nn::BatchNorm2d(out))) {
    if (stride != 1 || in != out) {
      down = register_module(
          "down", torch::nn::Sequential(
                      torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 1).stride(stride).bias(false)),
                      torch::nn::BatchNorm2d(out)));
    }
  }
  at::Tensor forward(const at::Tensor& x) {
    auto h = at::relu(bn1->forward(conv1->forward(x)));
    h = bn2->forward(conv2->forward(h));
    return at::relu(h + (down ? down->forward(x) : x));
  }
  torch::nn::Conv2d conv1;
  torch::nn::BatchNorm2d bn1;
  torch::nn::Conv2d conv2;
  torch::nn::BatchNorm2d bn2;
  torch::nn::Sequential down{nullptr};
};
TORCH_MODULE(BasicBlock);

} // namespace trainmem::testing
