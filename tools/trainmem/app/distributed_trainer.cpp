// The local multi-rank launcher and each rank's data-parallel loop
// (distributed_trainer.h). The only file that needs Gloo's headers
// (compiled with USE_C10D_GLOO; see CMakeLists.txt), and, in a CUDA build
// whose LibTorch has c10d's NCCL (TRAINMEM_WITH_NCCL), NCCL's.

#include "app/distributed_trainer.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <optional>
#include <thread>

#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <ATen/ops/randn.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef TRAINMEM_WITH_NCCL
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include "trainmem/accountant.h"
#include "trainmem/allocator.h"

#include "app/audited_step.h"
#include "core/detail/checkpoint_state.h"
#include "detail/text.h"

namespace trainmem {
namespace {

constexpr const char* kReportKey = "trainmem/report";
constexpr const char* kGradsKey = "trainmem/grads";
constexpr const char* kLossesKey = "trainmem/losses";
constexpr const char* kFailuresKey = "trainmem/failures";

std::string error_key(int64_t rank) {
  return fmt::format("trainmem/error/{}", rank);
}

std::vector<uint8_t> bytes_of(const std::string& s) {
  return {s.begin(), s.end()};
}

// Tensors as bytes for the store: count, then per tensor ndim, sizes, fp32 data.
std::vector<uint8_t> pack(const std::vector<at::Tensor>& tensors) {
  std::vector<uint8_t> out;
  auto put = [&](const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    out.insert(out.end(), b, b + n);
  };
  const int64_t count = static_cast<int64_t>(tensors.size());
  put(&count, sizeof count);
  for (const auto& t : tensors) {
    const auto c = t.defined() ? t.to(at::kFloat).contiguous() : at::Tensor();
    const int64_t ndim = c.defined() ? c.dim() : -1;
    put(&ndim, sizeof ndim);
    if (c.defined()) {
      for (int64_t d : c.sizes()) {
        put(&d, sizeof d);
      }
      put(c.data_ptr(), c.nbytes());
    }
  }
  return out;
}

std::vector<at::Tensor> unpack(const std::vector<uint8_t>& in) {
  size_t at = 0;
  auto get = [&](void* p, size_t n) {
    TORCH_CHECK(at + n <= in.size(), "train_distributed: rank 0's gradients are truncated");
    std::memcpy(p, in.data() + at, n);
    at += n;
  };
  int64_t count = 0;
  get(&count, sizeof count);
  std::vector<at::Tensor> out;
  for (int64_t i = 0; i < count; ++i) {
    int64_t ndim = 0;
    get(&ndim, sizeof ndim);
    if (ndim < 0) {
      out.emplace_back();
      continue;
    }
    std::vector<int64_t> sizes(static_cast<size_t>(ndim));
    for (auto& d : sizes) {
      get(&d, sizeof d);
    }
    auto t = at::empty(sizes, at::kFloat);
    get(t.data_ptr(), t.nbytes());
    out.push_back(t);
  }
  return out;
}

std::string signal_text(int sig) {
  const char* name = sigabbrev_np(sig);
  return fmt::format("signal {} (SIG{})", sig, name != nullptr ? name : "?");
}

bool on_cuda(const DistributedTrainerOptions& o) {
  return o.trainer().device() == "cuda";
}

// Note [NCCL ranks]
// On CUDA each rank owns cuda:rank and its process group has two backends,
// as PyTorch's init_process_group("cpu:gloo,cuda:nccl"): ProcessGroupNCCL
// for CUDA tensors (the Reducer's buckets) and ProcessGroupGloo for CPU
// tensors (check_model_agreement() and DistributedAudit::gather() send CPU
// tensors), each on a store prefix of its own, as PyTorch does. NCCL takes
// one device per rank: two ranks on one GPU fail in ncclCommInitRank
// ("Duplicate GPU detected"), so train_distributed() refuses more ranks than
// devices before it forks.
c10::intrusive_ptr<c10d::ProcessGroup> make_rank_process_group(
    const DistributedTrainerOptions& o,
    int rank,
    const c10::intrusive_ptr<c10d::Store>& store) {
  const int world = static_cast<int>(o.nproc());
  const auto timeout = std::chrono::milliseconds(o.timeout_ms());
  auto gloo = c10d::ProcessGroupGloo::Options::create(timeout);
  gloo->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  if (!on_cuda(o)) {
    auto backend = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world, gloo);
    return make_process_group(backend, store);
  }
#ifdef TRAINMEM_WITH_NCCL
  auto cpu = c10::make_intrusive<c10d::ProcessGroupGloo>(c10::make_intrusive<c10d::PrefixStore>("cpu/", store), rank,
                                                         world, gloo);
  auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
  nccl_options->timeout = timeout;
  auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(c10::make_intrusive<c10d::PrefixStore>("cuda/", store), rank,
                                                          world, nccl_options);
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(store, rank, world);
  pg->setDefaultBackend(c10d::ProcessGroup::BackendType::NCCL);
  pg->setBackend(c10::kCPU, c10d::ProcessGroup::BackendType::GLOO, cpu);
  pg->setBackend(c10::kCUDA, c10d::ProcessGroup::BackendType::NCCL, nccl);
  return pg;
#else
  TORCH_CHECK(false, "device cuda: this trainmem was built without NCCL (see nccl_available())");
#endif
}

// The prediction of a rank's static bytes (fp32), set beside its audit.
void set_static_prediction(DistributedAudit& audit, const DistributedTrainerOptions& o,
                           const torch::nn::Module& model) {
  const auto& t = o.trainer();
  const int world = static_cast<int>(o.nproc());
  const auto recipe = t.optimizer() == "sgd" ? Recipe::kFp32SGDMomentum : Recipe::kFp32AdamW;
  const auto sharded =
      shard_static_bytes(predict_static_bytes(model, recipe), ShardingOptions().zero_stage(0).world_size(world));
  const auto& dp = o.data_parallel();
  audit.set_prediction(
      sharded.device_per_rank_bytes,
      to_string(sharded) +
          (dp.gradient_as_bucket_view()
               ? "  DDP buckets: the gradients are views of them (gradient_as_bucket_view), 0 B beyond the "
                 "gradients\n"
               : "  DDP buckets, not in the formula: a flat copy of every gradient, as many bytes again as the "
                 "gradients, for the whole run (gradient_as_bucket_view avoids it)\n"));
}

// Rank 0 leaves the run's report, its first step's gradients and its
// losses in the store for the launcher.
void publish_run(const DistributedTrainerOptions& o, DistributedReport& report, const std::vector<at::Tensor>& grads,
                 const std::vector<double>& losses, c10d::Store& store) {
  const auto& t = o.trainer();
  const int world = static_cast<int>(o.nproc());
  const int64_t shard_batch = t.batch() / world;
  const auto& dp = o.data_parallel();
  report.config = {{"nproc", std::to_string(world)},
                   {"batch", std::to_string(t.batch())},
                   {"shard_batch", std::to_string(shard_batch)},
                   {"bucket_cap_bytes", std::to_string(dp.effective_bucket_cap_bytes())},
                   {"first_bucket_cap_bytes", std::to_string(dp.effective_first_bucket_cap_bytes())},
                   {"gradient_as_bucket_view", dp.gradient_as_bucket_view() ? "on" : "off"},
                   {"optimizer", t.optimizer()},
                   {"precision", precision_name(t.precision())},
                   {"checkpoint", t.checkpoint()},
                   {"steps", std::to_string(t.steps())}};
  report.notes.push_back(
      "Gloo's own transport buffers are allocated outside LibTorch's allocator and are not counted");
  store.set(kReportKey, bytes_of(to_json(report, -1)));
  store.set(kGradsKey, pack(grads));
  std::string l;
  for (double v : losses) {
    l += fmt::format("{:.17g}\n", v);
  }
  store.set(kLossesKey, bytes_of(l));
}

// One rank, in its own process. Throws on any failure.
void run_rank(const DistributedTrainerOptions& o, int rank, const c10::intrusive_ptr<c10d::Store>& store) {
  const auto& t = o.trainer();
  const auto& mo = t.model();
  const int world = static_cast<int>(o.nproc());
  at::set_num_threads(static_cast<int>(o.threads_per_rank()));
  CpuMemoryTracker::install();  // before the model, so its parameters are seen
  c10::Device device(c10::kCPU);
  if (on_cuda(o)) {
#ifdef TRAINMEM_WITH_NCCL
    c10::cuda::set_device(static_cast<c10::DeviceIndex>(rank));  // before anything is allocated
    device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(rank));
#endif
  }
  auto pg = make_rank_process_group(o, rank, store);

