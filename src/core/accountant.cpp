#include "trainmem/accountant.h"

#include <algorithm>
#include <map>
#include <sstream>
#include <typeinfo>
#include <unordered_set>

#include <c10/util/Exception.h>
#include <c10/util/irange.h>
#include <fmt/format.h>
#include <torch/nn/module.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include "trainmem/format.h"

#include "core/detail/optimizer_state_walk.h"
#include "detail/storage_set.h"

namespace trainmem {
namespace {

using detail::StorageSet;

// Unique parameters of a module, by storage (shared parameters count once).
struct ParamScan {
  StorageSet params;
  int64_t num_params = 0;
  int64_t num_trainable = 0;
  int64_t trainable_bytes = 0;
  StorageSet grads;
  StorageSet buffers;
  int64_t num_buffers = 0;
  std::unordered_set<const c10::TensorImpl*> impls;
};

ParamScan scan_params(const torch::nn::Module& module) {
  ParamScan scan;
  for (const auto& p : module.parameters(/*recurse=*/true)) {
    if (!scan.impls.insert(p.unsafeGetTensorImpl()).second) {
      continue;
    }
    if (!scan.params.add(p)) {
      continue; // another parameter tensor on the same storage (tied views)
    }
    scan.num_params += p.numel();
    if (p.requires_grad()) {
      scan.num_trainable += p.numel();
      scan.trainable_bytes += p.numel() * static_cast<int64_t>(p.element_size());
    }
    if (p.grad().defined()) {
      scan.grads.add(p.grad());
    }
  }
  // After the parameters: a buffer on a parameter's storage is counted there
  // once, not twice.
  for (const auto& b : module.buffers(/*recurse=*/true)) {
    if (b.defined() && !scan.params.contains(b) && scan.buffers.add(b)) {
      ++scan.num_buffers;
    }
  }
  return scan;
}

// Collects state bytes by field name, deduplicated by storage.
class StateWalk {
 public:
  void add(const std::string& name, const at::Tensor& t) {
    if (!t.defined()) {
      return;
    }
    auto& entry = by_name_[name];
    entry.name = name;
    entry.num_tensors += 1;
    const int64_t before = all_.bytes();
    all_.add(t);
    entry.bytes += all_.bytes() - before;
  }
  template <typename Container>
  void add_all(const std::string& name, const Container& tensors) {
    for (const auto& t : tensors) {
      add(name, t);
    }
  }
  // Any state class: serialize it and read every tensor back by key.
  void add_generic(const torch::optim::OptimizerParamState& state) {
    torch::serialize::OutputArchive out;
    try {
      state.serialize(out);
    } catch (const c10::Error& e) {
      TORCH_CHECK(
          false, "trainmem::account: cannot read optimizer state of type ",
          c10::demangle(typeid(state).name()),
          ": it has no serialize() to walk (", e.what_without_backtrace(),
          "); counting it as zero would be wrong");
    }
    std::stringstream buffer;
    out.save_to(buffer);
    torch::serialize::InputArchive in;
    in.load_from(buffer);
    walk_archive(in, "");
  }
  int64_t bytes() const {
    return all_.bytes();
  }
  std::vector<StateBytes> by_name() const {
    std::vector<StateBytes> out;
    for (const auto& [name, entry] : by_name_) {
      out.push_back(entry);
    }
    std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) {
      return a.bytes != b.bytes ? a.bytes > b.bytes : a.name < b.name;
    });
    return out;
  }

 private:
  void walk_archive(torch::serialize::InputArchive& in, const std::string& prefix) {
    for (const auto& key : in.keys()) {
      at::Tensor t;
      if (in.try_read(key, t)) {
        add(prefix + key, t);
        continue;
      }
      c10::IValue value;
      if (in.try_read(key, value)) {
        walk_ivalue(prefix + key, value);
        continue;
      }
      torch::serialize::InputArchive nested;
      if (in.try_read(key, nested)) {
        walk_archive(nested, prefix + key + ".");
      }
    }
  }
  void walk_ivalue(const std::string& name, const c10::IValue& v) {
    if (v.isTensor()) {
      add(name, v.toTensor());
    } else if (v.isTensorList()) {
      add_all(name, v.toTensorVector());
    } else if (v.isList()) {
      for (const auto& e : v.toListRef()) {
        walk_ivalue(name, e);
      }
    } else if (v.isTuple()) {
      for (const auto& e : v.toTupleRef().elements()) {
        walk_ivalue(name, e);
      }
    }
  }

