#include <ztrain/runtime/init.h>

#include <ztrain/comm/backend.h>
#include <ztrain/runtime/device.h>
#include <ztrain/runtime/rng.h>

#include "cpu_binding.h"
#include "host_allocator.h"

#include <torch/cuda.h>
#include <torch/torch.h>

#include <thread>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <mutex>
#include <string>

namespace ztrain {
namespace {

// Shuts the communicator backends down at process exit (MPI_Finalize when ztrain started MPI),
// after the runtime is gone: statics of one file are destroyed in reverse order of definition.
struct BackendGuard {
  ~BackendGuard() { shutdown_communicator_backends(); }
};

std::mutex g_mutex;
BackendGuard g_backends;
std::unique_ptr<Runtime> g_runtime;  // the one runtime; see init_distributed

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

// The integer `value` of environment variable `name`, at least `min`; `what` names the kind.
int64_t env_number(const char* name, const std::string& value, int64_t min, const char* what = "an integer") {
  size_t used = 0;
  long long parsed = 0;
  try {
    parsed = std::stoll(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  ZTRAIN_CHECK(used == value.size() && parsed >= min, "environment variable ", name, "=", value, " must be ", what,
               " >= ", min);
  return parsed;
}

int env_int(const char* name, const std::string& value, int min) {
  return static_cast<int>(std::min<int64_t>(env_number(name, value, min), std::numeric_limits<int>::max()));
}

std::chrono::milliseconds resolve_timeout(const InitOptions& o) {
  if (o.timeout) {
    ZTRAIN_CHECK(o.timeout->count() > 0, "InitOptions::timeout must be positive, got ", o.timeout->count(), " ms");
    return *o.timeout;
  }
  if (auto v = env("ZTRAIN_TIMEOUT_S")) return std::chrono::seconds(env_int("ZTRAIN_TIMEOUT_S", *v, 1));
  return std::chrono::seconds(300);
}

// An on/off option: as set, else environment variable `name` (on unless it is 0), else `otherwise`.
bool flag(const std::optional<bool>& option, const char* name, bool otherwise) {
  if (option) return *option;
  auto v = env(name);
  return v ? *v != "0" : otherwise;
}

int64_t resolve_host_cache_bytes(const InitOptions& o) {
  if (o.host_cache_bytes) {
    ZTRAIN_CHECK(*o.host_cache_bytes >= 0, "InitOptions::host_cache_bytes must be >= 0, got ", *o.host_cache_bytes);
    return *o.host_cache_bytes;
  }
  auto v = env("ZTRAIN_HOST_CACHE_BYTES");
  if (!v) return detail::default_host_cache_bytes();
  return env_number("ZTRAIN_HOST_CACHE_BYTES", *v, 0, "a number of bytes");
}

std::string resolve_backend(const InitOptions& o) {
  if (o.backend) return *o.backend;
  return env("ZTRAIN_BACKEND").value_or("mpi");
}

/// The device of the rank with index `local_rank` on its host (runtime/device.h).
c10::Device resolve_rank_device(const InitOptions& o, int local_rank) {
  const char* what = o.device ? "InitOptions::device" : "ZTRAIN_DEVICE";
  c10::Device requested(c10::kCPU);
  if (o.device) {
    requested = *o.device;
  } else if (auto v = env("ZTRAIN_DEVICE")) {
    requested = parse_device(*v, what);
  }
  if (requested.is_cuda() && !requested.has_index()) {
    resolve_device(requested, what);  // raises when no CUDA device is visible
    requested = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank % torch::cuda::device_count()));
  }
  return resolve_device(requested, what);
}

int usable_cores() {
  const auto cpus = detail::allowed_cpus();
  if (!cpus.empty()) return static_cast<int>(cpus.size());
  return std::max(1u, std::thread::hardware_concurrency());
}

int resolve_threads(const InitOptions& o, int local_size) {
  if (o.threads) {
    ZTRAIN_CHECK(*o.threads >= 1, "InitOptions::threads must be at least 1, got ", *o.threads);
    return *o.threads;
  }
  if (auto v = env("OMP_NUM_THREADS")) return env_int("OMP_NUM_THREADS", *v, 1);
  return std::max(1, usable_cores() / local_size);
}

/// Pins this rank's threads to its share of `cpus`, the CPUs it was given, which `alike` ranks
/// of its host were given too (InitOptions::bind_cores): the share, or nothing where they stay
/// as they were.
std::vector<int> bind_to_share(const std::vector<int>& cpus, const HostLayout& alike, int threads) {
  if (alike.local_size < 2) return {};
  // Every such rank decides alike: all pinned where every share holds the threads, else none
  // (also where the ranks outnumber the CPUs: no shares).
  const auto shares = detail::cpu_shares(cpus, alike.local_size);
  if (shares.empty()) return {};
  for (const auto& s : shares) {
    if (static_cast<int>(s.size()) < threads) return {};
  }
  const auto& share = shares[alike.local_rank];
  std::string error;
  if (!detail::pin_process_threads(share, error)) {
    std::cerr << "ztrain: could not pin this rank's threads to CPUs " << detail::cpu_list_string(share) << " ("
              << error << "); they stay where they were started\n";
    return {};
  }
  return share;
}

void finalize_at_exit() {
  try {
    finalize_distributed();
  } catch (const std::exception& e) {
    std::cerr << "ztrain: finalizing the runtime at exit: " << e.what() << std::endl;
  }
}

}  // namespace

Runtime::Runtime(const InitOptions& options)
    : timeout_(resolve_timeout(options)), debug_(flag(options.debug_collectives, "ZTRAIN_DEBUG_COLLECTIVES", false)),
      huge_pages_(flag(options.huge_pages, "ZTRAIN_HUGE_PAGES", true)),
      host_cache_bytes_(resolve_host_cache_bytes(options)) {
  detail::install_host_allocator({host_cache_bytes_, huge_pages_});
  // Ranks start at different times and make their first connections here: the communicators of
  // the context are made under a deadline of at least kStartupTimeout, then take timeout_.
  const auto startup = std::max<std::chrono::milliseconds>(timeout_, kStartupTimeout);
  const CommunicatorOptions world_options{.name = "world",
                                          .timeout = startup,
                                          .debug = debug_,
                                          .hierarchical = flag(options.hierarchical, "ZTRAIN_HIERARCHICAL", true)};
  // A backend bound to a device (NCCL) is made once the rank's device is known, which takes
  // the ranks' places on their hosts, found over MPI first.
  const auto backend = resolve_backend(options);
  const bool binds_device = communicator_backend_binds_device(backend);
  auto world = make_world_communicator(binds_device ? "mpi" : backend, world_options);
  const auto host = host_layout(*world);
  const auto cpus = detail::allowed_cpus();
  const auto alike = host_layout(*world, detail::cpu_list_string(cpus));  // the ranks here given these CPUs
  local_size_ = host.local_size;
  local_rank_ = host.local_rank;
  threads_ = resolve_threads(options, local_size_);
  const auto device = resolve_rank_device(options, local_rank_);
  set_current_device(device);
  if (binds_device) {
    ZTRAIN_CHECK(device.is_cuda(), "the ", backend, " backend moves CUDA tensors, but this rank's device is ", device,
                 "; choose a CUDA device (InitOptions::device, ZTRAIN_DEVICE or a program's --device), or "
                 "use the mpi backend");
    world = make_world_communicator(backend, world_options, device);
  }
  const bool host_shared_buffers = flag(options.host_shared_buffers, "ZTRAIN_HOST_SHARED_BUFFERS", true);
  context_ = ParallelContext::create(std::move(world), {.tp_size = options.tp_size,
                                                        .pp_size = options.pp_size,
                                                        .seed = options.seed,
                                                        .host_shared_buffers = host_shared_buffers,
                                                        .device = device});
  context_->set_timeout(timeout_);
  // Once nothing is left to reject: a configuration corrected in a second call finds the CPUs
  // as the launcher gave them.
  if (flag(options.bind_cores, "ZTRAIN_BIND_CORES", true)) cpus_ = bind_to_share(cpus, alike, threads_);
  at::set_num_threads(threads_);
  context_->world().reset_stats();
  torch::manual_seed(rng::data_parallel_seed(options.seed, context_->coord()));
}

Runtime::~Runtime() = default;

Runtime& init_distributed(const InitOptions& options) {
  std::lock_guard<std::mutex> lock(g_mutex);
  ZTRAIN_CHECK(!g_runtime, "ztrain::init_distributed() was already called in this process; call it "
               "once, at the start of main()");
  // A rejected configuration throws from here and leaves the backend up, so a corrected call
  // can follow.
  g_runtime.reset(new Runtime(options));
  if (!g_runtime->device().is_cpu()) {
    // A device runtime (CUDA) registers its teardown at exit when first used, which is after
    // this library's statics were made, so it would run before g_runtime's destructor and leave
    // the runtime's events, streams and NCCL communicators nothing to be destroyed by. An exit
    // handler registered now, after the device is in use, finalizes ztrain before that.
    static std::once_flag at_exit;
    std::call_once(at_exit, [] { std::atexit(finalize_at_exit); });
  }
  return *g_runtime;
}

bool is_initialized() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_runtime != nullptr;
}

