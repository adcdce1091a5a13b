#include <ztrain/error.h>

namespace ztrain::detail {

void throw_check_failure(const char* cond, const std::string& msg) {
  throw Error(msg.empty() ? std::string("ztrain: check failed: ") + cond : msg);
}

void throw_internal_failure(const char* cond, const char* file, int line, const std::string& msg) {
  throw Error(c10::str("ztrain internal error at ", file, ":", line, ": ", cond, " failed",
                       msg.empty() ? "" : ": ", msg, " (please report this)"));
}

}  // namespace ztrain::detail
