#include "model_config.h"

#include <ztrain/error.h>


namespace ztrain::gpt_app {

using json = nlohmann::json;
using models::GptConfig;

namespace {

/// An integer field in [min, 2^40] (no model here has a larger dimension).
int64_t size_field(const json& j, const char* key, const std::string& source, int64_t min = 1) {
  ZTRAIN_CHECK(j.contains(key), "'", source, "': the model configuration has no ", key);
  const auto& v = j.at(key);
  ZTRAIN_CHECK(v.is_number_integer() && v.get<int64_t>() >= min && v.get<int64_t>() <= (int64_t{1} << 40), "'",
               source, "': ", key, " = ", v.dump(), " must be an integer of at least ", min);
  return v.get<int64_t>();
}

/// A number field in [lo, hi], `fallback` when absent (or null).
double number_field(const json& j, const char* key, double fallback, double lo, double hi, const std::string& source) {
  if (!j.contains(key) || j.at(key).is_null()) return fallback;
  const auto& v = j.at(key);
  ZTRAIN_CHECK(v.is_number() && v.get<double>() >= lo && v.get<double>() <= hi, "'", source, "': ", key, " = ",
               v.dump(), " must be a number in [", lo, ", ", hi, "]");
  return v.get<double>();
}

std::string string_field(const json& j, const char* key, const std::string& fallback, const std::string& source) {
  if (!j.contains(key)) return fallback;
  ZTRAIN_CHECK(j.at(key).is_string(), "'", source, "': ", key, " = ", j.at(key).dump(), " must be a string");
  return j.at(key).get<std::string>();
}

GptConfig validated(GptConfig c, const std::string& source) {
  try {
    c.validate();
  } catch (const Error& e) {
    ZTRAIN_CHECK(false, "'", source, "' describes a model this GPT cannot build: ", e.what());
  }
  return c;
}

}  // namespace

c10::ScalarType parse_dtype(const std::string& name, const std::string& source) {
  if (name == "fp32") return torch::kFloat32;
  if (name == "bf16") return torch::kBFloat16;
  if (name == "fp16") return torch::kFloat16;
  ZTRAIN_CHECK(false, "'", source, "': dtype '", name, "' is not fp32, bf16 or fp16");
}

std::string dtype_name(c10::ScalarType dtype) {
  return dtype == torch::kBFloat16 ? "bf16" : dtype == torch::kFloat16 ? "fp16" : "fp32";
}

json config_json(const GptConfig& c) {
  return {{"vocab_size", c.vocab_size}, {"context", c.context}, {"d_model", c.d_model}, {"n_layer", c.n_layer},
          {"n_head", c.n_head},         {"dropout", c.dropout}, {"layer_norm_eps", c.layer_norm_eps},
          {"dtype", dtype_name(c.dtype)}};
}

GptConfig config_from_json(const json& j, const std::string& source) {
  ZTRAIN_CHECK(j.is_object(), "'", source, "': the model configuration is not a JSON object");
  return validated({.vocab_size = size_field(j, "vocab_size", source),
                    .context = size_field(j, "context", source),
                    .d_model = size_field(j, "d_model", source),
                    .n_layer = size_field(j, "n_layer", source, 0),
                    .n_head = size_field(j, "n_head", source),
                    .dropout = number_field(j, "dropout", 0.0, 0.0, 1.0, source),
                    .layer_norm_eps = number_field(j, "layer_norm_eps", 1e-5, 0.0, 1.0, source),
                    .dtype = parse_dtype(string_field(j, "dtype", "fp32", source), source)},
                   source);
}

GptConfig config_from_text(const std::string& text, const std::string& source) {
  const auto j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  ZTRAIN_CHECK(!j.is_discarded(), "'", source, "': the model configuration is not valid JSON");
  return config_from_json(j, source);
}

std::string recorded_tokenizer(const json& j, const std::string& source) {
  const auto name = string_field(j, "tokenizer", "bytes", source);
  ZTRAIN_CHECK(!name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos, "'", source,
               "': the tokenizer it records, '", name, "', is not a file name");
  return name;
}

json hf_config_json(const GptConfig& c) {
  return {{"architectures", {"GPT2LMHeadModel"}},
          {"model_type", "gpt2"},
          {"vocab_size", c.vocab_size},
          {"n_positions", c.context},
          {"n_embd", c.d_model},
          {"n_layer", c.n_layer},
          {"n_head", c.n_head},
          {"n_inner", nullptr},
          {"activation_function", "gelu_new"},
          {"layer_norm_epsilon", c.layer_norm_eps},
          {"resid_pdrop", c.dropout},
          {"embd_pdrop", c.dropout},
          {"attn_pdrop", c.dropout},
          {"tie_word_embeddings", true},
          {"torch_dtype", c.dtype == torch::kBFloat16 ? "bfloat16" : c.dtype == torch::kFloat16 ? "float16" : "float32"}};
}

GptConfig config_from_hf(const json& j, const std::string& source) {
  ZTRAIN_CHECK(j.is_object(), "'", source, "' is not a JSON object");
  ZTRAIN_CHECK(j.contains("model_type") && j.at("model_type") == "gpt2", "'", source,
               "' is not a GPT-2 configuration (model_type ", j.contains("model_type") ? j.at("model_type").dump() : "missing",
               ")");
  auto check = [&](const char* key, const json& want) {
    ZTRAIN_CHECK(!j.contains(key) || j.at(key).is_null() || j.at(key) == want, "'", source, "': ", key, " = ",
                 j.at(key).dump(), " is not supported (this GPT has ", want.dump(), ")");
  };
  check("activation_function", "gelu_new");
  check("tie_word_embeddings", true);
  check("scale_attn_weights", true);
  check("scale_attn_by_inverse_layer_idx", false);
  check("add_cross_attention", false);
  const int64_t d_model = size_field(j, "n_embd", source);
  ZTRAIN_CHECK(!j.contains("n_inner") || j.at("n_inner").is_null() || j.at("n_inner") == 4 * d_model, "'", source,
               "': n_inner must be 4 x n_embd");
  const auto dtype = string_field(j, "torch_dtype", "float32", source);
  ZTRAIN_CHECK(dtype == "float32" || dtype == "bfloat16" || dtype == "float16", "'", source, "': torch_dtype '", dtype,
               "' is not float32, bfloat16 or float16");
  return validated({.vocab_size = size_field(j, "vocab_size", source),
                    .context = size_field(j, "n_positions", source),
                    .d_model = d_model,
                    .n_layer = size_field(j, "n_layer", source, 0),
                    .n_head = size_field(j, "n_head", source),
                    .dropout = 0.0,
                    .layer_norm_eps = number_field(j, "layer_norm_epsilon", 1e-5, 0.0, 1.0, source),
                    .dtype = dtype == "bfloat16" ? torch::kBFloat16 : dtype == "float16" ? torch::kFloat16 : torch::kFloat32},
                   source);
}

}  // namespace ztrain::gpt_app
