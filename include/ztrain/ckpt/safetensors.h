#pragma once
/// The safetensors tensor file format (https://github.com/huggingface/safetensors).
///
/// A file is an 8-byte little-endian u64 N, then N bytes of UTF-8 JSON, then the data section:
///
///   {"__metadata__": {"k": "v"},
///    "fc.weight": {"dtype": "F32", "shape": [4, 3], "data_offsets": [0, 48]}, ...}
///
/// data_offsets are [begin, end) in bytes from the start of the data section; the data is raw,
/// row-major and little-endian. The writer pads the header with spaces so that the data section
/// starts on an 8-byte boundary, and packs the tensors back to back in the order it is given
/// them, so a model can be written one block at a time and a file loads in Hugging Face's
/// reader. dtypes: F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL.
///
/// No communication: nothing here needs init_distributed. Files are read and written with
/// pread/pwrite, so a reader reads only the bytes asked for (one rank's shard of a parameter),
/// and several processes can fill one file (see SafetensorsWriter::open_existing).
///
///   ztrain::ckpt::save_safetensors("model.safetensors", {{"fc.weight", w}, {"fc.bias", b}});
///   ztrain::ckpt::SafetensorsReader reader("model.safetensors");
///   auto w2 = reader.read("fc.weight");
///   auto piece = reader.read_range("fc.weight", 4, 8);   // flat elements [4, 12)

#include <torch/types.h>

#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace ztrain::ckpt {

/// The "__metadata__" of a file: string keys to string values.
using Metadata = std::map<std::string, std::string>;

/// A tensor to be written: its name, dtype and shape, known before any data is.
struct TensorSpec {
  std::string name;
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<int64_t> shape;
};

/// One tensor of a file. data_begin and data_end are bytes from the start of the data section.
struct TensorInfo {
  std::string name;
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<int64_t> shape;
  int64_t data_begin = 0;
  int64_t data_end = 0;
  /// Elements: the product of shape (1 for a scalar, shape []).
  int64_t numel() const;
};

/// The safetensors name of a dtype ("F32" for kFloat32); throws ztrain::Error for a dtype the
/// format has no name for (complex, quantized).
std::string safetensors_dtype_name(c10::ScalarType dtype);
/// The dtype of a safetensors name; throws ztrain::Error naming an unknown one.
c10::ScalarType safetensors_dtype(const std::string& name);

/// Writes one safetensors file whose entries are all declared up front.
///
/// The constructor lays the file out (header, then each entry's bytes, in the order given),
/// creates the temporary file `<path>.tmp.<pid>` next to `path`, writes the header and sizes the
/// file to its final length. write() and write_range() then fill entries in any order, each
/// element exactly once. commit() checks that every entry was filled, fsyncs, renames the
/// temporary onto `path` (atomic: a reader of `path` sees the previous file or the new one,
/// never a mix) and fsyncs the directory. A writer destroyed before commit() removes the
/// temporary and leaves `path` untouched; it never throws.
///
/// Several processes filling one file (a gathered checkpoint written from the shards):
///   - one process (rank 0) constructs the writer — it owns the temporary file and commits it;
///   - it sends temp_path() to the others, which each call open_existing(temp_path, same
///     entries, same metadata) and write their disjoint ranges, then flush();
///   - the counts written_numel() are summed over every process (the owner included) and the
///     owner calls commit(sum) once all the others have flushed.
/// Ranges written by different processes must not overlap: the per-entry sums then equal each
/// entry's numel exactly when every element was written.
///
/// Not thread-safe: one thread per writer object.
///
///   ztrain::ckpt::SafetensorsWriter w("model.safetensors",
///                                     {{"fc.weight", torch::kFloat32, {4, 3}},
///                                      {"fc.bias", torch::kFloat32, {4}}},
///                                     {{"format", "pt"}});
///   w.write("fc.bias", bias);
///   w.write_range("fc.weight", 0, weight_rows_0_1.reshape(-1));   // elements [0, 6)
///   w.write_range("fc.weight", 6, weight_rows_2_3.reshape(-1));   // elements [6, 12)
///   w.commit();
class SafetensorsWriter {
 public:
  /// Creates the temporary file for `path`. Throws ztrain::Error on an empty or repeated name,
  /// the reserved name "__metadata__", a negative dimension, a dtype the format cannot hold, or
  /// when the temporary cannot be created (a directory that does not exist, no permission, or
  /// another writer of this process writing the same path).
  SafetensorsWriter(std::string path, std::vector<TensorSpec> entries, Metadata metadata = {});

  /// Opens the temporary file another SafetensorsWriter created (its temp_path()) to write
  /// part of its entries. `entries` and `metadata` must be the creator's: the header on disk is
  /// checked against them. This writer cannot commit(); flush() its writes before the creator
  /// commits. Destroying it leaves the file in place.
  static SafetensorsWriter open_existing(std::string temp_path, std::vector<TensorSpec> entries,
                                         Metadata metadata = {});

  SafetensorsWriter(SafetensorsWriter&& other) noexcept;
  SafetensorsWriter& operator=(SafetensorsWriter&&) = delete;
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;
  ~SafetensorsWriter();

  /// Writes the whole of entry `name`. `tensor` must have the entry's dtype and shape (any
  /// strides; it is copied to a contiguous buffer when it is not contiguous). No element of the
  /// entry may have been written before.
  void write(const std::string& name, const torch::Tensor& tensor);

