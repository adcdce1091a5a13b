// A checkpoint's manifest.json beside fixed model, optimizer and generator files, through
// verify_checkpoint as every reader of a checkpoint calls it.
#include "fuzz_input.h"

#include <ztrain/ckpt/checkpoint.h>
#include <ztrain/error.h>

ZTRAIN_FUZZ_TARGET(manifest) {
  static const bool files = [] {
    // The contents tests/fuzz/corpus/manifest's seeds record the SHA-256 of.
    for (const char* name : {"model.safetensors", "optimizer.safetensors", "rng.safetensors"}) {
      const std::string text = std::string("fuzz ") + name;
      ztrain::fuzz::write_file(name, reinterpret_cast<const uint8_t*>(text.data()), text.size());
    }
    return true;
  }();
  (void)files;
  ztrain::fuzz::write_file("manifest.json", data, size);
  try {
    ztrain::verify_checkpoint(ztrain::fuzz::scratch_dir().string());
  } catch (const ztrain::Error&) {
  }
  return 0;
}
