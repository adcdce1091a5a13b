#pragma once
// Shared by the fuzz targets: where an input becomes a file, and the one outcome allowed
// besides success. A target's entry point is LLVMFuzzerTestOneInput; libFuzzer drives it in the
// fuzzing build (scripts/fuzz.sh), replay_main.cpp over the committed corpus in every build.

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

namespace ztrain::fuzz {

/// A directory of this process's own for input files.
inline const std::filesystem::path& scratch_dir() {
  static const auto dir = [] {
    auto d = std::filesystem::temp_directory_path() / ("ztrain-fuzz-" + std::to_string(::getpid()));
    std::filesystem::create_directories(d);
    return d;
  }();
  return dir;
}

/// Writes `size` bytes to `name` in scratch_dir() and returns its path.
inline std::string write_file(const std::string& name, const uint8_t* data, size_t size) {
  const auto path = (scratch_dir() / name).string();
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(reinterpret_cast<const char*>(data),
                                                                 static_cast<std::streamsize>(size));
  return path;
}

}  // namespace ztrain::fuzz

// Each target runs the reader and lets only ztrain::Error (a clear refusal naming the input) out
// of its try block: any other exception, a crash or a sanitizer report is a finding.
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
