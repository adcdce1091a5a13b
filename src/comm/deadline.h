#pragma once
// Waiting for transport requests against a deadline.

#include <ztrain/comm/transport.h>

#include <chrono>
#include <vector>

namespace ztrain::detail {

/// Polls the requests (null entries count as done) until every one completed — true — or
/// `timeout` passed — false. Exceptions from test() propagate. The first few hundred polls spin,
/// then the waiter yields the core for up to 20 ms, then sleeps 50 µs between polls, so a rank
/// waiting for a slow peer does not steal its host's compute cores.
bool poll_until_done(std::vector<TransportRequest*>& requests, std::chrono::milliseconds timeout);

}  // namespace ztrain::detail
