// Pipeline parity: the ZeRO tests' small transformer (tied embedding and LM head), cut into
// stages and trained a few steps with GPipe, 1F1B and interleaved 1F1B, gives the
// single-process libtorch losses and parameters, with ZeRO levels 0–3 inside each stage; the
// tied gradients equal the single-process gradient of the shared weight.
//
// The pipeline size comes from ZTRAIN_TEST_PP (default: the world size), so one executable
// covers pp = 1, 2, 4 and pp = 2 × dp = 2 (see CMakeLists.txt). Also: partitions.

#include "test_util.h"
#include "../zero/zero_model.h"

#include <ztrain/pipe/pipe.h>

#include <cstdlib>

namespace ztrain::pipe {
namespace pipeline_test {

using test::error_message;
using test::Layer;
using test::LayerImpl;
using test::ModelConfig;
using test::RefModel;
using test::tensors_equal;

constexpr int64_t kBatch = 16;  // divisible by dp × micro-batches in every configuration
constexpr int64_t kSeq = 8;
constexpr int kSteps = 4;
constexpr double kLr = 0.05;
const ModelConfig kConfig{.vocab = 32, .dim = 16, .layers = 7};  // uneven over 2, 4 and 8 parts

int pipeline_size() {
  const char* v = std::getenv("ZTRAIN_TEST_PP");
  return v ? std::atoi(v) : test::expected_world_size();
}

class PipelineEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    if (test::runs_any_suite({"Partition", "Pipeline", "PipelineParity"})) init_distributed({.pp_size = pipeline_size()});
  }
};
const auto* const kEnvironment = ::testing::AddGlobalTestEnvironment(new PipelineEnvironment);

// ---- the model, as pipeline stages -------------------------------------------------------------

struct EmbedImpl : torch::nn::Module {
  explicit EmbedImpl(torch::Tensor w) { weight = register_parameter("weight", w); }
  torch::Tensor forward(torch::Tensor tokens) { return torch::embedding(weight, tokens); }
  torch::Tensor weight;
};
TORCH_MODULE(Embed);

struct HeadImpl : torch::nn::Module {
  explicit HeadImpl(torch::Tensor w) { weight = register_parameter("weight", w); }
  torch::Tensor forward(torch::Tensor x, torch::Tensor tokens) {
    return test::lm_loss(torch::matmul(x, weight.t()), tokens);
  }
  torch::Tensor weight;
};
TORCH_MODULE(Head);

struct Trajectory {
  std::vector<double> losses;
  std::map<std::string, torch::Tensor> params;
  torch::Tensor first_tied_grad;  // of wte after step 0's backward
};

const Trajectory& reference() {
  static const Trajectory ref = [] {
    torch::manual_seed(7);
    RefModel model(kConfig);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(kLr).momentum(0.9));
    Trajectory t;
    for (int step = 0; step < kSteps; ++step) {
      auto tokens = test::batch_tokens(step, kBatch, kSeq, kConfig.vocab);
      auto loss = test::lm_loss(model(tokens), tokens);
      opt.zero_grad();
      loss.backward();
      if (step == 0) t.first_tied_grad = model->wte->weight.grad().clone();
      opt.step();
      t.losses.push_back(loss.item<double>());
    }
    for (const auto& p : model->named_parameters()) t.params[p.key()] = p.value().detach().clone();
    return t;
  }();
  return ref;
}

struct Config {
  ScheduleKind schedule;
  int chunks;  // per rank
  int level;
  bool checkpoint;
  int micro_batches;  // per dp rank
};

std::string name_of(const Config& c) {
  return c10::str(c.schedule == ScheduleKind::k1F1B ? "OneFOneB" : to_string(c.schedule), "_v", c.chunks, "_level",
                  c.level, c.checkpoint ? "_ckpt" : "", "_m", c.micro_batches);
}