  const auto dtype = detail::trainer_dtype(t);
  Transformer model = detail::make_trainer_model(t, device);
  if (rank == o.fail_rank() && o.fail_mode() == "model") {
    torch::NoGradGuard no_grad;
    model->parameters().front().add_(1.0);
  }
  // Ranks that disagree are reported, never averaged.
  const auto disagreements = check_model_agreement(*model, pg);
  if (!disagreements.empty()) {
    std::string lines;
    for (const auto& d : disagreements) {
      lines += "\n  " + d;
    }
    TORCH_CHECK(false, "the ranks disagree on the model, so their gradients are not averaged:", lines);
  }
  const auto plan = BlockCheckpointing::named(mo.num_layers(), t.checkpoint());
  // The global batch, made alike on every rank; each keeps its own shard
  // (a tensor of its own, as a distributed sampler's loader would give it).
  torch::manual_seed(t.seed() + 1);
  const auto shard = at::randn({t.batch(), t.seq_len(), mo.d_model()})
                         .chunk(world)[static_cast<size_t>(rank)]
                         .to(device, dtype)
                         .clone();
  const int64_t shard_batch = t.batch() / world;

  auto optimizer = detail::make_optimizer(t.optimizer(), model->parameters(), t.lr());
  DataParallel ddp(*model, pg, o.data_parallel());
  DistributedAudit audit(*model, optimizer.get(), pg, device,
                         AuditOptions().title("reference transformer").timeline(t.timeline()).meter_every(t.meter_every()));
  audit.set_data_parallel(ddp);
  auto& a = audit.audit();
  detail::set_model_config(a, t, shard_batch);
  a.set_config("checkpoint", t.checkpoint());
  a.set_config("rank", std::to_string(rank));
  if (t.precision() == Precision::kFp32 && t.checkpoint() == "none") {
    a.set_predicted_activation_bytes(predicted_activation_bytes(mo, shard_batch, t.seq_len()));
  }
  if (t.precision() == Precision::kFp32) {
    set_static_prediction(audit, o, *model);
  }