  StorageSet all_;
  std::map<std::string, StateBytes> by_name_;
};

// Optimizer name and predicted state bytes from its type and per-group
// options. `group_bytes[i]` is group i's trainable parameter bytes.
std::pair<std::string, int64_t> predict_state(
    const torch::optim::Optimizer& opt,
    const std::vector<int64_t>& group_bytes) {
  using namespace torch::optim;
  const auto& groups = opt.param_groups();
  auto per_group = [&](auto&& multiple) {
    int64_t total = 0;
    for (const auto i : c10::irange(groups.size())) {
      total += multiple(groups[i].options()) * group_bytes[i];
    }
    return total;
  };
  const std::string name = detail::builtin_optimizer_name(opt);
  if (name == "AdamW") {
    return {name, per_group([](const OptimizerOptions& o) {
              return static_cast<const AdamWOptions&>(o).amsgrad() ? 3 : 2;
            })};
  }
  if (name == "Adam") {
    return {name, per_group([](const OptimizerOptions& o) {
              return static_cast<const AdamOptions&>(o).amsgrad() ? 3 : 2;
            })};
  }
  if (name == "SGD") {
    return {name, per_group([](const OptimizerOptions& o) {
              return static_cast<const SGDOptions&>(o).momentum() != 0 ? 1 : 0;
            })};
  }
  if (name == "RMSprop") {
    return {name, per_group([](const OptimizerOptions& o) {
              const auto& r = static_cast<const RMSpropOptions&>(o);
              return 1 + (r.momentum() > 0 ? 1 : 0) + (r.centered() ? 1 : 0);
            })};
  }
  if (name == "Adagrad") {
    return {name, per_group([](const OptimizerOptions&) { return 1; })};
  }
  if (name == "LBFGS") {
    // d, prev_flat_grad and up to history_size (old_dirs, old_stps) pairs of
    // flat vectors; ro, al and H_diag are scalars per entry.
    return {name, per_group([](const OptimizerOptions& o) {
              return 2 + 2 * static_cast<const LBFGSOptions&>(o).history_size();
            })};
  }
  return {c10::demangle(typeid(opt).name()), -1};
}

StaticBuckets buckets_from(const ParamScan& scan) {
  StaticBuckets b;
  b.num_params = scan.num_params;
  b.num_trainable_params = scan.num_trainable;
  b.param_bytes = scan.params.bytes();
  b.buffer_bytes = scan.buffers.bytes();
  b.num_buffers = scan.num_buffers;
  b.grad_bytes = scan.grads.bytes();
  b.predicted_grad_bytes = scan.trainable_bytes;
  return b;
}

} // namespace

StaticBuckets account(const torch::nn::Module& module) {
  return buckets_from(scan_params(module));
}

StaticBuckets account(
    const torch::nn::Module& module,
    const torch::optim::Optimizer& optimizer) {
  const auto scan = scan_params(module);
  StaticBuckets b = buckets_from(scan);

  std::vector<int64_t> group_bytes;
  int64_t num_opt_params = 0;
  int64_t num_foreign = 0;
  for (const auto& group : optimizer.param_groups()) {
    int64_t bytes = 0;
    for (const auto& p : group.params()) {
      ++num_opt_params;
      if (scan.impls.count(p.unsafeGetTensorImpl()) == 0) {
        ++num_foreign;
      }
      if (p.requires_grad()) {
        bytes += p.numel() * static_cast<int64_t>(p.element_size());
      }
    }
    group_bytes.push_back(bytes);
  }
  TORCH_CHECK(
      num_opt_params > 0,
      "trainmem::account: the optimizer has no parameters; build it from "
      "module->parameters()");
  TORCH_CHECK(
      num_foreign == 0, "trainmem::account: ", num_foreign, " of the optimizer's ",
      num_opt_params,
      " parameters are not parameters of the module; account the module the "
      "optimizer was built for");

  auto [name, predicted] = predict_state(optimizer, group_bytes);
  b.optimizer = name;
  b.predicted_optimizer_state_bytes = predicted;

  StateWalk walk;
  detail::for_each_state_tensor(
      optimizer, [&](const std::string& field, const at::Tensor& t) { walk.add(field, t); },
      [&](const torch::optim::OptimizerParamState& s) { walk.add_generic(s); });
  b.optimizer_state_bytes = walk.bytes();
  b.state_by_name = walk.by_name();
  if (predicted < 0) {
    // Unknown optimizer: the best prediction is what it holds now.
    b.predicted_optimizer_state_bytes = b.optimizer_state_bytes;
  }
  return b;
}

