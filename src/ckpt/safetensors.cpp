// How it works.
//
// Writer: the constructor computes the whole layout from the declared entries — each entry's
// bytes follow the previous one's, in the order given — and serialises the header (JSON padded
// with spaces so that 8 + N is a multiple of 8). It creates `<path>.tmp.<pid>`, holds an
// exclusive flock on it (a second writer of the same path in this process fails instead of
// clobbering it; a stale temporary left by a killed process is simply reused), writes the header
// and ftruncates the file to its final size, so that every entry's place exists and any number
// of writers — this one, or others opened with open_existing in other processes — can pwrite
// their ranges in any order. Each writer keeps, per entry, the disjoint element intervals it
// has written; commit() compares their total with the entry sizes, then fsync, rename, fsync
// of the directory. The flock is released only after the temporary is unlinked or renamed.
//
// Reader: the header is read and checked once (sizes, JSON, dtypes, offsets against shapes and
// against the data section, overlaps); tensors are then read with pread at their offsets, so a
// rank loading its shard reads only that shard's bytes.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <ztrain/ckpt/safetensors.h>
#include <ztrain/error.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <tuple>

namespace ztrain::ckpt {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; ztrain reads and writes it as raw host memory");

namespace {

using Json = nlohmann::ordered_json;

constexpr int64_t kHeaderAlign = 8;
// The reference implementation refuses larger headers; so does this one, rather than allocate
// whatever a corrupt length field asks for.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;
// Linux transfers at most 0x7ffff000 bytes per read/write call.
constexpr size_t kMaxIoChunk = size_t{1} << 30;

struct DtypeName {
  c10::ScalarType dtype;
  const char* name;
};
constexpr DtypeName kDtypes[] = {
    {c10::ScalarType::Double, "F64"},    {c10::ScalarType::Float, "F32"}, {c10::ScalarType::Half, "F16"},
    {c10::ScalarType::BFloat16, "BF16"}, {c10::ScalarType::Long, "I64"},  {c10::ScalarType::Int, "I32"},
    {c10::ScalarType::Short, "I16"},     {c10::ScalarType::Char, "I8"},   {c10::ScalarType::Byte, "U8"},
    {c10::ScalarType::Bool, "BOOL"},
};

std::string errno_text(int err) { return std::strerror(err); }

/// numel * itemsize of `shape`, or -1 when a dimension is negative or the product overflows.
int64_t checked_nbytes(const std::vector<int64_t>& shape, int64_t itemsize) {
  int64_t n = itemsize;
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(n, d, &n)) return -1;
  }
  return n;
}

void pwrite_all(int fd, const char* src, int64_t nbytes, int64_t offset, const std::string& file) {
  while (nbytes > 0) {
    const size_t chunk = std::min<size_t>(static_cast<size_t>(nbytes), kMaxIoChunk);
    const ssize_t n = ::pwrite(fd, src, chunk, offset);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw Error(c10::str("cannot write ", file, " at byte ", offset, ": ", errno_text(errno)));
    }
    src += n;
    nbytes -= n;
    offset += n;
  }
}

/// Reads exactly nbytes; returns false when the file ends first.
bool pread_all(int fd, char* dst, int64_t nbytes, int64_t offset, const std::string& file) {
  while (nbytes > 0) {
    const size_t chunk = std::min<size_t>(static_cast<size_t>(nbytes), kMaxIoChunk);
    const ssize_t n = ::pread(fd, dst, chunk, offset);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw Error(c10::str("cannot read ", file, " at byte ", offset, ": ", errno_text(errno)));
    }
    if (n == 0) return false;
    dst += n;
    nbytes -= n;
    offset += n;
  }
  return true;
}

std::string parent_directory(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

std::string shape_text(const std::vector<int64_t>& shape) { return c10::str(c10::IntArrayRef(shape)); }

/// A non-negative JSON integer that fits int64, or nullopt.
std::optional<int64_t> json_index(const Json& v) {
  if (v.is_number_unsigned()) {
    const auto u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
    return static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) {
    const auto i = v.get<int64_t>();
    if (i < 0) return std::nullopt;
    return i;
  }
  return std::nullopt;
}

}  // namespace

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string safetensors_dtype_name(c10::ScalarType dtype) {
  for (const auto& d : kDtypes) {
    if (d.dtype == dtype) return d.name;
  }
  throw Error(c10::str("safetensors cannot hold dtype ", dtype,
                       "; it holds F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL (convert the tensor first)"));
}

