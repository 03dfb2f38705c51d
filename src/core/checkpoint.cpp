#include "trainmem/checkpoint.h"

#include <atomic>
#include <cmath>
#include <mutex>
#include <optional>
#include <sstream>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/Generator.h>
#include <ATen/core/custom_class.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/nn/modules/container/any.h>

#include "detail/attribution.h"
#include "core/detail/checkpoint_state.h"
#include "core/detail/autocast_on_meta.h"
#include "detail/intercept.h"
#include "trainmem/hooks.h"

// Note [Non-reentrant checkpoint]
// This follows torch/utils/checkpoint.py's _checkpoint_without_reentrant:
// - Forward: the region's inputs are kept as SavedVariables made while the
//   caller's hooks are innermost (so an outer meter or offload sees exactly the
//   inputs, labelled "CheckpointInputs"); then the region runs under our pack
//   hook, which hands autograd a small Holder per saved tensor and keeps only
//   a weak reference to it (plus shape/dtype/device for the determinism check).
// - Backward: the first unpack in a graph task re-runs the region under
//   recomputation hooks that fill the holders in save order, stops as soon as
//   the last holder still alive is filled (early stop), then checks counts and
//   metadata. Each holder hands its tensor out once and forgets it, so memory
//   is released as backward walks the region.
// RNG state (CPU and the CUDA devices of the inputs) and autocast state are
// captured in forward and re-applied for the recompute.

namespace trainmem {
namespace detail {

RngState RngState::capture(const std::vector<at::Tensor>& tensors) {
  RngState s;
  {
    auto gen = at::globalContext().defaultGenerator(at::kCPU);
    std::lock_guard<std::mutex> lock(gen.mutex());
    s.cpu = gen.get_state();
  }
  std::unordered_set<c10::DeviceIndex> seen;
  for (const auto& t : tensors) {
    if (t.defined() && t.is_cuda() && seen.insert(t.device().index()).second) {
      auto gen = at::globalContext().defaultGenerator(t.device());
      std::lock_guard<std::mutex> lock(gen.mutex());
      s.devices.emplace_back(t.device(), gen.get_state());
    }
  }
  return s;
}

// Note [Checkpoint RNG copies] in checkpoint_state.h.
namespace {
thread_local RngCopyObserver* t_rng_copy_observer = nullptr;
} // namespace

RngCopyObserver::~RngCopyObserver() = default;

RngCopyObserverGuard::RngCopyObserverGuard(RngCopyObserver* observer)
    : previous_(std::exchange(t_rng_copy_observer, observer)) {}

RngCopyObserverGuard::~RngCopyObserverGuard() {
  t_rng_copy_observer = previous_;
}

RngCopyObserver* RngCopyObserverGuard::current() {
  return t_rng_copy_observer;
}

int64_t RngState::nbytes() const {
  int64_t bytes = cpu.defined() ? static_cast<int64_t>(cpu.nbytes()) : 0;
  for (const auto& [device, state] : devices) {
    bytes += static_cast<int64_t>(state.nbytes());
  }
  return bytes;
}

RngState RngState::capture_stash(const std::vector<at::Tensor>& tensors) {
  RngState s = capture(tensors);
  if (auto* observer = RngCopyObserverGuard::current()) {
    s.observed = observer->hold(RngCopy::kStash, s.nbytes());
  }
  return s;
}

void RngState::restore() const {
  {
    auto gen = at::globalContext().defaultGenerator(at::kCPU);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(cpu);
  }
  for (const auto& [device, state] : devices) {
    auto gen = at::globalContext().defaultGenerator(device);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state);
  }
}

ForkRng::ForkRng(const RngState* stashed, const std::vector<at::Tensor>& tensors) {
  if (stashed == nullptr) {
    return;
  }
  current_ = RngState::capture(tensors);
  stashed->restore();
  if (auto* observer = RngCopyObserverGuard::current()) {
    observed_ = observer->hold(RngCopy::kFork, current_->nbytes());
  }
}

ForkRng::~ForkRng() {
  if (current_) {
    try {
      current_->restore();
    } catch (const std::exception& e) {
      TORCH_WARN("trainmem checkpoint: could not restore the RNG state: ", e.what());
    }
  }
}

AutocastState AutocastState::capture() {
  AutocastState s;
  for (auto type : {at::kCPU, at::kCUDA}) {
    s.entries.push_back(
        {type, at::autocast::is_autocast_enabled(type), at::autocast::get_autocast_dtype(type)});
  }
  s.cache_enabled = at::autocast::is_autocast_cache_enabled();
  if (const auto* guard = AutocastOnMeta::active()) {
    s.on_meta = guard->preferred();
  }
  return s;
}

void AutocastState::apply() const {
  for (const auto& e : entries) {
    at::autocast::set_autocast_enabled(e.type, e.enabled);
    at::autocast::set_autocast_dtype(e.type, e.dtype);
  }
  at::autocast::set_autocast_cache_enabled(cache_enabled);
}

AutocastGuard::AutocastGuard(const AutocastState& state) : previous_(AutocastState::capture()) {
  state.apply();
  if (state.on_meta && AutocastOnMeta::active() == nullptr) {
    on_meta_ = std::make_unique<AutocastOnMeta>(*state.on_meta);
  }
}

AutocastGuard::~AutocastGuard() {
  try {
    previous_.apply();
  } catch (...) {
  }
}

// While alive (thread-local), tensors from outside the recompute that an op
// writes in place are copied before the first write and restored at the end:
// Note [Recompute does not change state]. Never throws from its destructor.
class RestoreStateGuard final : public InterceptHandler {
 public:
  RestoreStateGuard();
  ~RestoreStateGuard() override;
  RestoreStateGuard(const RestoreStateGuard&) = delete;
  RestoreStateGuard& operator=(const RestoreStateGuard&) = delete;

