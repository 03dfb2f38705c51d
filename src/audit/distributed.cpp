// DataParallel on c10d::Reducer, the model check, and DistributedAudit's
// gather (distributed.h). No Gloo here: everything goes through the
// c10d::ProcessGroup the user gives, so NCCL works the same way.

#include "trainmem/distributed.h"

#include <time.h>

#include <algorithm>
#include <climits>
#include <limits>
#include <cstring>
#include <unordered_map>
#include <unordered_set>

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>
#include <torch/nn/module.h>

#include "audit/detail/distributed_json.h"

namespace trainmem {
namespace {

int64_t monotonic_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

// FNV-1a over bytes: a fingerprint, not a security hash.
uint64_t fnv1a(const void* data, size_t n, uint64_t h = 14695981039346656037ull) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

int64_t as_int64(uint64_t v) {
  int64_t out = 0;
  std::memcpy(&out, &v, sizeof out);
  return out;
}

} // namespace

c10::intrusive_ptr<c10d::ProcessGroup> make_process_group(
    const c10::intrusive_ptr<c10d::Backend>& backend,
    const c10::intrusive_ptr<c10d::Store>& store) {
  TORCH_CHECK(backend, "make_process_group: expected a backend, but got null");
  TORCH_CHECK(store, "make_process_group: expected the backend's store, but got null");
  const std::string name = backend->getBackendName();
  c10d::ProcessGroup::BackendType type = c10d::ProcessGroup::BackendType::UNDEFINED;
  c10::DeviceType device = c10::kCPU;
  if (name == "gloo") {
    type = c10d::ProcessGroup::BackendType::GLOO;
  } else if (name == "nccl") {
    type = c10d::ProcessGroup::BackendType::NCCL;
    device = c10::kCUDA;
  } else {
    TORCH_CHECK(false, "make_process_group: expected a gloo or nccl backend, but got \"", name, "\"");
  }
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(store, backend->getRank(), backend->getSize());
  pg->setDefaultBackend(type);
  pg->setBackend(device, type, backend);
  return pg;
}

// ---- DataParallel -----------------------------------------------------------

// Note [DDP through c10d::Reducer]
// The C++ Reducer that Python's DDP drives is exported by libtorch_cpu and
// needs nothing from Python: it hooks each parameter's AccumulateGrad, copies
// (or, with gradient_as_bucket_view, lets autograd write) gradients into flat
// bucket buffers, all-reduces each bucket when its last gradient arrives, and
// divides by the world size. We set it up as DDP's __init__ does with
// find_unused_parameters=False: a single bucket for the first step, rebuilt
// after it in the order gradients arrived (the first bucket capped at 1 MiB
// while bucket_cap_mb is DDP's default, at bucket_cap_mb once it is given;
// the rest at bucket_cap_mb). The bucket buffers are the "communication buffers"
// of the reports: with gradient_as_bucket_view=False they are a second copy
// of every gradient for the whole run; with True the gradients are views
// into them and they add nothing.
struct DataParallel::Impl {
  std::vector<at::Tensor> params;
  c10::intrusive_ptr<c10d::ProcessGroup> process_group;
  DataParallelOptions options;
  std::unique_ptr<c10d::Reducer> reducer;
};

DataParallel::DataParallel(
    torch::nn::Module& model,
    c10::intrusive_ptr<c10d::ProcessGroup> process_group,
    DataParallelOptions options)
    : impl_(std::make_unique<Impl>()) {
  TORCH_CHECK(process_group, "DataParallel: expected a process group, but got null");
  TORCH_CHECK(options.effective_bucket_cap_bytes() > 0, "DataParallel: expected bucket_cap_bytes > 0, but got ",
              options.effective_bucket_cap_bytes());
  TORCH_CHECK(options.effective_first_bucket_cap_bytes() > 0,
              "DataParallel: expected first_bucket_cap_bytes > 0, but got ", options.effective_first_bucket_cap_bytes());
  auto& s = *impl_;
  s.process_group = std::move(process_group);
  s.options = options;
  std::unordered_set<const void*> seen;
  for (const auto& p : model.parameters()) {
    if (p.requires_grad() && seen.insert(p.unsafeGetTensorImpl()).second) {
      s.params.push_back(p);
    }
  }
  TORCH_CHECK(!s.params.empty(), "DataParallel: the model has no trainable parameters");
  // DDP (find_unused_parameters=False): one bucket until the first step has
  // shown the order gradients arrive in; reversed, as DDP reverses them.
  auto [indices, limits] = c10d::compute_bucket_assignment_by_size(
      s.params, {std::numeric_limits<size_t>::max()}, std::vector<bool>(s.params.size(), false));
  (void)limits;
  std::reverse(indices.begin(), indices.end());
  std::unordered_map<size_t, std::string> names;
  s.reducer = std::make_unique<c10d::Reducer>(
      s.params, std::move(indices), s.process_group, std::vector<bool>(s.params.size(), false),
      options.effective_bucket_cap_bytes(), /*find_unused_parameters=*/false, options.gradient_as_bucket_view(),
      std::move(names), options.effective_first_bucket_cap_bytes(), /*skip_all_reduce_unused_params=*/false,
      /*use_python_reducer=*/false, /*bucket_bytes_cap_list=*/std::vector<int64_t>{});
}

DataParallel::~DataParallel() {
  try {
    impl_->reducer.reset();
  } catch (const std::exception& e) {
    // ~Reducer is noexcept(false); a destructor of ours must not throw.
    TORCH_WARN("DataParallel: c10d::Reducer's destructor threw: ", e.what());
  }
}

bool DataParallel::prepare_for_forward() {
  auto& r = *impl_->reducer;
  const bool rebuilt = r.rebuild_buckets();
  r.prepare_for_forward();
  return rebuilt;
}

void DataParallel::prepare_for_backward() {
  impl_->reducer->prepare_for_backward({});
}

void DataParallel::zero_grad() {
  for (auto& p : impl_->params) {
    auto& g = p.mutable_grad();
    if (!g.defined()) {
      continue;
    }
    if (impl_->options.gradient_as_bucket_view()) {
      g.zero_();  // keep the view: resetting it would make autograd allocate a fresh gradient
    } else {
      g = at::Tensor();
    }
  }
}

int64_t DataParallel::communication_bytes() const {
  int64_t total = 0;
  std::unordered_set<const void*> seen;
  for (const auto& b : impl_->reducer->get_grad_buckets(/*return_zero_tensors=*/false)) {
    const auto& buf = b.getBuffer();
    if (buf.defined() && seen.insert(buf.storage().unsafeGetStorageImpl()).second) {
      total += static_cast<int64_t>(buf.storage().nbytes());
    }
  }
  return total;
}

std::vector<at::Tensor> DataParallel::bucket_buffers() const {
  std::vector<at::Tensor> out;
  for (const auto& b : impl_->reducer->get_grad_buckets(/*return_zero_tensors=*/false)) {
    out.push_back(b.getBuffer());
  }
  return out;
}

std::vector<int64_t> DataParallel::bucket_bytes() const {
  std::vector<int64_t> out;
  for (const auto& b : impl_->reducer->get_grad_buckets(/*return_zero_tensors=*/false)) {
    const auto& buf = b.getBuffer();
    out.push_back(buf.defined() ? static_cast<int64_t>(buf.nbytes()) : 0);
  }
  return out;
}

int64_t DataParallel::world_size() const {
  return impl_->process_group->getSize();
}

const DataParallelOptions& DataParallel::options() const {
  return impl_->options;
}

// ---- check_model_agreement --------------------------------------------------

std::vector<std::string> check_model_agreement(
    const torch::nn::Module& model,
    const c10::intrusive_ptr<c10d::ProcessGroup>& process_group) {
  TORCH_CHECK(process_group, "check_model_agreement: expected a process group, but got null");
  // Per rank: tensors, elements, a hash of (shape, dtype) per tensor, a hash
  // of the values' bytes.
  int64_t num_tensors = 0, num_elements = 0;
  uint64_t shape_hash = 14695981039346656037ull, value_hash = 14695981039346656037ull;
  for (const auto& p : model.parameters()) {
    ++num_tensors;
    num_elements += p.numel();
    for (int64_t d : p.sizes()) {
      shape_hash = fnv1a(&d, sizeof d, shape_hash);
    }
    const auto dtype = static_cast<int64_t>(p.scalar_type());
    shape_hash = fnv1a(&dtype, sizeof dtype, shape_hash);
    const auto c = p.detach().to(c10::kCPU).contiguous();
    value_hash = fnv1a(c.data_ptr(), c.nbytes(), value_hash);
  }
  auto mine = at::empty({4}, at::kLong);
  auto* m = mine.data_ptr<int64_t>();
  m[0] = num_tensors;
  m[1] = num_elements;
  m[2] = as_int64(shape_hash);
  m[3] = as_int64(value_hash);
  const int world = process_group->getSize();
  std::vector<std::vector<at::Tensor>> all(1);
  for (int r = 0; r < world; ++r) {
    all[0].push_back(at::zeros({4}, at::kLong));
  }
  std::vector<at::Tensor> in{mine};
  process_group->allgather(all, in)->wait();
  std::vector<std::string> lines;
  const auto* r0 = all[0][0].data_ptr<int64_t>();
  for (int r = 1; r < world; ++r) {
    const auto* x = all[0][static_cast<size_t>(r)].data_ptr<int64_t>();
    if (x[0] != r0[0] || x[1] != r0[1]) {
      lines.push_back(fmt::format("rank {}: {} parameter tensors ({} elements), rank 0 has {} ({} elements)", r,
                                  x[0], x[1], r0[0], r0[1]));
    } else if (x[2] != r0[2]) {
      lines.push_back(fmt::format("rank {}: parameter shapes or dtypes differ from rank 0's", r));
    } else if (x[3] != r0[3]) {
      lines.push_back(fmt::format("rank {}: parameter values differ from rank 0's (initialise every rank alike, "
                                  "or broadcast rank 0's weights)", r));
    }
  }
  return lines;
}

// ---- DistributedAudit -------------------------------------------------------

struct DistributedAudit::Impl {
  Impl(const torch::nn::Module& model,
       const torch::optim::Optimizer* optimizer,
       c10::intrusive_ptr<c10d::ProcessGroup> pg,
       c10::Device device,
       AuditOptions options)
      : audit(model, optimizer, device, options), process_group(std::move(pg)), title(options.title()) {}
  Audit audit;
  c10::intrusive_ptr<c10d::ProcessGroup> process_group;
  std::string title;
  const DataParallel* data_parallel = nullptr;
  // Bucket storages already named (weak: a freed one's address may come back).
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> tagged;