c10::ScalarType safetensors_dtype(const std::string& name) {
  for (const auto& d : kDtypes) {
    if (name == d.name) return d.dtype;
  }
  throw Error(
      c10::str("unknown safetensors dtype \"", name, "\"; ztrain reads F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL"));
}

// ---- SafetensorsWriter ---------------------------------------------------------------------

SafetensorsWriter::SafetensorsWriter(std::string path, std::vector<TensorSpec> entries, Metadata metadata)
    : path_(std::move(path)), metadata_(std::move(metadata)), owner_(true) {
  ZTRAIN_CHECK(!path_.empty(), "SafetensorsWriter: the path is empty");
  temp_path_ = c10::str(path_, ".tmp.", ::getpid());
  lay_out(std::move(entries));

  fd_ = ::open(temp_path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666);
  if (fd_ < 0) {
    throw Error(c10::str("cannot create the temporary file ", temp_path_, " to write ", path_, ": ", errno_text(errno),
                         " (does the directory exist and is it writable?)"));
  }
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK) {
    ::close(fd_);
    fd_ = -1;
    owner_ = false;  // the file is the other writer's: leave it
    throw Error(c10::str("another SafetensorsWriter of this process is writing ", path_, " (", temp_path_,
                         " is locked); commit or destroy it first"));
  }
  // Other flock failures (a file system without locks) only lose the guard above.
  try {
    if (::ftruncate(fd_, 0) != 0) {
      throw Error(c10::str("cannot truncate ", temp_path_, ": ", errno_text(errno)));
    }
    pwrite_all(fd_, header_.data(), static_cast<int64_t>(header_.size()), 0, temp_path_);
    if (::ftruncate(fd_, file_size_) != 0) {
      throw Error(
          c10::str("cannot size ", temp_path_, " to ", file_size_, " bytes for ", path_, ": ", errno_text(errno)));
    }
  } catch (...) {
    remove_temp();
    throw;
  }
}

SafetensorsWriter::SafetensorsWriter(OpenExisting, std::string temp_path, std::vector<TensorSpec> entries,
                                     Metadata metadata)
    : temp_path_(std::move(temp_path)), metadata_(std::move(metadata)), owner_(false) {
  lay_out(std::move(entries));
  fd_ = ::open(temp_path_.c_str(), O_RDWR | O_CLOEXEC);
  if (fd_ < 0) {
    throw Error(c10::str("SafetensorsWriter::open_existing: cannot open ", temp_path_, ": ", errno_text(errno),
                         " (it must be the temp_path() of a live SafetensorsWriter)"));
  }
  struct stat st {};
  std::string on_disk(header_.size(), '\0');
  const bool same = ::fstat(fd_, &st) == 0 && st.st_size == file_size_ &&
                    pread_all(fd_, on_disk.data(), static_cast<int64_t>(on_disk.size()), 0, temp_path_) &&
                    on_disk == header_;
  if (!same) {
    ::close(fd_);
    fd_ = -1;
    throw Error(c10::str("SafetensorsWriter::open_existing: ", temp_path_,
                         " does not hold the header of the entries and metadata given; pass exactly the "
                         "creator's entries (same order) and metadata"));
  }
}

SafetensorsWriter SafetensorsWriter::open_existing(std::string temp_path, std::vector<TensorSpec> entries,
                                                   Metadata metadata) {
  return SafetensorsWriter(OpenExisting{}, std::move(temp_path), std::move(entries), std::move(metadata));
}