Runtime& runtime() {
  std::lock_guard<std::mutex> lock(g_mutex);
  ZTRAIN_CHECK(g_runtime, "ztrain: the distributed runtime is not initialised; call "
               "ztrain::init_distributed() at the start of main() before any communication");
  return *g_runtime;
}

ParallelContext& default_context() { return runtime().context(); }

std::shared_ptr<ParallelContext> context_or_default(const std::shared_ptr<ParallelContext>& context) {
  return context ? context : runtime().context_ptr();
}

void finalize_distributed() {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_runtime.reset();
  shutdown_communicator_backends();
}

void abort_distributed(int exit_code) {
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  abort_communicator_backends(exit_code);
  std::_Exit(exit_code);
}

int rank() { return runtime().rank(); }
int world_size() { return runtime().world_size(); }
void synchronize() { runtime().world().barrier(); }

torch::Tensor sum_loss(const torch::Tensor& loss, ParallelContext* context) {
  ZTRAIN_CHECK(loss.defined() && loss.numel() == 1, "sum_loss: expected a scalar loss, got ",
               loss.defined() ? c10::str(loss.sizes()) : std::string("an undefined tensor"));
  auto& dp = (context ? *context : default_context()).dp();
  auto out = loss.detach().to(torch::kFloat64).reshape({1}).contiguous().clone();
  dp.all_reduce(out, ReduceOp::kAvg);
  return out.reshape({}).to(loss.scalar_type());
}

}  // namespace ztrain
