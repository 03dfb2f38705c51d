#include "app/trainer.h"

#include <memory>
#include <optional>

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <torch/cuda.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/types.h>
#include <torch/utils.h>

#include "trainmem/allocator.h"
#include "trainmem/audit.h"
#include "trainmem/grad_scaler.h"
#include "trainmem/offload.h"
#include "trainmem/optimizer_in_backward.h"
#include "trainmem/selective.h"

#include "app/audited_step.h"
#include "core/detail/checkpoint_state.h"
#include "detail/text.h"

namespace trainmem {
namespace {

using OptimizerPtr = std::unique_ptr<torch::optim::Optimizer>;
using detail::AuditedStep;
using detail::run_audited_step;

// The data: one fixed batch (B, T, d).
at::Tensor make_batch(const TrainerOptions& o, c10::Device device) {
  const auto& mo = o.model();
  torch::manual_seed(o.seed() + 1);
  return torch::randn({o.batch(), o.seq_len(), mo.d_model()}).to(device, detail::trainer_dtype(o));
}

// Micro-batches are tensors of their own, as a loader would give them (a
// view would keep the whole batch's storage alive in autograd's eyes).
std::vector<at::Tensor> micro_batches(const at::Tensor& x, int64_t k) {
  std::vector<at::Tensor> micro = {x};
  if (k > 1) {
    micro.clear();
    for (const auto& part : x.split(x.size(0) / k)) {
      micro.push_back(part.clone());
    }
  }
  return micro;
}

} // namespace


void check_trainer_options(const TrainerOptions& o) {
  const auto& m = o.model();
  TORCH_CHECK(m.num_layers() > 0, "expected layers > 0, but got ", m.num_layers());
  TORCH_CHECK(m.d_model() > 0, "expected d_model > 0, but got ", m.d_model());
  TORCH_CHECK(m.num_heads() > 0, "expected heads > 0, but got ", m.num_heads());
  TORCH_CHECK(m.d_model() % m.num_heads() == 0, "expected d_model divisible by heads, but got d_model ",
              m.d_model(), " and heads ", m.num_heads());
  TORCH_CHECK(o.batch() > 0, "expected batch > 0, but got ", o.batch());
  TORCH_CHECK(o.seq_len() > 0, "expected seq_len > 0, but got ", o.seq_len());
  TORCH_CHECK(o.optimizer() == "adamw" || o.optimizer() == "adam" || o.optimizer() == "sgd",
              "expected optimizer adamw, adam or sgd, but got \"", o.optimizer(), "\"");
  TORCH_CHECK(o.lr() > 0, "expected lr > 0, but got ", o.lr());
  TORCH_CHECK(o.steps() >= 1, "expected steps >= 1, but got ", o.steps());
  (void)BlockCheckpointing::named(m.num_layers(), o.checkpoint());  // throws naming a bad name
  TORCH_CHECK(o.accumulation() >= 1, "expected accumulation >= 1, but got ", o.accumulation());
  TORCH_CHECK(o.meter_every() >= 0, "expected meter_every >= 0 (0: the steps that differ), but got ", o.meter_every());
  TORCH_CHECK(o.batch() % o.accumulation() == 0, "expected batch ", o.batch(),
              " to split into accumulation ", o.accumulation(), " equal micro-batches");
  TORCH_CHECK(!(o.precision() == Precision::kFp16Autocast && o.optimizer_in_backward()),
              "precision fp16-autocast needs a GradScaler, which cannot unscale or skip the steps an "
              "optimizer in backward takes inside backward; use bf16-autocast (no loss scaling) with "
              "optimizer_in_backward");
  std::optional<c10::Device> device;
  try {
    device.emplace(o.device());
  } catch (const c10::Error&) {
    TORCH_CHECK(false, "expected device cpu or cuda[:index], but got \"", o.device(), "\"");
  }
  TORCH_CHECK(device->is_cpu() || device->is_cuda(), "expected device cpu or cuda[:index], but got \"",
              o.device(), "\"");
  if (device->is_cuda()) {
    TORCH_CHECK(torch::cuda::is_available(), "device \"", o.device(),
                "\": this LibTorch has no CUDA or sees no GPU");
    TORCH_CHECK(!device->has_index() || device->index() < static_cast<int64_t>(torch::cuda::device_count()),
                "device \"", o.device(), "\": only ", torch::cuda::device_count(), " CUDA devices are visible");
  }
}

TrainingRun train(const TrainerOptions& o, const std::function<void(int64_t, int64_t)>& on_step) {
  check_trainer_options(o);
  const c10::Device device(o.device());
  if (device.is_cpu()) {
    CpuMemoryTracker::install();  // before the model, so its parameters are seen
  }
  const auto& mo = o.model();
  const int64_t k = o.accumulation();

  Transformer model = detail::make_trainer_model(o, device);
  const auto plan = BlockCheckpointing::named(mo.num_layers(), o.checkpoint());
  const auto x = make_batch(o, device);  // held for the whole run, as a loop's batch is
  std::vector<at::Tensor> micro = micro_batches(x, k);

  OptimizerPtr optimizer;
  std::unique_ptr<OptimizerInBackward> in_backward;
  if (o.optimizer_in_backward()) {
    const auto name = o.optimizer();
    const double lr = o.lr();
    in_backward = std::make_unique<OptimizerInBackward>(
        model->parameters(), [name, lr](std::vector<at::Tensor> p) { return detail::make_optimizer(name, std::move(p), lr); },
        k);
  } else {
    optimizer = detail::make_optimizer(o.optimizer(), model->parameters(), o.lr());
  }

  Audit audit(*model, optimizer.get(), device, AuditOptions().title("reference transformer").timeline(o.timeline()).meter_every(o.meter_every()));
  if (in_backward) {
    audit.add_optimizer(*in_backward);
  }
  detail::set_model_config(audit, o, o.batch());
  audit.set_config("device", o.device());
  audit.set_config("steps", std::to_string(o.steps()));
  audit.set_config("checkpoint", o.checkpoint());
  audit.set_config("offload", o.offload() ? "on" : "off");
  audit.set_config("optimizer_in_backward", o.optimizer_in_backward() ? "on" : "off");
  audit.set_config("accumulation", std::to_string(k));
  if (o.precision() == Precision::kFp32 && o.checkpoint() == "none") {
    // The first-order estimate (64 * T * B * d per layer) for one micro-batch.
    audit.set_predicted_activation_bytes(
        predicted_activation_bytes(mo, o.batch() / k, o.seq_len()));
  }
  if (o.precision() == Precision::kBf16) {
    audit.add_note("pure bf16: LibTorch's optimizers keep their state in the parameters' dtype (bf16), "
                   "so the optimizer state is half of a mixed-precision recipe's fp32 moments");
  }

  const bool amp_on = o.precision() == Precision::kBf16Autocast || o.precision() == Precision::kFp16Autocast;
  detail::AutocastState autocast;
  autocast.entries.push_back(
      {device.type(), true, o.precision() == Precision::kFp16Autocast ? at::kHalf : at::kBFloat16});
  // fp16 underflows: dynamic loss scaling (grad_scaler.h); bf16 needs none.
  GradScaler scaler(GradScalerOptions().enabled(o.precision() == Precision::kFp16Autocast));
  if (device.is_cuda()) {
    at::globalContext().setAllowTF32CuBLAS(o.tf32());
    at::globalContext().setAllowTF32CuDNN(o.tf32());
    audit.set_config("tf32", o.tf32() ? "on" : "off");
  }

  AuditedStep parts;  // Note [One audited step]
  parts.inputs = std::move(micro);
  parts.autocast = amp_on ? &autocast : nullptr;
  parts.loss = [&](const at::Tensor& xb) {
    std::optional<SaveOnCpuGuard> offload;
    if (o.offload()) {
      offload.emplace(*model);
    }
    // Mean over the whole batch = sum of micro-batch means / k.
    return model->forward(xb, plan).to(at::kFloat).pow(2).mean() / static_cast<double>(k);
  };
  parts.backward = [&](const at::Tensor& loss) { scaler.scale(loss).backward(); };
  if (optimizer) {
    parts.zero_grad = [&] { optimizer->zero_grad(); };
    parts.optimizer_step = [&] {
      scaler.step(*optimizer);  // a plain step unless fp16-autocast
      scaler.update();
    };
  }
  TrainingRun run;
  for (int64_t step = 0; step < o.steps(); ++step) {
    const double loss_sum = run_audited_step(audit, audit, parts);
    if (step == 0 && optimizer && o.keep_grads()) {
      // After the step: the copies are not part of the audited bytes.
      for (const auto& p : model->parameters()) {
        run.grads.push_back(p.grad().defined() ? p.grad().detach().to(at::kCPU, at::kFloat, false, true)
                                               : at::Tensor());
      }
    }
    run.losses.push_back(loss_sum);
    if (on_step) {
      on_step(step + 1, o.steps());
    }
  }
  run.report = audit.report();
  run.timeline = audit.take_timeline();  // one copy of a long run's events, not two
  return run;
}

} // namespace trainmem