  detail::AutocastState autocast;
  autocast.entries.push_back({device.type(), true, at::kBFloat16});
  std::vector<at::Tensor> grads;
  std::vector<double> losses;
  int64_t step = 0;
  detail::AuditedStep parts;  // Note [One audited step]
  parts.inputs = {shard};
  parts.autocast = t.precision() == Precision::kBf16Autocast ? &autocast : nullptr;
  parts.zero_grad = [&] { ddp.zero_grad(); };
  parts.loss = [&](const at::Tensor& x) { return model->forward(x, plan).to(at::kFloat).pow(2).mean(); };
  parts.before_backward = [&] {
    ddp.prepare_for_backward();
    if (rank == o.fail_rank() && step == o.fail_step()) {
      if (o.fail_mode() == "kill") {
        ::raise(SIGKILL);
      }
      if (o.fail_mode() == "throw") {
        TORCH_CHECK(false, "injected failure in step ", step, " (fail_mode \"throw\")");
      }
    }
  };
  // loss.backward(): each bucket is all-reduced as its gradients arrive.
  parts.optimizer_step = [&] { optimizer->step(); };
  for (; step < t.steps(); ++step) {
    ddp.prepare_for_forward();  // may rebuild the buckets: outside the audited step
    const double loss_value = detail::run_audited_step(audit, a, parts);
    if (step == 0 && rank == 0 && t.keep_grads()) {
      for (const auto& p : model->parameters()) {
        grads.push_back(p.grad().defined() ? p.grad().detach().to(c10::kCPU, at::kFloat).clone() : at::Tensor());
      }
    }
    losses.push_back(loss_value);
  }
  auto report = audit.gather();
  if (rank == 0) {
    TORCH_INTERNAL_ASSERT(report.has_value());
    publish_run(o, *report, grads, losses, *store);
  }
  pg->barrier()->wait();
}