  void handle(const InterceptScope& scope, const c10::OperatorHandle& op, c10::DispatchKeySet ks,
              torch::jit::Stack* stack) override;

 private:
  void snapshot(const at::Tensor& t);
  std::unordered_set<const c10::StorageImpl*> created_;  // made by the recompute
  std::unordered_set<const c10::StorageImpl*> saved_;    // already copied
  std::vector<std::pair<at::Tensor, at::Tensor>> snapshots_; // (whole storage, its copy)
  std::optional<InterceptScope> scope_;
};

// Note [Recompute does not change state]
// A recompute must not update state a second time: BatchNorm's running
// statistics (native_batch_norm writes running_mean and running_var in
// place) and num_batches_tracked (the module's `+= 1`) would move twice per
// step, and any module that counts its calls would count twice. PyTorch's
// checkpoint has this flaw; we do not. While a region is recomputed, this
// handler (innermost, so it also sees ops a selective policy replays) watches
// every op: an argument the op writes (`Tensor(a!)` in its schema, or a
// batch norm's `running_mean`/`running_var`, which native_batch_norm writes
// with no annotation) whose
// storage was not made during the recompute is state from outside the region,
// so its whole storage is copied once before the first write and copied back
// when the recompute ends (early stop and errors included). Storages the
// recompute makes (outputs that alias nothing) are its own and left alone.
// Costs nothing where nothing outside is written (transformers), a copy of
// each written buffer where something is (BatchNorm: 2 C floats and 8 B).
RestoreStateGuard::RestoreStateGuard() {
  register_intercept_fallback();
  scope_.emplace(*this);
}

RestoreStateGuard::~RestoreStateGuard() {
  scope_.reset();
  try {
    c10::impl::ExcludeDispatchKeyGuard no_intercept(kInterceptKey);
    at::NoGradGuard no_grad;
    for (auto& [target, copy] : snapshots_) {
      target.copy_(copy);
    }
  } catch (const std::exception& e) {
    TORCH_WARN("trainmem checkpoint: could not restore the state the recompute wrote: ", e.what());
  }
}

void RestoreStateGuard::snapshot(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) {
    return;
  }
  const c10::StorageImpl* key = t.storage().unsafeGetStorageImpl();
  if (created_.count(key) != 0 || !saved_.insert(key).second) {
    return;
  }
  c10::impl::ExcludeDispatchKeyGuard no_intercept(kInterceptKey);
  at::NoGradGuard no_grad;
  // The whole storage as bytes: every view of it is restored.
  auto bytes = at::empty({0}, t.options().dtype(at::kByte));
  bytes.set_(t.storage(), 0, {static_cast<int64_t>(t.storage().nbytes())}, {1});
  snapshots_.emplace_back(bytes, bytes.clone());
}

