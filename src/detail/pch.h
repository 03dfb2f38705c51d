// Precompiled header for the library's own sources (never installed): the
// LibTorch headers nearly every translation unit includes.
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
