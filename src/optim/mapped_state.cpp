#include "mapped_state.h"

#include <ztrain/error.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <vector>

namespace ztrain::optim::detail {
namespace {

/// The page-aligned range of `t`'s memory (a mapping starts on a page).
std::pair<char*, size_t> mapped_pages(const torch::Tensor& t) {
  static const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr()) & ~(page - 1);
  const auto end = reinterpret_cast<uintptr_t>(t.data_ptr()) + t.nbytes();
  return {reinterpret_cast<char*>(begin), end - begin};
}

}  // namespace

torch::Tensor mapped_zeros(const std::string& dir, at::IntArrayRef sizes) {
  const int64_t numel = c10::multiply_integers(sizes);
  if (numel == 0) return torch::zeros(sizes, torch::kFloat32);
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  ZTRAIN_CHECK(!ec, "optimizer state_dir '", dir, "': cannot create it: ", ec.message());
  std::string path = (std::filesystem::path(dir) / "ztrain-optimizer-state-XXXXXX").string();
  std::vector<char> name(path.begin(), path.end());
  name.push_back('\0');
  const int fd = mkstemp(name.data());
  ZTRAIN_CHECK(fd >= 0, "optimizer state_dir '", dir, "': cannot create a file there: ", std::strerror(errno));
  unlink(name.data());  // the mapping keeps it; nothing is left behind
  const auto bytes = static_cast<size_t>(numel) * sizeof(float);
  const int reserved = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  if (reserved != 0) {
    close(fd);
    throw Error(c10::str("optimizer state_dir '", dir, "': cannot reserve ", bytes, " bytes for a state tensor: ",
                         std::strerror(reserved)));
  }
  void* addr = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int mapped_errno = errno;
  close(fd);
  ZTRAIN_CHECK(addr != MAP_FAILED, "optimizer state_dir '", dir, "': cannot map ", bytes, " bytes: ",
               std::strerror(mapped_errno));
  return torch::from_blob(
      addr, sizes, [bytes](void* p) { munmap(p, bytes); }, torch::TensorOptions().dtype(torch::kFloat32));
}

void read_ahead(const torch::Tensor& t) {
  if (!t.defined() || t.numel() == 0) return;
  const auto [begin, length] = mapped_pages(t);
  madvise(begin, length, MADV_WILLNEED);
}

void write_behind(const torch::Tensor& t) {
  if (!t.defined() || t.numel() == 0) return;
  const auto [begin, length] = mapped_pages(t);
  ZTRAIN_CHECK(msync(begin, length, MS_SYNC) == 0, "optimizer state_dir: writing state back failed: ",
               std::strerror(errno));
  madvise(begin, length, MADV_DONTNEED);  // a shared file mapping: the file keeps the values
}

}  // namespace ztrain::optim::detail
