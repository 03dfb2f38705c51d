#include "trainmem/hooks.h"

#include <algorithm>
#include <atomic>
#include <functional>
#include <mutex>
#include <string_view>
#include <typeinfo>
#include <unordered_set>
#include <vector>

#include <ATen/SequenceNumber.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <c10/util/flat_hash_map.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/saved_variable_hooks.h>
#include <torch/csrc/autograd/variable.h>

#include "detail/backward_listener.h"
#include "detail/node_type.h"
#include "detail/save_observer.h"
#include "detail/thread_id.h"

// Note [Saved-tensor hooks]
// SavedVariable's constructor asks Engine::get_default_engine() for default
// hooks whenever at::SavedTensorDefaultHooks::is_enabled(). The base engine
// answers nullptr; PyTorch's PythonEngine answers with the Python stack. We
// install a subclass of the base engine through set_default_engine_stub() that
// answers with the innermost frame of a thread-local stack. The stub is read on
// every get_default_engine() call, so installing it at library load is enough;
// the engine is leaked on purpose (never destroyed at exit, so its worker
// threads never race a destructor). The frames hold shared_ptrs: each packed
// tensor keeps its hooks object alive, which is what lets unpack run after the
// guard is gone and on the engine's worker threads.

namespace trainmem {
namespace {

struct Frame {
  uint64_t id;
  std::shared_ptr<SavedTensorHooks> hooks; // null for a disable or observer frame
  std::string disabled_message;            // set only for a disable frame
  std::shared_ptr<detail::SaveObserver> observer; // set only for an observer frame
};

thread_local std::vector<Frame> tls_frames;

// Guards destroyed on a thread other than the one that created them cannot
// reach the owner's thread-local stack; they leave their id here and the owner
// drops the frame the next time it looks at its stack.
std::mutex orphan_mutex;
std::unordered_set<uint64_t> orphan_ids;
std::atomic<int64_t> num_orphans{0};

std::atomic<uint64_t> next_frame_id{1};

void drop_orphans() {
  if (num_orphans.load(std::memory_order_relaxed) == 0) {
    return;
  }
  std::lock_guard<std::mutex> lock(orphan_mutex);
  auto& frames = tls_frames;
  auto is_orphan = [](const Frame& f) { return orphan_ids.erase(f.id) > 0; };
  auto removed = std::remove_if(frames.begin(), frames.end(), is_orphan);
  num_orphans.fetch_sub(frames.end() - removed);
  frames.erase(removed, frames.end());
}

class HooksAdapter final : public torch::autograd::SavedVariableHooks {
 public:
  explicit HooksAdapter(std::shared_ptr<SavedTensorHooks> hooks)
      : hooks_(std::move(hooks)) {}
  void call_pack_hook(const at::Tensor& tensor) override {
    packed_ = hooks_->pack(tensor);
  }
  at::Tensor call_unpack_hook() override {
    return hooks_->unpack(packed_);
  }

