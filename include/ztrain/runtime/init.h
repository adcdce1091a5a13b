#pragma once
/// The distributed runtime: the communication backend, the default parallel context, seeds and
/// threads.
///
/// `init_distributed` is called once per process, before any other ztrain call that
/// communicates. It starts the communicator backend (MPI with MPI_THREAD_MULTIPLE, or adopts an
/// MPI the program already initialised, which then must provide that level), builds the default
/// ParallelContext over every rank — the pp × dp × tp topology and one communicator per group —
/// seeds libtorch's default generators (different per data-parallel replica and stage, same
/// across a tensor-parallel group), picks this rank's device and sets the intra-op thread count. A plain `./program`
/// without mpirun is a world of one rank. More contexts can be split from the default one.
///
/// The runtime lives until `finalize_distributed()` or process exit, whichever comes first;
/// MPI is finalised then if ztrain initialised it (and skipped after a communication failure,
/// where MPI_Finalize would block on the dead peer).
///
///   int main(int argc, char** argv) {
///     auto& rt = ztrain::init_distributed({.seed = 0, .tp_size = 2});
///     ztrain::print_rank("world ", rt.world_size(), ", dp ", rt.topology().dp_size());
///   }

#include <ztrain/comm/communicator.h>
#include <ztrain/runtime/parallel_context.h>
#include <ztrain/runtime/topology.h>

#include <c10/util/StringUtil.h>

#include <chrono>
#include <cstdint>
#include <iostream>
#include <memory>
#include <optional>
#include <vector>

namespace ztrain {

/// The least deadline of the waits while init_distributed makes the context's communicators.
inline constexpr std::chrono::seconds kStartupTimeout{60};

struct InitOptions {
  uint64_t seed = 0;
  /// The communicator backend (comm/backend.h): "mpi", or "nccl" where the build has it (CUDA
  /// devices only). Not set: ZTRAIN_BACKEND from the environment, else "mpi".
  std::optional<std::string> backend;
  int tp_size = 1;
  int pp_size = 1;
  /// Intra-op threads per rank. Not set: OMP_NUM_THREADS if the environment sets it, else the
  /// usable cores of this host divided by the ranks on it (at least 1).
  std::optional<int> threads;
  /// Pin each rank's threads to its own share of the CPUs: the ranks of one host that were given
  /// the same CPUs (started unbound, as by `mpirun --bind-to none` or a Python launcher) split
  /// them by physical core, local rank k of m taking the k-th of m equal shares, so that the
  /// threads a rank starts for communication take their time from its own compute threads, not
  /// a peer's. Nothing changes where a rank has its CPUs to itself (a launcher bound it), where
  /// the ranks outnumber the CPUs, or where a rank's intra-op threads would outnumber its share.
  /// Not set: on unless ZTRAIN_BIND_CORES is 0.
  std::optional<bool> bind_cores;
  /// Deadline of every communication wait. Not set: ZTRAIN_TIMEOUT_S from the environment,
  /// else 300 s. Making the context's communicators at init waits at least kStartupTimeout
  /// (ranks start at different times and connect for the first time there).
  std::optional<std::chrono::milliseconds> timeout;
  /// Check before every collective that all members agree on it (op, dtype, sizes, root).
  /// Not set: on when ZTRAIN_DEBUG_COLLECTIVES is 1.
  std::optional<bool> debug_collectives;
  /// Back CPU tensors of 2 MiB and more with transparent huge pages (each starting on one,
  /// madvise(MADV_HUGEPAGE); what is past its last whole huge page stays on 4 KiB pages, so it
  /// takes no more memory): fewer TLB misses in copies and streaming kernels, cross-process copies
  /// of large messages up to 1.5× faster (docs/benchmarks.md). Process-wide, from
  /// init_distributed on; nothing changes where the kernel has transparent huge pages off. Not
  /// set: on unless ZTRAIN_HUGE_PAGES is 0.
  std::optional<bool> huge_pages;
  /// Freed CPU tensors of 1 MiB and more are kept for reuse, at most this many bytes (the least
  /// recently freed go first), so that a training step does not map, fault and zero the same
  /// memory anew each time; 0 turns the cache off. Process-wide, from init_distributed on. Not
  /// set: ZTRAIN_HOST_CACHE_BYTES from the environment, else an eighth of the host's memory, at
  /// most 4 GiB.
  std::optional<int64_t> host_cache_bytes;
  /// Allocate the ZeRO engine's flat buffers (parameter shards, gathered parameters, gradients)
  /// in host-shared memory (comm/host_shared.h): where a data-parallel group shares one host,
  /// their gathers and reductions then read the peers' buffers in place instead of sending them.
  /// Not set: on unless ZTRAIN_HOST_SHARED_BUFFERS is 0. CPU devices only.
  std::optional<bool> host_shared_buffers;
  /// Run large collectives over members on several hosts in two levels, within each host and
  /// across hosts (CommunicatorOptions::hierarchical). Not set: on unless ZTRAIN_HIERARCHICAL
  /// is 0.
  std::optional<bool> hierarchical;
  /// This rank's device (runtime/device.h): the CPU, cuda:N, or cuda — then local rank modulo
  /// the CUDA devices visible — which becomes the current CUDA device. Not set: ZTRAIN_DEVICE
  /// from the environment ("cpu", "cuda", "cuda:N"), else the CPU.
  std::optional<c10::Device> device;
};

class Runtime {
 public:
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  /// The default context: every rank, laid out as InitOptions says.
  ParallelContext& context() { return *context_; }
  const std::shared_ptr<ParallelContext>& context_ptr() const { return context_; }

