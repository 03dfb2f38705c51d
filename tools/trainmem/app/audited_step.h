#pragma once
// The audited training step of `trainmem audit` (never installed; app layer).
//
// Note [One audited step]
// The command's two loops, train() (trainer.cpp: one process, micro-batches,
// loss scaling, offload, the optimizer in backward) and a data-parallel rank
// (distributed_trainer.cpp: DDP hooks, fault injection), run one step the
// same way: open the audit's step, mark the micro-batches as its inputs,
// zero the gradients, then per micro-batch the forward to a loss (under
// autocast when asked, whose cache is cleared after it), the backward, and
// last the optimizer step, all inside the step's scope so the audit sees
// every phase. run_audited_step() is that step; what differs between the
// loops comes in as AuditedStep's callbacks, so an order or a scope changed
// here changes both, and both report alike.
#include <functional>
#include <optional>
#include <vector>

#include <ATen/autocast_mode.h>
#include <ATen/core/Tensor.h>

#include "trainmem/audit.h"

#include "core/detail/checkpoint_state.h"

namespace trainmem::detail {

struct AuditedStep {
  /// The step's micro-batches, in order; each is marked as an input.
  std::vector<at::Tensor> inputs;
  /// The forward runs under it and its cache is cleared after; null: no autocast.
  const AutocastState* autocast = nullptr;
  /// Before the first forward; empty: none (the optimizer steps in backward).
  std::function<void()> zero_grad;
  /// One micro-batch's forward, to its scalar loss.
  std::function<at::Tensor(const at::Tensor& input)> loss;
  /// Between a forward and its backward; empty: none.
  std::function<void()> before_backward;
  /// The backward of a loss; empty: loss.backward().
  std::function<void(const at::Tensor& loss)> backward;
  /// After the last backward; empty: none.
  std::function<void()> optimizer_step;
};

/// Runs one step inside `auditor.step()`'s scope (an Audit, or a
/// DistributedAudit that tags its buckets first) and returns the sum of the
/// micro-batches' losses. `audit` is the Audit the inputs are marked in.
template <typename Auditor>
double run_audited_step(Auditor& auditor, Audit& audit, const AuditedStep& s) {
  double loss_sum = 0;
  auto guard = auditor.step();
  for (const auto& input : s.inputs) {
    audit.mark_input(input);
  }
  if (s.zero_grad) {
    s.zero_grad();
  }
  for (const auto& input : s.inputs) {
    at::Tensor loss;
    {
      std::optional<AutocastGuard> amp;
      if (s.autocast != nullptr) {
        amp.emplace(*s.autocast);
      }
      loss = s.loss(input);
    }
    if (s.autocast != nullptr) {
      at::autocast::clear_cache();
    }
    if (s.before_backward) {
      s.before_backward();
    }
    if (s.backward) {
      s.backward(loss);
    } else {
      loss.backward();
    }
    loss_sum += loss.item<double>();
  }
  if (s.optimizer_step) {
    s.optimizer_step();
  }
  return loss_sum;
}

} // namespace trainmem::detail