std::string to_string(const StaticBuckets& b) {
  std::string out;
  out += fmt::format("parameters       {:>16} B  ({} elements, {} trainable)\n",
                     with_commas(b.param_bytes), with_commas(b.num_params),
                     with_commas(b.num_trainable_params));
  if (b.num_buffers > 0) {
    out += fmt::format("buffers          {:>16} B  ({} tensors)\n", with_commas(b.buffer_bytes),
                       b.num_buffers);
  }
  out += fmt::format("gradients        {:>16} B  (predicted {} B)\n",
                     with_commas(b.grad_bytes), with_commas(b.predicted_grad_bytes));
  if (!b.optimizer.empty()) {
    out += fmt::format("optimizer state  {:>16} B  ({}, predicted {} B)\n",
                       with_commas(b.optimizer_state_bytes), b.optimizer,
                       with_commas(b.predicted_optimizer_state_bytes));
    for (const auto& s : b.state_by_name) {
      out += fmt::format("  {:<15}{:>16} B  ({} tensors)\n", s.name,
                         with_commas(s.bytes), s.num_tensors);
    }
  }
  out += fmt::format("total            {:>16} B\n", with_commas(b.total_bytes()));
  return out;
}

namespace {

StaticFormula make_formula(Recipe recipe, int64_t n, std::vector<FormulaTerm> terms) {
  StaticFormula f;
  f.recipe = recipe;
  f.num_params = n;
  for (auto& t : terms) {
    t.bucket = t.shard_first ? Bucket::kOptimizerState
        : t.name.rfind("gradients", 0) == 0 ? Bucket::kGradients
                                            : Bucket::kParameters;
    if (t.bytes == 0) {
      t.bytes = static_cast<int64_t>(t.bytes_per_param * static_cast<double>(n));
    }
    f.total_bytes += t.bytes;
  }
  f.terms = std::move(terms);
  f.bytes_per_param = n > 0 ? static_cast<double>(f.total_bytes) / static_cast<double>(n) : 0.0;
  return f;
}

} // namespace

StaticFormula predict_static_bytes(int64_t n, Recipe recipe) {
  TORCH_CHECK(n >= 0, "predict_static_bytes: expected num_params >= 0, but got ", n);
  switch (recipe) {
    case Recipe::kFp32AdamW:
      return make_formula(recipe, n, {{"parameters (fp32)", 4, 0, false},
                                      {"gradients (fp32)", 4, 0, false},
                                      {"AdamW exp_avg (fp32)", 4, 0, true},
                                      {"AdamW exp_avg_sq (fp32)", 4, 0, true}});
    case Recipe::kMixedAdamW:
      return make_formula(recipe, n, {{"parameters (bf16)", 2, 0, false},
                                      {"gradients (bf16)", 2, 0, false},
                                      {"master weights (fp32)", 4, 0, true},
                                      {"AdamW exp_avg (fp32)", 4, 0, true},
                                      {"AdamW exp_avg_sq (fp32)", 4, 0, true}});
    case Recipe::kPureBf16AdamW:
      return make_formula(recipe, n, {{"parameters (bf16)", 2, 0, false},
                                      {"gradients (bf16)", 2, 0, false},
                                      {"AdamW exp_avg (fp32)", 4, 0, true},
                                      {"AdamW exp_avg_sq (fp32)", 4, 0, true}});
    case Recipe::kFp32SGD:
      return make_formula(recipe, n, {{"parameters (fp32)", 4, 0, false},
                                      {"gradients (fp32)", 4, 0, false}});
    case Recipe::kFp32SGDMomentum:
      return make_formula(recipe, n, {{"parameters (fp32)", 4, 0, false},
                                      {"gradients (fp32)", 4, 0, false},
                                      {"SGD momentum_buffer (fp32)", 4, 0, true}});
    case Recipe::kFp32Adafactor:
      TORCH_CHECK(false, "predict_static_bytes: Adafactor's state depends on the "
                         "parameter shapes; pass the module instead of a count");
  }
  TORCH_CHECK(false, "predict_static_bytes: unknown recipe ", static_cast<int>(recipe));
}

