#include <ztrain/comm/mpi/transport.h>

#include "startup.h"

#include <ztrain/error.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/StringUtil.h>

#include <atomic>
#include <climits>
#include <functional>
#include <future>
#include <mutex>
#include <thread>

// How it works: each operation is one non-blocking MPI call wrapped in a request whose test()
// is MPI_Test, so the communicator's polling loop drives MPI's progress engine and applies its
// deadline. An error code becomes a TransportFailure carrying MPI's error text. The one blocking
// MPI call a transport needs, MPI_Comm_split, runs on a detached helper thread; the request
// completes when the thread has the new communicator, and a request abandoned at the deadline
// leaves the thread to MPI (the job is failing by then).

namespace ztrain {

namespace detail {
namespace {
std::atomic<bool> g_mpi_failure{false};
}
bool mpi_failure_seen() { return g_mpi_failure.load(); }
}  // namespace detail

namespace {

// ---- custom reductions for 16-bit floats ---------------------------------------------------

template <class T, class F>
void reduce16(void* in, void* inout, int* len, F f) {
  auto* a = static_cast<const T*>(in);
  auto* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = T(f(static_cast<float>(a[i]), static_cast<float>(b[i])));
}
struct Sum { float operator()(float a, float b) const { return a + b; } };
struct Max { float operator()(float a, float b) const { return (a > b || a != a) ? a : b; } };
struct Min { float operator()(float a, float b) const { return (a < b || a != a) ? a : b; } };

template <class T, class F>
void reduce16_fn(void* in, void* inout, int* len, MPI_Datatype*) { reduce16<T>(in, inout, len, F{}); }

// MPI operations are process-wide MPI objects: created once, after MPI_Init, and kept.
struct CustomOps {
  MPI_Op bf16[3];  // sum, max, min
  MPI_Op f16[3];
};

const CustomOps& custom_ops() {
  static CustomOps ops = [] {
    CustomOps o{};
    MPI_Op_create(&reduce16_fn<c10::BFloat16, Sum>, 1, &o.bf16[0]);
    MPI_Op_create(&reduce16_fn<c10::BFloat16, Max>, 1, &o.bf16[1]);
    MPI_Op_create(&reduce16_fn<c10::BFloat16, Min>, 1, &o.bf16[2]);
    MPI_Op_create(&reduce16_fn<c10::Half, Sum>, 1, &o.f16[0]);
    MPI_Op_create(&reduce16_fn<c10::Half, Max>, 1, &o.f16[1]);
    MPI_Op_create(&reduce16_fn<c10::Half, Min>, 1, &o.f16[2]);
    return o;
  }();
  return ops;
}

MPI_Datatype mpi_type(c10::ScalarType t) {
  switch (t) {
    case at::kFloat: return MPI_FLOAT;
    case at::kDouble: return MPI_DOUBLE;
    case at::kBFloat16: case at::kHalf: return MPI_UINT16_T;
    case at::kInt: return MPI_INT32_T;
    case at::kLong: return MPI_INT64_T;
    case at::kByte: return MPI_UINT8_T;
    case at::kBool: return MPI_C_BOOL;
    default: break;
  }
  ZTRAIN_INTERNAL_ASSERT(false, "no MPI type for ", t);
}

MPI_Op mpi_op(c10::ScalarType t, ReduceOp op) {
  ZTRAIN_INTERNAL_ASSERT(op != ReduceOp::kAvg, "the MPI transport is handed sums, never averages");
  const int idx = op == ReduceOp::kMax ? 1 : op == ReduceOp::kMin ? 2 : 0;
  if (t == at::kBFloat16) return custom_ops().bf16[idx];
  if (t == at::kHalf) return custom_ops().f16[idx];
  if (t == at::kBool) return op == ReduceOp::kMin ? MPI_LAND : MPI_LOR;
  return idx == 1 ? MPI_MAX : idx == 2 ? MPI_MIN : MPI_SUM;
}

int count(const torch::Tensor& t) { return static_cast<int>(t.numel()); }

std::string error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, text, &len);
  return "MPI error: " + std::string(text, len);
}

void check(int code) {
  if (code != MPI_SUCCESS) throw TransportFailure(error_text(code));
}

/// One MPI request; `on_done` checks the completed status (a receive's size).
class MpiRequest final : public TransportRequest {
 public:
  using Check = std::function<void(const MPI_Status&)>;
  explicit MpiRequest(Check on_done = {}) : on_done_(std::move(on_done)) {}
  MPI_Request* handle() { return &request_; }
  bool test() override {
    int done = 0;
    MPI_Status status;
    check(MPI_Test(&request_, &done, &status));
    if (done && on_done_) on_done_(status);
    return done != 0;
  }

 private:
  MPI_Request request_ = MPI_REQUEST_NULL;
  Check on_done_;
};

/// Starts `start` on a request and returns it (or raises the MPI error).
template <class F>
TransportRequestPtr started(F&& start, MpiRequest::Check on_done = {}) {
  auto request = std::make_unique<MpiRequest>(std::move(on_done));
  check(start(request->handle()));
  return request;
}

