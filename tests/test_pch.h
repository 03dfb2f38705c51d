// Precompiled header of the test binary.
#pragma once
#include <gtest/gtest.h>
#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
