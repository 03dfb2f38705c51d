#pragma once
// Listeners told when a top-level backward starts and ends on the calling
// thread (Engine::execute of trainmem's engine, see Note [Phases from the
// engine]). Used by Audit to split a step into forward, backward and
// optimizer phases without asking the trainer to mark them.
#include <cstdint>
#include <functional>

#include <torch/csrc/autograd/edge.h>

namespace trainmem::detail {

/// `fn(true, roots)` before and `fn(false, {})` after each outermost backward
/// started on the calling thread (`roots`: the graph's roots, as the engine
/// got them) (on CPU the graph runs there too; on CUDA the engine's
/// device threads run it while this thread waits). Must not throw. Returns
/// an id for remove_backward_listener(), which may be called from any thread:
/// once it returns, `fn` is not running and never runs again.
using BackwardListener = std::function<void(bool begin, const torch::autograd::edge_list& roots)>;
int64_t add_backward_listener(BackwardListener fn);
void remove_backward_listener(int64_t id);

/// Makes sure trainmem's engine is the default engine (idempotent).
void ensure_hooks_engine();

} // namespace trainmem::detail