void RestoreStateGuard::handle(const InterceptScope& scope, const c10::OperatorHandle& op,
                               c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto& args = schema.arguments();
  const size_t base = stack->size() - args.size();
  for (size_t i = 0; i < args.size(); ++i) {
    const auto* alias = args[i].alias_info();
    // native_batch_norm (and cudnn/miopen_batch_norm) write their running
    // statistics without saying so in the schema ("Tensor? running_mean").
    const bool hidden_write = args[i].name() == "running_mean" || args[i].name() == "running_var";
    if ((alias == nullptr || !alias->isWrite()) && !hidden_write) {
      continue;
    }
    const auto& v = (*stack)[base + i];
    if (v.isTensor()) {
      snapshot(v.toTensor());
    } else if (v.isTensorList()) {
      for (const auto& t : v.toTensorVector()) {
        snapshot(t);
      }
    }
  }
  scope.call_next(op, ks, stack);
  const auto& returns = schema.returns();
  const size_t out = stack->size() - returns.size();
  auto remember = [&](const at::Tensor& t) {
    if (t.defined() && t.has_storage()) {
      created_.insert(t.storage().unsafeGetStorageImpl());
    }
  };
  for (size_t i = 0; i < returns.size(); ++i) {
    if (returns[i].alias_info() != nullptr) {
      continue;  // a view or the written argument: not a new storage
    }
    const auto& v = (*stack)[out + i];
    if (v.isTensor()) {
      remember(v.toTensor());
    } else if (v.isTensorList()) {
      for (const auto& t : v.toTensorVector()) {
        remember(t);
      }
    }
  }
}

} // namespace detail

namespace {

using detail::AutocastGuard;
using detail::AutocastState;
using detail::ForkRng;
using detail::RngState;

// Thrown by the recomputation pack hook once every live holder is filled.
struct StopRecomputation {};

struct TensorMetadata {
  std::vector<int64_t> shape;
  at::ScalarType dtype;
  at::Device device;
  bool operator==(const TensorMetadata& o) const {
    return shape == o.shape && dtype == o.dtype && device == o.device;
  }
};

std::string to_string(const TensorMetadata& m) {
  std::ostringstream os;
  os << "{'shape': " << c10::IntArrayRef(m.shape) << ", 'dtype': " << m.dtype
     << ", 'device': " << m.device << "}";
  return os.str();
}

TensorMetadata metadata_of(const at::Tensor& t) {
  return {t.sizes().vec(), t.scalar_type(), t.device()};
}

struct Holder {
  int64_t index = 0;
  std::unordered_set<int64_t> unpacked_in; // graph tasks that took it already
};

std::atomic<int64_t> next_pseudo_graph_task{-2};

class Frame;

class CheckpointHooks final : public SavedTensorHooks {
 public:
  explicit CheckpointHooks(std::shared_ptr<Frame> frame) : frame_(std::move(frame)) {}
  std::any pack(const at::Tensor& tensor) override;
  at::Tensor unpack(const std::any& packed) override;

 private:
  std::shared_ptr<Frame> frame_;
};

class RecomputationHooks final : public SavedTensorHooks {
 public:
  RecomputationHooks(Frame* frame, int64_t gid) : frame_(frame), gid_(gid) {}
  std::any pack(const at::Tensor& tensor) override;
  at::Tensor unpack(const std::any& packed) override {
    return std::any_cast<const at::Tensor&>(packed);
  }

 private:
  Frame* frame_;
  int64_t gid_;
};

class Frame : public std::enable_shared_from_this<Frame> {
 public:
  Frame(CheckpointFunction fn, const CheckpointOptions& options)
      : fn_(std::move(fn)), options_(options) {}

  void save_inputs(const std::vector<at::Tensor>& inputs) {
    detail::SaveLabelGuard label("CheckpointInputs");
    inputs_.reserve(inputs.size());
    for (const auto& t : inputs) {
      inputs_.emplace_back(t, /*is_output=*/false);
    }
    if (options_.preserve_rng_state()) {
      rng_ = RngState::capture_stash(inputs);
    }
    autocast_ = AutocastState::capture();
  }

  void set_recompute_context(std::function<ContextToken()> ctx) {
    recompute_context_ = std::move(ctx);
  }

  std::shared_ptr<Holder> new_holder(const at::Tensor& t) {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    auto holder = std::make_shared<Holder>();
    holder->index = static_cast<int64_t>(holders_.size());
    holders_.push_back(holder);
    if (options_.determinism_check()) {
      metadata_.push_back(metadata_of(t));
    }
    return holder;
  }

