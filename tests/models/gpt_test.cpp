// The GPT model: Hugging Face names and layouts, and the same loss as an independent PyTorch
// GPT-2 (tests/models/gpt_reference.py) on weights going both ways.

#include "test_util.h"

#include <filesystem>
#include <fstream>

namespace ztrain::test {
namespace {

using models::Gpt;
using models::GptConfig;

const char* kScript = ZTRAIN_GPT_REFERENCE;  // set by CMake
const char* kPython = ZTRAIN_PYTHON;

std::string shared_dir() {
  std::string dir;
  if (runtime().rank() == 0) {
    dir = (std::filesystem::temp_directory_path() / c10::str("ztrain_gpt_test_", ::getpid())).string();
    std::filesystem::create_directories(dir);
  }
  return runtime().world().broadcast_bytes(dir, 0);
}

std::string run(const std::string& cmd) {
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return out;
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  EXPECT_EQ(::pclose(p), 0) << cmd << "\n" << out;
  return out;
}

double python_loss(const std::string& file, const torch::Tensor& tokens, int64_t n_head) {
  const auto path = file + ".tokens";
  {
    std::ofstream f(path);
    for (int64_t i = 0; i < tokens.size(0); ++i) {
      for (int64_t j = 0; j < tokens.size(1); ++j) f << tokens[i][j].item<int64_t>() << ' ';
      f << '\n';
    }
  }
  const auto out = run(c10::str(kPython, " ", kScript, " loss ", file, " ", path, " ", n_head));
  const auto at = out.find("loss=");
  EXPECT_NE(at, std::string::npos) << out;
  return at == std::string::npos ? 0 : std::stod(out.substr(at + 5));
}

const GptConfig kConfig{.vocab_size = 96, .context = 16, .d_model = 32, .n_layer = 2, .n_head = 4};

TEST(Gpt, NamesAndShapesAreHuggingFaces) {
  Gpt model(kConfig, {.zero_level = 3});
  std::vector<std::string> names;
  for (const auto& r : named_parameter_refs(*model)) names.push_back(c10::str(r.name, c10::IntArrayRef(r.shape)));
  const std::vector<std::string> want = {
      "transformer.wte.weight[96, 32]", "transformer.wpe.weight[16, 32]",
      "transformer.h.0.ln_1.weight[32]", "transformer.h.0.ln_1.bias[32]",
      "transformer.h.0.attn.c_attn.weight[32, 96]", "transformer.h.0.attn.c_attn.bias[96]",
      "transformer.h.0.attn.c_proj.weight[32, 32]", "transformer.h.0.attn.c_proj.bias[32]",
      "transformer.h.0.ln_2.weight[32]", "transformer.h.0.ln_2.bias[32]",
      "transformer.h.0.mlp.c_fc.weight[32, 128]", "transformer.h.0.mlp.c_fc.bias[128]",
      "transformer.h.0.mlp.c_proj.weight[128, 32]", "transformer.h.0.mlp.c_proj.bias[32]"};
  ASSERT_EQ(names.size(), 2u + 2 * 12 + 2);
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(names[i], want[i]);
  EXPECT_EQ(names[names.size() - 2], "transformer.ln_f.weight[32]");
  int64_t total = 0;
  for (const auto& [n, t] : gathered_parameters(*model)) total += t.numel();
  EXPECT_EQ(total, kConfig.num_parameters());
  EXPECT_EQ(GptConfig::preset("gpt2").num_parameters(), 124439808);  // GPT-2 small, tied head
}

TEST(Gpt, MatchesAnIndependentPyTorchGpt2BothWays) {
  ASSERT_EQ(world_size(), expected_world_size());
  const auto dir = shared_dir();
  auto tokens = torch::randint(kConfig.vocab_size, {3, 12}, at::detail::createCPUGenerator(4), torch::kLong);
  for (int level : {0, 3}) {
    // ztrain → PyTorch
    Gpt model(kConfig, {.zero_level = level});
    init_parameters(*model, {.seed = 1, .init = models::gpt_init(kConfig)});
    const auto file = c10::str(dir, "/ours", level, ".safetensors");
    save(*model, file);
    torch::NoGradGuard no_grad;
    const auto ours = model->loss(tokens).item<double>();
    if (runtime().rank() == 0) {
      EXPECT_NEAR(ours, python_loss(file, tokens, kConfig.n_head), 1e-5 * ours);
    }

    // PyTorch → ztrain
    const auto theirs_file = c10::str(dir, "/theirs", level, ".safetensors");
    if (runtime().rank() == 0) {
      run(c10::str(kPython, " ", kScript, " write ", theirs_file, " 7 ", kConfig.vocab_size, " ", kConfig.context, " ",
                   kConfig.d_model, " ", kConfig.n_layer));
    }
    synchronize();
    load(*model, theirs_file);
    const auto loaded = model->loss(tokens).item<double>();
    if (runtime().rank() == 0) {
      EXPECT_NEAR(loaded, python_loss(theirs_file, tokens, kConfig.n_head), 1e-5 * loaded);
    }
  }
  synchronize();
  if (runtime().rank() == 0) std::filesystem::remove_all(dir);
}

// bf16 parameters with fp32 masters (ztrain's AdamW) follow the fp32 run of the same model.
TEST(Gpt, Bf16WithFp32MastersTracksFp32) {
  std::vector<double> losses[2];
  for (int i = 0; i < 2; ++i) {
    auto c = kConfig;
    c.dtype = i == 0 ? torch::kFloat32 : torch::kBFloat16;
    Gpt model(c, {.zero_level = 3, .use_checkpoint = false});
    init_parameters(*model, {.seed = 3, .init = models::gpt_init(c)});
    optim::AdamW opt(model->parameters(), optim::AdamOptions(3e-3).weight_decay(0.0));
    optim::OptimManager mgr(*model);
    mgr.add_optimizer(opt);
    const int dp = runtime().dp().size(), r = runtime().dp().rank();
    for (int step = 0; step < 100; ++step) {
      // Counting sequences from random starts: learnable, so the losses move.
      auto starts = torch::randint(c.vocab_size, {4 * dp, 1}, at::detail::createCPUGenerator(step), torch::kLong);
      auto tokens = ((starts + torch::arange(13)) % c.vocab_size).slice(0, 4 * r, 4 * (r + 1));
      mgr.zero_grad();
      auto loss = model->loss(tokens);
      mgr.backward(loss);
      mgr.step();
      losses[i].push_back(sum_loss(loss).item<double>());
    }
    if (i == 1) {
      for (const auto& p : model->parameters()) EXPECT_EQ(p.scalar_type(), torch::kBFloat16);
      EXPECT_EQ(opt.state_of(model->parameters()[0])->master.scalar_type(), torch::kFloat32);
    }
  }
  EXPECT_LT(losses[0].back(), losses[0].front() - 0.3);  // it learns
  for (int s = 0; s < 100; ++s) EXPECT_NEAR(losses[1][s], losses[0][s], 2e-2 * losses[0][s]) << "step " << s;
}

// The tied table's gradient, the head's product with the lookup's rows added into it in place,
// is the one libtorch's operators give: PlainGpt's on the same values, with tokens repeated
// within the batch and without, and twice in a row (accumulated).
// The head's product is computed in the table's gradient place and the lookup's rows added there
// (models/gpt.cpp): at level 0 and 3, over two backwards that accumulate, and with the model used
// twice in one backward (the second head computes its product out of place).
TEST(Gpt, TiedEmbeddingGradientIsLibtorchs) {
  const auto file = c10::str(shared_dir(), "/tied.safetensors");
  models::PlainGpt plain(kConfig);
  const int64_t v = kConfig.vocab_size, d = kConfig.d_model;
  for (int level : {0, 3}) {
    Gpt model(kConfig, {.zero_level = level});
    init_parameters(*model, {.seed = 1, .init = models::gpt_init(kConfig)});
    save(*model, file);
    load(*plain, file);
    auto table_gradient = [&] {  // the whole table's, gathered from the shards at level 3
      const auto& group = model->transformer->wte->groups().front();
      auto full = group.shard.grad();
      if (level > 0) {
        full = torch::empty({group.layout.total_numel()}, full.options());
        runtime().dp().all_gather(group.shard.grad(), full);
      }
      return full.narrow(0, 0, v * d).view({v, d}).to(torch::kFloat64);
    };
    for (int64_t range : {int64_t{4}, v}) {
      auto tokens = torch::randint(range, {3, 13}, at::detail::createCPUGenerator(range), torch::kLong);
      auto other = torch::randint(v, {2, 9}, at::detail::createCPUGenerator(range + 1), torch::kLong);
      model->zero_grad();
      plain->zero_grad();
      for (int pass = 0; pass < 2; ++pass) {
        model->loss(tokens).backward();
        plain->loss(tokens).backward();
      }
      (model->loss(tokens) + model->loss(other)).backward();
      (plain->loss(tokens) + plain->loss(other)).backward();
      const auto ours = table_gradient();
      const auto want = plain->transformer->wte->weight.grad().to(torch::kFloat64);
      EXPECT_LT((ours - want).norm().item<double>(), 1e-6 * want.norm().item<double>())
          << "level " << level << ", tokens < " << range;
      EXPECT_GT(want.slice(0, 0, 4).abs().sum().item<double>(), 0.0);  // the looked-up rows have their share
    }
  }
  synchronize();
  if (runtime().rank() == 0) std::filesystem::remove_all(std::filesystem::path(file).parent_path());
}

// ztrain's GPT computes what PlainGpt computes through libtorch's operators, in fp32 and bf16: the
// same loss and every gradient the same bit for bit, but the tied table's, which it sums in
// another order (the head's product made in its place, the lookup's rows added into it): within
// the rounding of the table's dtype. (bench/report.py holds run_all's final losses to this.)
// With a vocabulary of more than one slice of the head's products on the CPU (4096 rows, the last
// slice here partial; models/gpt.cpp), the head's input gradient is a sum of the slices' products,
// made in another order: there the loss and every gradient are at most twice as far from PlainGpt's
// in float64 as PlainGpt's own (measured in bf16: 0.8–1.3 times), plus float's rounding.
TEST(Gpt, GradientsArePlainGpts) {
  const auto file = c10::str(shared_dir(), "/plain.safetensors");
  auto sliced = kConfig;
  sliced.vocab_size = 2 * 4096 + 37;
  // ‖a − b‖ / ‖b‖ in float64
  auto error = [](const torch::Tensor& a, const torch::Tensor& b) {
    const auto b64 = b.to(torch::kFloat64);
    return (a.to(torch::kFloat64) - b64).norm().item<double>() / b64.norm().item<double>();
  };
  for (const auto& [config, whole] : {std::pair{kConfig, true}, std::pair{sliced, false}}) {
    for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
      SCOPED_TRACE(c10::str(dtype, ", vocabulary ", config.vocab_size));
      auto c = config;
      c.dtype = dtype;
      Gpt model(c, {.zero_level = 0});
      models::PlainGpt plain(c);
      c.dtype = torch::kFloat64;
      models::PlainGpt plain64(c);
      init_parameters(*model, {.seed = 4, .init = models::gpt_init(config)});
      save(*model, file);
      load(*plain, file);
      load(*plain64, file);
      // The same tokens on every rank: level 0's average of equal gradients is each of them.
      auto tokens = torch::randint(c.vocab_size, {3, 13}, at::detail::createCPUGenerator(7), torch::kLong);
      auto ours = model->loss(tokens), want = plain->loss(tokens), exact = plain64->loss(tokens);
      // ours as close as whole products in libtorch: the same bits, or as near to float64's
      auto as_close = [&](const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& b64) {
        return whole ? torch::equal(a, b) : error(a, b64) <= 2 * error(b, b64) + 1e-6;
      };
      EXPECT_TRUE(as_close(ours, want, exact)) << ours.item<double>() << " against " << want.item<double>();
      ours.backward();
      want.backward();
      exact.backward();
      const auto named = plain->named_parameters(), named64 = plain64->named_parameters();
      int compared = 0;
      for (const auto& ref : named_parameter_refs(*model)) {
        ASSERT_NE(ref.owner, nullptr) << ref.name;  // every parameter of the GPT is in a sharded module
        const auto& group = ref.owner->groups()[ref.group];
        const auto& entry = group.layout.entries()[ref.entry];
        const auto grad = group.shard.grad().narrow(0, entry.offset, entry.numel).view(entry.shape);
        const auto &expected = named[ref.name].grad(), &expected64 = named64[ref.name].grad();
        ++compared;
        if (!whole || ref.name != "transformer.wte.weight") {
          EXPECT_TRUE(as_close(grad, expected, expected64)) << ref.name;
          continue;
        }
        const double rounding = dtype == torch::kFloat32 ? 1e-6 : 4e-3;  // bf16 rounds to 2^-8 relative
        EXPECT_LT(error(grad, expected), rounding);
      }
      EXPECT_EQ(compared, static_cast<int>(named.size()));
    }
  }
  synchronize();
  if (runtime().rank() == 0) std::filesystem::remove_all(std::filesystem::path(file).parent_path());
}

// The fused attention (scaled_dot_product_attention) computes the eager product, causal mask,
// softmax and dropout: the same loss and gradients up to rounding.
TEST(Gpt, FusedAttentionComputesTheEagerAttention) {
  auto tokens = torch::randint(kConfig.vocab_size, {3, 13}, at::detail::createCPUGenerator(5), torch::kLong);
  for (auto [dtype, dropout] : {std::pair{torch::kFloat32, 0.0}, {torch::kBFloat16, 0.0}, {torch::kFloat32, 0.3},
                                {torch::kBFloat16, 0.3}}) {  // with dropout: the same masks
    SCOPED_TRACE(c10::str(dtype, ", dropout ", dropout));
    std::vector<double> losses;
    std::vector<torch::Tensor> grads;
    for (bool fused : {false, true}) {
      auto c = kConfig;
      c.dtype = dtype;
      c.dropout = dropout;
      c.fused_attention = fused;
      Gpt model(c, {.zero_level = 0});
      init_parameters(*model, {.seed = 2, .init = models::gpt_init(c)});
      torch::manual_seed(12);
      auto loss = model->loss(tokens);
      loss.backward();
      losses.push_back(loss.item<double>());
      grads.push_back(model->parameters()[2].grad().to(torch::kFloat64).clone());  // block 0's
    }
    const double tol = dtype == torch::kFloat32 ? 1e-5 : 2e-2;
    EXPECT_NEAR(losses[1], losses[0], tol * losses[0]) << dtype;
    EXPECT_LT((grads[1] - grads[0]).norm().item<double>(), tol * grads[0].norm().item<double>()) << dtype;
  }
}

// With attention dropout, recomputation replays the fused kernel's masks: the gradients of a
// recomputed model are those of a stored one, bit for bit.
TEST(Gpt, FusedAttentionDropoutReplaysUnderRecomputation) {
  auto tokens = torch::randint(kConfig.vocab_size, {3, 13}, at::detail::createCPUGenerator(6), torch::kLong);
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {  // bf16: the kernel on widened operands, or eager
    auto c = kConfig;
    c.dropout = 0.3;
    c.dtype = dtype;
    std::vector<torch::Tensor> grads;
    for (bool recompute : {false, true}) {
      Gpt model(c, {.zero_level = 0, .use_checkpoint = recompute});
      init_parameters(*model, {.seed = 2, .init = models::gpt_init(c)});
      model->train();
      torch::manual_seed(11);
      model->loss(tokens).backward();
      grads.push_back(model->parameters()[2].grad().clone());
    }
    EXPECT_TRUE(torch::equal(grads[0], grads[1])) << "recomputation drew other attention dropout masks, " << dtype;
  }
}

TEST(Gpt, LayerNormsAreTheFusedKernel) {
  // Every LayerNorm of both models (the blocks' two and the final one) is a GptLayerNorm.
  const auto count = [](torch::nn::Module& m) {
    int64_t n = 0;
    for (const auto& sub : m.modules()) n += dynamic_cast<const models::GptLayerNormImpl*>(sub.get()) != nullptr;
    return n;
  };
  Gpt model(kConfig, {.zero_level = 3});
  auto& tr = *model->transformer;
  int64_t in_gpt = count(*tr.ln_f->module());  // the engine's blocks hold their modules unregistered
  for (size_t i = 0; i < tr.h->size(); ++i) in_gpt += count(*tr.h[i]->module());
  EXPECT_EQ(in_gpt, 2 * kConfig.n_layer + 1);
  models::PlainGpt plain(kConfig);
  EXPECT_EQ(count(*plain), 2 * kConfig.n_layer + 1);
  // Over one dimension its forward is models::layer_norm's, whose bf16 statistics stay in float (libtorch's
  // are bf16, and differ here); over more, libtorch's.
  torch::manual_seed(3);
  models::GptLayerNorm ln(torch::nn::LayerNormOptions({48}).eps(1e-5));
  {
    torch::NoGradGuard no_grad;
    ln->weight.normal_();
    ln->bias.normal_();
  }
  ln->to(torch::kBFloat16);
  const auto x = (torch::randn({5, 7, 48}) * 3 + 100).to(torch::kBFloat16);
  EXPECT_TRUE(torch::equal(ln(x), models::layer_norm(x, ln->weight, ln->bias, 1e-5)));
  EXPECT_FALSE(torch::equal(ln(x), torch::layer_norm(x, {48}, ln->weight, ln->bias, 1e-5)));
  models::GptLayerNorm ln2(torch::nn::LayerNormOptions({7, 48}));
  const auto x2 = torch::randn({5, 7, 48});
  EXPECT_TRUE(torch::equal(ln2(x2), torch::layer_norm(x2, {7, 48}, ln2->weight, ln2->bias, 1e-5)));
}

TEST(Gpt, BadConfigurationsAreRejected) {
  EXPECT_NE(error_message([] { Gpt(GptConfig{.d_model = 30, .n_head = 4}); }).find("multiple of n_head"), std::string::npos);
  EXPECT_NE(error_message([] { GptConfig::preset("huge"); }).find("tiny"), std::string::npos);
  Gpt model(kConfig, {.zero_level = 2});
  EXPECT_NE(error_message([&] { model(torch::zeros({1, 17}, torch::kLong)); }).find("exceeds the context 16"),
            std::string::npos);
}

}  // namespace
}  // namespace ztrain::test
