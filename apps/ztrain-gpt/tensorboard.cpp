#include "tensorboard.h"

#include <ztrain/error.h>

#include <unistd.h>

#include <array>
#include <chrono>
#include <cstring>
#include <filesystem>

// The few protocol buffer fields an Event needs are encoded by hand (tensorboard's event.proto):
//   Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
//   Summary { repeated Value value = 1; }   Value { string tag = 1; float simple_value = 2; }

namespace ztrain::gpt_app {

namespace {

std::array<uint32_t, 256> crc32c_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;  // the reflected polynomial
    t[i] = c;
  }
  return t;
}

uint32_t masked(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }

// Protocol buffer wire format: a key is (field << 3) | wire type.
void varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>(v | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
template <class T>
void fixed(std::string& out, int field, int wire_type, T v) {
  varint(out, static_cast<uint64_t>(field << 3 | wire_type));
  char bytes[sizeof(T)];
  std::memcpy(bytes, &v, sizeof(T));  // little-endian on the machines ztrain runs on
  out.append(bytes, sizeof(T));
}
void bytes_field(std::string& out, int field, const std::string& v) {
  varint(out, static_cast<uint64_t>(field << 3 | 2));
  varint(out, v.size());
  out += v;
}

std::string event_header(int64_t step) {
  std::string e;
  const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  fixed(e, 1, 1, now);
  varint(e, 2 << 3 | 0);
  varint(e, static_cast<uint64_t>(step));
  return e;
}

}  // namespace

uint32_t crc32c(const void* data, size_t n) {
  static const auto table = crc32c_table();
  uint32_t c = 0xFFFFFFFFu;
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(
                           std::chrono::system_clock::now().time_since_epoch()).count();
  path_ = c10::str(dir, "/events.out.tfevents.", seconds, ".", host, ".", ::getpid());
  out_.open(path_, std::ios::binary);
  ZTRAIN_CHECK(out_, "--tensorboard: cannot write '", path_, "'");
  std::string first = event_header(0);
  bytes_field(first, 3, "brain.Event:2");
  record(first);
}

void TensorBoardWriter::scalar(const std::string& tag, int64_t step, double value) {
  std::string v;
  bytes_field(v, 1, tag);
  fixed(v, 2, 5, static_cast<float>(value));
  std::string summary;
  bytes_field(summary, 1, v);
  std::string e = event_header(step);
  bytes_field(e, 5, summary);
  record(e);
}

void TensorBoardWriter::record(const std::string& event) {
  const uint64_t length = event.size();
  const uint32_t length_crc = masked(crc32c(&length, sizeof(length)));
  const uint32_t data_crc = masked(crc32c(event.data(), event.size()));
  out_.write(reinterpret_cast<const char*>(&length), sizeof(length));
  out_.write(reinterpret_cast<const char*>(&length_crc), sizeof(length_crc));
  out_.write(event.data(), static_cast<std::streamsize>(event.size()));
  out_.write(reinterpret_cast<const char*>(&data_crc), sizeof(data_crc));
  ZTRAIN_CHECK(out_, "--tensorboard: writing '", path_, "' failed");
}

void TensorBoardWriter::flush() {
  out_.flush();
  ZTRAIN_CHECK(out_, "--tensorboard: writing '", path_, "' failed");
}

}  // namespace ztrain::gpt_app