namespace {

// Note [Buffers are replicated]
// A module's buffers (BatchNorm's running_mean, running_var and
// num_batches_tracked) are static bytes no recipe here predicts: the
// formula's last term is their bytes as they are stored (the accountant's
// buffer_bytes), in whatever dtype the model made them. No sharding scheme
// splits them: DeepSpeed's ZeRO partitions parameters, gradients and
// optimizer state only, and PyTorch FSDP flattens and shards parameters only;
// every rank keeps each buffer whole (FSDP moves and may cast them,
// MixedPrecision's buffer_dtype, and DDP broadcasts rank 0's copies before
// each forward by default, but none of them splits a buffer). So
// shard_static_bytes() keeps Bucket::kBuffers replicated at every stage and
// on the device (no offload moves it).
void add_buffer_term(StaticFormula& f, const ParamScan& scan) {
  const int64_t bytes = scan.buffers.bytes();
  if (scan.num_buffers == 0) {
    return;
  }
  FormulaTerm t;
  t.name = "buffers";
  t.bytes = bytes;
  t.bytes_per_param = f.num_params > 0 ? static_cast<double>(bytes) / static_cast<double>(f.num_params) : 0.0;
  t.shard_first = false;
  t.bucket = Bucket::kBuffers;
  f.terms.push_back(t);
  f.total_bytes += bytes;
  f.bytes_per_param =
      f.num_params > 0 ? static_cast<double>(f.total_bytes) / static_cast<double>(f.num_params) : 0.0;
}

StaticFormula predict_parameter_bytes(const ParamScan& scan, const torch::nn::Module& module, Recipe recipe) {
  if (recipe != Recipe::kFp32Adafactor) {
    auto f = predict_static_bytes(scan.num_trainable, recipe);
    const int64_t frozen = scan.num_params - scan.num_trainable;
    if (frozen > 0) {
      // Frozen parameters: stored, but no gradient and no optimizer state.
      const double param_bpp = f.terms.front().bytes_per_param;
      f.terms.insert(f.terms.begin() + 1,
                     FormulaTerm{"frozen parameters", param_bpp,
                                 static_cast<int64_t>(param_bpp * static_cast<double>(frozen)), false,
                                 Bucket::kParameters});
      f.total_bytes += f.terms[1].bytes;
      f.num_params = scan.num_params;
      f.bytes_per_param = static_cast<double>(f.total_bytes) / static_cast<double>(f.num_params);
    }
    return f;
  }
  // Adafactor (Shazeer & Stern 2018, as torch.optim.Adafactor keeps it):
  // a matrix (..., r, c) keeps row_var (..., r, 1) and col_var (..., 1, c);
  // a vector keeps a full variance.
  int64_t factored = 0;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& p : module.parameters(/*recurse=*/true)) {
    if (!p.requires_grad() || !seen.insert(p.unsafeGetTensorImpl()).second) {
      continue;
    }
    if (p.numel() == 0) {
      continue;
    }
    if (p.dim() >= 2) {
      const int64_t lead = p.numel() / (p.size(-1) * p.size(-2));
      factored += lead * (p.size(-1) + p.size(-2));
    } else {
      factored += p.numel();
    }
  }
  const int64_t n = scan.num_params;
  auto f = make_formula(recipe, n,
                        {{"parameters (fp32)", 4, 0, false},
                         {"gradients (fp32)", 0, 4 * scan.num_trainable, false},
                         {"Adafactor row_var + col_var (fp32)", 0, 4 * factored, true}});
  for (auto& t : f.terms) {
    t.bytes_per_param = n > 0 ? static_cast<double>(t.bytes) / static_cast<double>(n) : 0.0;
  }
  return f;
}

} // namespace

StaticFormula predict_static_bytes(const torch::nn::Module& module, Recipe recipe) {
  const auto scan = scan_params(module);
  auto f = predict_parameter_bytes(scan, module, recipe);
  add_buffer_term(f, scan);
  return f;
}

std::string to_string(Recipe recipe) {
  switch (recipe) {
    case Recipe::kFp32AdamW: return "fp32 AdamW";
    case Recipe::kMixedAdamW: return "mixed-precision AdamW";
    case Recipe::kPureBf16AdamW: return "pure bf16 AdamW";
    case Recipe::kFp32SGD: return "fp32 SGD";
    case Recipe::kFp32SGDMomentum: return "fp32 SGD with momentum";
    case Recipe::kFp32Adafactor: return "fp32 Adafactor";
  }
  return "unknown recipe";
}

std::string to_string(const StaticFormula& f) {
  std::string terms;
  std::string whole;  // terms not per parameter (buffers): "+ 208 B buffers"
  for (const auto& t : f.terms) {
    if (t.bucket == Bucket::kBuffers) {
      whole += fmt::format(" + {} B {}", with_commas(t.bytes), t.name);
      continue;
    }
    terms += fmt::format("{}{:g} {}", terms.empty() ? "" : " + ", t.bytes_per_param, t.name);
  }
  return fmt::format("{}: P = {} x ({}){} = {} B ({:g} B/param)", to_string(f.recipe),
                     with_commas(f.num_params), terms, whole, with_commas(f.total_bytes),
                     f.bytes_per_param);
}