  void mark_forward_completed() {
    forward_completed_ = true;
  }

  at::Tensor unpack(Holder& holder) {
    int64_t gid = torch::autograd::get_current_graph_task_id();
    if (gid == -1) {
      gid = next_pseudo_graph_task.fetch_sub(1);
    }
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    if (recomputed_gids_.count(gid) == 0) {
      recompute(gid);
      recomputed_gids_.insert(gid);
      check_recomputed(gid);
    }
    TORCH_CHECK(
        holder.unpacked_in.insert(gid).second,
        "torch.utils.checkpoint: Unpack is being triggered for a tensor that was "
        "already unpacked once. If you are calling ctx.saved_tensors in backward, "
        "make sure to do so only once. Otherwise please open an issue with details "
        "on your use case.");
    auto& values = recomputed_[gid];
    TORCH_INTERNAL_ASSERT(
        holder.index < static_cast<int64_t>(values.size()) && values[holder.index].defined(),
        "trainmem checkpoint: holder ", holder.index, " was not recomputed");
    at::Tensor out = std::move(values[holder.index]);
    values[holder.index] = at::Tensor();
    return out;
  }

  // Called by the recomputation pack hook.
  at::Tensor fill(int64_t gid, const at::Tensor& x) {
    auto& counter = recomp_counter_[gid];
    const int64_t idx = counter++;
    const int64_t expected = static_cast<int64_t>(holders_.size());
    if (idx >= expected) {
      if (!forward_completed_) {
        ignore_saved_mismatch_ = true;
        return x;
      }
      TORCH_CHECK(
          false,
          "torch.utils.checkpoint: trying to save more tensors during recomputation "
          "than during the original forward pass.");
    }
    auto& values = recomputed_[gid];
    values.resize(holders_.size());
    if (!holders_[idx].expired()) {
      values[idx] = x;
    }
    if (options_.early_stop() && idx + 1 == expected) {
      throw StopRecomputation{};
    }
    return x;
  }

 private:
  void recompute(int64_t gid) {
    std::vector<at::Tensor> args;
    args.reserve(inputs_.size());
    for (const auto& sv : inputs_) {
      args.push_back(sv.unpack());
    }
    recomputed_[gid].resize(holders_.size());
    auto hooks = std::make_shared<RecomputationHooks>(this, gid);
    try {
      SavedTensorHooksGuard guard(hooks);
      at::AutoGradMode grad(true);
      AutocastGuard autocast(autocast_);
      ForkRng rng(options_.preserve_rng_state() ? &rng_ : nullptr, args);
      ContextToken token = recompute_context_ ? recompute_context_() : nullptr;
      detail::RestoreStateGuard restore;  // innermost: Note [Recompute does not change state]
      (void)fn_(args);
    } catch (const StopRecomputation&) {
      // early stop: every tensor backward needs exists
    }
  }

  void check_recomputed(int64_t gid) {
    if (ignore_saved_mismatch_) {
      return;
    }
    const int64_t saved = static_cast<int64_t>(holders_.size());
    const int64_t recomputed = recomp_counter_[gid];
    TORCH_CHECK(
        recomputed == saved,
        "torch.utils.checkpoint: A different number of tensors was saved during "
        "the original forward and recomputation.\nNumber of tensors saved during "
        "forward: ", saved, "\nNumber of tensors saved during recomputation: ",
        recomputed);
    if (!options_.determinism_check()) {
      return;
    }
    std::string mismatched;
    const auto& values = recomputed_[gid];
    for (int64_t i = 0; i < saved; ++i) {
      if (holders_[i].expired() || i >= static_cast<int64_t>(values.size()) ||
          !values[i].defined()) {
        continue;
      }
      auto now = metadata_of(values[i]);
      if (!(now == metadata_[i])) {
        mismatched += "tensor at position " + std::to_string(i) + ":\nsaved metadata: " +
            to_string(metadata_[i]) + "\nrecomputed metadata: " + to_string(now) + "\n";
      }
    }
    TORCH_CHECK(
        mismatched.empty(),
        "torch.utils.checkpoint: Recomputed values for the following tensors have "
        "different metadata than during the forward pass.\n",
        mismatched);
  }

