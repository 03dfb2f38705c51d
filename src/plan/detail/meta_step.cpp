#include "plan/detail/meta_step.h"

#include "core/detail/autocast_on_meta.h"

#include <optional>
#include <sstream>
#include <string>

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include "detail/backward_on_meta.h"

namespace trainmem::detail {

namespace {

std::string describe(const at::Tensor& t) {
  if (!t.defined()) {
    return "an undefined tensor";
  }
  std::ostringstream os;
  os << "a tensor of shape " << t.sizes() << " on " << t.device();
  return os.str();
}

void check_loss(const at::Tensor& loss, const StepOptions& o) {
  const bool device_ok = loss.defined() && (!o.on_meta || loss.is_meta());
  if (o.forward_only) {
    TORCH_CHECK(device_ok, o.who, ": loss_fn must return a ", o.on_meta ? "meta " : "", "tensor, but got ",
                describe(loss));
    return;
  }
  TORCH_CHECK(device_ok && loss.numel() == 1, o.who, ": loss_fn must return a scalar", o.on_meta ? " meta" : "",
              " tensor, but got ", describe(loss));
}

// One step (Note [A step twice with an optimizer]); the forward's output
// with forward_only.
at::Tensor run_step(torch::nn::Module& module, const std::function<at::Tensor()>& loss_fn,
                    torch::optim::Optimizer* optimizer, const StepOptions& options, const StepMark& mark, int step) {
  mark(step, StepPoint::kBegin);
  for (auto& p : module.parameters()) {
    p.mutable_grad().reset();  // zero_grad(set_to_none=True)
  }
  if (optimizer != nullptr) {
    optimizer->zero_grad();
  }
  mark(step, StepPoint::kForward);
  at::Tensor loss;
  {
    // The forward's ops on meta get autocast's casts where the user's code
    // enables it (Note [Autocast on meta]); backward follows the forward's
    // types, as on the device.
    std::optional<AutocastOnMeta> autocast;
    if (options.on_meta) {
      autocast.emplace(options.autocast_device);
    }
    loss = loss_fn();
  }
  check_loss(loss, options);
  mark(step, StepPoint::kBackward);
  if (options.forward_only) {
    mark(step, StepPoint::kOptimizerStep);
    mark(step, StepPoint::kEnd);
    return loss;
  }
  if (options.on_meta) {
    // Gradients meet as the device's engine adds them: in place where it
    // holds the only reference (Note [Gradient accumulation on meta]).
    BackwardOnMeta::run(loss);
  } else {
    loss.backward();
  }
  loss = at::Tensor();
  mark(step, StepPoint::kOptimizerStep);
  if (optimizer != nullptr) {
    optimizer->step();
  }
  mark(step, StepPoint::kEnd);
  return at::Tensor();
}

} // namespace

at::Tensor run_steps(torch::nn::Module& module, const std::function<at::Tensor()>& loss_fn,
                     torch::optim::Optimizer* optimizer, const StepOptions& options, const StepMark& mark) {
  const bool warm_up = optimizer != nullptr && !options.first_step && !options.forward_only;
  at::Tensor out;
  for (int step = 0; step < (warm_up ? 2 : 1); ++step) {
    out = run_step(module, loss_fn, optimizer, options, mark, step);
  }
  return out;
}

at::Tensor run_meta_step(torch::nn::Module& module, const std::function<at::Tensor()>& loss_fn,
                         torch::optim::Optimizer* optimizer, StepOptions options, const StepMark& mark) {
  options.on_meta = true;
  return run_steps(module, loss_fn, optimizer, options, mark);
}

void check_step_function_args(const std::vector<torch::nn::Module*>& modules,
                     const std::vector<torch::optim::Optimizer*>& optimizers, const std::function<void()>& step,
                     int64_t warmup_steps, const char* who) {
  TORCH_CHECK(static_cast<bool>(step), who, ": the step function is empty");
  TORCH_CHECK(!modules.empty(), who, ": expected at least one module (what the step trains), but got none");
  TORCH_CHECK(warmup_steps >= 0, who, ": expected warmup_steps >= 0, but got ", warmup_steps);
  for (size_t i = 0; i < modules.size(); ++i) {
    TORCH_CHECK(modules[i] != nullptr, who, ": module ", i, " is null");
  }
  for (size_t i = 0; i < optimizers.size(); ++i) {
    TORCH_CHECK(optimizers[i] != nullptr, who, ": optimizer ", i, " is null");
  }
}

StepFunctionStateGuard::StepFunctionStateGuard(const std::vector<torch::nn::Module*>& modules,
                                               const std::vector<torch::optim::Optimizer*>& optimizers) {
  for (auto* m : modules) {
    modules_.push_back(std::make_unique<StepStateGuard>(*m, nullptr));
  }
  for (auto* o : optimizers) {
    states_.push_back(std::make_unique<OptimizerStateAside>(*o));
  }
}

// Note [Checkpoint RNG copies on meta] in meta_step.h.
std::shared_ptr<void> MetaRngCopies::hold(RngCopy copy, int64_t bytes) {
  if (!(copy == RngCopy::kStash ? stash_ : fork_)) {
    return nullptr;
  }
  return std::make_shared<at::Tensor>(at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(at::kMeta)));
}

} // namespace trainmem::detail