// Note [Sharded static bytes]
// ZeRO shards the optimizer-side terms at stage 1, the gradients too at 2 and
// the parameters too at 3; a rank keeps ceil(P / N) elements of each sharded
// flat buffer. Offload moves the optimizer-side shards (and, from stage 2, the
// gradient shard the CPU optimizer reads) to the host. The published formulas
// are data below, each term marked where its assumptions differ from ours, so
// a test can reconcile them byte for byte (docs/design.md).

namespace {

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

bool is_sharded(Bucket bucket, int64_t stage) {
  switch (bucket) {
    case Bucket::kOptimizerState: return stage >= 1;
    case Bucket::kGradients: return stage >= 2;
    case Bucket::kParameters: return stage >= 3;
    case Bucket::kBuffers: return false;  // Note [Buffers are replicated]
  }
  return false;
}

bool is_offloaded(Bucket bucket, const ShardingOptions& o) {
  switch (bucket) {
    case Bucket::kOptimizerState: return o.offload_optimizer();
    case Bucket::kGradients: return o.offload_optimizer() && o.zero_stage() >= 2;
    case Bucket::kParameters: return o.offload_parameters();
    case Bucket::kBuffers: return false;
  }
  return false;
}

const char* bucket_name(Bucket b) {
  switch (b) {
    case Bucket::kParameters: return "parameters";
    case Bucket::kGradients: return "gradients";
    case Bucket::kOptimizerState: return "optimizer state";
    case Bucket::kBuffers: return "buffers";
  }
  return "unknown";
}

} // namespace

ShardedStatic shard_static_bytes(const StaticFormula& formula, const ShardingOptions& o) {
  TORCH_CHECK(o.zero_stage() >= 0 && o.zero_stage() <= 3,
              "shard_static_bytes: expected zero_stage in 0..3, but got ", o.zero_stage());
  TORCH_CHECK(o.world_size() >= 1, "shard_static_bytes: expected world_size >= 1, but got ",
              o.world_size());
  TORCH_CHECK(!o.offload_optimizer() || o.zero_stage() >= 1,
              "shard_static_bytes: optimizer offload needs zero_stage >= 1, but got ", o.zero_stage());
  TORCH_CHECK(!o.offload_parameters() || o.zero_stage() == 3,
              "shard_static_bytes: parameter offload needs zero_stage 3, but got ", o.zero_stage());
  TORCH_CHECK(o.largest_layer_params() >= 0,
              "shard_static_bytes: expected largest_layer_params >= 0, but got ",
              o.largest_layer_params());
  ShardedStatic r;
  r.formula = formula;
  r.options = o;
  const int64_t n = o.world_size();
  const int64_t shard_elements = ceil_div(formula.num_params, n);
  double gather_bytes_per_element = 0;
  for (const auto& t : formula.terms) {
    ShardedTerm st;
    st.name = t.name;
    st.bucket = t.bucket;
    st.total_bytes = t.bytes;
    st.sharded = is_sharded(t.bucket, o.zero_stage());
    st.on_host = is_offloaded(t.bucket, o);
    const bool per_element =
        t.bytes_per_param == static_cast<double>(static_cast<int64_t>(t.bytes_per_param)) &&
        t.bytes == static_cast<int64_t>(t.bytes_per_param) * formula.num_params;
    st.per_rank_bytes = !st.sharded ? t.bytes
        : per_element            ? static_cast<int64_t>(t.bytes_per_param) * shard_elements
                                 : ceil_div(t.bytes, n);
    if (t.bucket == Bucket::kParameters && t.name.rfind("frozen", 0) != 0) {
      gather_bytes_per_element += t.bytes_per_param;
    } else if (t.bucket == Bucket::kGradients) {
      gather_bytes_per_element += t.bytes_per_param;
    }
    r.terms.push_back(st);
  }
  if (o.zero_stage() == 3 && o.largest_layer_params() > 0) {
    ShardedTerm g;
    g.name = "gathered largest layer (parameters + gradients)";
    g.bucket = Bucket::kParameters;
    g.working = true;
    g.total_bytes = static_cast<int64_t>(gather_bytes_per_element) * o.largest_layer_params();
    g.per_rank_bytes = g.total_bytes;
    r.terms.push_back(g);
  }
  for (const auto& t : r.terms) {
    (t.on_host ? r.host_per_rank_bytes : r.device_per_rank_bytes) += t.per_rank_bytes;
  }
  return r;
}

