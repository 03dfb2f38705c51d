#include "detail/backward_on_meta.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "detail/held_arguments.h"

namespace trainmem::detail {
namespace {

// Note [Gradient accumulation on meta]
// Where two gradients meet (a tensor used twice in forward: a residual, a
// recurrent state, the steps of one input, a weight used at every step),
// the autograd engine adds them in the next node's input buffer, between
// nodes. On CPU (and CUDA) it adds in place when it holds the only
// reference to one of the two (InputBuffer's can_accumulate_inplace), else
// into a new buffer (input_buffer.cpp's accumulate() and
// can_accumulate_inplace() are device-agnostic: CUDA decides as the CPU
// does, only on the consumer's stream); on meta always into a new buffer, for
// at::isTensorSubclassLike counts the meta backend as a subclass. A meta
// backward whose peak sat on such a transient was over-predicted by it (an
// LSTMCell decoder unrolled over 12 steps: +43,008 B, 4.2 %). So, while a
// meta backward runs, a RecordFunction callback on BACKWARD_FUNCTION scopes
// marks where nodes start and end, and between them (where only the
// engine's accumulation runs) an aten::add.Tensor of two meta tensors is
// decided as the CPU (or CUDA) decides: when the CPU would add in place, the result
// shares that operand's storage and nothing is allocated; else it runs.
// The intercept stack holds one reference to each argument of its own, so
// "the only reference" is a use count of two, plus what boxed frames of ours
// above autograd hold (Note [References held above the interceptor]: inside
// a step function, AutocastOnMeta's).
// predict_step_peak, the region planner and predict_cuda_step_peak all run
// their meta backward under it (a meta backward without it over-predicts a
// backward peak by an accumulated gradient wherever one is at the peak: a
// residual, a tied weight).
thread_local bool t_between_backward_nodes = false;

std::unique_ptr<at::ObserverContext> on_node_start(const at::RecordFunction& /*fn*/) {
  t_between_backward_nodes = false;
  return nullptr;
}

void on_node_end(const at::RecordFunction& /*fn*/, at::ObserverContext* /*ctx*/) {
  t_between_backward_nodes = true;
}

} // namespace

BackwardOnMeta::BackwardOnMeta()
    : handle_(at::addThreadLocalCallback(
          at::RecordFunctionCallback(&on_node_start, &on_node_end).scopes({at::RecordScope::BACKWARD_FUNCTION}))),
      scope_((register_intercept_fallback(), *this)) {}

BackwardOnMeta::~BackwardOnMeta() {
  at::removeCallback(handle_);
  t_between_backward_nodes = false;
}

void BackwardOnMeta::run(const at::Tensor& loss) {
  BackwardOnMeta guard;
  loss.backward();
}

void BackwardOnMeta::handle(const InterceptScope& scope, const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                            torch::jit::Stack* stack) {
  // Inside a backward only: a guard held across a user's whole step also
  // sees the forward and the optimizer step after a backward's last node.
  if (t_between_backward_nodes && torch::autograd::get_current_graph_task_id() != -1 &&
      !at::GradMode::is_enabled() && op.schema().name() == "aten::add" &&
      op.schema().overload_name() == "Tensor" && stack->size() >= 3) {
    const auto& a = (*stack)[stack->size() - 3];
    const auto& b = (*stack)[stack->size() - 2];
    const auto& alpha = (*stack)[stack->size() - 1];
    if (a.isTensor() && b.isTensor() && alpha.isScalar() && alpha.toScalar().equal(1)) {
      const at::Tensor& x = a.toTensor();
      const at::Tensor& y = b.toTensor();
      // Two: the engine's and the intercept stack's, plus what boxed frames
      // of ours above autograd hold (Note [References held above the
      // interceptor]).
      const auto stealable = [&](const at::Tensor& t) {
        return t.defined() && t.is_meta() && t.layout() == at::kStrided && t.is_non_overlapping_and_dense() &&
            t.use_count() == 2 + static_cast<size_t>(held_references(t, stack)) && t.has_storage() &&
            t.storage().use_count() == 1;
      };
      if (x.defined() && y.defined() && x.sizes() == y.sizes() && x.scalar_type() == y.scalar_type()) {
        const at::Tensor* into = stealable(x) ? &x : stealable(y) ? &y : nullptr;
        if (into != nullptr) {
          at::Tensor result;
          {
            c10::impl::ExcludeDispatchKeyGuard no_intercept(kInterceptKey);
            at::AutoDispatchBelowADInplaceOrView below;
            result = at::empty({0}, into->options())
                         .set_(into->storage(), into->storage_offset(), into->sizes(), into->strides());
          }
          torch::jit::drop(*stack, 3);
          stack->emplace_back(std::move(result));
          return;
        }
      }
    }
  }
  scope.call_next(op, ks, stack);
}

} // namespace trainmem::detail