 private:
  std::shared_ptr<SavedTensorHooks> hooks_;
  std::any packed_;
};

// Note [A plain save keeps its own tensor]
// Without hooks, SavedVariable keeps an input (or a leaf) itself and an
// output as tensor_data(): an output's autograd meta holds the node that
// saves it, so keeping the output itself would make a reference cycle and
// leak the graph. Hooks are not told which one they get, and a copy costs
// a TensorImpl made and freed per save (60-100 ns a kept save in a chain
// of multiplications, docs/benchmarks.md). So a plain observed save keeps
// the tensor itself when its autograd meta provably holds no node that
// could be saving it, as PyTorch itself would for an input, and
// tensor_data() otherwise. The saving node S is made on this thread by the
// op's autograd kernel before it saves; the only nodes that kernel makes
// after S are the clones of an in-place op's old input (CloneBackward0,
// saved at once: seen here), and the ops it redispatches to make none. So S
// is the thread's newest node, or the one before when the newest is a clone
// seen saved, and a tensor is kept itself when its grad_fn (and, for a view,
// its base's) is
//  - none (a leaf holds its grad accumulator weakly), or
//  - a node made on another thread, or
//  - a CloneBackward0 (it saves nothing), or
//  - a node of a generated single-node op older than S.
// Nodes of other kinds may save after newer nodes are made: a custom
// Function's forward can build graph before its outputs are saved, a
// _foreach op makes one node per element (ForeachMulBackward0List and
// friends), and CopySlices or TorchScript's differentiable graphs wrap
// others. Their tensors are copied.
enum class NodeKind { kOther, kGenerated, kClone };

NodeKind node_kind(const torch::autograd::Node& node) {
  thread_local ska::flat_hash_map<const std::type_info*, NodeKind> cache;
  const std::type_info* type = &typeid(node);
  if (auto it = cache.find(type); it != cache.end()) {
    return it->second;
  }
  const std::string_view mangled = type->name();
  NodeKind kind = NodeKind::kOther;
  if (detail::is_generated_node_type(*type) && mangled.find("Foreach") == std::string_view::npos) {
    kind = mangled.ends_with("14CloneBackward0E") || mangled.ends_with("::CloneBackward0")
        ? NodeKind::kClone
        : NodeKind::kGenerated;
  }
  cache.emplace(type, kind);
  return kind;
}

// The sequence number of the newest CloneBackward0 seen saved on this thread.
thread_local uint64_t tls_saved_clone = UINT64_MAX;

// `meta`'s grad_fn cannot be the node saving now (Note [A plain save keeps
// its own tensor]); `meta` is not a view's.
bool holds_no_saving_node(const torch::autograd::AutogradMeta* meta, uint64_t thread, uint64_t next) {
  const auto* fn = meta == nullptr ? nullptr : meta->grad_fn_.get();
  if (fn == nullptr || fn->thread_id() != thread) {
    return true;
  }
  const uint64_t seq = fn->sequence_nr();
  switch (node_kind(*fn)) {
    case NodeKind::kClone:
      if (seq + 1 == next) {
        tls_saved_clone = seq;  // an in-place op's old input: its own node is the one before
      }
      return true;
    case NodeKind::kGenerated: {
      const uint64_t saving = tls_saved_clone + 1 == next ? next - 2 : next - 1;
      return seq < saving;
    }
    case NodeKind::kOther:
      return false;
  }
  return false;
}

bool keeps_no_saving_node(const at::Tensor& t) {
  const auto* meta = torch::autograd::impl::get_autograd_meta(t);
  if (meta == nullptr) {
    return true;
  }
  const uint64_t thread = at::RecordFunction::currentThreadId();
  const uint64_t next = at::sequence_number::peek();
  if (!meta->is_view_) {
    return holds_no_saving_node(meta, thread, next);
  }
  const auto* view = torch::autograd::impl::get_view_autograd_meta(t);
  if (view == nullptr || !view->has_bw_view() || (view->has_fw_view() && !view->shared_view_info())) {
    return false;
  }
  const auto& base = view->get_backward_view().base_;
  const auto* base_meta = torch::autograd::impl::get_autograd_meta(base);
  return holds_no_saving_node(meta, thread, next) &&
      (base_meta == nullptr || (!base_meta->is_view_ && holds_no_saving_node(base_meta, thread, next)));
}

// Note [Meters observe, hooks pack]
// A meter must count what autograd saves whatever hooks pack it (offload to
// the host, a user's own pair), and must never change what is kept. So a
// meter is an observer frame, not a hooks frame: the innermost hooks frame
// (or none: a plain save) packs, and the innermost observer is told what
// was saved and what now holds its bytes (SavedTensorHooks::packed_tensor).
// Checkpoint's hooks keep no tensor, so their saves are not counted (the
// region's inputs are, through their own SavedVariables). A plain save keeps
// its tensor in the adapter itself (no std::any to allocate: one save in
// every few ops of a metered forward takes this path).
class ObservedAdapter final : public torch::autograd::SavedVariableHooks {
 public:
  // `observer` is used by the pack alone, which runs right after the engine
  // made this adapter, while the observer's frame (which owns it) is alive.
  ObservedAdapter(std::shared_ptr<SavedTensorHooks> hooks, detail::SaveObserver* observer)
      : hooks_(std::move(hooks)), observer_(observer) {}
  void call_pack_hook(const at::Tensor& tensor) override {
    at::Tensor kept;
    if (hooks_) {
      packed_ = hooks_->pack(tensor);
      kept = hooks_->packed_tensor(packed_);
    } else {
      // Note [A plain save keeps its own tensor]. tensor_data() drops the
      // autograd metadata (no reference cycle through a saved output); both
      // share the version counter, so unpack can still catch in-place
      // modification, which autograd stops checking once hooks are set.
      plain_ = keeps_no_saving_node(tensor) ? tensor : tensor.tensor_data();
      version_ = tensor._version();
      kept = plain_;
    }
    observer_->on_save(tensor, kept);
    observer_ = nullptr;  // only the pack is observed
  }
  at::Tensor call_unpack_hook() override {
    if (hooks_) {
      return hooks_->unpack(packed_);
    }
    TORCH_CHECK(
        plain_._version() == version_,
        "one of the variables needed for gradient computation has been "
        "modified by an inplace operation: [",
        plain_.toString(), " ", plain_.sizes(), "] is at version ",
        plain_._version(), "; expected version ", version_, " instead.");
    return plain_;
  }

