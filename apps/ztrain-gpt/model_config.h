#pragma once
// The model's configuration as ztrain-gpt writes and reads it: in a model file's metadata and a
// checkpoint's manifest (its own JSON), and as Hugging Face's GPT2Config (config.json).

#include <ztrain/models/gpt.h>

#include <nlohmann/json.hpp>

#include <string>

namespace ztrain::gpt_app {

/// "fp32", "bf16" or "fp16"; anything else raises ztrain::Error naming `source`.
c10::ScalarType parse_dtype(const std::string& name, const std::string& source);
std::string dtype_name(c10::ScalarType dtype);

/// ztrain-gpt's own configuration JSON, and the model it describes. Every field is checked (type,
/// range, and GptConfig::validate); a problem raises ztrain::Error naming `source` (the file).
nlohmann::json config_json(const models::GptConfig& config);
models::GptConfig config_from_json(const nlohmann::json& j, const std::string& source);
/// config_from_json of JSON text, which may be malformed.
models::GptConfig config_from_text(const std::string& text, const std::string& source);

/// The tokenizer a configuration records: "bytes" (also when absent), or the name of the file
/// train copied beside the model (a plain file name; anything else raises ztrain::Error).
std::string recorded_tokenizer(const nlohmann::json& j, const std::string& source);

/// A GPT2Config (config.json of a Hugging Face model directory), so that transformers'
/// GPT2LMHeadModel.from_pretrained loads a trained model's directory, and the model one
/// describes; refuses what this GPT does not compute the same way.
nlohmann::json hf_config_json(const models::GptConfig& config);
models::GptConfig config_from_hf(const nlohmann::json& j, const std::string& source);

}  // namespace ztrain::gpt_app
