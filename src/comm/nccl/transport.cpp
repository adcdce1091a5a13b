#include "startup.h"

#include "../mpi/startup.h"

#include <ztrain/error.h>

#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/StringUtil.h>

#include <nccl.h>

#include <cstring>
#include <functional>
#include <map>

// How it works
// ------------
// An NcclTransport pairs an NCCL communicator (CUDA tensors) with the MPI transport over the same
// ranks (CPU tensors: the communicator's own small exchanges, NCCL's bootstrap, the headers of
// point-to-point messages). NCCL runs non-blocking (ncclConfig_t::blocking = 0): creating,
// splitting and launching return at once, and ncclCommGetAsyncError says when the work is
// enqueued or failed. Each operation waits on the caller's current CUDA stream through an event,
// runs on the transport's own stream, and records an event there; the request's test() polls
// NCCL's state, then that event, and never blocks. The communicator's deadline is the watchdog:
// when it gives up, on_failure() aborts the NCCL communicator (ncclCommAbort), which stops its
// kernels, so a dead peer leaves no rank spinning on the GPU.
//
// NCCL pairs point-to-point messages between two ranks in the order they were sent, whatever
// their tags. So each message is announced by a header over MPI (its tag, element count and
// sequence number between the pair); the receiver posts the NCCL receive only when the header
// matches what it expects, and raises, naming both tags, when it does not.

namespace ztrain {

namespace {

std::string last_error(ncclComm_t comm) {
  const char* text = comm ? ncclGetLastError(comm) : nullptr;
  return text && *text ? c10::str(" (", text, ")") : std::string();
}

/// Raises the NCCL error of `result` unless it is success or work still in progress.
void check(ncclResult_t result, ncclComm_t comm, const char* what) {
  if (result == ncclSuccess || result == ncclInProgress) return;
  throw TransportFailure(c10::str("NCCL ", what, " failed: ", ncclGetErrorString(result), last_error(comm)));
}

/// Whether the communicator finished what it was asked to do (creation, a launch); raises its
/// error.
bool ready(ncclComm_t comm, const char* what) {
  ncclResult_t state = ncclSuccess;
  check(ncclCommGetAsyncError(comm, &state), comm, what);
  check(state, comm, what);
  return state != ncclInProgress;
}

ncclDataType_t nccl_type(c10::ScalarType t) {
  switch (t) {
    case at::kFloat: return ncclFloat32;
    case at::kDouble: return ncclFloat64;
    case at::kBFloat16: return ncclBfloat16;
    case at::kHalf: return ncclFloat16;
    case at::kInt: return ncclInt32;
    case at::kLong: return ncclInt64;
    case at::kByte: case at::kBool: return ncclUint8;
    default: break;
  }
  ZTRAIN_INTERNAL_ASSERT(false, "no NCCL type for ", t);
}

ncclRedOp_t nccl_op(c10::ScalarType t, ReduceOp op) {
  ZTRAIN_INTERNAL_ASSERT(op != ReduceOp::kAvg, "the NCCL transport is handed sums, never averages");
  if (t == at::kBool) return op == ReduceOp::kMin ? ncclMin : ncclMax;  // and, or
  return op == ReduceOp::kMax ? ncclMax : op == ReduceOp::kMin ? ncclMin : ncclSum;
}

ncclConfig_t nonblocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

/// Polls a CUDA event, turning a CUDA error into a transport failure.
bool event_done(at::cuda::CUDAEvent& event) {
  try {
    return event.query();
  } catch (const c10::Error& e) {
    throw TransportFailure(c10::str("CUDA failed while NCCL ran: ", e.what_without_backtrace()));
  }
}

/// One NCCL operation: optionally waiting for a message over MPI first (a receive's header),
/// then launched, enqueued, and done when the event after it on the transport's stream is.
class NcclRequest final : public TransportRequest {
 public:
  /// Enqueues the work; returns an error to raise once that work is done (a receive that drains
  /// a message of the wrong size, so that its sender is not left waiting), or "".
  using Launch = std::function<std::string()>;
  NcclRequest(ncclComm_t comm, c10::cuda::CUDAStream stream, std::vector<torch::Tensor> keep, Launch launch,
              TransportRequestPtr host_first = nullptr, TransportRequestPtr host_beside = nullptr)
      : comm_(comm), stream_(stream), keep_(std::move(keep)), launch_(std::move(launch)),
        host_first_(std::move(host_first)), host_beside_(std::move(host_beside)) {
    if (!host_first_) start();
  }

