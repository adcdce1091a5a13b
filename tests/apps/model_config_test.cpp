// ztrain-gpt's model configuration: what train writes reads back, and a damaged or foreign one
// is refused naming the file and the field.
#include "model_config.h"
#include "test_util.h"

namespace ztrain::gpt_app {
namespace {

using json = nlohmann::json;
using test::error_message;

TEST(ModelConfig, RoundTripsAndReadsHuggingFace) {
  auto c = models::GptConfig::preset("small");
  c.dtype = torch::kBFloat16;
  const auto back = config_from_json(config_json(c), "f");
  EXPECT_EQ(config_json(back), config_json(c));
  const auto hf = config_from_hf(hf_config_json(c), "config.json");
  EXPECT_EQ(hf.d_model, c.d_model);
  EXPECT_EQ(hf.dtype, torch::kBFloat16);
  EXPECT_EQ(recorded_tokenizer(json::object(), "f"), "bytes");
  EXPECT_EQ(recorded_tokenizer({{"tokenizer", "tokenizer.json"}}, "f"), "tokenizer.json");
}

TEST(ModelConfig, RefusesDamagedFieldsNamingTheFile) {
  const auto good = config_json(models::GptConfig::preset("tiny"));
  for (const auto& [key, value, what] : std::vector<std::tuple<std::string, json, std::string>>{
           {"d_model", "64", "d_model = \"64\" must be an integer"},
           {"n_head", 0, "n_head = 0 must be an integer of at least 1"},
           {"vocab_size", 1e300, "vocab_size = 1e+300 must be an integer"},
           {"context", int64_t{1} << 50, "context = 1125899906842624"},
           {"n_head", 3, "cannot build: GPT: d_model (64) must be a positive multiple of n_head (3)"},
           {"dropout", "x", "dropout = \"x\" must be a number"},
           {"dtype", "fp8", "dtype 'fp8' is not fp32, bf16 or fp16"},
           {"dtype", 3, "dtype = 3 must be a string"}}) {
    auto j = good;
    j[key] = value;
    const auto msg = error_message([&] { config_from_json(j, "run/model.safetensors"); });
    EXPECT_NE(msg.find("'run/model.safetensors'"), std::string::npos) << msg;
    EXPECT_NE(msg.find(what), std::string::npos) << key << ": " << msg;
  }
  auto missing = good;
  missing.erase("n_layer");
  EXPECT_NE(error_message([&] { config_from_json(missing, "m"); }).find("has no n_layer"), std::string::npos);
  EXPECT_NE(error_message([&] { config_from_text("{\"vocab", "m"); }).find("'m': the model configuration is not valid JSON"),
            std::string::npos);
  EXPECT_NE(error_message([&] { config_from_json(json::array(), "m"); }).find("not a JSON object"), std::string::npos);
  EXPECT_NE(error_message([&] { config_from_hf({{"model_type", 7}}, "c.json"); }).find("not a GPT-2 configuration"),
            std::string::npos);
  for (const char* name : {"../../etc/passwd", "a/b.json", "..", ""}) {
    EXPECT_NE(error_message([&] { recorded_tokenizer({{"tokenizer", name}}, "m"); }).find("is not a file name"),
              std::string::npos) << name;
  }
}

}  // namespace
}  // namespace ztrain::gpt_app
