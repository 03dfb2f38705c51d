#pragma once
/// \file hooks.h
/// Saved-tensor hooks for C++: see, replace or move every tensor autograd
/// keeps between forward and backward, like Python's
/// `torch.autograd.graph.saved_tensors_hooks`.
///
/// LibTorch has no C++ `saved_tensors_hooks` (PyTorch keeps Python objects on
/// that stack). trainmem installs a small subclass of the autograd engine whose
/// `get_default_saved_variable_hooks()` consults a thread-local stack of hooks
/// objects (docs/design.md, Note [Saved-tensor hooks]). Every other trainmem
/// feature that touches saved tensors (meter, checkpoint, offload) goes through
/// this header.
///
/// Example:
/// ```
/// trainmem::SavedTensorHooksGuard guard(
///     [](const at::Tensor& t) -> std::any { return t.to(at::kCPU); },   // pack
///     [](const std::any& p) { return std::any_cast<at::Tensor>(p); });  // unpack
/// auto loss = model->forward(x).sum();   // saved tensors go through pack
/// loss.backward();                       // ... and come back through unpack
/// ```

#include <any>
#include <functional>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

#include "trainmem/export.h"

namespace trainmem {

/// A pair of pack/unpack hooks. `pack` runs once per tensor autograd saves,
/// on the forward thread, under no-grad, and receives the tensor with its
/// autograd metadata: keep `tensor.tensor_data()` (or a copy), never the tensor
/// itself, or a saved output would own its own graph node (a reference cycle).
/// `unpack` runs when backward needs the tensor, possibly on another thread
/// and after the scope that installed the hooks has ended, so an implementation
/// must keep the state it needs in itself. It returns a plain tensor; autograd
/// re-attaches the history.
class TRAINMEM_API SavedTensorHooks {
 public:
  virtual ~SavedTensorHooks() = default;
  /// Called once per saved tensor; the returned value is handed to unpack.
  virtual std::any pack(const at::Tensor& tensor) = 0;
  /// Called when backward needs the tensor back.
  virtual at::Tensor unpack(const std::any& packed) = 0;
  /// The tensor that holds the saved bytes after pack, which a meter
  /// (meter.h, audit.h) counts and reads the device of: by default `packed`
  /// itself when it holds an at::Tensor (a copy on the host, or the tensor),
  /// else an undefined tensor, meaning nothing is kept (checkpointing keeps a
  /// handle and recomputes). Override it when pack returns another type that
  /// does keep the bytes.
  virtual at::Tensor packed_tensor(const std::any& packed) const;
};

/// Pack callable: receives the tensor autograd saves, returns anything.
using PackHook = std::function<std::any(const at::Tensor&)>;
/// Unpack callable: receives what pack returned, returns the tensor.
using UnpackHook = std::function<at::Tensor(const std::any&)>;

/// Makes `hooks` the innermost active pair for tensors saved on this thread
/// until the guard is destroyed; the previous pair is restored then.
/// Thread-local: tensors saved by other threads are not affected, and the
/// hooks are not inherited by threads started inside the scope. Nesting is
/// LIFO; the innermost pair alone applies (as in PyTorch). Exception-safe: a
/// throw that unwinds the guard leaves no hooks behind. Tensors packed inside
/// the scope keep a reference to `hooks`, so unpack works after the scope
/// ended and on other threads.
///
/// Example:
/// ```
/// auto hooks = std::make_shared<MyHooks>();
/// {
///   trainmem::SavedTensorHooksGuard guard(hooks);
///   loss = model->forward(x).sum();
/// }
/// loss.backward();   // MyHooks::unpack runs here
/// ```
class TRAINMEM_API SavedTensorHooksGuard {
 public:
  /// Installs a hooks object. Throws if `hooks` is null, or inside a
  /// DisableSavedTensorHooksGuard (with its message).
  explicit SavedTensorHooksGuard(std::shared_ptr<SavedTensorHooks> hooks);
  /// Installs a pack/unpack pair of callables. Both must be non-empty.
  SavedTensorHooksGuard(PackHook pack, UnpackHook unpack);
  ~SavedTensorHooksGuard();

  SavedTensorHooksGuard(const SavedTensorHooksGuard&) = delete;
  SavedTensorHooksGuard& operator=(const SavedTensorHooksGuard&) = delete;
  SavedTensorHooksGuard(SavedTensorHooksGuard&&) = delete;
  SavedTensorHooksGuard& operator=(SavedTensorHooksGuard&&) = delete;

 private:
  uint64_t id_;
  uint64_t thread_;
};

/// Inside the scope, tensors are saved plainly, with no hooks at all (an outer
/// SavedTensorHooksGuard is suspended), and installing new hooks throws with
/// `error_message` (or a default one naming the guard). Thread-local, RAII,
/// nests. This is what a feature that cannot work with hooks uses, like
/// `torch.autograd.graph.disable_saved_tensors_hooks`; unlike PyTorch's, it
/// does not fail when hooks are already active: it suspends them.
///
/// Example:
/// ```
/// trainmem::DisableSavedTensorHooksGuard off("my cache cannot be offloaded");
/// auto y = layer->forward(x);   // saved without any hook
/// ```
class TRAINMEM_API DisableSavedTensorHooksGuard {
 public:
  explicit DisableSavedTensorHooksGuard(std::string error_message = {});
  ~DisableSavedTensorHooksGuard();

  DisableSavedTensorHooksGuard(const DisableSavedTensorHooksGuard&) = delete;
  DisableSavedTensorHooksGuard& operator=(const DisableSavedTensorHooksGuard&) =
      delete;
  DisableSavedTensorHooksGuard(DisableSavedTensorHooksGuard&&) = delete;
  DisableSavedTensorHooksGuard& operator=(DisableSavedTensorHooksGuard&&) =
      delete;

 private:
  uint64_t id_;
  uint64_t thread_;
};

/// True when trainmem's engine is LibTorch's default autograd engine, so the
/// guards above take effect. It is installed when this library loads; a
/// process that imports torch's Python module replaces it (then the guards
/// throw with a message saying so).
TRAINMEM_API bool saved_tensor_hooks_available();

/// Number of hook frames (hooks and disable guards) active on this thread.
TRAINMEM_API int64_t num_active_saved_tensor_hooks();

} // namespace trainmem