int64_t largest_layer_params(const torch::nn::Module& module) {
  int64_t largest = 0;
  for (const auto& m : module.modules(/*include_self=*/true)) {
    std::unordered_set<const c10::TensorImpl*> seen;
    int64_t own = 0;
    for (const auto& p : m->parameters(/*recurse=*/false)) {
      if (seen.insert(p.unsafeGetTensorImpl()).second) {
        own += p.numel();
      }
    }
    largest = std::max(largest, own);
  }
  return largest;
}

std::string to_string(const ShardedStatic& r) {
  const auto& o = r.options;
  std::string out = fmt::format(
      "{}, ZeRO-{} over {} ranks{}{}: {} B per rank on the device, {} B on the host\n",
      to_string(r.formula.recipe), o.zero_stage(), o.world_size(),
      o.offload_optimizer() ? ", optimizer offloaded" : "",
      o.offload_parameters() ? ", parameters offloaded" : "", with_commas(r.device_per_rank_bytes),
      with_commas(r.host_per_rank_bytes));
  for (const auto& t : r.terms) {
    out += fmt::format("  {:<48}{:>20} B  {}{}{}\n", t.name, with_commas(t.per_rank_bytes),
                       t.working ? "working buffer" : t.sharded ? "sharded" : "replicated",
                       t.on_host ? ", host" : "", t.working ? "" : fmt::format(" ({})", bucket_name(t.bucket)));
  }
  return out;
}

int64_t PublishedFormula::device_per_rank_bytes(int64_t num_params, int64_t world_size,
                                                int64_t largest_layer) const {
  TORCH_CHECK(world_size >= 1, "PublishedFormula: expected world_size >= 1, but got ", world_size);
  double replicated = 0;
  double sharded = 0;
  double layer = 0;
  for (const auto& t : terms) {
    if (t.on_host) {
      continue;
    }
    (t.per_largest_layer ? layer : t.sharded ? sharded : replicated) += t.bytes_per_param;
  }
  const auto p = static_cast<double>(num_params);
  return static_cast<int64_t>(replicated * p) + static_cast<int64_t>(sharded * p / static_cast<double>(world_size)) +
      static_cast<int64_t>(layer * static_cast<double>(largest_layer));
}