// The child's whole life: connect, run, report a failure, exit without
// running the parent's destructors or atexit handlers.
[[noreturn]] void rank_main(const DistributedTrainerOptions& o, int rank, uint16_t port) {
  if (CpuMemoryTracker::installed()) {
    // The caller's live tensors are not this rank's (Note [Blocks inherited through fork]).
    CpuMemoryTracker::install().forget_inherited_blocks();
  }
  c10::intrusive_ptr<c10d::Store> store;
  try {
    c10d::TCPStoreOptions co;
    co.port = port;
    co.isServer = false;
    co.numWorkers = static_cast<size_t>(o.nproc());
    co.timeout = std::chrono::milliseconds(o.timeout_ms());
    store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", co);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "trainmem: rank %d cannot reach the store on port %u: %s\n", rank, port, e.what());
    ::_exit(3);
  }
  int status = 0;
  std::string message;
  try {
    run_rank(o, rank, store);
  } catch (const c10::Error& e) {
    message = e.what_without_backtrace();
    status = 1;
  } catch (const std::exception& e) {
    message = e.what();
    status = 1;
  }
  if (status != 0) {
    try {
      // The order failures happen in tells the cause from its echoes.
      const auto seq = store->add(kFailuresKey, 1);
      store->set(error_key(rank), bytes_of(fmt::format("{}\n{}", seq, message)));
    } catch (...) {
      std::fprintf(stderr, "trainmem: rank %d failed: %s\n", rank, message.c_str());
    }
  }
  ::_exit(status);
}

struct RankExit {
  bool exited = false;
  int status = 0;     // waitpid status
  int64_t failure_seq = 0;  // order of its reported failure, 0 when it reported none
  std::string message;
};

bool failed(const RankExit& e) {
  return e.exited && !(WIFEXITED(e.status) && WEXITSTATUS(e.status) == 0);
}

// A TCP socket listening on 127.0.0.1 at a free port, and that port.
std::pair<int, uint16_t> store_socket() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  TORCH_CHECK(fd >= 0, "train_distributed: cannot open the store's socket: ", std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = 0;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(fd, SOMAXCONN) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const int err = errno;
    ::close(fd);
    TORCH_CHECK(false, "train_distributed: cannot listen on 127.0.0.1 for the store: ", std::strerror(err));
  }
  return {fd, ntohs(addr.sin_port)};
}

// Kills and reaps the ranks started so far.
void stop_ranks(const std::vector<pid_t>& pids) {
  for (pid_t p : pids) {
    ::kill(p, SIGKILL);
    ::waitpid(p, nullptr, 0);
  }
}

// Forks rank 0 .. nproc - 1, each running rank_main(). On a failed fork the
// ranks started are stopped and it throws.
std::vector<pid_t> fork_ranks(const DistributedTrainerOptions& o, int listen_fd, uint16_t port) {
  const int world = static_cast<int>(o.nproc());
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::close(listen_fd);
      rank_main(o, r, port);
    }
    if (pid < 0) {
      const int err = errno;
      stop_ranks(pids);
      ::close(listen_fd);
      TORCH_CHECK(false, "train_distributed: cannot start rank ", r, ": fork failed: ", std::strerror(err));
    }
    pids.push_back(pid);
  }
  return pids;
}