MPI_Comm split_blocking(MPI_Comm comm, int color, int key) {
  MPI_Comm part = MPI_COMM_NULL;
  check(MPI_Comm_split(comm, color, key, &part));
  return part;
}

}  // namespace

// ---- creation ----------------------------------------------------------------------------------

/// A new MPI communicator on its way: from MPI_Comm_idup, or from a helper thread.
class PendingMpiTransport final : public PendingTransport {
 public:
  explicit PendingMpiTransport(MpiTransportOptions options) : options_(options) {}
  ~PendingMpiTransport() override {
    // Abandoned before MPI_Comm_idup completed (a timeout): MPI may still write the handle.
    if (request_ != MPI_REQUEST_NULL && comm_) new std::shared_ptr<MPI_Comm>(comm_);
  }

  static std::unique_ptr<PendingMpiTransport> idup(MPI_Comm comm, MpiTransportOptions options) {
    auto p = std::make_unique<PendingMpiTransport>(options);
    p->comm_ = std::make_shared<MPI_Comm>(MPI_COMM_NULL);
    check(MPI_Comm_idup(comm, p->comm_.get(), &p->request_));
    return p;
  }

  static std::unique_ptr<PendingMpiTransport> on_thread(std::function<MPI_Comm()> create, MpiTransportOptions options) {
    auto p = std::make_unique<PendingMpiTransport>(options);
    auto promise = std::make_shared<std::promise<MPI_Comm>>();
    p->future_ = promise->get_future();
    std::thread([promise, create = std::move(create)] {
      try {
        promise->set_value(create());
      } catch (...) {
        promise->set_exception(std::current_exception());
      }
    }).detach();
    return p;
  }

  bool test() override {
    if (future_.valid()) {
      if (future_.wait_for(std::chrono::seconds(0)) != std::future_status::ready) return false;
      comm_ = std::make_shared<MPI_Comm>(future_.get());  // rethrows the helper's failure
      return true;
    }
    int done = 0;
    check(MPI_Test(&request_, &done, MPI_STATUS_IGNORE));  // sets request_ to MPI_REQUEST_NULL when done
    return done != 0;
  }

  std::unique_ptr<Transport> take() override {
    ZTRAIN_INTERNAL_ASSERT(comm_ && *comm_ != MPI_COMM_NULL, "an MPI transport was taken before it was created");
    auto comm = std::exchange(*comm_, MPI_COMM_NULL);
    return std::unique_ptr<Transport>(new MpiTransport(comm, options_));
  }

 private:
  MpiTransportOptions options_;
  MPI_Request request_ = MPI_REQUEST_NULL;
  std::shared_ptr<MPI_Comm> comm_;  // shared: an abandoned MPI_Comm_idup may still write it
  std::future<MPI_Comm> future_;
};

MpiTransport::MpiTransport(MPI_Comm owned, MpiTransportOptions options) : comm_(owned), options_(options) {
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
  MPI_Group world_group, group;
  MPI_Comm_group(MPI_COMM_WORLD, &world_group);
  MPI_Comm_group(comm_, &group);
  std::vector<int> ranks(size_);
  for (int i = 0; i < size_; ++i) ranks[i] = i;
  world_ranks_.resize(size_);
  MPI_Group_translate_ranks(group, size_, ranks.data(), world_group, world_ranks_.data());
  MPI_Group_free(&group);
  MPI_Group_free(&world_group);
  (void)custom_ops();
}

std::unique_ptr<PendingTransport> MpiTransport::dup_of(MPI_Comm comm, MpiTransportOptions options) {
  detail::require_mpi_threads();
  return PendingMpiTransport::idup(comm, options);
}

std::unique_ptr<MpiTransport> MpiTransport::adopt(MPI_Comm comm, MpiTransportOptions options) {
  detail::require_mpi_threads();
  MPI_Comm mine = MPI_COMM_NULL;
  const int code = MPI_Comm_dup(comm, &mine);
  if (code != MPI_SUCCESS) {
    int rank = -1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    throw CommError(c10::str("ztrain: MpiTransport::adopt: MPI_Comm_dup failed on world rank ", rank, ": ",
                             error_text(code)),
                    rank, "MPI_Comm_dup", -1);
  }
  return std::unique_ptr<MpiTransport>(new MpiTransport(mine, options));
}

MpiTransport::~MpiTransport() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  // After a failure anywhere, requests may be abandoned and peers gone: freeing could block, so
  // the handle is left to process exit.
  if (comm_ != MPI_COMM_NULL && !finalized && !detail::mpi_failure_seen()) MPI_Comm_free(&comm_);
}

std::unique_ptr<PendingTransport> MpiTransport::dup() { return PendingMpiTransport::idup(comm_, options_); }

std::unique_ptr<PendingTransport> MpiTransport::split(int color, int key) {
  MPI_Comm comm = comm_;
  return PendingMpiTransport::on_thread([comm, color, key] { return split_blocking(comm, color, key); }, options_);
}

void MpiTransport::on_failure() { detail::g_mpi_failure = true; }

// ---- transfers ---------------------------------------------------------------------------------

