#include "detail/intercept.h"

#include <mutex>
#include <string>

#include <c10/util/Exception.h>
#include <torch/library.h>

#include "detail/process_library.h"

namespace trainmem::detail {
namespace {

thread_local InterceptScope* tls_top = nullptr;

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

} // namespace trainmem::detail