PublishedFormula published_formula(Published which) {
  // Sentences reused by several formulas.
  const std::string fp32_grads =
      "DeepSpeed keeps a 4 B fp32 copy of the gradient partition for the fp32 optimizer; our "
      "mixed recipe steps from the 2 B gradients and has no such term";
  const std::string megatron_grads =
      "Megatron accumulates and all-reduces gradients in fp32 (main_grad, 4 B); our mixed "
      "recipe keeps 2 B gradients";
  PublishedFormula f;
  f.recipe = Recipe::kMixedAdamW;
  switch (which) {
    case Published::kZeroPaperStage1:
    case Published::kZeroPaperStage2:
    case Published::kZeroPaperStage3: {
      const int64_t stage = static_cast<int64_t>(which) - static_cast<int64_t>(Published::kZeroPaperStage1) + 1;
      f.source = fmt::format("Rajbhandari et al. 2020 (ZeRO), stage {}, mixed-precision Adam, K = 12", stage);
      f.formula = stage == 1 ? "(2 + 2) P + 12 P / N" : stage == 2 ? "2 P + (2 + 12) P / N" : "(2 + 2 + 12) P / N";
      f.sharding.zero_stage(stage);
      f.terms = {{"fp16 parameters", 2, stage >= 3, false, false, ""},
                 {"fp16 gradients", 2, stage >= 2, false, false, ""},
                 {"optimizer states (fp32 params, momentum, variance), K = 12", 12, true, false, false, ""}};
      return f;
    }
    case Published::kDeepSpeedZero2:
      f.source = "DeepSpeed estimate_zero2_model_states_mem_needs, cpu_offload=False (GPU figure)";
      f.formula = "2 P + 18 P / N";
      f.sharding.zero_stage(2);
      f.terms = {{"16-bit parameters", 2, false, false, false, ""},
                 {"16-bit gradients", 2, true, false, false, ""},
                 {"fp32 gradients", 4, true, false, false, fp32_grads},
                 {"fp32 parameters", 4, true, false, false, ""},
                 {"fp32 momentum and variance", 8, true, false, false, ""}};
      return f;
    case Published::kDeepSpeedZero2Offload:
      f.source = "DeepSpeed estimate_zero2_model_states_mem_needs, cpu_offload=True (GPU figure)";
      f.formula = "2 P (GPU); CPU per node: P x max(4 N, 16) x 1.5";
      f.sharding.zero_stage(2).offload_optimizer(true);
      f.terms = {{"16-bit parameters", 2, false, false, false, ""},
                 {"gradient and optimizer partitions (CPU)", 16, true, true, false,
                  "DeepSpeed's CPU figure is per node, 16 B/param (fp32 gradients, params, moments) or "
                  "4 N B/param, times a 1.5 buffer factor; ours is per rank, (2 + 12) P / N, no factor"}};
      return f;
    case Published::kDeepSpeedZero3:
      f.source = "DeepSpeed estimate_zero3_model_states_mem_needs, no offload (GPU figure)";
      f.formula = "4 x largest layer + 18 P / N";
      f.sharding.zero_stage(3);
      f.terms = {{"gathered largest layer: 16-bit params + grads", 4, false, false, true, ""},
                 {"16-bit parameter partition", 2, true, false, false, ""},
                 {"fp32 gradient partition", 4, true, false, false,
                  "DeepSpeed keeps the gradient partition in fp32 (4 B) for the optimizer; ours keeps "
                  "it at 2 B, the gradients' dtype"},
                 {"fp32 parameters", 4, true, false, false, ""},
                 {"fp32 momentum and variance", 8, true, false, false, ""}};
      return f;
    case Published::kDeepSpeedZero3OffloadOptimizer:
      f.source = "DeepSpeed estimate_zero3_model_states_mem_needs, offload optimizer only (GPU figure)";
      f.formula = "4 x largest layer + 2 P / N";
      f.sharding.zero_stage(3).offload_optimizer(true);
      f.terms = {{"gathered largest layer: 16-bit params + grads", 4, false, false, true, ""},
                 {"16-bit parameter partition", 2, true, false, false, ""},
                 {"fp32 gradients, params, momentum, variance (CPU)", 16, true, true, false,
                  "DeepSpeed's CPU figure is 16 B/param per node x 1.5; ours is (2 + 12) P / N per rank"}};
      return f;
    case Published::kDeepSpeedZero3OffloadAll:
      f.source = "DeepSpeed estimate_zero3_model_states_mem_needs, offload optimizer and params (GPU figure)";
      f.formula = "4 x largest layer";
      f.sharding.zero_stage(3).offload_optimizer(true).offload_parameters(true);
      f.terms = {{"gathered largest layer: 16-bit params + grads", 4, false, false, true, ""},
                 {"everything else (CPU)", 18, true, true, false,
                  "DeepSpeed's CPU figure is 18 B/param per node x 1.5; ours is 16 P / N per rank"}};
      return f;
    case Published::kMegatronBf16Fp32Grads:
      f.source = "Megatron-LM distributed optimizer guide, float16 param, fp32 grads, non-distributed";
      f.formula = "18";
      f.terms = {{"16-bit parameters", 2, false, false, false, ""},
                 {"fp32 main gradients", 4, false, false, false, megatron_grads},
                 {"fp32 main params, exp_avg, exp_avg_sq", 12, false, false, false, ""}};
      return f;
    case Published::kMegatronDistributedBf16Fp32Grads:
      f.source = "Megatron-LM distributed optimizer guide, float16 param, fp32 grads";
      f.formula = "6 + 12 / d";
      f.sharding.zero_stage(1);
      f.terms = {{"16-bit parameters", 2, false, false, false, ""},
                 {"fp32 main gradients", 4, false, false, false, megatron_grads},
                 {"fp32 main params, exp_avg, exp_avg_sq", 12, true, false, false, ""}};
      return f;
    case Published::kMegatronDistributedFp32:
      f.source = "Megatron-LM distributed optimizer guide, fp32 param, fp32 grads";
      f.formula = "8 + 8 / d";
      f.recipe = Recipe::kFp32AdamW;
      f.sharding.zero_stage(1);
      f.terms = {{"fp32 parameters", 4, false, false, false, ""},
                 {"fp32 gradients", 4, false, false, false, ""},
                 {"exp_avg, exp_avg_sq", 8, true, false, false, ""}};
      return f;
  }
  TORCH_CHECK(false, "published_formula: unknown formula ", static_cast<int>(which));
}

