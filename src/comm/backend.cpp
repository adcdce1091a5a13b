#include <ztrain/comm/backend.h>

#include "deadline.h"
#include "mpi/startup.h"
#include <ztrain_comm_backends.h>  // generated: ZTRAIN_HAS_NCCL
#if ZTRAIN_HAS_NCCL
#include "nccl/startup.h"
#endif

#include <sstream>

namespace ztrain {

namespace {

struct Backend {
  const char* name;
  /// Starts the backend if needed and begins creating this process's world transport, which
  /// moves tensors on `device` where the backend binds one.
  std::unique_ptr<PendingTransport> (*world)(c10::Device device);
  /// Whether the transport moves one device's memory, chosen at creation (NCCL's).
  bool binds_device;
  void (*shutdown)();
  /// Ends every process of the job, if the backend is running (returns otherwise).
  void (*abort)(int exit_code);
};

// The backends of this build. A constant table: nothing registers at run time.
constexpr Backend kBackends[] = {
    {"mpi", [](c10::Device) { return detail::mpi_world(); }, false, &detail::shutdown_mpi, &detail::abort_mpi},
#if ZTRAIN_HAS_NCCL
    // MPI underneath, shut down and aborted by its own row; each NCCL communicator goes with its
    // transport.
    {"nccl", &detail::nccl_world, true, [] {}, [](int) {}},
#endif
};

const Backend& find_backend(const std::string& name) {
  for (const auto& b : kBackends) {
    if (name == b.name) return b;
  }
  std::ostringstream names;
  for (const auto& b : kBackends) names << " " << b.name;
  ZTRAIN_CHECK(name != "nccl", "the nccl backend is not in this build of ztrain (it needs a libtorch with CUDA, and "
               "NCCL's nccl.h and libnccl where CMake looks: beside PyTorch or in the CUDA toolkit); this build "
               "has:", names.str());
  ZTRAIN_CHECK(false, "unknown communicator backend '", name, "'; this build has:", names.str());
}

}  // namespace

std::vector<std::string> communicator_backends() {
  std::vector<std::string> out;
  for (const auto& b : kBackends) out.emplace_back(b.name);
  return out;
}

bool communicator_backend_binds_device(const std::string& backend) { return find_backend(backend).binds_device; }

std::unique_ptr<Communicator> make_world_communicator(const std::string& backend, CommunicatorOptions options,
                                                      c10::Device device) {
  const Backend* found = &find_backend(backend);
  ZTRAIN_CHECK(options.timeout.count() > 0, "communicator timeout must be positive, got ", options.timeout.count(),
               " ms");
  std::unique_ptr<PendingTransport> pending;
  bool done = false;
  try {
    pending = found->world(device);
    std::vector<TransportRequest*> requests{pending.get()};
    done = detail::poll_until_done(requests, options.timeout);
  } catch (const TransportFailure& e) {
    throw CommError(c10::str("ztrain: creating the '", backend, "' world communicator failed: ", e.what()), -1,
                    "make_world_communicator", -1);
  }
  if (!done) {
    throw CommError(c10::str("ztrain: creating the '", backend, "' world communicator timed out after ",
                             options.timeout.count() / 1000.0, " s: a process of the job did not take part"),
                    -1, "make_world_communicator", -1);
  }
  return std::make_unique<Communicator>(pending->take(), std::move(options));
}

void shutdown_communicator_backends() {
  for (const auto& b : kBackends) b.shutdown();
}

void abort_communicator_backends(int exit_code) {
  for (const auto& b : kBackends) b.abort(exit_code);
}

}  // namespace ztrain
