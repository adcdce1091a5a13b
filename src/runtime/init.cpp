#include <ztrain/runtime/init.h>

#include <ztrain/comm/mpi/communicator.h>
#include <ztrain/runtime/rng.h>

#include "huge_pages.h"

#include <torch/torch.h>

#include <sched.h>

#include <thread>

#include <cstdlib>
#include <mutex>
#include <string>

namespace ztrain {
namespace {

// Finalises MPI at process exit when ztrain initialised it, after the runtime is gone (statics
// are destroyed in reverse order). Skipped after a communication failure: MPI_Finalize would
// block on the dead peer.
struct MpiGuard {
  bool owns = false;
  ~MpiGuard() { finalize(); }
  void finalize() {
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (owns && initialized && !finalized && !detail::mpi_failure_seen()) MPI_Finalize();
    owns = false;
  }
};

std::mutex g_mutex;
MpiGuard g_mpi;
std::unique_ptr<Runtime> g_runtime;  // the one runtime; see init_distributed

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

int env_int(const char* name, const std::string& value, int min) {
  size_t used = 0;
  long parsed = 0;
  try {
    parsed = std::stol(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  ZTRAIN_CHECK(used == value.size() && parsed >= min, "environment variable ", name, "=", value,
               " must be an integer >= ", min);
  return static_cast<int>(parsed);
}

std::chrono::milliseconds resolve_timeout(const InitOptions& o) {
  if (o.timeout) {
    ZTRAIN_CHECK(o.timeout->count() > 0, "InitOptions::timeout must be positive, got ", o.timeout->count(), " ms");
    return *o.timeout;
  }
  if (auto v = env("ZTRAIN_TIMEOUT_S")) return std::chrono::seconds(env_int("ZTRAIN_TIMEOUT_S", *v, 1));
  return std::chrono::seconds(300);
}

bool resolve_debug(const InitOptions& o) {
  if (o.debug_collectives) return *o.debug_collectives;
  auto v = env("ZTRAIN_DEBUG_COLLECTIVES");
  return v && *v != "0";
}

bool resolve_huge_pages(const InitOptions& o) {
  if (o.huge_pages) return *o.huge_pages;
  auto v = env("ZTRAIN_HUGE_PAGES");
  return v && *v != "0";
}

bool resolve_host_shared_buffers(const InitOptions& o) {
  if (o.host_shared_buffers) return *o.host_shared_buffers;
  auto v = env("ZTRAIN_HOST_SHARED_BUFFERS");
  return !v || *v != "0";
}

int usable_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
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

int world_size_of_mpi() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

}  // namespace

Runtime::Runtime(const InitOptions& options)
    : topology_(world_size_of_mpi(), options.tp_size, options.pp_size),
      seed_(options.seed),
      timeout_(resolve_timeout(options)),
      debug_(resolve_debug(options)),
      huge_pages_(resolve_huge_pages(options)),
      host_shared_buffers_(resolve_host_shared_buffers(options)) {
  if (huge_pages_) detail::install_huge_page_allocator();
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);

  MPI_Comm local = MPI_COMM_NULL;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &local);
  MPI_Comm_size(local, &local_size_);
  MPI_Comm_rank(local, &local_rank_);
  MPI_Comm_free(&local);
  threads_ = resolve_threads(options, local_size_);
  at::set_num_threads(threads_);

  world_ = std::make_unique<MpiCommunicator>(MPI_COMM_WORLD,
                                             MpiCommunicatorOptions{"world", timeout_, debug_});
  const Coord c = coord();
  const Topology& t = topology_;
  // Each split's color numbers the group; its key orders members by their coordinate.
  tp_ = world_->split(c.pp * t.dp_size() + c.dp, c.tp, "tp");
  dp_ = world_->split(c.pp * t.tp_size() + c.tp, c.dp, "dp");
  pp_ = world_->split(c.dp * t.tp_size() + c.tp, c.pp, "pp");
  stage_ = world_->split(c.pp, rank_, "stage");
  world_->reset_stats();

  torch::manual_seed(rng::data_parallel_seed(seed_, c));
}

Runtime::~Runtime() {
  world_.reset();
  tp_.reset();
  dp_.reset();
  pp_.reset();
  stage_.reset();
}

Runtime& init_distributed(const InitOptions& options) {
  std::lock_guard<std::mutex> lock(g_mutex);
  ZTRAIN_CHECK(!g_runtime, "ztrain::init_distributed() was already called in this process; call it "
               "once, at the start of main()");
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  ZTRAIN_CHECK(!finalized, "ztrain::init_distributed(): MPI was already finalised in this process and "
               "cannot be started again");
  int provided = 0;
  if (!initialized) {
    int code = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    ZTRAIN_CHECK(code == MPI_SUCCESS, "ztrain::init_distributed(): MPI_Init_thread failed (code ", code, ")");
    g_mpi.owns = true;
  } else {
    MPI_Query_thread(&provided);
  }
  if (provided < MPI_THREAD_MULTIPLE) {
    ZTRAIN_CHECK(false, "ztrain::init_distributed(): the MPI library provides thread level ", provided,
                 " but ztrain's communication streams need MPI_THREAD_MULTIPLE (", MPI_THREAD_MULTIPLE,
                 "); use an MPI built with thread support", initialized ? ", or initialise MPI with "
                 "MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...)" : "");
  }
  // A rejected configuration throws from here and leaves MPI up, so a corrected call can follow.
  g_runtime.reset(new Runtime(options));
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

void finalize_distributed() {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_runtime.reset();
  g_mpi.finalize();
}

int rank() { return runtime().rank(); }
int world_size() { return runtime().world_size(); }
void synchronize() { runtime().world().barrier(); }

torch::Tensor sum_loss(const torch::Tensor& loss) {
  ZTRAIN_CHECK(loss.defined() && loss.numel() == 1, "sum_loss: expected a scalar loss, got ",
               loss.defined() ? c10::str(loss.sizes()) : std::string("an undefined tensor"));
  auto out = loss.detach().to(torch::kFloat64).reshape({1}).contiguous().clone();
  runtime().dp().all_reduce(out, ReduceOp::kAvg);
  return out.reshape({}).to(loss.scalar_type());
}

}  // namespace ztrain
