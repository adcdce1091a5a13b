#include "cpu_binding.h"

#include <dirent.h>
#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>

namespace ztrain::detail {

std::vector<int> allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  return cpus;
}

int physical_core_of(int cpu) {
  const std::string dir = "/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/";
  int package = -1, core = -1;
  std::ifstream(dir + "physical_package_id") >> package;
  std::ifstream(dir + "core_id") >> core;
  if (package < 0 || core < 0) return -1;
  return package * (1 << 16) + core;
}

std::vector<std::vector<int>> cpu_shares(const std::vector<int>& cpus, int shares,
                                         const std::function<int(int)>& core_of) {
  if (shares < 1 || static_cast<int>(cpus.size()) < shares) return {};
  // The cores in the order of their first CPU, each with its CPUs; a CPU of unknown core alone.
  std::vector<std::vector<int>> cores;
  std::map<int, size_t> core_index;
  for (int cpu : cpus) {
    const int core = core_of(cpu);
    if (core < 0) {
      cores.push_back({cpu});
      continue;
    }
    auto [it, added] = core_index.emplace(core, cores.size());
    if (added) cores.emplace_back();
    cores[it->second].push_back(cpu);
  }
  if (static_cast<int>(cores.size()) < shares) {  // fewer cores than shares: cut by CPU
    cores.clear();
    for (int cpu : cpus) cores.push_back({cpu});
  }
  const size_t n = cores.size();
  std::vector<std::vector<int>> out(shares);
  for (int k = 0; k < shares; ++k) {
    for (size_t u = n * k / shares; u < n * (k + 1) / shares; ++u) {
      out[k].insert(out[k].end(), cores[u].begin(), cores[u].end());
    }
    std::sort(out[k].begin(), out[k].end());
  }
  return out;
}

bool pin_process_threads(const std::vector<int>& cpus, std::string& error) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) CPU_SET(c, &set);
  // This thread first: threads started from now on inherit its CPUs.
  if (sched_setaffinity(0, sizeof(set), &set) != 0) {
    error = std::strerror(errno);
    return false;
  }
  DIR* tasks = opendir("/proc/self/task");
  if (tasks == nullptr) {
    error = std::string("/proc/self/task: ") + std::strerror(errno);
    return false;
  }
  bool ok = true;
  while (const dirent* entry = readdir(tasks)) {
    const int tid = std::atoi(entry->d_name);
    // A thread that ended meanwhile (ESRCH) needs no CPUs.
    if (tid > 0 && sched_setaffinity(tid, sizeof(set), &set) != 0 && errno != ESRCH) {
      error = "thread " + std::to_string(tid) + ": " + std::strerror(errno);
      ok = false;
    }
  }
  closedir(tasks);
  return ok;
}

std::string cpu_list_string(const std::vector<int>& cpus) {
  std::string out;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += std::to_string(cpus[i]);
    if (j > i) out += '-' + std::to_string(cpus[j]);
    i = j + 1;
  }
  return out;
}

}  // namespace ztrain::detail