// The TCPStore server on the launcher's listening socket.
c10::intrusive_ptr<c10d::TCPStore> host_store(const DistributedTrainerOptions& o, int listen_fd, uint16_t port,
                                              const std::vector<pid_t>& pids) {
  const int world = static_cast<int>(o.nproc());
  c10d::TCPStoreOptions so;
  so.port = port;
  so.isServer = true;
  so.numWorkers = static_cast<size_t>(world);
  so.waitWorkers = false;
  so.timeout = std::chrono::milliseconds(o.timeout_ms());
  so.masterListenFd = listen_fd;  // the server takes the socket over
  try {
    return c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
  } catch (...) {
    stop_ranks(pids);
    throw;
  }
}

bool any_failed(const std::vector<RankExit>& exits) {
  for (const auto& e : exits) {
    if (failed(e)) {
      return true;
    }
  }
  return false;
}

// Waits until every rank has exited or one has failed; after a failure the
// others are given a short grace, then killed.
std::vector<RankExit> wait_for_ranks(const std::vector<pid_t>& pids) {
  const int world = static_cast<int>(pids.size());
  std::vector<RankExit> exits(static_cast<size_t>(world));
  auto poll = [&] {
    for (int r = 0; r < world; ++r) {
      auto& e = exits[static_cast<size_t>(r)];
      if (!e.exited && ::waitpid(pids[static_cast<size_t>(r)], &e.status, WNOHANG) > 0) {
        e.exited = true;
      }
    }
  };
  auto all_exited = [&] {
    for (const auto& e : exits) {
      if (!e.exited) {
        return false;
      }
    }
    return true;
  };
  while (!all_exited() && !any_failed(exits)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    poll();
  }
  if (!any_failed(exits)) {
    return exits;
  }
  // A short grace lets the others notice and report, then nobody is left running.
  const auto grace_end = std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
  while (!all_exited() && std::chrono::steady_clock::now() < grace_end) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    poll();
  }
  for (int r = 0; r < world; ++r) {
    if (!exits[static_cast<size_t>(r)].exited) {
      ::kill(pids[static_cast<size_t>(r)], SIGKILL);
    }
  }
  for (int r = 0; r < world; ++r) {
    auto& e = exits[static_cast<size_t>(r)];
    if (!e.exited) {
      ::waitpid(pids[static_cast<size_t>(r)], &e.status, 0);
      e.exited = true;
      e.message = "stopped by the launcher";
      e.failure_seq = -1;
    }
  }
  return exits;
}