namespace trainmem::detail {

at::ScalarType trainer_dtype(const TrainerOptions& o) {
  return o.precision() == Precision::kBf16 ? at::kBFloat16 : at::kFloat;
}

Transformer make_trainer_model(const TrainerOptions& o, c10::Device device) {
  torch::manual_seed(o.seed());
  Transformer model(o.model());
  model->to(device, trainer_dtype(o));
  return model;
}

void set_model_config(Audit& audit, const TrainerOptions& o, int64_t batch) {
  const auto& mo = o.model();
  audit.set_config("layers", std::to_string(mo.num_layers()));
  audit.set_config("d_model", std::to_string(mo.d_model()));
  audit.set_config("heads", std::to_string(mo.num_heads()));
  audit.set_config("batch", std::to_string(batch));
  audit.set_config("seq_len", std::to_string(o.seq_len()));
  audit.set_config("optimizer", o.optimizer());
  audit.set_config("precision", precision_name(o.precision()));
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& name, std::vector<at::Tensor> params,
                                                        double lr) {
  if (name == "adamw") {
    return std::make_unique<torch::optim::AdamW>(std::move(params), torch::optim::AdamWOptions(lr));
  }
  if (name == "adam") {
    return std::make_unique<torch::optim::Adam>(std::move(params), torch::optim::AdamOptions(lr));
  }
  return std::make_unique<torch::optim::SGD>(std::move(params), torch::optim::SGDOptions(lr).momentum(0.9));
}

} // namespace trainmem::detail