// This rank's part of the model, built from the reference's initial weights.
struct Built {
  std::vector<StageModule<Layer>> chunks;
  std::vector<int64_t> bounds;  // over virtual stages
  std::shared_ptr<BlockImpl<Embed>> embed;
  std::shared_ptr<BlockImpl<Head>> head;
};

Built build(const Config& c, int p, int s) {
  torch::manual_seed(7);
  RefModel init(kConfig);
  const BlockOptions options{.zero_level = c.level, .use_checkpoint = c.checkpoint};
  Built b;
  b.bounds = partition_uniform(kConfig.layers, p * c.chunks);
  const int last = p * c.chunks - 1;
  for (int chunk = 0; chunk < c.chunks; ++chunk) {
    const int vs = virtual_stage(s, chunk, p);
    std::vector<Block<Layer>> blocks;
    for (int64_t i = b.bounds[vs]; i < b.bounds[vs + 1]; ++i) {
      Layer layer(kConfig.dim, kConfig.dropout);
      auto source = init->layers[i]->named_parameters();
      torch::NoGradGuard no_grad;
      for (auto& param : layer->named_parameters()) param.value().copy_(source[param.key()]);
      blocks.emplace_back(layer, options);
    }
    StageModuleOptions<Layer> parts;
    if (vs == 0) {
      Block<Embed> embed(Embed(init->wte->weight.detach().clone()), options);
      b.embed = embed.ptr();
      parts.pre = {embed.ptr(), [e = embed.ptr()](const TensorList&, const TensorList& mb) {
                     return TensorList{e->forward(mb[0])};
                   }};
    }
    if (vs == last) {
      Block<Head> head(Head(init->wte->weight.detach().clone()), options);
      b.head = head.ptr();
      parts.post = {head.ptr(), [h = head.ptr()](const TensorList& x, const TensorList& mb) {
                      return TensorList{h->forward(x[0], mb[0])};
                    }};
    }
    b.chunks.emplace_back(BlockList<Layer>(std::move(blocks)), std::move(parts));
  }
  return b;
}

std::vector<torch::Tensor> shards(const std::shared_ptr<ShardedModule>& m) {
  if (!m) return {};
  return m->parameters();
}

// The reference's wte gradient laid out like `m`'s shard on this dp rank.
torch::Tensor expected_shard_grad(ShardedModule& m, const torch::Tensor& full_grad) {
  const auto& group = m.groups()[0];
  auto flat = torch::zeros({group.layout.total_numel()});
  flat.narrow(0, 0, full_grad.numel()).copy_(full_grad.reshape(-1));
  if (m.zero_level() == 0) return flat;
  const auto [begin, end] = group.layout.shard_range(runtime().dp().rank());
  return flat.narrow(0, begin, end - begin);
}

class PipelineParity : public ::testing::TestWithParam<Config> {};

