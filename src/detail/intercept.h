#pragma once
// The one op interceptor below autograd (never installed). See
// docs/design.md, Note [One interception key].
//
// LibTorch takes one boxed fallback per dispatch key, so every trainmem
// feature that intercepts ops (selective checkpointing, construction on the
// meta device) shares this one: an InterceptScope pushes a handler on a
// thread-local stack and includes the key in the thread-local dispatch set;
// the fallback hands each op to the innermost handler, which runs it further
// down with InterceptScope::call_next (the next handler out, or the kernel
// below the key with the key excluded).
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/DispatchKey.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

namespace trainmem::detail {

// The one place the interception key is chosen. If a LibTorch release removes
// DispatchKey::Fake, this line stops compiling; if one claims it, the first
// InterceptScope throws (register_intercept_fallback).
constexpr c10::DispatchKey kInterceptKey = c10::DispatchKey::Fake;

class InterceptScope;

// What an InterceptScope does with each op dispatched on its thread while it
// is the innermost scope. `stack` holds the op's arguments; on return it must
// hold its results (call scope.call_next to run the op, or push replacements).
class InterceptHandler {
 public:
  virtual ~InterceptHandler() = default;
  virtual void handle(const InterceptScope& scope, const c10::OperatorHandle& op,
                      c10::DispatchKeySet ks, torch::jit::Stack* stack) = 0;
};

// Registers the fallback (once per process). Throws c10::Error, naming the
// key, if another library registered one first.
void register_intercept_fallback();

// Runs `op` on the kernels below kInterceptKey with the key excluded, so ops
// that the kernel calls internally are not intercepted again.
void run_below_intercept(const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                         torch::jit::Stack* stack);

// Thread-local RAII: while alive, ops dispatched on this thread go to
// `handler` first (innermost scope wins). Scopes must end in reverse order of
// construction on their thread. `handler` must outlive the scope.
class InterceptScope {
 public:
  explicit InterceptScope(InterceptHandler& handler);
  ~InterceptScope();
  InterceptScope(const InterceptScope&) = delete;
  InterceptScope& operator=(const InterceptScope&) = delete;
  InterceptScope(InterceptScope&&) = delete;
  InterceptScope& operator=(InterceptScope&&) = delete;

  // Runs `op` further down: the next enclosing scope's handler, or the kernel
  // below the key (run_below_intercept) when this is the outermost scope.
  void call_next(const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                 torch::jit::Stack* stack) const;

 private:
  friend void intercept_fallback(const c10::OperatorHandle&, c10::DispatchKeySet,
                                 torch::jit::Stack*);
  InterceptHandler& handler_;
  InterceptScope* previous_;
  c10::impl::IncludeDispatchKeyGuard include_;
};

} // namespace trainmem::detail
