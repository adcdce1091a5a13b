#pragma once
/// Errors raised by ztrain.
///
/// Policy (docs/errors.md): a user mistake raises `ztrain::Error` with a message that names what
/// was wrong and what to do; a transport failure (an MPI error, a timeout, a dead peer) raises
/// `ztrain::CommError`, which also names the rank, the operation and the peer; a broken internal
/// invariant raises `ztrain::Error` through ZTRAIN_INTERNAL_ASSERT with the source location. The
/// library never calls exit() or abort(), and never throws from a destructor.
///
///   ZTRAIN_CHECK(level >= 0 && level <= 3, "zero_level must be 0..3, got ", level);

#include <c10/util/StringUtil.h>

#include <stdexcept>
#include <string>

namespace ztrain {

/// Base of every exception ztrain throws.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

/// A communication failed: an MPI call returned an error, a wait passed its deadline, or a peer
/// stopped answering. `rank` is the world rank that raised it; `peer` is the peer rank in the
/// communicator, or -1 for a collective (any member may be the culprit).
class CommError : public Error {
 public:
  CommError(const std::string& what, int rank, std::string op, int peer)
      : Error(what), rank_(rank), op_(std::move(op)), peer_(peer) {}
  int rank() const noexcept { return rank_; }
  const std::string& op() const noexcept { return op_; }
  int peer() const noexcept { return peer_; }

 private:
  int rank_;
  std::string op_;
  int peer_;
};

namespace detail {
[[noreturn]] void throw_check_failure(const char* cond, const std::string& msg);
[[noreturn]] void throw_internal_failure(const char* cond, const char* file, int line,
                                         const std::string& msg);
}  // namespace detail

}  // namespace ztrain

/// Raises ztrain::Error("<message>") when `cond` is false. Arguments are streamed together.
#define ZTRAIN_CHECK(cond, ...)                                                      \
  do {                                                                               \
    if (!(cond)) [[unlikely]] {                                                      \
      ::ztrain::detail::throw_check_failure(#cond, ::c10::str(__VA_ARGS__));         \
    }                                                                                \
  } while (0)

/// Raises ztrain::Error naming the source location: for ztrain's own invariants, never for user
/// input. Stays active in release builds.
#define ZTRAIN_INTERNAL_ASSERT(cond, ...)                                            \
  do {                                                                               \
    if (!(cond)) [[unlikely]] {                                                      \
      ::ztrain::detail::throw_internal_failure(#cond, __FILE__, __LINE__,            \
                                               ::c10::str(__VA_ARGS__));             \
    }                                                                                \
  } while (0)