 private:
  std::shared_ptr<SavedTensorHooks> hooks_;
  detail::SaveObserver* observer_;
  std::any packed_;     // what hooks_ packed
  at::Tensor plain_;    // without hooks: the saved tensor's data
  int64_t version_ = 0;
};

class HooksEngine final : public torch::autograd::Engine {
 public:
  std::unique_ptr<torch::autograd::SavedVariableHooks>
  get_default_saved_variable_hooks() override {
    if (tls_frames.empty()) {
      return nullptr;
    }
    drop_orphans();
    // The innermost packing frame (hooks or disable) and innermost observer.
    const Frame* packer = nullptr;
    const Frame* observer = nullptr;
    for (auto it = tls_frames.rbegin(); it != tls_frames.rend() && (!packer || !observer); ++it) {
      if (it->observer) {
        observer = observer ? observer : &*it;
      } else {
        packer = packer ? packer : &*it;
      }
    }
    if (observer != nullptr) {
      return std::make_unique<ObservedAdapter>(packer ? packer->hooks : nullptr, observer->observer.get());
    }
    if (packer == nullptr || !packer->hooks) {
      return nullptr;
    }
    return std::make_unique<HooksAdapter>(packer->hooks);
  }

  // Note [Phases from the engine]
  // Every backward() and autograd::grad() enters Engine::execute on the
  // calling thread and returns when the graph is done (CUDA work included,
  // the engine waits for its device threads). Wrapping it tells listeners
  // where backward starts and ends without touching the trainer. Nested
  // executes (reentrant checkpoint's backward inside backward) are not
  // phase changes: only the outermost one on a thread notifies.
  torch::autograd::variable_list execute(
      const torch::autograd::edge_list& roots,
      const torch::autograd::variable_list& inputs,
      bool keep_graph,
      bool create_graph,
      bool accumulate_grad,
      const torch::autograd::edge_list& outputs) override {
    struct Depth {
      explicit Depth(const torch::autograd::edge_list& roots) {
        outermost = depth++ == 0;
        if (outermost) {
          notify(true, roots);
        }
      }
      ~Depth() {
        --depth;
        if (outermost) {
          notify(false, {});
        }
      }
      bool outermost;
    } scope(roots);
    return Engine::execute(roots, inputs, keep_graph, create_graph, accumulate_grad, outputs);
  }

