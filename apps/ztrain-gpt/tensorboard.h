#pragma once
// TensorBoard event files: scalars, in the format TensorBoard reads (and tf.summary and
// torch.utils.tensorboard write): a file events.out.tfevents.<seconds>.<host>.<pid> of TFRecords,
// each a length, its masked CRC-32C, an Event protocol buffer and its masked CRC-32C.
//
//   TensorBoardWriter tb("runs/gpt/tb");
//   tb.scalar("loss", step, 2.31);          // flushed by flush() and on destruction
#include <cstdint>
#include <fstream>
#include <string>

namespace ztrain::gpt_app {

/// CRC-32C (Castagnoli) of `n` bytes, as TFRecord frames use it (unmasked).
uint32_t crc32c(const void* data, size_t n);

class TensorBoardWriter {
 public:
  /// Creates `dir` if needed and a new event file in it; throws ztrain::Error naming the path
  /// when it cannot be written.
  explicit TensorBoardWriter(const std::string& dir);
  /// One scalar (stored as float32, as TensorBoard's simple_value) of `tag` at `step`.
  void scalar(const std::string& tag, int64_t step, double value);
  void flush();
  const std::string& path() const { return path_; }

 private:
  void record(const std::string& event);
  std::string path_;
  std::ofstream out_;
};

}  // namespace ztrain::gpt_app