// After a failure: names the rank that caused it, and how, and throws.
[[noreturn]] void throw_rank_failure(std::vector<RankExit>& exits, c10d::TCPStore& server) {
  const int world = static_cast<int>(exits.size());
  // The cause: a rank that died without a word (killed, crashed), else the
  // first failure reported.
  int cause = -1;
  for (int r = 0; r < world; ++r) {
    auto& e = exits[static_cast<size_t>(r)];
    if (e.failure_seq == -1 || !failed(e)) {
      continue;
    }
    if (server.check({error_key(r)})) {
      const auto v = server.get(error_key(r));
      const std::string s(v.begin(), v.end());
      const auto nl = s.find('\n');
      e.failure_seq = std::stoll(s.substr(0, nl));
      e.message = nl == std::string::npos ? "" : s.substr(nl + 1);
    }
  }
  // A rank killed by SIGPIPE wrote to a peer that had died first (its
  // socket closed): a consequence, named only when no other rank died
  // silently (CI once named rank 0's SIGPIPE for rank 1's SIGKILL).
  auto broken_pipe = [](const RankExit& e) { return WIFSIGNALED(e.status) && WTERMSIG(e.status) == SIGPIPE; };
  for (int pass = 0; pass < 2 && cause < 0; ++pass) {
    for (int r = 0; r < world && cause < 0; ++r) {
      const auto& e = exits[static_cast<size_t>(r)];
      if (failed(e) && e.failure_seq == 0 && (pass == 1 || !broken_pipe(e))) {
        cause = r;
      }
    }
  }
  for (int r = 0; r < world; ++r) {
    const auto& e = exits[static_cast<size_t>(r)];
    if (failed(e) && e.failure_seq > 0 &&
        (cause < 0 || (exits[static_cast<size_t>(cause)].failure_seq > 0 &&
                       e.failure_seq < exits[static_cast<size_t>(cause)].failure_seq))) {
      cause = r;
    }
  }
  TORCH_INTERNAL_ASSERT(cause >= 0);
  const auto& e = exits[static_cast<size_t>(cause)];
  std::string how;
  if (WIFSIGNALED(e.status)) {
    how = fmt::format("was killed by {}", signal_text(WTERMSIG(e.status)));
  } else if (e.failure_seq > 0) {
    how = "failed: " + e.message;
  } else {
    how = fmt::format("exited with status {} without a report", WEXITSTATUS(e.status));
  }
  TORCH_CHECK(false, "train_distributed: rank ", cause, " of ", world, " ", how,
              "; the run was stopped (the other ranks were ended)");
}

// Rank 0's report, gradients and losses, from the store.
DistributedRun collect_run(c10d::TCPStore& server) {
  DistributedRun run;
  TORCH_CHECK(server.check({kReportKey}), "train_distributed: every rank exited, but rank 0 left no report");
  const auto report = server.get(kReportKey);
  run.report = distributed_report_from_json(std::string(report.begin(), report.end()));
  run.grads = unpack(server.get(kGradsKey));
  const auto losses = server.get(kLossesKey);
  std::string l(losses.begin(), losses.end());
  for (size_t at = 0, nl; (nl = l.find('\n', at)) != std::string::npos; at = nl + 1) {
    run.losses.push_back(std::stod(l.substr(at, nl - at)));
  }
  return run;
}

} // namespace

bool nccl_available() {
#ifdef TRAINMEM_WITH_NCCL
  return true;
#else
  return false;
#endif
}

