#include "host_rendezvous.h"

#include "host_shared_detail.h"

#include <ztrain/error.h>

#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <ctime>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

// The memory file, one or more pages:
//   [0, 64)         the wake word: bumped at every arrival, the futex that absent members' waiters sleep on
//   [64, ...)       one arrival word per member: the number of the last meeting it arrived at
//   [data, ...)     two sets of slots, kSlotBytes per member: meeting n's in set n % 2
// Two sets, because a member that has passed meeting n may write its slot for meeting n + 1
// while a slower one still reads what was said at n; it cannot reach n + 2 before every member
// has arrived at n + 1, that is, has finished reading n.

namespace ztrain::detail {
namespace {

constexpr size_t kLine = 64;
// How long a member polls the arrival words before it sleeps: about what waking a sleeper costs
// (40 µs between two ranks of a virtual machine, wait_bench's 0 ms row), so that a peer a few
// microseconds behind is not paid for with a sleep and a wake.
constexpr auto kSpinTime = std::chrono::microseconds(50);
// The longest single sleep, so that the deadline is checked even if no one ever wakes us.
constexpr auto kLongestSleep = std::chrono::milliseconds(100);

size_t data_offset(int members) { return kLine + (members * sizeof(uint32_t) + kLine - 1) / kLine * kLine; }

size_t file_bytes(int members) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t bytes = data_offset(members) + 2 * members * HostRendezvous::kSlotBytes;
  return (bytes + page - 1) / page * page;
}

long futex(uint32_t* word, int op, uint32_t value, const timespec* timeout) {
  return syscall(SYS_futex, word, op, value, timeout, nullptr, 0);
}

inline void relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

}  // namespace

HostRendezvous::HostRendezvous(char* base, size_t bytes, int fd, int members, int member)
    : base_(base), bytes_(bytes), fd_(fd), members_(members), member_(member) {}

HostRendezvous::~HostRendezvous() {
  munmap(base_, bytes_);
  if (fd_ >= 0) close(fd_);
}

std::unique_ptr<HostRendezvous> HostRendezvous::create(int members, std::string& error) {
  const size_t bytes = file_bytes(members);
  const int fd = memfd_create("ztrain-host-rendezvous", MFD_CLOEXEC);
  void* base = MAP_FAILED;
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(bytes)) != 0 ||
      (base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) == MAP_FAILED) {
    error = std::string("cannot make a shared memory file for the members' meetings: ") + std::strerror(errno);
    if (fd >= 0) close(fd);
    return nullptr;
  }
  // A new memory file reads as zeros: no one has arrived anywhere.
  return std::unique_ptr<HostRendezvous>(new HostRendezvous(static_cast<char*>(base), bytes, fd, members, 0));
}

std::unique_ptr<HostRendezvous> HostRendezvous::join(const Name& name, int members, int member, std::string& error) {
  const size_t bytes = file_bytes(members);
  void* base = map_process_file(name.pid, name.fd, 0, bytes, /*writable=*/true, nullptr, error);
  if (base == nullptr) return nullptr;
  return std::unique_ptr<HostRendezvous>(new HostRendezvous(static_cast<char*>(base), bytes, -1, members, member));
}

HostRendezvous::Name HostRendezvous::name() const { return {static_cast<int32_t>(getpid()), fd_}; }

namespace {

uint32_t* wake_word(char* base) { return reinterpret_cast<uint32_t*>(base); }
uint32_t* arrival_word(char* base, int m) { return reinterpret_cast<uint32_t*>(base + kLine) + m; }

// Whether member m has arrived at `meeting` (or, having passed it, at the next).
bool arrived(char* base, int m, uint32_t meeting) {
  return static_cast<int32_t>(__atomic_load_n(arrival_word(base, m), __ATOMIC_ACQUIRE) - meeting) >= 0;
}

}  // namespace

bool HostRendezvous::meet(const void* mine, size_t bytes, std::chrono::milliseconds timeout) {
  using clock = std::chrono::steady_clock;
  const uint32_t meeting = ++meetings_;
  ZTRAIN_INTERNAL_ASSERT(bytes <= kSlotBytes);
  if (bytes > 0) std::memcpy(slot(meeting, member_), mine, bytes);
  __atomic_store_n(arrival_word(base_, member_), meeting, __ATOMIC_RELEASE);
  __atomic_add_fetch(wake_word(base_), 1, __ATOMIC_SEQ_CST);
  futex(wake_word(base_), FUTEX_WAKE, INT_MAX, nullptr);
  const auto arrival = clock::now();
  const auto deadline = arrival + timeout;
  bool spinning = true;
  for (uint32_t polls = 1;; ++polls) {
    // Read before looking at the arrivals: an arrival after the look changes the word, and the
    // futex then returns at once instead of sleeping.
    const uint32_t seen = __atomic_load_n(wake_word(base_), __ATOMIC_SEQ_CST);
    bool all = true;
    for (int m = 0; m < members_ && all; ++m) all = arrived(base_, m, meeting);
    if (all) return true;
    if (spinning && (polls % 64 != 0 || clock::now() - arrival < kSpinTime)) {
      relax();
      continue;
    }
    spinning = false;
    const auto left = deadline - clock::now();
    if (left <= clock::duration::zero()) return false;
    using std::chrono::nanoseconds;
    const auto nap = std::chrono::duration_cast<nanoseconds>(std::min<clock::duration>(left, kLongestSleep)).count();
    const timespec ts{static_cast<time_t>(nap / 1000000000), static_cast<long>(nap % 1000000000)};
    futex(wake_word(base_), FUTEX_WAIT, seen, &ts);  // also returns on a signal or a spurious wake
  }
}

char* HostRendezvous::slot(uint32_t meeting, int m) const {
  return base_ + data_offset(members_) + ((meeting & 1) * members_ + m) * kSlotBytes;
}

const char* HostRendezvous::said(int m) const { return slot(meetings_, m); }

std::vector<int> HostRendezvous::absent() const {
  std::vector<int> out;
  for (int m = 0; m < members_; ++m) {
    if (!arrived(base_, m, meetings_)) out.push_back(m);
  }
  return out;
}

}  // namespace ztrain::detail
