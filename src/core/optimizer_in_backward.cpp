#include "trainmem/optimizer_in_backward.h"

#include <cmath>
#include <mutex>
#include <unordered_map>

#include <ATen/ops/mul.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/optim/optimizer.h>

namespace trainmem {

struct OptimizerInBackward::State {
  enum class Mode { kStep, kMeasureNorm, kClipAndStep };
  std::vector<at::Tensor> params;
  std::vector<std::unique_ptr<torch::optim::Optimizer>> optimizers;
  std::unordered_map<const c10::TensorImpl*, size_t> index;
  std::vector<int64_t> backward_count;
  int64_t accumulation_steps = 1;
  int64_t steps = 0;
  std::mutex mutex;  // hooks of different devices may fire concurrently
  Mode mode = Mode::kStep;
  double norm_sq = 0.0;
  double clip_coef = 1.0;

  void on_grad(const at::Tensor& p) {
    auto it = index.find(p.unsafeGetTensorImpl());
    if (it == index.end()) {
      return;
    }
    const size_t i = it->second;
    std::lock_guard<std::mutex> lock(mutex);
    auto& grad = p.mutable_grad();
    if (mode == Mode::kMeasureNorm) {
      norm_sq += grad.to(at::kDouble).pow(2).sum().item<double>();
      grad.reset();
      return;
    }
    if (++backward_count[i] % accumulation_steps != 0) {
      return;  // keep accumulating
    }
    if (mode == Mode::kClipAndStep && clip_coef < 1.0) {
      grad.mul_(clip_coef);
    }
    optimizers[i]->step();
    grad.reset();  // free it now: the gradient bucket never exists whole
    if (i == 0) {
      ++steps;
    }
  }
};

namespace {

// Never throws: a failing step is reported and backward goes on.
class StepHook final : public torch::autograd::PostAccumulateGradHook {
 public:
  explicit StepHook(std::weak_ptr<OptimizerInBackward::State> state) : state_(std::move(state)) {}
  void operator()(const torch::autograd::Variable& tensor) override {
    auto state = state_.lock();
    if (!state) {
      return;
    }
    try {
      state->on_grad(tensor);
    } catch (const std::exception& e) {
      TORCH_WARN("trainmem::OptimizerInBackward: the step for a parameter of shape ",
                 tensor.sizes(), " failed and was skipped: ", e.what());
    }
  }

 private:
  std::weak_ptr<OptimizerInBackward::State> state_;
};

} // namespace

OptimizerInBackward::OptimizerInBackward(
    std::vector<at::Tensor> parameters,
    OptimizerFactory factory,
    int64_t accumulation_steps)
    : state_(std::make_shared<State>()) {
  TORCH_CHECK(static_cast<bool>(factory), "OptimizerInBackward: the optimizer factory is empty");
  TORCH_CHECK(accumulation_steps >= 1,
              "OptimizerInBackward: expected accumulation_steps >= 1, but got ", accumulation_steps);
  state_->accumulation_steps = accumulation_steps;
  for (auto& p : parameters) {
    if (!p.requires_grad() || state_->index.count(p.unsafeGetTensorImpl()) != 0) {
      continue;
    }
    TORCH_CHECK(!torch::autograd::impl::post_acc_grad_hooks(p),
                "OptimizerInBackward: a parameter of shape ", p.sizes(),
                " already has a post-accumulate-grad hook (LibTorch allows one per tensor)");
    auto opt = factory({p});
    TORCH_CHECK(opt != nullptr, "OptimizerInBackward: the factory returned no optimizer");
    state_->index.emplace(p.unsafeGetTensorImpl(), state_->params.size());
    state_->params.push_back(p);
    state_->optimizers.push_back(std::move(opt));
  }
  TORCH_CHECK(!state_->params.empty(),
              "OptimizerInBackward: none of the ", parameters.size(),
              " parameters requires grad");
  state_->backward_count.assign(state_->params.size(), 0);
  for (auto& p : state_->params) {
    torch::autograd::impl::set_post_acc_grad_hooks(p, std::make_unique<StepHook>(state_));
  }
}

OptimizerInBackward::~OptimizerInBackward() {
  for (auto& p : state_->params) {
    try {
      torch::autograd::impl::post_acc_grad_hooks(p).reset();
    } catch (...) {
    }
  }
}

void OptimizerInBackward::set_lr(double lr) {
  TORCH_CHECK(lr >= 0, "OptimizerInBackward::set_lr: expected lr >= 0, but got ", lr);
  for (auto& opt : state_->optimizers) {
    for (auto& group : opt->param_groups()) {
      group.options().set_lr(lr);
    }
  }
}

double OptimizerInBackward::lr() const {
  return state_->optimizers.front()->param_groups().front().options().get_lr();
}

int64_t OptimizerInBackward::num_steps() const {
  return state_->steps;
}

std::vector<const torch::optim::Optimizer*> OptimizerInBackward::optimizers() const {
  std::vector<const torch::optim::Optimizer*> out;
  for (const auto& o : state_->optimizers) {
    out.push_back(o.get());
  }
  return out;
}

torch::optim::Optimizer& OptimizerInBackward::optimizer_for(const at::Tensor& parameter) {
  auto it = state_->index.find(parameter.unsafeGetTensorImpl());
  TORCH_CHECK(it != state_->index.end(),
              "OptimizerInBackward::optimizer_for: this parameter (shape ", parameter.sizes(),
              ") is not stepped in backward here");
  return *state_->optimizers[it->second];
}

double OptimizerInBackward::clip_grad_norm(double max_norm,
                                           const std::function<void()>& forward_backward) {
  TORCH_CHECK(max_norm > 0, "OptimizerInBackward::clip_grad_norm: expected max_norm > 0, but got ",
              max_norm);
  TORCH_CHECK(state_->accumulation_steps == 1,
              "OptimizerInBackward::clip_grad_norm: clipping with accumulation_steps = ",
              state_->accumulation_steps, " is not supported (the norm needs the full sum)");
  struct ModeReset {
    State& s;
    ~ModeReset() { s.mode = State::Mode::kStep; }
  } reset{*state_};
  state_->mode = State::Mode::kMeasureNorm;
  state_->norm_sq = 0.0;
  forward_backward();
  const double total = std::sqrt(state_->norm_sq);
  state_->clip_coef = max_norm / (total + 1e-6);
  state_->mode = State::Mode::kClipAndStep;
  forward_backward();
  return total;
}

} // namespace trainmem
