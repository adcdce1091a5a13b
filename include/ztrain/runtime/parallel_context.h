#pragma once
/// ParallelContext: one mesh of ranks and everything that communicates over it.
///
/// A context owns a group of ranks laid out as pp × dp × tp (runtime/topology.h), one
/// communicator per group of the layout (world, tp, dp, pp and the dp × tp stage), the ZeRO
/// engine's two communication streams over dp (parameter gathers, gradient reductions) and the
/// communicators of background saves. Every component that communicates takes a context: a
/// Block shards over its context's dp group, a pipeline runs over its pp group, a checkpoint is
/// written over its world. init_distributed makes the default context over every rank, so user
/// code that never names one stays as short as single-process code.
///
/// Several contexts live in one process side by side: split the world into sub-meshes (two
/// models trained on two halves of the ranks), or lay the same ranks out twice. A context is
/// shared (std::shared_ptr): whatever communicates over it keeps it alive.
///
/// Creating a context is collective over the ranks it is made from. Its communicators follow the
/// communicator's threading rule (one thread at a time); its streams are thread-safe.
///
///   auto& rt = ztrain::init_distributed({.seed = 0});               // the default context: all ranks
///   auto half = rt.context().split(rt.rank() < rt.world_size() / 2 ? 0 : 1, {.tp_size = 2, .name = "half"});
///   ztrain::Block<Layer> block(Layer(64), {.zero_level = 3, .context = half});   // shards over half's dp

#include <ztrain/comm/comm_stream.h>
#include <ztrain/comm/communicator.h>
#include <ztrain/runtime/topology.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

namespace ztrain {

struct ParallelOptions {
  int tp_size = 1;
  int pp_size = 1;
  /// The run's seed (init_parameters' default, the generators of rng.h).
  uint64_t seed = 0;
  /// Allocate the ZeRO engine's flat buffers in host-shared memory (comm/host_shared.h), so that
  /// their collectives on one host read the peers' buffers in place.
  bool host_shared_buffers = true;
  /// The context's name: its world communicator's, and the prefix of its groups' ("half.dp").
  /// The default context is "world", whose groups are plain "tp", "dp", "pp", "stage".
  std::string name = "world";
  /// This rank's device: where sharded modules keep parameters, gradients and flat buffers, and
  /// where optimizers keep their state. One device per rank, resolved (cuda:N, never plain cuda;
  /// runtime/device.h). Not set: the device of the context split from, else the CPU.
  std::optional<c10::Device> device;
};

class ParallelContext : public std::enable_shared_from_this<ParallelContext> {
 public:
  /// A context over the members of `world`, which it takes over (collective over them): the
  /// group communicators are split from it. Throws ztrain::Error when tp_size × pp_size does not
  /// divide its size.
  static std::shared_ptr<ParallelContext> create(std::unique_ptr<Communicator> world, ParallelOptions options = {});
  /// A context over the ranks of this one's world that pass the same `color` (>= 0), ordered as
  /// here (collective over world()).
  std::shared_ptr<ParallelContext> split(int color, ParallelOptions options);
  ~ParallelContext();
  ParallelContext(const ParallelContext&) = delete;
  ParallelContext& operator=(const ParallelContext&) = delete;

  const ParallelOptions& options() const { return options_; }
  const std::string& name() const { return options_.name; }
  const Topology& topology() const { return topology_; }
  /// This rank in the context's world, and the world's size.
  int rank() const { return world_->rank(); }
  int world_size() const { return topology_.world_size(); }
  Coord coord() const { return topology_.coord(rank()); }
  int tp_rank() const { return coord().tp; }
  int dp_rank() const { return coord().dp; }
  int pp_rank() const { return coord().pp; }
  uint64_t seed() const { return options_.seed; }
  /// Host-shared flat buffers: asked for, and the device is the CPU.
  bool host_shared_buffers() const { return options_.host_shared_buffers && device().is_cpu(); }
  /// This rank's device (ParallelOptions::device).
  c10::Device device() const { return *options_.device; }

  /// The communicators of the groups this rank belongs to.
  Communicator& world() { return *world_; }
  Communicator& tp() { return *tp_; }
  Communicator& dp() { return *dp_; }
  Communicator& pp() { return *pp_; }
  /// All ranks of this pipeline stage (dp × tp).
  Communicator& stage() { return *stage_; }
  /// Sets the deadline of every group communicator above. The ZeRO streams and the background
  /// context, duplicates made on first use, take the deadline their source has then: set it
  /// before (init_distributed does).
  void set_timeout(std::chrono::milliseconds timeout);

  /// The ZeRO engine's streams over dp: gathers of parameters and reductions of gradients, each
  /// on its own duplicate of dp, so that a reduction never queues behind the next gather. Made
  /// by the first call (collective over dp: the construction of the first sharded module).
  CommStream& gather_stream();
  CommStream& reduce_stream();
  /// Whether the streams were made (so that waiting on them is not collective).
  bool has_zero_streams() const;

  /// The same mesh over duplicates of every communicator, for saves that run on a background
  /// thread while this context's communicators go on training. Made by the first call
  /// (collective over world()).
  ParallelContext& background_context();

 private:
  ParallelContext(std::unique_ptr<Communicator> world, ParallelOptions options);
  std::string group_name(const char* group) const;

  ParallelOptions options_;
  std::unique_ptr<Communicator> world_;
  Topology topology_;
  std::unique_ptr<Communicator> tp_, dp_, pp_, stage_;
  mutable std::mutex lazy_mutex_;  // the lazily made members below
  std::unique_ptr<CommStream> gather_, reduce_;
  std::shared_ptr<ParallelContext> background_;
};

}  // namespace ztrain
