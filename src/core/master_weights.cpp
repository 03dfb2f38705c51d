// fp32 master weights for a bf16 or fp16 model (master_weights.h).

#include "trainmem/master_weights.h"

#include <string>

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include "trainmem/grad_scaler.h"

namespace trainmem {

MasterWeightsImpl::MasterWeightsImpl(const std::vector<at::Tensor>& trainable) {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < trainable.size(); ++i) {
    const auto& p = trainable[i];
    TORCH_CHECK(p.defined() && p.is_floating_point(), "MasterWeights: trainable tensor ", i,
                " is not a floating-point tensor");
    if (p.scalar_type() == at::kBFloat16 || p.scalar_type() == at::kHalf) {
      weights_.push_back(p);
      masters_.push_back(register_parameter("master" + std::to_string(i), p.detach().to(at::kFloat),
                                            /*requires_grad=*/false));
      optimized_.push_back(masters_.back());
    } else {
      optimized_.push_back(p);
    }
  }
}

void MasterWeightsImpl::to_master_grads() {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < weights_.size(); ++i) {
    if (weights_[i].grad().defined()) {
      masters_[i].mutable_grad() = weights_[i].grad().to(at::kFloat);
      weights_[i].mutable_grad().reset();
    }
  }
}

void MasterWeightsImpl::from_masters() {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < weights_.size(); ++i) {
    weights_[i].copy_(masters_[i]);
    masters_[i].mutable_grad().reset();
  }
}

void MasterWeightsImpl::step(torch::optim::Optimizer& optimizer) {
  to_master_grads();
  optimizer.step();
  from_masters();
}

bool MasterWeightsImpl::step(torch::optim::Optimizer& optimizer, GradScaler& scaler) {
  to_master_grads();
  scaler.unscale_(optimizer);
  const bool stepped = scaler.step(optimizer);
  scaler.update();
  from_masters();
  return stepped;
}

} // namespace trainmem