  const Topology& topology() const { return context_->topology(); }
  int rank() const { return context_->rank(); }
  int world_size() const { return context_->world_size(); }
  Coord coord() const { return context_->coord(); }
  int tp_rank() const { return coord().tp; }
  int dp_rank() const { return coord().dp; }
  int pp_rank() const { return coord().pp; }
  /// Ranks on this host (sharing memory) and this rank's index among them.
  int local_size() const { return local_size_; }
  int local_rank() const { return local_rank_; }

  /// The default context's communicators. Not thread-safe: a thread other than the one that
  /// called init_distributed should dup() its own.
  Communicator& world() { return context_->world(); }
  Communicator& tp() { return context_->tp(); }
  Communicator& dp() { return context_->dp(); }
  Communicator& pp() { return context_->pp(); }
  /// All ranks of this pipeline stage (dp × tp).
  Communicator& stage() { return context_->stage(); }

  uint64_t seed() const { return context_->seed(); }
  int threads() const { return threads_; }
  /// The CPUs this rank's threads were pinned to (InitOptions::bind_cores); empty where they
  /// were left as the launcher started them.
  const std::vector<int>& cpus() const { return cpus_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  bool debug_collectives() const { return debug_; }
  bool huge_pages() const { return huge_pages_; }
  int64_t host_cache_bytes() const { return host_cache_bytes_; }
  bool host_shared_buffers() const { return context_->host_shared_buffers(); }
  /// This rank's device, the default context's.
  c10::Device device() const { return context_->device(); }

 private:
  friend Runtime& init_distributed(const InitOptions&);
  explicit Runtime(const InitOptions& options);

  int local_size_ = 1;
  int local_rank_ = 0;
  int threads_ = 1;
  std::vector<int> cpus_;
  std::chrono::milliseconds timeout_;
  bool debug_ = false;
  bool huge_pages_ = false;
  int64_t host_cache_bytes_ = 0;
  std::shared_ptr<ParallelContext> context_;
};

/// Initialise the runtime (collective over all processes). Throws if called twice.
Runtime& init_distributed(const InitOptions& options = {});
/// True between init_distributed and finalize_distributed.
bool is_initialized();
/// The runtime; throws ztrain::Error naming init_distributed when it was not called.
Runtime& runtime();
/// The runtime's default context (throws as runtime() does).
ParallelContext& default_context();
/// `context` if set, else the default context: how components resolve an option left unset.
std::shared_ptr<ParallelContext> context_or_default(const std::shared_ptr<ParallelContext>& context);
/// Tear the runtime down and finalise MPI if ztrain started it (collective). Happens at process
/// exit otherwise. MPI cannot be started again afterwards.
void finalize_distributed();

/// Ends every process of the job now with `exit_code`, from any one rank; never returns. For an
/// error this rank met alone (a file it could not write, a bad value only it read): the other
/// ranks would wait for it in their next collective until their deadline, and a normal exit
/// would wait for them in MPI_Finalize. Under MPI the launcher ends the others (MPI_Abort).
/// Without a running backend the process exits. Streams are flushed first. A communication
/// failure needs no abort: every rank meets its own within the deadline.
[[noreturn]] void abort_distributed(int exit_code);

/// World rank and size of this process (requires init_distributed).
int rank();
int world_size();
/// Blocks until every rank reaches it (a world barrier).
void synchronize();
/// The mean of a per-rank loss over the data-parallel group — a mean, not a sum, despite the
/// name kept from BMTrain: each rank's loss is already the mean over its micro-batch, so this
/// is the global mean for equal micro-batches. Detached; collective over the dp group of
/// `context` (the default context when null).
torch::Tensor sum_loss(const torch::Tensor& loss, ParallelContext* context = nullptr);

/// Prints the streamed arguments, followed by a newline, on world rank `rank` only.
template <class... Args>
void print_on(int rank, const Args&... args) {
  if (ztrain::rank() == rank) std::cout << c10::str(args...) << std::endl;
}
/// Prints on world rank 0 only.
template <class... Args>
void print_rank(const Args&... args) {
  print_on(0, args...);
}

}  // namespace ztrain