TEST_P(PipelineParity, MatchesSingleProcess) {
  ASSERT_EQ(world_size(), test::expected_world_size());
  auto& rt = runtime();
  ASSERT_EQ(rt.topology().pp_size(), pipeline_size());
  const auto c = GetParam();
  const int p = rt.pp().size(), s = rt.pp().rank(), dp = rt.dp().size(), r = rt.dp().rank();
  const auto& ref = reference();
  auto built = build(c, p, s);
  std::vector<std::shared_ptr<StageImpl>> chunks;
  for (auto& ch : built.chunks) chunks.push_back(ch.ptr());
  Pipeline pipeline(chunks, {.schedule = c.schedule, .broadcast_loss = true});
  if (built.head) {
    // The head's copy starts off; tie() must give it the embedding's value.
    torch::NoGradGuard no_grad;
    for (auto& t : shards(built.head)) t.add_(0.5);
  }
  pipeline.tie("wte", [&] {
    auto out = shards(built.embed);
    for (auto& t : shards(built.head)) out.push_back(t);
    return out;
  }());
  torch::optim::SGD opt(pipeline.parameters(), torch::optim::SGDOptions(kLr).momentum(0.9));

  const int64_t local = kBatch / dp, per_micro = local / c.micro_batches;
  ASSERT_EQ(per_micro * c.micro_batches * dp, kBatch);
  for (int step = 0; step < kSteps; ++step) {
    auto tokens = test::batch_tokens(step, kBatch, kSeq, kConfig.vocab).slice(0, r * local, (r + 1) * local);
    std::vector<TensorList> micro;
    for (int i = 0; i < c.micro_batches; ++i) micro.push_back({tokens.slice(0, i * per_micro, (i + 1) * per_micro)});
    opt.zero_grad();
    auto loss = pipeline.forward_backward_step(micro);
    ASSERT_TRUE(loss.defined());
    EXPECT_NEAR(sum_loss(loss).item<double>(), ref.losses[step], 1e-5 * ref.losses[step]) << "step " << step;
    if (step == 0) {
      // Tied copies hold the whole single-process gradient (embedding use + head use).
      for (const auto& m : {std::static_pointer_cast<ShardedModule>(built.embed),
                            std::static_pointer_cast<ShardedModule>(built.head)}) {
        if (!m) continue;
        EXPECT_TRUE(tensors_equal(m->parameters()[0].grad(), expected_shard_grad(*m, ref.first_tied_grad), 1e-5, 1e-6))
            << "tied gradient";
      }
    }
    opt.step();
  }

  // Final parameters, under their single-process names.
  for (size_t chunk = 0; chunk < built.chunks.size(); ++chunk) {
    const int vs = virtual_stage(s, static_cast<int>(chunk), p);
    for (const auto& [name, value] : gathered_parameters(*built.chunks[chunk])) {
      std::string ref_name;
      if (name.starts_with("pre.") || name.starts_with("post.")) {
        ref_name = "wte.weight";
      } else {
        ASSERT_TRUE(name.starts_with("blocks.")) << name;
        const auto rest = name.substr(7);
        const auto dot = rest.find('.');
        ref_name = c10::str("layers.", built.bounds[vs] + std::stoll(rest.substr(0, dot)), rest.substr(dot));
      }
      ASSERT_TRUE(ref.params.count(ref_name)) << ref_name;
      EXPECT_TRUE(tensors_equal(value, ref.params.at(ref_name), 1e-5, 1e-6)) << name << " (" << ref_name << ")";
    }
  }
}

std::vector<Config> configs() {
  const int p = pipeline_size();
  const int dp = test::expected_world_size() / p;
  std::vector<Config> out;
  auto add = [&](Config c) {
    if (c.schedule == ScheduleKind::kInterleaved1F1B && c.micro_batches % p != 0) return;
    if (kBatch % (dp * c.micro_batches) != 0) return;
    out.push_back(c);
  };
  for (int level : {0, 3}) {
    add({ScheduleKind::kGPipe, 1, level, false, 2 * p});
    add({ScheduleKind::k1F1B, 1, level, level == 3, 2 * p});
    add({ScheduleKind::kInterleaved1F1B, 2, level, false, 2 * p});
  }
  // The other levels and shapes once each: fewer micro-batches than stages, m == p.
  add({ScheduleKind::k1F1B, 1, 1, false, std::max(1, p / 2)});
  add({ScheduleKind::k1F1B, 1, 2, true, p});
  add({ScheduleKind::kInterleaved1F1B, 2, 2, true, p});
  add({ScheduleKind::kInterleaved1F1B, 2, 1, false, 4 * p > 8 ? 2 * p : 4 * p});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Schedules, PipelineParity, ::testing::ValuesIn(configs()),
                         [](const auto& info) { return name_of(info.param); });

