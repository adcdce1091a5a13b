#pragma once
// SHA-256 (FIPS 180-4) of bytes or a file, as lowercase hex, by OpenSSL's libcrypto.

#include <string>

namespace ztrain::detail {

std::string sha256_hex(const std::string& data);
/// Throws ztrain::Error naming the file when it cannot be read.
std::string sha256_file(const std::string& path);

}  // namespace ztrain::detail