  bool test() override {
    if (host_first_) {
      if (!host_first_->test()) return false;
      host_first_.reset();
      start();
    }
    if (!recorded_) {
      if (!ready(comm_, "launch")) return false;
      c10::cuda::CUDAGuard on(stream_.device_index());
      done_.record(stream_);
      recorded_ = true;
    }
    if (!event_done(done_)) {
      ready(comm_, "operation");  // raises what NCCL saw go wrong (a peer's connection lost)
      return false;
    }
    if (host_beside_ && !host_beside_->test()) return false;
    keep_.clear();
    if (!error_.empty()) throw Error(error_);
    return true;
  }

 private:
  void start() {
    c10::cuda::CUDAGuard on(stream_.device_index());
    // The tensors were written on the caller's stream: NCCL's stream waits for that work.
    at::cuda::CUDAEvent written;
    written.record(c10::cuda::getCurrentCUDAStream(stream_.device_index()));
    written.block(stream_);
    error_ = launch_();
  }

  ncclComm_t comm_;
  c10::cuda::CUDAStream stream_;
  std::vector<torch::Tensor> keep_;
  Launch launch_;
  TransportRequestPtr host_first_;
  TransportRequestPtr host_beside_;
  at::cuda::CUDAEvent done_;
  bool recorded_ = false;
  std::string error_;
};

/// What precedes every point-to-point message, over MPI.
struct Header {
  int64_t tag = 0;
  int64_t numel = 0;
  int64_t sequence = 0;  // of the messages from sender to receiver
};

torch::Tensor header_tensor(const Header& h) {
  auto t = torch::empty({static_cast<int64_t>(sizeof(Header))}, torch::kUInt8);
  std::memcpy(t.data_ptr(), &h, sizeof(Header));
  return t;
}

class NcclTransport final : public Transport {
 public:
  NcclTransport(std::unique_ptr<Transport> host, ncclComm_t comm, c10::Device device)
      : host_(std::move(host)), comm_(comm), device_(device),
        stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device.index())) {}

  ~NcclTransport() override {
    if (!aborted_) ncclCommDestroy(comm_);
  }

  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  const std::vector<int>& world_ranks() const override { return host_->world_ranks(); }
  c10::Device device() const override { return device_; }
  const char* backend() const override { return "nccl"; }
  bool collectives_at_every_size() const override { return true; }

  TransportRequestPtr send(const torch::Tensor& tensor, int dst, int tag) override {
    if (tensor.is_cpu()) return host_->send(tensor, dst, tag);
    auto header = header_tensor({tag, tensor.numel(), sent_[dst]++});
    auto announce = host_->send(header, dst, tag);
    return request({tensor, header}, [=, this] {
      check(ncclSend(tensor.data_ptr(), tensor.numel(), nccl_type(tensor.scalar_type()), dst, comm_, stream_), comm_,
            "send");
      return std::string();
    }, nullptr, std::move(announce));
  }

