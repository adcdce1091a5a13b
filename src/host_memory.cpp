#include "host_memory.h"

#include <algorithm>
#include <atomic>
#include <fstream>
#include <limits>
#include <string>
#include <utility>

namespace ztrain::detail {
namespace {

// The first number in `path`; -1 where there is none (a missing file, "max").
int64_t read_number(const std::string& path, const std::string& key = "") {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (!key.empty() && line.rfind(key, 0) != 0) continue;
    const auto digits = line.find_first_of("0123456789", key.size());
    if (digits == std::string::npos) return -1;
    return std::stoll(line.substr(digits));
  }
  return -1;
}

// This process's memory cgroup: its limit and usage files (cgroup v1 or v2), or none.
std::pair<std::string, std::string> cgroup_files() {
  std::ifstream in("/proc/self/cgroup");
  std::string line;
  while (std::getline(in, line)) {
    const auto first = line.find(':'), second = line.find(':', first + 1);
    if (first == std::string::npos || second == std::string::npos) continue;
    const auto controllers = line.substr(first + 1, second - first - 1), path = line.substr(second + 1);
    if ((',' + controllers + ',').find(",memory,") != std::string::npos) {
      const auto dir = "/sys/fs/cgroup/memory" + path;
      return {dir + "/memory.limit_in_bytes", dir + "/memory.usage_in_bytes"};
    }
    if (line.rfind("0::", 0) == 0) {
      const auto dir = "/sys/fs/cgroup" + path;
      if (std::ifstream(dir + "/memory.max")) return {dir + "/memory.max", dir + "/memory.current"};
    }
  }
  return {};
}

std::atomic<int64_t> g_fake{-1};

}  // namespace

void fake_host_memory_left(int64_t left) { g_fake.store(left); }

int64_t host_memory_left() {
  if (const int64_t fake = g_fake.load(); fake >= 0) return fake;
  static const auto cgroup = cgroup_files();
  int64_t left = read_number("/proc/meminfo", "MemAvailable:");
  left = left < 0 ? std::numeric_limits<int64_t>::max() : left * 1024;
  if (!cgroup.first.empty()) {
    const int64_t limit = read_number(cgroup.first), usage = read_number(cgroup.second);
    if (limit >= 0 && usage >= 0) left = std::min(left, limit - usage);
  }
  return left;
}

}  // namespace ztrain::detail