  CheckpointFunction fn_;
  CheckpointOptions options_;
  std::vector<torch::autograd::SavedVariable> inputs_;
  RngState rng_;
  AutocastState autocast_;
  std::function<ContextToken()> recompute_context_;

  std::recursive_mutex mutex_;
  std::vector<std::weak_ptr<Holder>> holders_;
  std::vector<TensorMetadata> metadata_;
  std::unordered_map<int64_t, std::vector<at::Tensor>> recomputed_;
  std::unordered_map<int64_t, int64_t> recomp_counter_;
  std::unordered_set<int64_t> recomputed_gids_;
  bool forward_completed_ = false;
  bool ignore_saved_mismatch_ = false;
};

std::any CheckpointHooks::pack(const at::Tensor& tensor) {
  return frame_->new_holder(tensor);
}

at::Tensor CheckpointHooks::unpack(const std::any& packed) {
  const auto& holder = std::any_cast<const std::shared_ptr<Holder>&>(packed);
  return frame_->unpack(*holder);
}

std::any RecomputationHooks::pack(const at::Tensor& tensor) {
  // tensor_data(): no autograd metadata, so no reference cycle through a
  // recomputed output; the original SavedVariable re-attaches the history.
  return frame_->fill(gid_, tensor.tensor_data());
}

std::vector<at::Tensor> checkpoint_non_reentrant(
    const CheckpointFunction& fn,
    const std::vector<at::Tensor>& inputs,
    const CheckpointOptions& options) {
  CheckpointContexts contexts;
  if (options.context_fn()) {
    contexts = options.context_fn()();
  }
  if (!at::GradMode::is_enabled()) {
    // Nothing is saved without grad mode: just run the region.
    ContextToken token = contexts.forward ? contexts.forward() : nullptr;
    return fn(inputs);
  }
  auto frame = std::make_shared<Frame>(fn, options);
  frame->save_inputs(inputs);
  frame->set_recompute_context(contexts.recompute);
  std::vector<at::Tensor> outputs;
  {
    SavedTensorHooksGuard guard(std::make_shared<CheckpointHooks>(frame));
    ContextToken token = contexts.forward ? contexts.forward() : nullptr;
    outputs = fn(inputs);
  }
  frame->mark_forward_completed();
  return outputs;
}

// Reentrant: a custom autograd Function that runs the region without grad in
// forward and again, with grad, inside its own backward.
struct ReentrantState {
  CheckpointFunction fn;
  bool preserve_rng_state = true;
  RngState rng;
  AutocastState autocast;
  std::vector<bool> requires_grad;
};

struct ReentrantCheckpointFunction
    : public torch::autograd::Function<ReentrantCheckpointFunction> {
  static torch::autograd::variable_list forward(
      torch::autograd::AutogradContext* ctx,
      std::shared_ptr<ReentrantState> state,
      at::TensorList inputs) {
    std::vector<at::Tensor> in(inputs.begin(), inputs.end());
    if (state->preserve_rng_state) {
      state->rng = RngState::capture_stash(in);
    }
    state->autocast = AutocastState::capture();
    for (const auto& t : in) {
      state->requires_grad.push_back(t.defined() && t.requires_grad());
    }
    ctx->save_for_backward(in);
    ctx->saved_data["state"] = c10::IValue::make_capsule(
        c10::make_intrusive<StateCapsule>(std::move(state)));
    auto* s = static_cast<StateCapsule*>(ctx->saved_data["state"].toCapsule().get());
    return s->state->fn(in);
  }

  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::variable_list grad_outputs) {
    TORCH_CHECK(
        torch::autograd::Engine::get_default_engine().is_checkpoint_valid(),
        "When use_reentrant=True, torch.utils.checkpoint is incompatible with .grad() "
        "or passing an `inputs` parameter to .backward(). To resolve this error, you "
        "can either set use_reentrant=False, or call .backward() without passing the "
        "`inputs` argument.");
    auto* capsule = static_cast<StateCapsule*>(ctx->saved_data["state"].toCapsule().get());
    const auto& state = *capsule->state;
    auto saved = ctx->get_saved_variables();
    std::vector<at::Tensor> detached;
    for (size_t i = 0; i < saved.size(); ++i) {
      if (!saved[i].defined()) {
        detached.emplace_back();
        continue;
      }
      auto d = saved[i].detach();
      d.set_requires_grad(state.requires_grad[i]);
      detached.push_back(d);
    }
    std::vector<at::Tensor> outputs;
    {
      at::AutoGradMode grad(true);
      AutocastGuard autocast(state.autocast);
      ForkRng rng(state.preserve_rng_state ? &state.rng : nullptr, detached);
      detail::RestoreStateGuard restore;  // Note [Recompute does not change state]
      outputs = state.fn(detached);
    }
    std::vector<at::Tensor> roots, grads;
    for (size_t i = 0; i < outputs.size() && i < grad_outputs.size(); ++i) {
      if (outputs[i].defined() && outputs[i].requires_grad() && grad_outputs[i].defined()) {
        roots.push_back(outputs[i]);
        grads.push_back(grad_outputs[i]);
      }
    }
    TORCH_CHECK(
        !roots.empty(),
        "trainmem::checkpoint (reentrant): none of the region's outputs requires grad "
        "after recompute");
    torch::autograd::backward(roots, grads);
    torch::autograd::variable_list result;
    result.emplace_back(); // for `state`
    for (const auto& d : detached) {
      result.push_back(d.defined() ? d.grad() : at::Tensor());
    }
    return result;
  }

