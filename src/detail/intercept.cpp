#include "detail/intercept.h"

#include <algorithm>
#include <mutex>
#include <string>

#include <c10/util/Exception.h>
#include <torch/library.h>

#include "detail/held_arguments.h"
#include "detail/process_library.h"

namespace trainmem::detail {
namespace {

thread_local InterceptScope* tls_top = nullptr;
thread_local HeldArguments* tls_held = nullptr;

} // namespace

// The fallback sees every op on a thread whose TLS includes the key. The key
// can be included on a thread with no scope of ours: at::ThreadLocalState
// carries the dispatch key set into autograd worker threads and
// at::parallel_for tasks. Those ops just run below.
void intercept_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                        torch::jit::Stack* stack) {
  InterceptScope* top = tls_top;
  if (top == nullptr) {
    run_below_intercept(op, ks, stack);
    return;
  }
  top->handler_.handle(*top, op, ks, stack);
}

void register_intercept_fallback() {
  static std::once_flag once;
  static std::string error;
  std::call_once(once, [] {
    error = register_fallback_for_process(kInterceptKey,
                                          torch::CppFunction::makeFromBoxedFunction<&intercept_fallback>());
  });
  TORCH_CHECK(error.empty(), "trainmem: cannot register the op interceptor on dispatch key ",
              c10::toString(kInterceptKey), " (is another library using it?): ", error);
}

void run_below_intercept(const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                         torch::jit::Stack* stack) {
  c10::impl::ExcludeDispatchKeyGuard no_intercept(kInterceptKey);
  op.redispatchBoxed(ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kInterceptKey), stack);
}

InterceptScope::InterceptScope(InterceptHandler& handler)
    : handler_(handler), previous_(tls_top), include_(kInterceptKey) {
  tls_top = this;
}

InterceptScope::~InterceptScope() {
  tls_top = previous_;
}

void InterceptScope::call_next(const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                               torch::jit::Stack* stack) const {
  if (previous_ == nullptr) {
    run_below_intercept(op, ks, stack);
    return;
  }
  // The outer handler sees the op as if it were innermost; ops it dispatches
  // itself still reach the innermost scope first (the stack is not popped).
  previous_->handler_.handle(*previous_, op, ks, stack);
}

// Note [References held above the interceptor]
// An op called unboxed (as the autograd engine calls aten::add to sum two
// gradients) is boxed by the first boxed kernel it meets: that kernel's stack
// holds one reference to each tensor argument. A boxed fallback above
// autograd (AutocastOnMeta's mode key, which predict_step_function and
// predict_cuda_step_function hold across the step) passes the op down to
// autograd's unboxed kernel, whose redispatch reaches the interception key
// boxed again: a tensor that only the engine holds then has a use count of
// three there, not two. A handler that decides as the CPU would from a
// use count (Note [Gradient accumulation on meta]) subtracts what such a
// frame holds: the fallback marks its arguments with a HeldArguments while
// the op runs below it, and held_references() counts them (a frame whose
// stack is the handler's own, passed down boxed, is the handler's one
// reference, not counted again). Without it the engine's in-place sum of a
// gradient used twice (the shared body of a policy with two heads; a value
// used by two terms of a loss) ran out of place on meta in a step function:
// a PPO update of 2 x 2 minibatches was predicted 1,792 B over the CPU.
HeldArguments::HeldArguments(const torch::jit::Stack* stack, size_t n)
    : previous_(tls_held), stack_(stack), begin_(stack->size() - std::min(n, stack->size())),
      n_(std::min(n, stack->size())) {
  tls_held = this;
}

HeldArguments::~HeldArguments() {
  tls_held = previous_;
}

int64_t held_references(const at::Tensor& t, const torch::jit::Stack* except) {
  if (!t.defined()) {
    return 0;
  }
  int64_t count = 0;
  for (const HeldArguments* f = tls_held; f != nullptr; f = f->previous_) {
    if (f->stack_ == except) {
      continue;
    }
    const size_t end = std::min(f->begin_ + f->n_, f->stack_->size());
    for (size_t i = f->begin_; i < end; ++i) {
      const auto& v = (*f->stack_)[i];
      if (v.isTensor() && v.toTensor().unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) {
        ++count;
      }
    }
  }
  return count;
}

} // namespace trainmem::detail