int64_t cuda_device_count_before_fork() {
  if (!c10::impl::hasDeviceGuardImpl(c10::kCUDA)) {
    return 0;  // a CPU LibTorch: nothing to ask (at::hasCUDA() would initialise CUDA)
  }
  // Asking CUDA initialises its driver, after which a forked child cannot
  // use CUDA; a child of our own asks and says it in its exit status.
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = ::fork();
  TORCH_CHECK(pid >= 0, "cuda_device_count_before_fork: fork failed: ", std::strerror(errno));
  if (pid == 0) {
    int n = 0;
    try {
      n = static_cast<int>(c10::impl::getDeviceGuardImpl(c10::kCUDA)->deviceCount());
    } catch (...) {
      n = 0;
    }
    ::_exit(std::min(n, 200));
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  TORCH_CHECK(WIFEXITED(status), "cuda_device_count_before_fork: the probe process ended by ",
              WIFSIGNALED(status) ? signal_text(WTERMSIG(status)) : std::string("an unknown status"));
  return WEXITSTATUS(status);
}

void check_distributed_trainer_options(const DistributedTrainerOptions& o) {
  TORCH_CHECK(o.nproc() >= 1, "expected nproc >= 1, but got ", o.nproc());
  TORCH_CHECK(o.nproc() <= 1024, "expected nproc <= 1024 local ranks, but got ", o.nproc());
  const auto& t = o.trainer();
  TORCH_CHECK(t.device() == "cpu" || t.device() == "cuda",
              "expected device cpu (ranks on Gloo) or cuda (ranks on NCCL, rank r on cuda:r), but got \"", t.device(),
              "\"");
  TORCH_CHECK(t.device() == "cpu" || nccl_available(),
              "device cuda: this trainmem was built without NCCL (it needs a CUDA LibTorch whose c10d has "
              "ProcessGroupNCCL, USE_C10D_NCCL)");
  // Checked as on cpu: check_trainer_options() asks CUDA about the device,
  // and a launcher that has touched CUDA cannot fork ranks that use it.
  check_trainer_options(TrainerOptions(t).device("cpu"));
  TORCH_CHECK(t.batch() % o.nproc() == 0, "expected batch ", t.batch(), " to split into nproc ",
              o.nproc(), " equal shards");
  TORCH_CHECK(!t.offload(), "offload is not supported with nproc > 1");
  TORCH_CHECK(!t.optimizer_in_backward(), "optimizer_in_backward is not supported with nproc > 1");
  TORCH_CHECK(t.accumulation() == 1, "expected accumulation 1 with nproc > 1 (DDP no_sync is not modelled), but got ",
              t.accumulation());
  TORCH_CHECK(o.timeout_ms() > 0, "expected timeout_ms > 0, but got ", o.timeout_ms());
  TORCH_CHECK(o.threads_per_rank() >= 1, "expected threads_per_rank >= 1, but got ", o.threads_per_rank());
  TORCH_CHECK(o.fail_mode() == "kill" || o.fail_mode() == "throw" || o.fail_mode() == "model",
              "expected fail_mode kill, throw or model, but got \"", o.fail_mode(), "\"");
  TORCH_CHECK(o.fail_rank() >= -1 && o.fail_rank() < o.nproc(), "expected fail_rank -1 or below nproc ", o.nproc(),
              ", but got ", o.fail_rank());
  const auto& dp = o.data_parallel();
  TORCH_CHECK(dp.effective_bucket_cap_bytes() > 0, "expected bucket_cap_bytes > 0, but got ",
              dp.effective_bucket_cap_bytes());
  TORCH_CHECK(dp.effective_first_bucket_cap_bytes() > 0, "expected first_bucket_cap_bytes > 0, but got ",
              dp.effective_first_bucket_cap_bytes());
}

// Note [Local ranks by fork]
// torchrun starts one process per rank; so do we, by fork() from the
// launcher, so a ctest or `trainmem audit --nproc N` needs no second binary.
// The launcher itself runs no ATen work before forking (OpenMP's thread pool
// does not survive fork) and starts no thread either: it binds the store's
// listening socket (port 0: a free port), forks the ranks, and only then
// hosts the TCPStore server on that socket (its thread, had it run at fork,
// could have held a lock that the child would wait on forever; the ranks'
// connections wait in the socket's backlog meanwhile). Then it only waits:
// a rank's failure is its exit status (a signal when it was killed) plus the
// message it left in the store, numbered by a store counter so the first
// failure is named, not the "connection closed" echoes of its peers. On the
// first failure the others get a short grace, then SIGKILL: the run ends in
// bounded time even when a peer is stuck outside a collective. Collectives
// and store operations time out after timeout_ms.
DistributedRun train_distributed(const DistributedTrainerOptions& o) {
  check_distributed_trainer_options(o);
  const int world = static_cast<int>(o.nproc());
  if (on_cuda(o)) {
    const int64_t devices = cuda_device_count_before_fork();
    TORCH_CHECK(devices >= world, "train_distributed: NCCL needs one CUDA device per rank, but ", world,
                " ranks were asked for and ", devices,
                " CUDA device(s) are visible (two ranks on one device fail in ncclCommInitRank)");
  }
  const auto [listen_fd, port] = store_socket();
  const std::vector<pid_t> pids = fork_ranks(o, listen_fd, port);
  const auto server = host_store(o, listen_fd, port, pids);
  auto exits = wait_for_ranks(pids);
  if (any_failed(exits)) {
    throw_rank_failure(exits, *server);
  }
  return collect_run(*server);
}

} // namespace trainmem