  struct StateCapsule : torch::CustomClassHolder {
    explicit StateCapsule(std::shared_ptr<ReentrantState> s) : state(std::move(s)) {}
    std::shared_ptr<ReentrantState> state;
  };
};

std::vector<at::Tensor> checkpoint_reentrant(
    const CheckpointFunction& fn,
    const std::vector<at::Tensor>& inputs,
    const CheckpointOptions& options) {
  TORCH_CHECK(
      !options.context_fn(),
      "trainmem::checkpoint: context_fn (selective checkpointing) needs "
      "use_reentrant(false)");
  bool any_requires_grad = false;
  for (const auto& t : inputs) {
    any_requires_grad |= t.defined() && t.requires_grad();
  }
  if (!any_requires_grad && at::GradMode::is_enabled()) {
    TORCH_WARN(
        "None of the inputs have requires_grad=True. Gradients will be None "
        "(trainmem::checkpoint with use_reentrant(true); use_reentrant(false) does "
        "not have this limitation)");
  }
  auto state = std::make_shared<ReentrantState>();
  state->fn = fn;
  state->preserve_rng_state = options.preserve_rng_state();
  return ReentrantCheckpointFunction::apply(std::move(state), at::TensorList(inputs));
}

} // namespace

namespace detail {

std::vector<at::Tensor> checkpoint_impl(
    const CheckpointFunction& fn,
    const std::vector<at::Tensor>& inputs,
    const CheckpointOptions& options) {
  TORCH_CHECK(static_cast<bool>(fn), "trainmem::checkpoint: the function is empty");
  return options.use_reentrant() ? checkpoint_reentrant(fn, inputs, options)
                                 : checkpoint_non_reentrant(fn, inputs, options);
}

} // namespace detail

at::Tensor checkpoint_sequential(
    const torch::nn::Sequential& sequential,
    int64_t segments,
    const at::Tensor& input,
    const CheckpointOptions& options) {
  const int64_t n = static_cast<int64_t>(sequential->size());
  TORCH_CHECK(
      segments >= 1 && segments <= n,
      "checkpoint_sequential: expected 1 <= segments <= ", n,
      " (the number of modules), but got segments = ", segments);
  std::vector<torch::nn::AnyModule> modules(sequential->begin(), sequential->end());
  auto run = [modules](int64_t begin, int64_t end) {
    return [modules, begin, end](const at::Tensor& x) mutable {
      at::Tensor y = x;
      for (int64_t i = begin; i < end; ++i) {
        y = modules[i].forward<at::Tensor>(y);
      }
      return y;
    };
  };
  const int64_t size = n / segments;
  at::Tensor x = input;
  int64_t begin = 0;
  for (int64_t s = 0; s + 1 < segments; ++s, begin += size) {
    x = checkpoint(run(begin, begin + size), x, options);
  }
  return run(begin, n)(x);
}

int64_t sqrt_segments(int64_t num_layers) {
  TORCH_CHECK(num_layers >= 1, "sqrt_segments: expected num_layers >= 1, but got ", num_layers);
  return std::max<int64_t>(1, std::llround(std::sqrt(static_cast<double>(num_layers))));
}

} // namespace trainmem