 private:
  static thread_local int depth;
  static void notify(bool begin, const torch::autograd::edge_list& roots);
};

thread_local int HooksEngine::depth = 0;

struct Listener {
  int64_t id;
  uint64_t thread;  // detail::this_thread_id() of the thread it listens to
  std::function<void(bool, const torch::autograd::edge_list&)> fn;
};
std::mutex listeners_mutex;
std::vector<Listener>& listeners() {
  static auto* l = new std::vector<Listener>();
  return *l;
}
std::atomic<int64_t> num_listeners{0};

void HooksEngine::notify(bool begin, const torch::autograd::edge_list& roots) {
  if (num_listeners.load(std::memory_order_relaxed) == 0) {
    return;
  }
  // Only this thread's listeners: an audit on another thread must not see
  // this backward. The lock is held while they run, so a listener removed
  // (from any thread) is never called afterwards.
  const uint64_t thread = detail::this_thread_id();
  std::lock_guard<std::mutex> lock(listeners_mutex);
  for (const auto& l : listeners()) {
    if (l.thread != thread) {
      continue;
    }
    try {
      l.fn(begin, roots);
    } catch (...) {
      // a listener must never break the backward it observes
    }
  }
}

HooksEngine* hooks_engine() {
  static auto* engine = new HooksEngine();
  return engine;
}

torch::autograd::Engine& get_hooks_engine() {
  return *hooks_engine();
}

void install_engine() {
  static std::once_flag once;
  std::call_once(once, [] {
    torch::autograd::set_default_engine_stub(&get_hooks_engine);
  });
}

// Installed when the library loads, before any backward can run in a program
// that links it; the guards install it again (idempotently) in case a static
// link dropped this translation unit's initializer.
const bool engine_installed_at_load = (install_engine(), true);

class LambdaHooks final : public SavedTensorHooks {
 public:
  LambdaHooks(PackHook pack, UnpackHook unpack)
      : pack_(std::move(pack)), unpack_(std::move(unpack)) {}
  std::any pack(const at::Tensor& tensor) override {
    return pack_(tensor);
  }
  at::Tensor unpack(const std::any& packed) override {
    return unpack_(packed);
  }