TEST(Pipeline, TheLossIsOnTheLastStageUnlessBroadcast) {
  auto& rt = runtime();
  const int p = rt.pp().size(), s = rt.pp().rank();
  const Config c{ScheduleKind::k1F1B, 1, 0, false, 2};
  auto built = build(c, p, s);
  Pipeline pipeline({built.chunks[0].ptr()}, {.schedule = c.schedule});
  auto tokens = test::batch_tokens(0, 4, kSeq, kConfig.vocab);
  auto loss = pipeline.forward_backward_step({{tokens.slice(0, 0, 2)}, {tokens.slice(0, 2, 4)}});
  EXPECT_EQ(loss.defined(), s == p - 1);
  if (s == p - 1) {
    EXPECT_EQ(loss.dim(), 0);
  }
  // A mismatch in micro-batch counts across stages is an error, not a hang.
  if (p > 1) {
    std::vector<TensorList> micro(s == 0 ? 1 : 2, TensorList{tokens.slice(0, 0, 2)});
    auto msg = error_message([&] { pipeline.forward_backward_step(micro); });
    EXPECT_NE(msg.find("every stage must run the same number"), std::string::npos) << msg;
  }
}

TEST(Pipeline, RejectsSeveralChunksWithoutInterleaving) {
  auto& rt = runtime();
  const int p = rt.pp().size(), s = rt.pp().rank();
  auto built = build({ScheduleKind::kInterleaved1F1B, 2, 0, false, 2}, p, s);
  auto msg = error_message([&] {
    Pipeline pipeline({built.chunks[0].ptr(), built.chunks[1].ptr()}, {.schedule = ScheduleKind::kGPipe});
  });
  EXPECT_NE(msg.find("use the interleaved schedule"), std::string::npos) << msg;
}

// ---- partitions --------------------------------------------------------------------------------

TEST(Partition, UniformSpreadsTheRemainderOverTheFirstParts) {
  EXPECT_EQ(partition_uniform(7, 4), (std::vector<int64_t>{0, 2, 4, 6, 7}));
  EXPECT_EQ(partition_uniform(8, 2), (std::vector<int64_t>{0, 4, 8}));
  EXPECT_EQ(partition_uniform(2, 4), (std::vector<int64_t>{0, 1, 2, 2, 2}));
  EXPECT_EQ(partition_uniform(0, 1), (std::vector<int64_t>{0, 0}));
}

TEST(Partition, BalancedMinimisesTheLargestPart) {
  EXPECT_EQ(partition_balanced({1, 1, 1, 1}, 2), (std::vector<int64_t>{0, 2, 4}));
  EXPECT_EQ(partition_balanced({10, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}, 2), (std::vector<int64_t>{0, 1, 11}));
  EXPECT_EQ(partition_balanced({1, 2, 3, 4, 5}, 3), (std::vector<int64_t>{0, 3, 4, 5}));
  EXPECT_EQ(partition_balanced({5, 5}, 3), (std::vector<int64_t>{0, 1, 2, 2}));
  // By parameter count: an embedding-sized first block gets a part of its own.
  auto counts = parameter_counts<torch::nn::Linear>(
      4, [](int64_t i) { return torch::nn::Linear(i == 0 ? 64 : 8, 8); });
  EXPECT_EQ(counts, (std::vector<int64_t>{64 * 8 + 8, 72, 72, 72}));
  EXPECT_EQ(partition_balanced(counts, 2), (std::vector<int64_t>{0, 1, 4}));
}

TEST(Partition, ExplicitBoundsAreValidated) {
  EXPECT_EQ(partition_explicit({0, 3, 3, 7}, 7, 3), (std::vector<int64_t>{0, 3, 3, 7}));
  auto msg = error_message([] { partition_explicit({0, 3, 7}, 7, 3); });
  EXPECT_NE(msg.find("need 4 cut points"), std::string::npos) << msg;
  msg = error_message([] { partition_explicit({0, 5, 3, 7}, 7, 3); });
  EXPECT_NE(msg.find("must not decrease"), std::string::npos) << msg;
  msg = error_message([] { partition_explicit({0, 3, 3, 6}, 7, 3); });
  EXPECT_NE(msg.find("end at the number of blocks 7"), std::string::npos) << msg;
}

}  // namespace pipeline_test
}  // namespace ztrain::pipe
