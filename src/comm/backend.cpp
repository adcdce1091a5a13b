#include <ztrain/comm/backend.h>

#include "deadline.h"
#include "mpi/startup.h"

#include <sstream>

namespace ztrain {

namespace {

struct Backend {
  const char* name;
  /// Starts the backend if needed and begins creating this process's world transport.
  std::unique_ptr<PendingTransport> (*world)();
  void (*shutdown)();
  /// Ends every process of the job, if the backend is running (returns otherwise).
  void (*abort)(int exit_code);
};

// The backends of this build. A constant table: nothing registers at run time.
constexpr Backend kBackends[] = {
    {"mpi", &detail::mpi_world, &detail::shutdown_mpi, &detail::abort_mpi},
};

}  // namespace

std::vector<std::string> communicator_backends() {
  std::vector<std::string> out;
  for (const auto& b : kBackends) out.emplace_back(b.name);
  return out;
}

std::unique_ptr<Communicator> make_world_communicator(const std::string& backend, CommunicatorOptions options) {
  const Backend* found = nullptr;
  for (const auto& b : kBackends) {
    if (backend == b.name) found = &b;
  }
  if (!found) {
    std::ostringstream names;
    for (const auto& b : kBackends) names << " " << b.name;
    ZTRAIN_CHECK(false, "unknown communicator backend '", backend, "'; this build has:", names.str());
  }
  ZTRAIN_CHECK(options.timeout.count() > 0, "communicator timeout must be positive, got ", options.timeout.count(),
               " ms");
  std::unique_ptr<PendingTransport> pending;
  bool done = false;
  try {
    pending = found->world();
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
