// A safetensors file as ztrain reads checkpoints and models: the header (length, JSON, dtypes,
// shapes, offsets, metadata), then every tensor in full and in part.
#include "fuzz_input.h"

#include <ztrain/ckpt/safetensors.h>
#include <ztrain/error.h>

ZTRAIN_FUZZ_TARGET(safetensors) {
  const auto path = ztrain::fuzz::write_file("input.safetensors", data, size);
  try {
    ztrain::ckpt::SafetensorsReader reader(path);
    for (const auto& e : reader.entries()) {
      reader.read(e.name);
      if (e.numel() > 1) reader.read_range(e.name, 1, e.numel() - 1);
    }
  } catch (const ztrain::Error&) {
  }
  return 0;
}
