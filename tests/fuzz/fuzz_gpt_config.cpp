// ztrain-gpt's model configuration, as it reads it from a model file's metadata or a
// checkpoint's manifest, and a Hugging Face config.json.
#include "fuzz_input.h"
#include "model_config.h"

#include <ztrain/error.h>

ZTRAIN_FUZZ_TARGET(gpt_config) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    ztrain::gpt_app::config_from_text(text, "fuzz");
  } catch (const ztrain::Error&) {
  }
  const auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return 0;
  try {
    ztrain::gpt_app::config_from_hf(j, "fuzz");
  } catch (const ztrain::Error&) {
  }
  try {
    ztrain::gpt_app::recorded_tokenizer(j, "fuzz");
  } catch (const ztrain::Error&) {
  }
  return 0;
}