SafetensorsWriter::SafetensorsWriter(SafetensorsWriter&& o) noexcept
    : path_(std::move(o.path_)),
      temp_path_(std::move(o.temp_path_)),
      metadata_(std::move(o.metadata_)),
      entries_(std::move(o.entries_)),
      index_(std::move(o.index_)),
      header_(std::move(o.header_)),
      data_offset_(o.data_offset_),
      file_size_(o.file_size_),
      written_(std::move(o.written_)),
      fd_(std::exchange(o.fd_, -1)),
      owner_(std::exchange(o.owner_, false)),
      committed_(o.committed_) {}

SafetensorsWriter::~SafetensorsWriter() { remove_temp(); }

void SafetensorsWriter::remove_temp() noexcept {
  // Unlink before closing: the flock keeps another writer of this path from taking the name
  // in between.
  if (owner_ && !committed_) ::unlink(temp_path_.c_str());
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void SafetensorsWriter::lay_out(std::vector<TensorSpec> specs) {
  const std::string& file = path_.empty() ? temp_path_ : path_;
  Json header = Json::object();
  if (!metadata_.empty()) {
    Json meta = Json::object();
    for (const auto& [k, v] : metadata_) meta[k] = v;
    header["__metadata__"] = std::move(meta);
  }
  int64_t offset = 0;
  entries_.reserve(specs.size());
  for (auto& s : specs) {
    ZTRAIN_CHECK(!s.name.empty(), "safetensors writer for ", file, ": an entry has an empty name");
    ZTRAIN_CHECK(s.name != "__metadata__", "safetensors writer for ", file,
                 ": \"__metadata__\" is reserved and cannot name a tensor");
    ZTRAIN_CHECK(index_.emplace(s.name, entries_.size()).second, "safetensors writer for ", file, ": entry '", s.name,
                 "' is declared twice");
    const std::string dtype_name = safetensors_dtype_name(s.dtype);
    const int64_t nbytes = checked_nbytes(s.shape, static_cast<int64_t>(c10::elementSize(s.dtype)));
    ZTRAIN_CHECK(nbytes >= 0, "safetensors writer for ", file, ": entry '", s.name, "' has shape ", shape_text(s.shape),
                 " (a negative dimension, or too large)");
    ZTRAIN_CHECK(!__builtin_add_overflow(offset, nbytes, &offset), "safetensors writer for ", file,
                 ": the entries are too large for one file");
    header[s.name] = {{"dtype", dtype_name}, {"shape", s.shape}, {"data_offsets", {offset - nbytes, offset}}};
    entries_.push_back({std::move(s.name), s.dtype, std::move(s.shape), offset - nbytes, offset});
  }
  written_.assign(entries_.size(), {});

  const std::string json = header.dump();
  const int64_t padded = (8 + static_cast<int64_t>(json.size()) + kHeaderAlign - 1) / kHeaderAlign * kHeaderAlign;
  const uint64_t n = static_cast<uint64_t>(padded - 8);
  header_.assign(8, '\0');
  std::memcpy(header_.data(), &n, 8);
  header_ += json;
  header_.resize(static_cast<size_t>(padded), ' ');
  data_offset_ = padded;
  file_size_ = padded + offset;
}

size_t SafetensorsWriter::index_of(const std::string& name) const {
  auto it = index_.find(name);
  ZTRAIN_CHECK(it != index_.end(), "safetensors writer for ", path_.empty() ? temp_path_ : path_, ": no entry named '",
               name, "' was declared");
  return it->second;
}

void SafetensorsWriter::check_writable(const char* op) const {
  const std::string& file = path_.empty() ? temp_path_ : path_;
  ZTRAIN_CHECK(!committed_, "safetensors writer for ", file, ": ", op, " after commit()");
  ZTRAIN_CHECK(fd_ >= 0, "safetensors writer for ", file, ": ", op, " on a writer that was moved from");
}

void SafetensorsWriter::write(const std::string& name, const torch::Tensor& tensor) {
  check_writable("write");
  const size_t i = index_of(name);
  const auto& e = entries_[i];
  const std::string& file = path_.empty() ? temp_path_ : path_;
  ZTRAIN_CHECK(tensor.defined(), "safetensors writer for ", file, ": tensor '", name, "' is undefined");
  ZTRAIN_CHECK(tensor.scalar_type() == e.dtype, "safetensors writer for ", file, ": tensor '", name, "' has dtype ",
               tensor.scalar_type(), " but the entry was declared ", e.dtype);
  ZTRAIN_CHECK(tensor.sizes() == c10::IntArrayRef(e.shape), "safetensors writer for ", file, ": tensor '", name,
               "' has shape ", tensor.sizes(), " but the entry was declared ", shape_text(e.shape));
  write_bytes(i, 0, tensor);
}

void SafetensorsWriter::write_range(const std::string& name, int64_t element_begin, const torch::Tensor& piece) {
  check_writable("write_range");
  const size_t i = index_of(name);
  const auto& e = entries_[i];
  const std::string& file = path_.empty() ? temp_path_ : path_;
  ZTRAIN_CHECK(piece.defined(), "safetensors writer for ", file, ": the piece of '", name, "' is undefined");
  ZTRAIN_CHECK(piece.scalar_type() == e.dtype, "safetensors writer for ", file, ": the piece of '", name,
               "' has dtype ", piece.scalar_type(), " but the entry was declared ", e.dtype);
  ZTRAIN_CHECK(element_begin >= 0 && element_begin <= e.numel() && piece.numel() <= e.numel() - element_begin,
               "safetensors writer for ", file, ": elements [", element_begin, ", ", element_begin + piece.numel(),
               ") are outside entry '", name, "' of ", e.numel(), " elements");
  write_bytes(i, element_begin, piece);
}

void SafetensorsWriter::write_bytes(size_t entry, int64_t element_begin, const torch::Tensor& piece) {
  const auto& e = entries_[entry];
  const int64_t n = piece.numel();
  if (n == 0) return;
  const int64_t end = element_begin + n;
  auto& done = written_[entry];
  // The first interval starting after element_begin, and the one before it.
  auto next = done.upper_bound(element_begin);
  const bool overlaps_prev = next != done.begin() && std::prev(next)->second > element_begin;
  const bool overlaps_next = next != done.end() && next->first < end;
  if (overlaps_prev || overlaps_next) {
    const auto& hit = overlaps_prev ? *std::prev(next) : *next;
    throw Error(c10::str("safetensors writer for ", path_.empty() ? temp_path_ : path_, ": elements [", element_begin,
                         ", ", end, ") of '", e.name, "' overlap elements [", hit.first, ", ", hit.second,
                         ") written before; write each element once"));
  }

  const torch::Tensor src = piece.to(torch::kCPU).contiguous();
  const int64_t itemsize = static_cast<int64_t>(c10::elementSize(e.dtype));
  pwrite_all(fd_, static_cast<const char*>(src.data_ptr()), n * itemsize,
             data_offset_ + e.data_begin + element_begin * itemsize, temp_path_);

  // Record [element_begin, end), merged with the intervals it touches.
  int64_t lo = element_begin, hi = end;
  if (next != done.begin() && std::prev(next)->second == lo) {
    lo = std::prev(next)->first;
    done.erase(std::prev(next));
  }
  if (next != done.end() && next->first == hi) {
    hi = next->second;
    done.erase(next);
  }
  done.emplace(lo, hi);
}

std::vector<int64_t> SafetensorsWriter::written_numel() const {
  std::vector<int64_t> out(entries_.size(), 0);
  for (size_t i = 0; i < entries_.size(); ++i) {
    for (const auto& [b, e] : written_[i]) out[i] += e - b;
  }
  return out;
}

void SafetensorsWriter::flush() {
  check_writable("flush");
  if (::fsync(fd_) != 0) throw Error(c10::str("cannot fsync ", temp_path_, ": ", errno_text(errno)));
}

void SafetensorsWriter::commit() { commit(written_numel()); }

void SafetensorsWriter::commit(const std::vector<int64_t>& written_numel) {
  check_writable("commit");
  ZTRAIN_CHECK(owner_, "safetensors writer for ", temp_path_,
               ": a writer made by open_existing cannot commit; flush() it and let the creator commit");
  ZTRAIN_CHECK(written_numel.size() == entries_.size(), "safetensors writer for ", path_, ": commit got ",
               written_numel.size(), " written counts for ", entries_.size(), " entries");
  std::string missing, excess;
  size_t n_missing = 0;
  for (size_t i = 0; i < entries_.size(); ++i) {
    const auto& e = entries_[i];
    if (written_numel[i] < e.numel()) {
      if (n_missing++ < 20)
        missing += c10::str(missing.empty() ? "" : ", ", "'", e.name, "' (", written_numel[i], " of ", e.numel(),
                            " elements)");
    } else if (written_numel[i] > e.numel()) {
      excess +=
          c10::str(excess.empty() ? "" : ", ", "'", e.name, "' (", written_numel[i], " of ", e.numel(), " elements)");
    }
  }
  if (n_missing > 20) missing += c10::str(" and ", n_missing - 20, " more");
  ZTRAIN_CHECK(excess.empty(), "safetensors writer for ", path_,
               ": more elements were written than the entries hold, so ranges overlapped: ", excess);
  ZTRAIN_CHECK(missing.empty(), "safetensors writer for ", path_, ": cannot commit, ", n_missing,
               " entries are not fully written: ", missing, "; ", path_, " was left untouched");

  if (::fsync(fd_) != 0) throw Error(c10::str("cannot fsync ", temp_path_, ": ", errno_text(errno)));
  if (::rename(temp_path_.c_str(), path_.c_str()) != 0) {
    throw Error(c10::str("cannot rename ", temp_path_, " to ", path_, ": ", errno_text(errno)));
  }
  committed_ = true;
  ::close(fd_);
  fd_ = -1;
  const std::string dir = parent_directory(path_);
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  const bool synced = dfd >= 0 && ::fsync(dfd) == 0;
  const int err = errno;
  if (dfd >= 0) ::close(dfd);
  if (!synced) {
    throw Error(c10::str("wrote ", path_, " but could not fsync its directory ", dir, ": ", errno_text(err),
                         "; the file may not survive a crash"));
  }
}

// ---- SafetensorsReader ---------------------------------------------------------------------

SafetensorsReader::SafetensorsReader(std::string path) : path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) {
    if (errno == ENOENT) throw Error(c10::str("safetensors file ", path_, " does not exist"));
    throw Error(c10::str("cannot open safetensors file ", path_, ": ", errno_text(errno)));
  }
  try {
    parse_header();
  } catch (...) {
    ::close(fd_);
    fd_ = -1;
    throw;
  }
}