std::vector<Published> all_published_formulas() {
  std::vector<Published> out;
  for (int i = 0; i <= static_cast<int>(Published::kMegatronDistributedFp32); ++i) {
    out.push_back(static_cast<Published>(i));
  }
  return out;
}

Reconciliation reconcile(Published which, int64_t num_params, int64_t world_size,
                         int64_t largest_layer_params) {
  Reconciliation r;
  r.published = published_formula(which);
  r.published_bytes = r.published.device_per_rank_bytes(num_params, world_size, largest_layer_params);
  auto sharding = r.published.sharding;
  sharding.world_size(world_size);
  // The gather buffer is counted only where the published formula counts it
  // (DeepSpeed's estimator, not the ZeRO paper).
  for (const auto& t : r.published.terms) {
    if (t.per_largest_layer) {
      sharding.largest_layer_params(largest_layer_params);
    }
  }
  r.ours = shard_static_bytes(predict_static_bytes(num_params, r.published.recipe), sharding);
  r.difference_bytes = r.published_bytes - r.ours.device_per_rank_bytes;
  return r;
}

std::string to_string(const Reconciliation& r) {
  std::string out = fmt::format("{}: {}\n  published {:>20} B per rank on the device\n  ours      {:>20} B ({}, ZeRO-{})\n  difference {:>19} B\n",
                                r.published.source, r.published.formula, with_commas(r.published_bytes),
                                with_commas(r.ours.device_per_rank_bytes), to_string(r.ours.formula.recipe),
                                r.ours.options.zero_stage(), with_commas(r.difference_bytes));
  for (const auto& t : r.published.terms) {
    if (!t.differs.empty()) {
      out += fmt::format("  {}: {}\n", t.name, t.differs);
    }
  }
  return out;
}

} // namespace trainmem

namespace trainmem::detail {

std::string builtin_optimizer_name(const torch::optim::Optimizer& o) {
  using namespace torch::optim;
  if (dynamic_cast<const AdamW*>(&o) != nullptr) return "AdamW";
  if (dynamic_cast<const Adam*>(&o) != nullptr) return "Adam";
  if (dynamic_cast<const SGD*>(&o) != nullptr) return "SGD";
  if (dynamic_cast<const RMSprop*>(&o) != nullptr) return "RMSprop";
  if (dynamic_cast<const Adagrad*>(&o) != nullptr) return "Adagrad";
  if (dynamic_cast<const LBFGS*>(&o) != nullptr) return "LBFGS";
  return "";
}

// Note [One optimizer-state walk] (core/detail/optimizer_state_walk.h).
void for_each_state_tensor(const torch::optim::Optimizer& optimizer, const StateTensorFn& tensor,
                           const UnknownStateFn& unknown) {
  using namespace torch::optim;
  auto all = [&](const std::string& field, const auto& tensors) {
    for (const auto& t : tensors) {
      tensor(field, t);
    }
  };
  for (const auto& [key, state] : optimizer.state()) {
    if (!state) {
      continue;
    }
    const auto* s = state.get();
    if (const auto* a = dynamic_cast<const AdamParamState*>(s)) {
      tensor("exp_avg", a->exp_avg());
      tensor("exp_avg_sq", a->exp_avg_sq());
      tensor("max_exp_avg_sq", a->max_exp_avg_sq());
    } else if (const auto* w = dynamic_cast<const AdamWParamState*>(s)) {
      tensor("exp_avg", w->exp_avg());
      tensor("exp_avg_sq", w->exp_avg_sq());
      tensor("max_exp_avg_sq", w->max_exp_avg_sq());
    } else if (const auto* g = dynamic_cast<const SGDParamState*>(s)) {
      tensor("momentum_buffer", g->momentum_buffer());
    } else if (const auto* r = dynamic_cast<const RMSpropParamState*>(s)) {
      tensor("square_avg", r->square_avg());
      tensor("momentum_buffer", r->momentum_buffer());
      tensor("grad_avg", r->grad_avg());
    } else if (const auto* ag = dynamic_cast<const AdagradParamState*>(s)) {
      tensor("sum", ag->sum());
    } else if (const auto* l = dynamic_cast<const LBFGSParamState*>(s)) {
      tensor("d", l->d());
      tensor("H_diag", l->H_diag());
      tensor("prev_flat_grad", l->prev_flat_grad());
      all("old_dirs", l->old_dirs());
      all("old_stps", l->old_stps());
      all("ro", l->ro());
      if (l->al()) {
        all("al", *l->al());
      }
    } else if (unknown) {
      unknown(*s);
    }
  }
}

} // namespace trainmem::detail