  /// Writes the entry's row-major elements [element_begin, element_begin + piece.numel()) from
  /// `piece` (any shape: its elements in row-major order), which must have the entry's dtype.
  /// Throws when the range runs past the entry or overlaps a range this writer wrote before.
  void write_range(const std::string& name, int64_t element_begin, const torch::Tensor& piece);

  /// fsyncs what this writer has written.
  void flush();

  /// Checks that every element of every entry was written by this writer, then publishes the
  /// file at path(). Throws ztrain::Error naming the incomplete entries, leaving the temporary
  /// in place (write the rest and commit again) and `path` untouched.
  void commit();
  /// commit() for a file filled by several processes: `written_numel` holds, per entry in
  /// entries() order, the elements written by all the processes together (the sum of their
  /// written_numel()). Only the writer that created the file commits.
  void commit(const std::vector<int64_t>& written_numel);

  /// Elements this writer has written, per entry in entries() order.
  std::vector<int64_t> written_numel() const;

  /// The final path ("" for a writer made by open_existing) and the temporary one.
  const std::string& path() const { return path_; }
  const std::string& temp_path() const { return temp_path_; }
  /// The entries in the order given, which is also their order in the data section.
  const std::vector<TensorInfo>& entries() const { return entries_; }
  const Metadata& metadata() const { return metadata_; }
  /// Byte offset of the data section in the file (a multiple of 8).
  int64_t data_offset() const { return data_offset_; }
  bool committed() const { return committed_; }

 private:
  struct OpenExisting {};
  SafetensorsWriter(OpenExisting, std::string temp_path, std::vector<TensorSpec> entries, Metadata metadata);
  void lay_out(std::vector<TensorSpec> specs);
  size_t index_of(const std::string& name) const;
  void check_writable(const char* op) const;
  void write_bytes(size_t entry, int64_t element_begin, const torch::Tensor& piece);
  void remove_temp() noexcept;

  std::string path_;
  std::string temp_path_;
  Metadata metadata_;
  std::vector<TensorInfo> entries_;
  std::unordered_map<std::string, size_t> index_;
  std::string header_;  // the 8-byte length and the padded JSON
  int64_t data_offset_ = 0;
  int64_t file_size_ = 0;
  // Per entry, the disjoint element ranges written so far: begin -> end.
  std::vector<std::map<int64_t, int64_t>> written_;
  int fd_ = -1;
  bool owner_ = false;
  bool committed_ = false;
};

/// Reads a safetensors file. The constructor reads and validates the header; tensors are read
/// on request with pread, only the bytes asked for.
///
/// Every problem with the file — missing, truncated, a header length past the end, bad JSON,
/// an unknown dtype, offsets that overlap, run past the data or disagree with the shape — raises
/// ztrain::Error naming the file and what is wrong.
///
/// const methods may be called from several threads at once.
///
///   ztrain::ckpt::SafetensorsReader reader("model.safetensors");
///   for (const auto& e : reader.entries()) std::cout << e.name << " " << e.numel() << "\n";
///   auto shard = reader.read_range("fc.weight", rank * 6, 6);
class SafetensorsReader {
 public:
  explicit SafetensorsReader(std::string path);
  SafetensorsReader(SafetensorsReader&& other) noexcept;
  SafetensorsReader& operator=(SafetensorsReader&&) = delete;
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;
  ~SafetensorsReader();

  const std::string& path() const { return path_; }
  /// The tensors in data-offset order.
  const std::vector<TensorInfo>& entries() const { return entries_; }
  bool contains(const std::string& name) const { return index_.count(name) != 0; }
  /// Throws ztrain::Error naming the tensor and the file when it is absent.
  const TensorInfo& info(const std::string& name) const;
  const Metadata& metadata() const { return metadata_; }
  /// Byte offset of the data section in the file.
  int64_t data_offset() const { return data_offset_; }

  /// The whole tensor: CPU, contiguous, with the file's dtype and shape.
  torch::Tensor read(const std::string& name) const;
  /// Row-major elements [element_begin, element_begin + element_count) of the tensor, as a 1-D
  /// tensor. Reads only those bytes.
  torch::Tensor read_range(const std::string& name, int64_t element_begin, int64_t element_count) const;
  /// Reads out.numel() elements from element_begin into `out` (row-major), which must have the
  /// tensor's dtype; any shape and strides.
  void read_into(const std::string& name, int64_t element_begin, torch::Tensor out) const;

 private:
  void parse_header();
  void read_bytes(const TensorInfo& info, int64_t element_begin, int64_t element_count, void* dst) const;

  std::string path_;
  int fd_ = -1;
  int64_t file_size_ = 0;
  int64_t data_offset_ = 0;
  std::vector<TensorInfo> entries_;
  std::unordered_map<std::string, size_t> index_;
  Metadata metadata_;
};

/// Writes `tensors` to `path` in the given order, atomically (SafetensorsWriter).
void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                      const Metadata& metadata = {});

/// Every tensor of the file, in data-offset order (for a file save_safetensors wrote, the order
/// it was given).
std::vector<std::pair<std::string, torch::Tensor>> load_safetensors(const std::string& path);

}  // namespace ztrain::ckpt