SafetensorsReader::SafetensorsReader(SafetensorsReader&& o) noexcept
    : path_(std::move(o.path_)),
      fd_(std::exchange(o.fd_, -1)),
      file_size_(o.file_size_),
      data_offset_(o.data_offset_),
      entries_(std::move(o.entries_)),
      index_(std::move(o.index_)),
      metadata_(std::move(o.metadata_)) {}

SafetensorsReader::~SafetensorsReader() {
  if (fd_ >= 0) ::close(fd_);
}

void SafetensorsReader::parse_header() {
  const std::string where = c10::str("safetensors file ", path_, ": ");
  struct stat st {};
  if (::fstat(fd_, &st) != 0) throw Error(c10::str(where, "cannot stat: ", errno_text(errno)));
  if (!S_ISREG(st.st_mode)) throw Error(c10::str(where, "not a regular file"));
  file_size_ = st.st_size;
  if (file_size_ < 8) {
    throw Error(c10::str(where, "truncated: ", file_size_, " bytes, shorter than the 8-byte header length"));
  }
  uint64_t n = 0;
  if (!pread_all(fd_, reinterpret_cast<char*>(&n), 8, 0, path_)) {
    throw Error(c10::str(where, "truncated while reading the header length"));
  }
  if (n > static_cast<uint64_t>(file_size_ - 8)) {
    throw Error(c10::str(where, "the header length ", n, " runs past the end of the file (", file_size_,
                         " bytes): the file is truncated or not safetensors"));
  }
  if (n > kMaxHeaderBytes) {
    throw Error(c10::str(where, "the header length ", n, " is over the format's limit of ", kMaxHeaderBytes,
                         " bytes: the file is corrupt or not safetensors"));
  }
  std::string text(n, '\0');
  if (!pread_all(fd_, text.data(), static_cast<int64_t>(n), 8, path_)) {
    throw Error(c10::str(where, "truncated while reading the header"));
  }
  data_offset_ = 8 + static_cast<int64_t>(n);
  const int64_t data_size = file_size_ - data_offset_;

  Json header;
  try {
    header = Json::parse(text);
  } catch (const Json::exception& e) {
    throw Error(c10::str(where, "the header is not valid JSON (", e.what(), ")"));
  }
  if (!header.is_object()) throw Error(c10::str(where, "the header is not a JSON object"));

  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      if (value.is_null()) continue;
      if (!value.is_object()) throw Error(c10::str(where, "\"__metadata__\" is not an object"));
      for (const auto& [k, v] : value.items()) {
        if (!v.is_string()) {
          throw Error(c10::str(where, "metadata value of \"", k, "\" is not a string: ", v.dump()));
        }
        metadata_[k] = v.get<std::string>();
      }
      continue;
    }
    const std::string bad = c10::str(where, "tensor '", name, "': ");
    if (!value.is_object()) throw Error(c10::str(bad, "its entry is not a JSON object"));
    if (!value.contains("dtype") || !value["dtype"].is_string()) {
      throw Error(c10::str(bad, "\"dtype\" is missing or not a string"));
    }
    const auto dtype_name = value["dtype"].get<std::string>();
    c10::ScalarType dtype;
    try {
      dtype = safetensors_dtype(dtype_name);
    } catch (const Error& e) {
      throw Error(c10::str(bad, e.what()));
    }
    if (!value.contains("shape") || !value["shape"].is_array()) {
      throw Error(c10::str(bad, "\"shape\" is missing or not an array"));
    }
    std::vector<int64_t> shape;
    for (const auto& d : value["shape"]) {
      auto v = json_index(d);
      if (!v) throw Error(c10::str(bad, "\"shape\" ", value["shape"].dump(), " holds a non-integer or negative"));
      shape.push_back(*v);
    }
    const auto& offsets = value.contains("data_offsets") ? value["data_offsets"] : Json();
    std::optional<int64_t> begin, end;
    if (offsets.is_array() && offsets.size() == 2) {
      begin = json_index(offsets[0]);
      end = json_index(offsets[1]);
    }
    if (!begin || !end || *begin > *end) {
      throw Error(c10::str(bad, "\"data_offsets\" must be [begin, end] with 0 <= begin <= end, got ", offsets.dump()));
    }
    const int64_t nbytes = checked_nbytes(shape, static_cast<int64_t>(c10::elementSize(dtype)));
    if (nbytes != *end - *begin) {
      throw Error(c10::str(bad, "data_offsets [", *begin, ", ", *end, "] hold ", *end - *begin, " bytes but shape ",
                           shape_text(shape), " of ", dtype_name, " needs ",
                           nbytes < 0 ? std::string("more than 2^63") : c10::str(nbytes)));
    }
    if (*end > data_size) {
      throw Error(c10::str(bad, "data_offsets [", *begin, ", ", *end, "] run past the end of the data section (",
                           data_size, " bytes): the file is truncated"));
    }
    entries_.push_back({name, dtype, std::move(shape), *begin, *end});
  }

  // Data-offset order; ties (empty tensors) keep the header's order.
  std::stable_sort(entries_.begin(), entries_.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return std::tie(a.data_begin, a.data_end) < std::tie(b.data_begin, b.data_end);
  });
  const TensorInfo* last = nullptr;  // the non-empty tensor that ends last so far
  for (size_t i = 0; i < entries_.size(); ++i) {
    const auto& e = entries_[i];
    if (e.data_end == e.data_begin) continue;
    if (last != nullptr && e.data_begin < last->data_end) {
      throw Error(c10::str(where, "tensors '", last->name, "' [", last->data_begin, ", ", last->data_end, ") and '",
                           e.name, "' [", e.data_begin, ", ", e.data_end, ") overlap"));
    }
    last = &e;
  }
  for (size_t i = 0; i < entries_.size(); ++i) index_.emplace(entries_[i].name, i);
}

