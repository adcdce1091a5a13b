#pragma once
// Pinning a rank's threads to its own share of the host's CPUs (InitOptions::bind_cores).
//
// Ranks started unbound (mpirun --bind-to none, a Python launcher) may each run on any CPU. A
// rank's communication threads (the gather and reduce streams, summing gradients in the
// host-shared collectives) then preempt whichever compute thread the scheduler finds, a peer's as
// often as their own: that peer falls behind, and at the next collective every rank waits for it.
// Bound to disjoint shares, a rank's helper threads take their time from its own compute threads
// only, and the ranks stay in step.

#include <functional>
#include <string>
#include <vector>

namespace ztrain::detail {

/// The CPUs this thread may run on, ascending.
std::vector<int> allowed_cpus();

/// The physical core of each CPU as the kernel reports it (its package and core id), or -1 when
/// unknown: CPUs of one core are hardware threads sharing its units.
int physical_core_of(int cpu);

/// `cpus` in `shares` equal shares, in order, cut by physical core (`core_of`; a core's hardware
/// threads stay together) where there are at least `shares` cores, else by CPU. None when there
/// are fewer CPUs than shares. Shares differ in size by at most one core (or CPU).
std::vector<std::vector<int>> cpu_shares(const std::vector<int>& cpus, int shares,
                                         const std::function<int(int)>& core_of = physical_core_of);

/// Pins every thread of this process (and so the threads it starts later) to `cpus`; false,
/// with the reason in `error`, if the kernel refused.
bool pin_process_threads(const std::vector<int>& cpus, std::string& error);

/// "0-3,8-11": a CPU list as the kernel writes one.
std::string cpu_list_string(const std::vector<int>& cpus);

}  // namespace ztrain::detail
