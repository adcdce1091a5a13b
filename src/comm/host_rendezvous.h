#pragma once
// A meeting point in shared memory for the members of a communicator that share one host.
//
// The host-shared collectives synchronise three times a call: the members exchange the names of
// their buffers (which also says that each has arrived with its input ready), agree that every
// mapping worked, and meet once more when all have finished with the buffers. Through the
// transport each of these is a message round whose waiter polls, and a rank whose peer is late
// keeps yielding and waking on the core its compute thread needs. Here a member writes what it
// has to say into its slot of one small memory file, marks its arrival and wakes the others; a
// member that finds someone missing sleeps in the kernel (a futex on the shared page) until the
// next arrival, or its deadline.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace ztrain::detail {

class HostRendezvous {
 public:
  /// What each member may say at a meeting.
  static constexpr size_t kSlotBytes = 256;

  /// Where a meeting point lies, for the other members to join it. Plain data: sent as bytes.
  struct Name {
    int32_t pid = 0;  // the creator, member 0; 0 when it could not create one
    int32_t fd = -1;  // its memory file in the creator
  };

  /// Made by member 0 of `members`; null with the reason in `error`.
  static std::unique_ptr<HostRendezvous> create(int members, std::string& error);
  /// Joined by member `member` (not 0) from the creator's name; null with the reason in `error`.
  static std::unique_ptr<HostRendezvous> join(const Name& name, int members, int member, std::string& error);
  ~HostRendezvous();
  HostRendezvous(const HostRendezvous&) = delete;
  HostRendezvous& operator=(const HostRendezvous&) = delete;

  Name name() const;

  /// Says `bytes` (at most kSlotBytes) of `mine` and waits until every member has arrived at this
  /// meeting, the members' n-th meeting for a member's n-th call: true, and said(m) holds what
  /// member m said. False when `timeout` passed first; the meeting point is then unusable.
  bool meet(const void* mine, size_t bytes, std::chrono::milliseconds timeout);
  /// What member m said at the last meeting: valid until this member's next meet.
  const char* said(int m) const;
  /// The members that had not arrived at the last meeting when it timed out.
  std::vector<int> absent() const;

 private:
  HostRendezvous(char* base, size_t bytes, int fd, int members, int member);
  char* slot(uint32_t meeting, int m) const;  // member m's, for that meeting

  char* base_;
  size_t bytes_;
  int fd_;  // the creator's memory file; -1 in the others
  int members_;
  int member_;
  uint32_t meetings_ = 0;  // this member's meetings so far
};

}  // namespace ztrain::detail