const TensorInfo& SafetensorsReader::info(const std::string& name) const {
  auto it = index_.find(name);
  ZTRAIN_CHECK(it != index_.end(), "safetensors file ", path_, " has no tensor named '", name, "'");
  return entries_[it->second];
}

void SafetensorsReader::read_bytes(const TensorInfo& e, int64_t element_begin, int64_t element_count, void* dst) const {
  ZTRAIN_CHECK(element_begin >= 0 && element_count >= 0 && element_begin <= e.numel() &&
                   element_count <= e.numel() - element_begin,
               "safetensors file ", path_, ": elements [", element_begin, ", ", element_begin + element_count,
               ") are outside tensor '", e.name, "' of ", e.numel(), " elements");
  if (element_count == 0) return;
  const int64_t itemsize = static_cast<int64_t>(c10::elementSize(e.dtype));
  char* p = static_cast<char*>(dst);
  if (!pread_all(fd_, p, element_count * itemsize, data_offset_ + e.data_begin + element_begin * itemsize, path_)) {
    throw Error(c10::str("safetensors file ", path_, ": tensor '", e.name,
                         "' is cut short (the file shrank after it was opened)"));
  }
  if (e.dtype == c10::ScalarType::Bool) {
    const char* bad = std::find_if(p, p + element_count, [](char c) { return c != 0 && c != 1; });
    ZTRAIN_CHECK(bad == p + element_count, "safetensors file ", path_, ": BOOL tensor '", e.name, "' holds byte ",
                 static_cast<int>(static_cast<unsigned char>(*bad)), " at element ", element_begin + (bad - p),
                 " (only 0 and 1 are booleans): the file is corrupt");
  }
}