 private:
  PackHook pack_;
  UnpackHook unpack_;
};

void check_engine() {
  install_engine();
  TORCH_CHECK(
      saved_tensor_hooks_available(),
      "trainmem saved-tensor hooks are unavailable: the default autograd engine "
      "was replaced after trainmem installed its own (does this process import "
      "torch's Python module?)");
}

uint64_t push_frame(Frame frame) {
  check_engine();
  drop_orphans();
  for (const auto& f : tls_frames) {
    TORCH_CHECK(
        f.hooks || f.observer || frame.hooks == nullptr,
        f.disabled_message.empty()
            ? std::string(
                  "Saved-tensor hooks are disabled here by a "
                  "DisableSavedTensorHooksGuard; cannot install new hooks")
            : f.disabled_message);
  }
  frame.id = next_frame_id.fetch_add(1);
  tls_frames.push_back(std::move(frame));
  return tls_frames.back().id;
}

// Never throws: it runs from destructors.
void pop_frame(uint64_t id, uint64_t owner_thread, const char* guard) noexcept {
  try {
    if (owner_thread != detail::this_thread_id()) {
      // A meter's frame may be dropped from any thread (an Audit destroyed
      // elsewhere): that is supported, so it is not warned about.
      if (std::string_view(guard) != "SaveObserverGuard") {
        TORCH_WARN(
            guard, " destroyed on thread ", detail::this_thread_id(),
            " but created on thread ", owner_thread,
            "; its hooks are removed from the creating thread the next time it "
            "saves a tensor. Destroy guards on the thread that made them.");
      }
      std::lock_guard<std::mutex> lock(orphan_mutex);
      orphan_ids.insert(id);
      num_orphans.fetch_add(1);
      return;
    }
    auto& frames = tls_frames;
    if (!frames.empty() && frames.back().id == id) {
      frames.pop_back();
      return;
    }
    auto it = std::find_if(frames.begin(), frames.end(), [id](const Frame& f) {
      return f.id == id;
    });
    if (it != frames.end()) {
      if (it->observer) {
        // An observer packs nothing: ending it under an inner hooks guard (an
        // audit's meter at a backward, inside a user's SaveOnCpuGuard) is fine.
        frames.erase(it);
        return;
      }
      TORCH_WARN(
          guard,
          " destroyed out of order (an inner guard is still alive); removing "
          "it anyway");
      frames.erase(it);
    }
  } catch (...) {
    // Nothing may escape a destructor; losing a warning is acceptable.
  }
}

} // namespace

SavedTensorHooksGuard::SavedTensorHooksGuard(
    std::shared_ptr<SavedTensorHooks> hooks)
    : id_(0), thread_(detail::this_thread_id()) {
  TORCH_CHECK(hooks != nullptr, "SavedTensorHooksGuard: hooks must not be null");
  id_ = push_frame(Frame{0, std::move(hooks), {}, nullptr});
}

SavedTensorHooksGuard::SavedTensorHooksGuard(PackHook pack, UnpackHook unpack)
    : id_(0), thread_(detail::this_thread_id()) {
  TORCH_CHECK(
      static_cast<bool>(pack), "SavedTensorHooksGuard: pack hook is empty");
  TORCH_CHECK(
      static_cast<bool>(unpack), "SavedTensorHooksGuard: unpack hook is empty");
  id_ = push_frame(Frame{
      0, std::make_shared<LambdaHooks>(std::move(pack), std::move(unpack)), {}, nullptr});
}

SavedTensorHooksGuard::~SavedTensorHooksGuard() {
  pop_frame(id_, thread_, "SavedTensorHooksGuard");
}

DisableSavedTensorHooksGuard::DisableSavedTensorHooksGuard(
    std::string error_message)
    : id_(0), thread_(detail::this_thread_id()) {
  id_ = push_frame(Frame{0, nullptr, std::move(error_message), nullptr});
}

DisableSavedTensorHooksGuard::~DisableSavedTensorHooksGuard() {
  pop_frame(id_, thread_, "DisableSavedTensorHooksGuard");
}

at::Tensor SavedTensorHooks::packed_tensor(const std::any& packed) const {
  if (const auto* t = std::any_cast<at::Tensor>(&packed)) {
    return *t;
  }
  return at::Tensor();
}

bool saved_tensor_hooks_available() {
  install_engine();
  return &torch::autograd::Engine::get_default_engine() == hooks_engine();
}

int64_t num_active_saved_tensor_hooks() {
  drop_orphans();
  return std::count_if(tls_frames.begin(), tls_frames.end(), [](const Frame& f) { return !f.observer; });
}

} // namespace trainmem

namespace trainmem::detail {

SaveObserverGuard::SaveObserverGuard(std::shared_ptr<SaveObserver> observer)
    : id_(0), thread_(this_thread_id()) {
  TORCH_CHECK(observer != nullptr, "SaveObserverGuard: observer must not be null");
  id_ = push_frame(Frame{0, nullptr, {}, std::move(observer)});
}

SaveObserverGuard::~SaveObserverGuard() {
  pop_frame(id_, thread_, "SaveObserverGuard");
}

int64_t add_backward_listener(BackwardListener fn) {
  static std::atomic<int64_t> next_id{1};
  const int64_t id = next_id.fetch_add(1);
  std::lock_guard<std::mutex> lock(listeners_mutex);
  listeners().push_back(Listener{id, this_thread_id(), std::move(fn)});
  num_listeners.fetch_add(1);
  return id;
}

void remove_backward_listener(int64_t id) {
  std::lock_guard<std::mutex> lock(listeners_mutex);
  auto& l = listeners();
  auto it = std::find_if(l.begin(), l.end(), [id](const auto& e) { return e.id == id; });
  if (it != l.end()) {
    l.erase(it);
    num_listeners.fetch_sub(1);
  }
}

void ensure_hooks_engine() {
  install_engine();
}

} // namespace trainmem::detail
