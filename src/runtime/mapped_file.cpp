#include <ztrain/runtime/mapped_file.h>

#include <ztrain/error.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <vector>

namespace ztrain::detail {
namespace {

struct Mapping {
  void* addr;
  size_t bytes;
};

// The deleter of every mapped tensor's memory: also what is_mapped recognises it by.
void unmap(void* context) {
  auto* m = static_cast<Mapping*>(context);
  munmap(m->addr, m->bytes);
  delete m;
}

/// The page-aligned range of `t`'s memory (a mapping starts on a page).
std::pair<char*, size_t> mapped_pages(const torch::Tensor& t) {
  static const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr()) & ~(page - 1);
  const auto end = reinterpret_cast<uintptr_t>(t.data_ptr()) + t.nbytes();
  return {reinterpret_cast<char*>(begin), end - begin};
}

}  // namespace

torch::Tensor mapped_zeros(const std::string& dir, at::IntArrayRef sizes, c10::ScalarType dtype,
                           const std::string& what) {
  const auto options = torch::TensorOptions().dtype(dtype);
  const int64_t numel = c10::multiply_integers(sizes);
  if (numel == 0) return torch::zeros(sizes, options);
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  ZTRAIN_CHECK(!ec, what, " '", dir, "': cannot create it: ", ec.message());
  std::string path = (std::filesystem::path(dir) / "ztrain-offload-XXXXXX").string();
  std::vector<char> name(path.begin(), path.end());
  name.push_back('\0');
  const int fd = mkstemp(name.data());
  ZTRAIN_CHECK(fd >= 0, what, " '", dir, "': cannot create a file there: ", std::strerror(errno));
  unlink(name.data());  // the mapping keeps it; nothing is left behind
  const auto bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  const int reserved = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  if (reserved != 0) {
    close(fd);
    throw Error(c10::str(what, " '", dir, "': cannot reserve ", bytes, " bytes for a tensor: ", std::strerror(reserved)));
  }
  void* addr = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int mapped_errno = errno;
  close(fd);
  ZTRAIN_CHECK(addr != MAP_FAILED, what, " '", dir, "': cannot map ", bytes, " bytes: ", std::strerror(mapped_errno));
  c10::DataPtr data(addr, new Mapping{addr, bytes}, &unmap, c10::Device(c10::kCPU));
  c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, std::move(data), /*allocator=*/nullptr,
                       /*resizable=*/false);
  return torch::empty({0}, options).set_(storage, 0, sizes);
}

bool is_mapped(const torch::Tensor& t) {
  return t.defined() && t.has_storage() && t.numel() > 0 && t.storage().data_ptr().get_deleter() == &unmap;
}

void read_ahead(const torch::Tensor& t) {
  if (!is_mapped(t)) return;
  const auto [begin, length] = mapped_pages(t);
  madvise(begin, length, MADV_WILLNEED);
}

void write_behind(const torch::Tensor& t) {
  if (!is_mapped(t)) return;
  const auto [begin, length] = mapped_pages(t);
  ZTRAIN_CHECK(msync(begin, length, MS_SYNC) == 0, "writing a tensor back to its file failed: ", std::strerror(errno));
  madvise(begin, length, MADV_DONTNEED);  // a shared file mapping: the file keeps the values
}

}  // namespace ztrain::detail