  TransportRequestPtr recv(const torch::Tensor& tensor, int src, int tag) override {
    if (tensor.is_cpu()) return host_->recv(tensor, src, tag);
    auto header = torch::empty({static_cast<int64_t>(sizeof(Header))}, torch::kUInt8);
    auto announced = host_->recv(header, src, tag);
    const int64_t expected = received_[src]++;
    auto into = std::make_shared<torch::Tensor>(tensor);  // or a buffer that drains a wrong-sized message
    return request({header}, [=, this] {
      Header h;
      std::memcpy(&h, header.data_ptr(), sizeof(Header));
      ZTRAIN_CHECK(h.sequence == expected, "recv: the next message from rank ", src, " over NCCL is message #",
                   expected, " between the two, but tag ", tag, " came as #", h.sequence,
                   "; NCCL delivers a pair's messages in the order they were sent, whatever their tags: "
                   "receive in the order of sending, or use the mpi backend");
      std::string error;
      if (h.numel != tensor.numel()) {
        error = c10::str("recv: expected ", tensor.numel(), " elements of ", tensor.scalar_type(), " from rank ", src,
                         " (tag ", tag, ") but the message held ", h.numel,
                         "; sender and receiver must agree on the shape");
        *into = torch::empty({h.numel}, tensor.options());
      }
      check(ncclRecv(into->data_ptr(), into->numel(), nccl_type(tensor.scalar_type()), src, comm_, stream_), comm_,
            "recv");
      return error;
    }, std::move(announced));
  }

  TransportRequestPtr all_reduce(const torch::Tensor& tensor, ReduceOp op) override {
    if (tensor.is_cpu()) return host_->all_reduce(tensor, op);
    return request({tensor}, [=, this] {
      check(ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), nccl_type(tensor.scalar_type()),
                          nccl_op(tensor.scalar_type(), op), comm_, stream_),
            comm_, "all_reduce");
      return std::string();
    });
  }

  TransportRequestPtr all_gather(const torch::Tensor& input, const torch::Tensor& output) override {
    if (input.is_cpu()) return host_->all_gather(input, output);
    return request({input, output}, [=, this] {
      check(ncclAllGather(input.data_ptr(), output.data_ptr(), input.numel(), nccl_type(input.scalar_type()), comm_,
                          stream_),
            comm_, "all_gather");
      return std::string();
    });
  }

  TransportRequestPtr reduce_scatter(const torch::Tensor& input, const torch::Tensor& output, ReduceOp op) override {
    if (input.is_cpu()) return host_->reduce_scatter(input, output, op);
    return request({input, output}, [=, this] {
      check(ncclReduceScatter(input.data_ptr(), output.data_ptr(), output.numel(), nccl_type(input.scalar_type()),
                              nccl_op(input.scalar_type(), op), comm_, stream_),
            comm_, "reduce_scatter");
      return std::string();
    });
  }

  TransportRequestPtr broadcast(const torch::Tensor& tensor, int root) override {
    if (tensor.is_cpu()) return host_->broadcast(tensor, root);
    return request({tensor}, [=, this] {
      check(ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), nccl_type(tensor.scalar_type()), root,
                          comm_, stream_),
            comm_, "broadcast");
      return std::string();
    });
  }

  TransportRequestPtr barrier() override { return host_->barrier(); }

  std::unique_ptr<PendingTransport> dup() override;
  std::unique_ptr<PendingTransport> split(int color, int key) override;

  void on_failure() override {
    host_->on_failure();
    if (!aborted_) ncclCommAbort(comm_);  // stops this communicator's kernels; never waits for peers
    aborted_ = true;
  }

 private:
  TransportRequestPtr request(std::vector<torch::Tensor> keep, NcclRequest::Launch launch,
                              TransportRequestPtr host_first = nullptr, TransportRequestPtr host_beside = nullptr) {
    return std::make_unique<NcclRequest>(comm_, stream_, std::move(keep), std::move(launch), std::move(host_first),
                                         std::move(host_beside));
  }
  std::unique_ptr<PendingTransport> derive(std::unique_ptr<PendingTransport> host, int color, int key);

  std::unique_ptr<Transport> host_;
  ncclComm_t comm_;
  c10::Device device_;
  c10::cuda::CUDAStream stream_;
  std::map<int, int64_t> sent_, received_;  // point-to-point messages, by peer
  bool aborted_ = false;
};

// ---- creation ----------------------------------------------------------------------------------