TransportRequestPtr MpiTransport::send(const torch::Tensor& tensor, int dst, int tag) {
  return started([&](MPI_Request* r) {
    return MPI_Isend(tensor.data_ptr(), count(tensor), mpi_type(tensor.scalar_type()), dst, tag, comm_, r);
  });
}

TransportRequestPtr MpiTransport::recv(const torch::Tensor& tensor, int src, int tag) {
  const auto type = mpi_type(tensor.scalar_type());
  auto check_size = [type, expected = count(tensor), dtype = tensor.scalar_type(), src, tag](const MPI_Status& s) {
    int received = 0;
    MPI_Get_count(&s, type, &received);
    ZTRAIN_CHECK(received == expected, "recv: expected ", expected, " elements of ", dtype, " from rank ", src,
                 " (tag ", tag, ") but the message held ", received, "; sender and receiver must agree on the shape");
  };
  return started([&](MPI_Request* r) { return MPI_Irecv(tensor.data_ptr(), count(tensor), type, src, tag, comm_, r); },
                 check_size);
}

TransportRequestPtr MpiTransport::all_reduce(const torch::Tensor& tensor, ReduceOp op) {
  if (!options_.native_collectives) return nullptr;
  return started([&](MPI_Request* r) {
    return MPI_Iallreduce(MPI_IN_PLACE, tensor.data_ptr(), count(tensor), mpi_type(tensor.scalar_type()),
                          mpi_op(tensor.scalar_type(), op), comm_, r);
  });
}

TransportRequestPtr MpiTransport::all_gather(const torch::Tensor& input, const torch::Tensor& output) {
  if (!options_.native_collectives) return nullptr;
  const auto type = mpi_type(input.scalar_type());
  const bool in_place =
      input.data_ptr() == static_cast<const char*>(output.data_ptr()) + rank_ * static_cast<int64_t>(input.nbytes());
  return started([&](MPI_Request* r) {
    return MPI_Iallgather(in_place ? MPI_IN_PLACE : input.data_ptr(), count(input), type, output.data_ptr(),
                          count(input), type, comm_, r);
  });
}

TransportRequestPtr MpiTransport::reduce_scatter(const torch::Tensor& input, const torch::Tensor& output, ReduceOp op) {
  if (!options_.native_collectives) return nullptr;
  return started([&](MPI_Request* r) {
    return MPI_Ireduce_scatter_block(input.data_ptr(), output.data_ptr(), count(output), mpi_type(input.scalar_type()),
                                     mpi_op(input.scalar_type(), op), comm_, r);
  });
}

TransportRequestPtr MpiTransport::broadcast(const torch::Tensor& tensor, int root) {
  if (!options_.native_collectives) return nullptr;
  return started([&](MPI_Request* r) {
    return MPI_Ibcast(tensor.data_ptr(), count(tensor), mpi_type(tensor.scalar_type()), root, comm_, r);
  });
}

TransportRequestPtr MpiTransport::barrier() {
  if (!options_.native_collectives) return nullptr;
  return started([&](MPI_Request* r) { return MPI_Ibarrier(comm_, r); });
}

// ---- the process's MPI -------------------------------------------------------------------------

namespace detail {
namespace {
std::mutex g_startup_mutex;
bool g_started_by_us = false;
}  // namespace

void require_mpi_threads() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  ZTRAIN_CHECK(initialized, "ztrain: MPI is not initialised; call ztrain::init_distributed() (or "
               "ztrain::make_world_communicator(\"mpi\")) first");
}

void start_mpi() {
  std::lock_guard<std::mutex> lock(g_startup_mutex);
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  ZTRAIN_CHECK(!finalized, "ztrain: MPI was already finalised in this process and cannot be started again");
  int provided = 0;
  if (!initialized) {
    const int code = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    ZTRAIN_CHECK(code == MPI_SUCCESS, "ztrain: MPI_Init_thread failed (", error_text(code), ")");
    g_started_by_us = true;
  } else {
    MPI_Query_thread(&provided);
  }
  ZTRAIN_CHECK(provided >= MPI_THREAD_MULTIPLE, "ztrain: the MPI library provides thread level ", provided,
               " but ztrain's communication streams need MPI_THREAD_MULTIPLE (", MPI_THREAD_MULTIPLE,
               "); use an MPI built with thread support",
               initialized ? ", or initialise MPI with MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...)" : "");
  // Errors come back as codes, so that a failing call (duplicating the world, say) reaches the
  // caller as a CommError instead of aborting the job. A program that started MPI itself keeps
  // the handler it chose.
  if (g_started_by_us) MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
}

std::unique_ptr<PendingTransport> mpi_world() {
  start_mpi();
  return MpiTransport::dup_of(MPI_COMM_WORLD);
}

void shutdown_mpi() {
  std::lock_guard<std::mutex> lock(g_startup_mutex);
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (g_started_by_us && initialized && !finalized && !mpi_failure_seen()) MPI_Finalize();
  g_started_by_us = false;
}

void abort_mpi(int exit_code) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, exit_code);
}

}  // namespace detail

}  // namespace ztrain