  // Note [Communication buffers in the timeline]
  // The Reducer makes its buckets before the audit and again when
  // prepare_for_forward() rebuilds them between steps 0 and 1. Unnamed, the
  // first ones were "before the audit" and stayed counted there after the
  // rebuild freed them (the audit sees the frees of the blocks it owns
  // only), and the rebuilt ones were unknown (made between steps). So each
  // buffer is named before the next step opens: Category::kCommunication,
  // or, with gradient_as_bucket_view, GRADIENT (they are the gradients'
  // storage). Named, its block is the audit's and its free is counted.
  void tag_buffers() {
    if (data_parallel == nullptr) {
      return;
    }
    const auto category =
        data_parallel->options().gradient_as_bucket_view() ? Category::kGradient : Category::kCommunication;
    for (const auto& buf : data_parallel->bucket_buffers()) {
      if (!buf.defined() || !buf.has_storage()) {
        continue;
      }
      const auto* impl = buf.storage().unsafeGetStorageImpl();
      const bool known = std::any_of(tagged.begin(), tagged.end(), [&](const auto& w) {
        auto p = w.lock();
        return p && p.get() == impl;
      });
      if (!known) {
        tagged.push_back(buf.storage().getWeakStorageImpl());
        audit.set_category(buf, category);
      }
    }
  }
  int64_t origin_ns = 0;
  int64_t predicted_bytes = -1;
  std::string prediction;
  std::vector<std::string> disagreements;
};

DistributedAudit::DistributedAudit(
    const torch::nn::Module& model,
    const torch::optim::Optimizer* optimizer,
    c10::intrusive_ptr<c10d::ProcessGroup> process_group,
    c10::Device device,
    AuditOptions options) {
  TORCH_CHECK(process_group, "DistributedAudit: expected a process group, but got null");
  impl_ = std::make_unique<Impl>(model, optimizer, std::move(process_group), device, std::move(options));
}

DistributedAudit::~DistributedAudit() = default;

Audit& DistributedAudit::audit() {
  if (impl_->origin_ns == 0 && impl_->audit.num_steps() == 0) {
    // The audit's time zero is its first begin_step(), which follows.
    impl_->origin_ns = monotonic_ns();
  }
  return impl_->audit;
}

Audit::StepGuard DistributedAudit::step() {
  impl_->tag_buffers();
  return audit().step();
}

void DistributedAudit::set_data_parallel(const DataParallel& data_parallel) {
  impl_->data_parallel = &data_parallel;
  impl_->tagged.clear();
  impl_->tag_buffers();
}

void DistributedAudit::set_prediction(int64_t static_per_rank_bytes, const std::string& formula) {
  impl_->predicted_bytes = static_per_rank_bytes;
  impl_->prediction = formula;
}

void DistributedAudit::add_disagreement(const std::string& line) {
  impl_->disagreements.push_back(line);
}

std::optional<DistributedReport> DistributedAudit::gather() {
  auto& s = *impl_;
  const int rank = s.process_group->getRank();
  const int world = s.process_group->getSize();
  RankReport mine;
  mine.rank = rank;
  mine.audit = s.audit.report();
  mine.origin_ns = s.origin_ns;
  if (s.data_parallel != nullptr) {
    mine.communication_bytes = s.data_parallel->communication_bytes();
    mine.bucket_bytes = s.data_parallel->bucket_bytes();
  }
  const std::string text = detail::rank_report_to_json(mine);
  // Gather needs equal sizes: pad every document to the longest (JSON has no NUL).
  auto len = at::empty({1}, at::kLong);
  len.data_ptr<int64_t>()[0] = static_cast<int64_t>(text.size()) + 1;
  std::vector<at::Tensor> lens{len};
  c10d::AllreduceOptions max;
  max.reduceOp = c10d::ReduceOp::MAX;
  s.process_group->allreduce(lens, max)->wait();
  const int64_t n = len.data_ptr<int64_t>()[0];
  auto buf = at::zeros({n}, at::kByte);
  std::memcpy(buf.data_ptr(), text.data(), text.size());
  std::vector<std::vector<at::Tensor>> out;
  if (rank == 0) {
    out.emplace_back();
    for (int r = 0; r < world; ++r) {
      out[0].push_back(at::zeros({n}, at::kByte));
    }
  }
  std::vector<at::Tensor> in{buf};
  c10d::GatherOptions root;
  root.rootRank = 0;
  s.process_group->gather(out, in, root)->wait();
  if (rank != 0) {
    return std::nullopt;
  }
  DistributedReport report;
  report.title = s.title;
  report.backend = s.process_group->getBackendName();
  report.world_size = world;
  report.predicted_static_per_rank_bytes = s.predicted_bytes;
  report.prediction = s.prediction;
  report.disagreements = s.disagreements;
  for (int r = 0; r < world; ++r) {
    const auto* p = static_cast<const char*>(out[0][static_cast<size_t>(r)].data_ptr());
    report.ranks.push_back(detail::rank_report_from_json(std::string(p, strnlen(p, static_cast<size_t>(n)))));
    TORCH_CHECK(report.ranks.back().rank == r, "DistributedAudit::gather: rank ", r, "'s slot holds rank ",
                report.ranks.back().rank, "'s report");
  }
  return report;
}

} // namespace trainmem
