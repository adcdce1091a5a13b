#include "sha256.h"

#include <ztrain/error.h>

#include <openssl/evp.h>

#include <fstream>
#include <memory>
#include <vector>

// OpenSSL's libcrypto computes the digests (its assembly kernels use the CPU's SHA extensions).

namespace ztrain::detail {

namespace {

/// One SHA-256 computation.
class Sha256 {
 public:
  Sha256() : ctx_(EVP_MD_CTX_new(), &EVP_MD_CTX_free) {
    ZTRAIN_CHECK(ctx_ && EVP_DigestInit_ex(ctx_.get(), EVP_sha256(), nullptr) == 1,
                 "SHA-256: OpenSSL could not start a digest");
  }
  void update(const void* data, size_t n) {
    ZTRAIN_CHECK(EVP_DigestUpdate(ctx_.get(), data, n) == 1, "SHA-256: OpenSSL's digest update failed");
  }
  std::string hex() {
    unsigned char digest[EVP_MAX_MD_SIZE];
    unsigned int n = 0;
    ZTRAIN_CHECK(EVP_DigestFinal_ex(ctx_.get(), digest, &n) == 1, "SHA-256: OpenSSL's digest failed");
    static const char* digits = "0123456789abcdef";
    std::string out;
    for (unsigned int i = 0; i < n; ++i) {
      out.push_back(digits[digest[i] >> 4]);
      out.push_back(digits[digest[i] & 15]);
    }
    return out;
  }

 private:
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx_;
};

}  // namespace

std::string sha256_hex(const std::string& data) {
  Sha256 s;
  s.update(data.data(), data.size());
  return s.hex();
}

std::string sha256_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  ZTRAIN_CHECK(in, "cannot read '", path, "'");
  Sha256 s;
  std::vector<char> buf(1 << 20);
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    s.update(buf.data(), static_cast<size_t>(in.gcount()));
  }
  return s.hex();
}

}  // namespace ztrain::detail