torch::Tensor SafetensorsReader::read(const std::string& name) const {
  const auto& e = info(name);
  auto out = torch::empty(e.shape, torch::TensorOptions().dtype(e.dtype));
  read_bytes(e, 0, e.numel(), out.data_ptr());
  return out;
}

torch::Tensor SafetensorsReader::read_range(const std::string& name, int64_t element_begin,
                                            int64_t element_count) const {
  const auto& e = info(name);
  ZTRAIN_CHECK(element_count >= 0, "safetensors file ", path_, ": read_range of '", name, "' with a negative count ",
               element_count);
  auto out = torch::empty({element_count}, torch::TensorOptions().dtype(e.dtype));
  read_bytes(e, element_begin, element_count, out.data_ptr());
  return out;
}

void SafetensorsReader::read_into(const std::string& name, int64_t element_begin, torch::Tensor out) const {
  const auto& e = info(name);
  ZTRAIN_CHECK(out.defined(), "safetensors file ", path_, ": read_into of '", name, "' into an undefined tensor");
  ZTRAIN_CHECK(out.scalar_type() == e.dtype, "safetensors file ", path_, ": tensor '", name, "' is ", e.dtype,
               " but read_into was given a ", out.scalar_type(), " tensor");
  if (out.is_contiguous() && out.device().is_cpu()) {
    read_bytes(e, element_begin, out.numel(), out.data_ptr());
  } else {
    out.copy_(read_range(name, element_begin, out.numel()).view(out.sizes()));
  }
}

// ---- convenience ---------------------------------------------------------------------------

void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                      const Metadata& metadata) {
  std::vector<TensorSpec> specs;
  specs.reserve(tensors.size());
  for (const auto& [name, t] : tensors) {
    ZTRAIN_CHECK(t.defined(), "save_safetensors ", path, ": tensor '", name, "' is undefined");
    specs.push_back({name, t.scalar_type(), t.sizes().vec()});
  }
  SafetensorsWriter writer(path, std::move(specs), metadata);
  for (const auto& [name, t] : tensors) writer.write(name, t);
  writer.commit();
}

std::vector<std::pair<std::string, torch::Tensor>> load_safetensors(const std::string& path) {
  SafetensorsReader reader(path);
  std::vector<std::pair<std::string, torch::Tensor>> out;
  out.reserve(reader.entries().size());
  for (const auto& e : reader.entries()) out.emplace_back(e.name, reader.read(e.name));
  return out;
}

}  // namespace ztrain::ckpt
