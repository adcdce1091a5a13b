#pragma once
// Shared by the fuzz targets: how a target is defined, where an input becomes a file, and the
// one outcome allowed besides success. libFuzzer drives each target in the fuzzing build
// (scripts/fuzz.sh), replay_main.cpp over the committed corpus in every build.

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
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

using Target = int (*)(const uint8_t* data, size_t size);

/// The targets of this program by name (the replay program holds them all).
inline std::map<std::string, Target>& targets() {
  static std::map<std::string, Target> all;
  return all;
}

inline bool register_target(const char* name, Target target) {
  targets().emplace(name, target);
  return true;
}

}  // namespace ztrain::fuzz

// ZTRAIN_FUZZ_TARGET(name) { ... } defines fuzz target `name` (a function of `data` and
// `size`). Each target runs the reader and lets only ztrain::Error (a clear refusal naming the
// input) out of its try block: any other exception, a crash or a sanitizer report is a finding.
// In the fuzzing build (ZTRAIN_FUZZING: one program per target) it is libFuzzer's
// LLVMFuzzerTestOneInput; elsewhere the targets register themselves in one replay program, which
// runs the one its first argument names.
#ifdef ZTRAIN_FUZZING
#define ZTRAIN_FUZZ_TARGET(name) extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size)
#else
#define ZTRAIN_FUZZ_TARGET(name)                                                                                \
  static int fuzz_target_##name(const uint8_t* data, size_t size);                                              \
  [[maybe_unused]] static const bool fuzz_registered_##name = ztrain::fuzz::register_target(#name, fuzz_target_##name); \
  static int fuzz_target_##name(const uint8_t* data, size_t size)
#endif
