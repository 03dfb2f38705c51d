#pragma once
/// \file meta.h
/// The meta device for C++ modules: shapes, dtypes and exact byte counts with
/// no data. Build a model on meta without allocating (`MetaInitGuard`), plan
/// it, then give it real storage (`materialize()`) or load a checkpoint into it
/// one tensor at a time (`load_into()`).
///
/// Example:
/// ```
/// trainmem::GPT model{nullptr};
/// {
///   trainmem::MetaInitGuard meta;                    // this thread only
///   model = trainmem::GPT(trainmem::GPTOptions());   // GPT-2 small, no data
/// }
/// trainmem::account(*model).num_params;              // 124,439,808
/// trainmem::materialize(*model, torch::kCPU);        // allocated and initialized
/// ```

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "trainmem/export.h"

namespace torch::nn {
class Module;
} // namespace torch::nn
namespace torch::serialize {
class InputArchive;
} // namespace torch::serialize

namespace trainmem {

/// Moves every parameter and buffer of `module` (recursively) to the meta
/// device in place: each tensor keeps its identity (an optimizer or a meter
/// built on it still refers to it), its shape, strides, dtype and
/// requires_grad, and its storage is released. LibTorch's `module->to(kMeta)`
/// refuses this ("incompatible tensor type"). Note that the module was built
/// on CPU first, so its parameters were allocated once; build it under a
/// MetaInitGuard instead to allocate nothing.
TRAINMEM_API void to_meta(torch::nn::Module& module);

/// Thread-local RAII guard: while it is alive, every factory op called on this
/// thread — an ATen op with a `device` argument and no tensor argument:
/// `empty`, `empty_strided`, `zeros`, `ones`, `full`, `rand`, `randn`,
/// `randint`, `arange`, `linspace`, `eye`, `scalar_tensor`, ... —
/// creates a meta tensor, whatever device it names (and never pinned). In-place
/// initializers (`uniform_`, `normal_`, `kaiming_uniform_`, `fill_`, `zero_`)
/// are no-ops on meta tensors and draw nothing from the random generator. So a
/// LibTorch module constructed under the guard (its `reset()` calls
/// `torch::empty` and an initializer) has meta parameters: no storage bytes,
/// exact sizes. Ops on existing real tensors run as usual.
///
/// Record: the outermost guard on a thread records, in order, every op it sees
/// that is a factory or reads a meta tensor the record made (the constructor's
/// own `orthogonal_`, `kaiming_normal_`, `constant_`, a `copy_` under
/// no_grad, ...), so that materialize() can replay them (docs/design.md, Note
/// [Init replayed on materialize]). The record lives in the meta tensors it
/// made (a tag on each; a real tensor an op read is kept with it): it dies with
/// them, or when materialize(), load_into() or to_empty() gives the last of
/// them storage; it holds no meta storage's bytes. Predictions and
/// find_missing_meta_kernel() record nothing.
///
/// Mechanism: the one op interceptor below autograd (docs/design.md, Note [One
/// interception key]) rewrites each factory op's device to Meta. What it cannot
/// catch: `torch::from_blob` (no op), and code that reads data back (`item()`,
/// `data_ptr()`, `torch::tensor({1, 2, 3})`), which throws on meta. Ops with no
/// C++ Meta kernel throw on meta tensors; the guard first adds the few that
/// LibTorch 2.13 lacks and models need (register_meta_kernels()).
/// `torch::jit::load` cannot run under the guard (it reads each storage on
/// CPU and sets it into a tensor the guard made on meta; the guard throws
/// saying so): load a TorchScript module onto meta with
/// `torch::jit::load(path, c10::Device(c10::kMeta))` instead (its tensors are
/// read once and moved, one at a time). A module left on CPU that meets a
/// meta input is named by find_missing_meta_kernel() ("the module is not on
/// the meta device").
/// Guards nest; they must end in reverse order of construction.
///
/// Example:
/// ```
/// trainmem::MetaInitGuard meta;
/// torch::nn::Linear lin(1000, 1000);   // lin->weight.is_meta(), nothing allocated
/// ```
class TRAINMEM_API MetaInitGuard {
 public:
  /// Starts routing this thread's factory ops to the meta device. Throws if
  /// the op interceptor cannot be registered.
  explicit MetaInitGuard();
  /// Restores the previous state. Never throws.
  ~MetaInitGuard();
  MetaInitGuard(const MetaInitGuard&) = delete;
  MetaInitGuard& operator=(const MetaInitGuard&) = delete;
  MetaInitGuard(MetaInitGuard&&) = delete;
  MetaInitGuard& operator=(MetaInitGuard&&) = delete;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Adds Meta kernels that LibTorch's C++ lacks (Python registers them from
/// Python), each only if the op has none: `index_select` (so Embedding's
/// forward runs on meta), `relu`, `randperm`, and what conv nets and their
/// losses need, with the CPU kernels' sizes, dtypes and memory formats:
/// `convolution` and `convolution_backward` (1-D/2-D/3-D, groups,
/// transposed, channels-last), `native_batch_norm` and its backward (train
/// and eval), `max_pool3d_with_indices` and its backward,
/// `_adaptive_avg_pool2d`/`3d` and their backwards,
/// `embedding_dense_backward`, `nll_loss2d_forward`/`_backward`,
/// `mse_loss_backward`, `binary_cross_entropy` and its backward. (Max/avg
/// pooling in 1-D/2-D, dropout, log-softmax and nll have LibTorch meta kernels
/// already.) Recurrent nets run the CPU's kernels on meta (Note [Meta RNNs
/// follow the CPU's kernel]): `lstm` through oneDNN's `mkldnn_rnn_layer`
/// where the CPU would (its workspace and scratch measured once per shape on
/// zero-filled CPU tensors; a probe above 1 GiB is refused as a missing meta
/// kernel), and `lstm` with projections, `gru`, `rnn_tanh`, `rnn_relu` and
/// their packed-sequence forms through the CPU branch of the composite
/// layers (every step's input projection at once); saved tensors, layouts
/// and peaks equal the CPU's. A CUDA prediction keeps the composite path
/// (cuDNN's RNN is neither). Every other ATen op with a CPU kernel and no
/// Meta or composite kernel (where, abs.out under logsumexp, logical_and,
/// full max/min, std, var, dot, flip, cdist, ...) gets one generic meta
/// kernel: the op's CPU kernel run once per distinct call on zero-filled CPU
/// stand-ins of the meta arguments (1 GiB at most; pointwise ops above it on
/// a shrunk shape), whose outputs' sizes, strides, dtypes and storage bytes,
/// and scratch, the meta call reproduces; an op whose output shape depends on
/// values (nonzero, unique, masked_select, `.item()`) throws
/// c10::NotImplementedError "trainmem: aten::nonzero has no meta kernel and
/// its output shape depends on values" (docs/design.md, Note [A meta path for
/// ops without a meta kernel]). Idempotent; MetaInitGuard and to_meta() call
/// it. Call it yourself before running a forward on meta tensors made
/// otherwise.
TRAINMEM_API void register_meta_kernels();

/// A read of values from meta tensors inside a prediction (planner.h's and
/// cuda_predict.h's predictions, plan_regions), where control flow may have
/// differed from a real run: a meta tensor holds no values, so each such read
/// returns a documented one. `.item()` and `if (t.all().item<bool>())` (op
/// "aten::_local_scalar_dense") return 0, or false for a bool tensor; a meta
/// tensor copied to the CPU (`.to(torch::kCPU)`: "aten::_to_copy", or
/// "aten::copy_" into a CPU tensor) gives zeros. Outside a prediction a meta
/// `.item()` throws as in LibTorch. Plain data.
struct ScalarRead {
  std::string op;        ///< "aten::_local_scalar_dense", "aten::_to_copy", "aten::copy_"
  std::string value;     ///< what each read returned on meta: "0", "false" or "zeros"
  int64_t num_reads = 0; ///< how many times, warm-up steps included
};

/// An op that has no kernel for meta tensors, as find_missing_meta_kernel()
/// found it. Plain data.
struct MissingMetaKernel {
  /// The operator, "aten::histc" or "aten::add.Tensor" (overload after the
  /// dot), or "" if the error did not name one.
  std::string op;
  /// The error as thrown.
  std::string message;
};

/// Runs `run` (a forward, or a whole step, on meta tensors) after
/// register_meta_kernels(), and returns the op that could not run on meta if
/// that is why it threw (LibTorch words it "Could not run 'aten::x' with
/// arguments from the 'Meta' backend", "aten::x: attempted to run this
/// operator with Meta tensors, but there was no fake impl or Meta kernel
/// registered", or, from a composite kernel, "x_overrideable not
/// implemented"; register_meta_kernels()'s generic kernel "trainmem: aten::x
/// has no meta kernel and ..."; any c10::NotImplementedError counts, with
/// `op` "" if it names none), or nullopt if `run` returned. Any other error propagates; an op
/// that gets both a meta tensor and a CPU one (not a 0-dim scalar) throws,
/// naming it: the module was left on CPU. A planner uses it to fall back to
/// profiling that region on CPU at the planned shapes instead of failing
/// the whole plan.
///
/// Example:
/// ```
/// auto missing = trainmem::find_missing_meta_kernel([&] {
///   model->forward(torch::empty({8, 1, 28, 28}, torch::kMeta)).sum().backward(); });
/// if (missing) std::cout << "no meta kernel for " << missing->op << "\n";
/// ```
TRAINMEM_API std::optional<MissingMetaKernel> find_missing_meta_kernel(const std::function<void()>& run);

/// A module with an initialization of its own beyond its children's (e.g.
/// GPT's embeddings at N(0, 0.02)): `materialize()` calls `reset_parameters()`
/// after its children's, in place, tensors kept.
class TRAINMEM_API Reinitializable {
 public:
  virtual ~Reinitializable() = default;
  /// Re-initializes, in place, the values this module sets itself.
  virtual void reset_parameters() = 0;
};

/// Re-initializes the tensors `module` owns directly. Returns true if it did
/// (then the built-in reset is skipped for that module).
using ModuleInit = std::function<bool(torch::nn::Module& module)>;

/// Re-initializes, in place, the parameters and buffers of LibTorch's
/// built-in modules with their own `reset_parameters()`: Linear, Bilinear,
/// Conv{1,2,3}d, ConvTranspose{1,2,3}d, Embedding, EmbeddingBag, LayerNorm,
/// GroupNorm, BatchNorm{1,2,3}d, InstanceNorm{1,2,3}d, MultiheadAttention,
/// RNN, LSTM, GRU and their cells. Returns false for any other type.
TRAINMEM_API bool reset_builtin_parameters(torch::nn::Module& module);

/// Gives every meta parameter and buffer of `module` (recursively) storage on
/// `device`, uninitialized (PyTorch's `Module.to_empty`). Each tensor keeps its
/// identity (TensorImpl), shape, strides, dtype and requires_grad; tensors
/// that share one storage on meta (tied weights, views) share one on `device`.
/// Tensors already off meta are left alone. Allocates exactly the meta
/// storages' bytes. A MetaInitGuard's record of their construction is dropped
/// (nothing is replayed: use materialize() for values).
TRAINMEM_API void to_empty(torch::nn::Module& module, c10::Device device);

/// Gives every meta parameter and buffer of `module` (recursively) storage on
/// `device` and the values its construction gave it.
///
/// Built under a MetaInitGuard: the ops the guard recorded are replayed on
/// `device` in order (factories made there, each meta tensor mapped to its
/// real counterpart, each temporary released after its last use), the
/// constructor's own init included, and each tensor adopts the replayed
/// storage. On the CPU the values are bit-identical to a CPU construction
/// after the same `torch::manual_seed` (the replay draws from the generator
/// as it stands, in the construction's order; other devices draw from their
/// own generators). What cannot be replayed throws c10::Error before anything
/// is allocated, naming the tensor and the op ("materialize: cannot give
/// weight the values its construction gave: aten::copy_ read a meta tensor of
/// size [3, 4] not made under the MetaInitGuard"): an op that read a meta
/// tensor from outside the record, an op that returned a value read from meta
/// tensors or threw on meta and was caught (control flow may have differed), a
/// draw out of order; at replay, a real tensor the construction read and that
/// changed since, or an op with no kernel on `device` (then nothing is
/// changed). Ops run on the meta tensors
/// after the guard ended are not recorded, so not reproduced.
///
/// Moved to meta with to_meta() (no construction recorded): `to_empty(module,
/// device)`, then each module owning such tensors is re-initialized in
/// post-order (children in registration order, then the parent): `init` if
/// given and it returns true, else `Reinitializable::reset_parameters()`, else
/// `reset_builtin_parameters()`: LibTorch's defaults, not the constructor's
/// own init (which is not reproduced). Throws, naming them, if some module
/// owns such tensors and none of the three knows it (its tensors are then
/// allocated but uninitialized), or if a module owns both recorded and
/// unrecorded meta tensors. With nothing recorded, every module is
/// re-initialized (the same draws as a CPU construction when each module
/// constructs its children in registration order and initializes its own
/// tensors after them, as LibTorch's modules, Transformer and GPT do).
///
/// Identity: every parameter and buffer keeps its TensorImpl, so optimizers,
/// meters and handles taken on the meta module stay valid.
///
/// Example:
/// ```
/// torch::manual_seed(0);
/// Policy policy{nullptr};
/// {
///   trainmem::MetaInitGuard meta;
///   policy = Policy();             // runs orthogonal_ on its weights: recorded
/// }
/// torch::optim::Adam adam(policy->parameters());
/// trainmem::materialize(*policy, torch::kCPU);   // as Policy() on the CPU after manual_seed(0)
/// ```
TRAINMEM_API void materialize(torch::nn::Module& module, c10::Device device, const ModuleInit& init = nullptr);

/// Yields the tensor for a parameter or buffer by its dotted name in
/// `named_parameters()` / `named_buffers()` ("transformer.blocks.0.qkv.weight"),
/// or an undefined tensor when there is none.
using TensorSource = std::function<at::Tensor(const std::string& name)>;

/// A TensorSource over an archive written by `torch::save(module, ...)`
/// (nested archives per submodule). Reading shares the archive's storages (no
/// copy). `archive` must outlive the source. The archive holds every tensor it
/// loaded until it is destroyed: loading onto another device keeps the
/// checkpoint once in host memory (the archive) and once on the device; a
/// TensorSource that reads each tensor on demand keeps one at a time.
TRAINMEM_API TensorSource archive_source(torch::serialize::InputArchive& archive);

/// What load_into() did.
struct LoadReport {
  int64_t num_loaded = 0;          ///< tensors given storage
  int64_t loaded_bytes = 0;        ///< their bytes, in bytes
  int64_t num_adopted = 0;         ///< of them, storages taken over from the source (no copy)
  int64_t num_copied = 0;          ///< of them, copied (other device or dtype)
  std::vector<std::string> missing; ///< names the source had no tensor for
};

/// Materializes the meta parameters and buffers of `module` from `source`, one
/// tensor at a time, so a checkpoint is never held twice: a source tensor
/// already on `device` with the parameter's dtype is adopted (the parameter
/// takes its storage, no copy); otherwise it is converted to `device` and the
/// dtype, and the source tensor is released before the next one is asked for.
/// Peak memory: the model's bytes plus the largest converted tensor, plus
/// whatever the source itself keeps alive. Tensors keep their identity and
/// requires_grad; a tensor shared by several modules is loaded once, under its
/// first name. Throws if a shape differs (naming it), or, when `strict`, if the
/// source had no tensor for some names (listed; the rest are loaded). Nothing
/// of a MetaInitGuard's record is replayed (the checkpoint's values win); the
/// record of each loaded tensor is dropped.
///
/// Example:
/// ```
/// torch::serialize::InputArchive archive;
/// archive.load_from("gpt2.pt");
/// trainmem::load_into(*model, trainmem::archive_source(archive), torch::kCPU);
/// ```
TRAINMEM_API LoadReport load_into(torch::nn::Module& module, const TensorSource& source, c10::Device device,
                     bool strict = true);

} // namespace trainmem
