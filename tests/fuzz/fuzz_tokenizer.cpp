// A Hugging Face tokenizer.json as ztrain-gpt loads it, then one encode and decode with it.
#include "fuzz_input.h"
#include "tokenizer.h"

#include <ztrain/error.h>

ZTRAIN_FUZZ_TARGET(tokenizer) {
  const auto path = ztrain::fuzz::write_file("tokenizer.json", data, size);
  try {
    auto tokenizer = ztrain::gpt_app::load_tokenizer(path);
    const auto ids = tokenizer->encode("Hello, world! Ünïcode 😀 \n\t end");
    tokenizer->decode(ids);
  } catch (const ztrain::Error&) {
  }
  return 0;
}