/// An NCCL transport on its way: the MPI transport first, then (for the world) NCCL's unique id
/// over it, then the NCCL communicator, each step polled.
class PendingNcclTransport final : public PendingTransport {
 public:
  /// The world: NCCL initialised from a unique id that rank 0 broadcasts over MPI.
  PendingNcclTransport(std::unique_ptr<PendingTransport> host, c10::Device device)
      : host_pending_(std::move(host)), device_(device) {}
  /// A split of `parent` (collective over its members): MPI's and NCCL's at once.
  PendingNcclTransport(std::unique_ptr<PendingTransport> host, c10::Device device, ncclComm_t parent, int color,
                       int key)
      : host_pending_(std::move(host)), device_(device), parent_(parent) {
    c10::cuda::CUDAGuard on(device_);
    auto config = nonblocking_config();
    check(ncclCommSplit(parent, color, key, &comm_, &config), parent, "ncclCommSplit");
  }

  ~PendingNcclTransport() override {
    if (comm_) ncclCommAbort(comm_);  // abandoned (a timeout) or never taken
  }

  bool test() override {
    if (host_pending_) {
      if (!host_pending_->test()) return false;
      host_ = host_pending_->take();
      host_pending_.reset();
      if (!comm_) start_world();
    }
    if (id_request_) {
      if (!id_request_->test()) return false;
      id_request_.reset();
      initialise();
    }
    // A split keeps its parent busy until every new communicator is made: the parent is usable
    // again (for the next split, say) once it reports so.
    return comm_ && ready(comm_, "communicator creation") && (!parent_ || ready(parent_, "ncclCommSplit"));
  }

  std::unique_ptr<Transport> take() override {
    ZTRAIN_INTERNAL_ASSERT(comm_ && host_, "an NCCL transport was taken before it was created");
    return std::make_unique<NcclTransport>(std::move(host_), std::exchange(comm_, nullptr), device_);
  }

 private:
  void start_world() {
    id_ = torch::zeros({static_cast<int64_t>(sizeof(ncclUniqueId))}, torch::kUInt8);
    if (host_->rank() == 0) {
      ncclUniqueId id;
      check(ncclGetUniqueId(&id), nullptr, "ncclGetUniqueId");
      std::memcpy(id_.data_ptr(), &id, sizeof(id));
    }
    id_request_ = host_->broadcast(id_, 0);
    ZTRAIN_INTERNAL_ASSERT(id_request_, "the MPI transport has no broadcast");
  }

  void initialise() {
    ncclUniqueId id;
    std::memcpy(&id, id_.data_ptr(), sizeof(id));
    c10::cuda::CUDAGuard on(device_);
    auto config = nonblocking_config();
    ncclComm_t comm = nullptr;
    check(ncclCommInitRankConfig(&comm, host_->size(), id, host_->rank(), &config), comm, "ncclCommInitRankConfig");
    comm_ = comm;
  }

  std::unique_ptr<PendingTransport> host_pending_;
  std::unique_ptr<Transport> host_;
  c10::Device device_;
  torch::Tensor id_;
  TransportRequestPtr id_request_;
  ncclComm_t parent_ = nullptr;  // of a split, alive while it is made
  ncclComm_t comm_ = nullptr;
};

std::unique_ptr<PendingTransport> NcclTransport::derive(std::unique_ptr<PendingTransport> host, int color, int key) {
  return std::make_unique<PendingNcclTransport>(std::move(host), device_, comm_, color, key);
}

std::unique_ptr<PendingTransport> NcclTransport::dup() { return derive(host_->dup(), 0, rank()); }

std::unique_ptr<PendingTransport> NcclTransport::split(int color, int key) {
  return derive(host_->split(color, key), color, key);
}

}  // namespace

namespace detail {

std::unique_ptr<PendingTransport> nccl_world(c10::Device device) {
  ZTRAIN_CHECK(device.is_cuda() && device.has_index(), "the nccl backend moves CUDA tensors and needs this rank's "
               "CUDA device (cuda:N), got ", device, "; on the CPU use the mpi backend");
  return std::make_unique<PendingNcclTransport>(mpi_world(), device);
}

}  // namespace detail

}  // namespace ztrain
