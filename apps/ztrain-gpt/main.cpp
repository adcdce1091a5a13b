// ztrain-gpt: train a GPT on your own text, evaluate it, score a file, sample from it, make a tokenizer.
//
//   mpirun -np 2 ztrain-gpt train --data corpus.txt --preset small --steps 1000 --out runs/gpt
//   ztrain-gpt score --model runs/gpt/model.safetensors --input some.txt
//   ztrain-gpt sample --model runs/gpt/model.safetensors --prompt "ROMEO:" --tokens 200
//   ztrain-gpt tokenizer train --data corpus.txt --vocab-size 4096 --out tokenizer.json
//
// See docs/ztrain-gpt.md for every option.
#include "data.h"
#include "model_config.h"
#include "progress.h"
#include "tensorboard.h"
#include "tokenizer.h"

#include <ztrain/ztrain.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>

namespace {

namespace fs = std::filesystem;
namespace zt = ztrain;
using zt::gpt_app::Corpus;
using zt::gpt_app::config_from_hf;
using zt::gpt_app::config_from_json;
using zt::gpt_app::config_from_text;
using zt::gpt_app::config_json;
using zt::gpt_app::dtype_name;
using zt::gpt_app::hf_config_json;
using zt::gpt_app::parse_dtype;
using zt::gpt_app::Sampler;
using zt::gpt_app::Tokenizer;
using zt::models::Gpt;
using zt::models::GptConfig;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

// ---- options -------------------------------------------------------------------------------------

/// Where the ranks run and how they talk; not set: ZTRAIN_DEVICE and ZTRAIN_BACKEND, else the CPU
/// and MPI.
struct Placement {
  std::optional<std::string> device;
  std::optional<std::string> backend;
};

struct ModelArgs {
  std::string preset = "small";
  std::optional<int64_t> d_model, layers, heads, context;
  double dropout = 0.0;
  std::string dtype = "fp32";
  int zero_level = 2;
  bool recompute = false;
};

struct TrainArgs {
  ModelArgs model;
  std::string data;
  std::string tokenizer;    // empty: bytes
  std::string token_cache;  // empty: default_token_cache()
  double validation_fraction = 0.05;
  std::string optimizer = "adamw";
  double lr = 1e-3, min_lr = 1e-4, weight_decay = 0.1, beta1 = 0.9, beta2 = 0.95, grad_clip = 1.0;
  std::string schedule = "cosine";       // the learning rate's
  std::string pipe_schedule = "1f1b";
  int64_t warmup = 50;
  int64_t batch = 8, grad_accum = 1, steps = 300;
  std::optional<int64_t> seq;  // not set: the model's context
  int64_t eval_interval = 100, eval_batches = 8;
  std::string out = "runs/gpt";
  std::string ckpt_dir;
  int64_t ckpt_interval = 0;
  int keep_last = 3;
  bool resume = false;
  uint64_t seed = 1234;
  int tp = 1;
  int pp = 1;
  std::string plugin;  // empty: models::Gpt on the ZeRO engine (hybrid with --pp); else the Booster's plugin
  std::optional<int64_t> micro_batches;  // with pp: per step (default 2 × pp)
  int chunks = 2;                        // per rank, with the interleaved schedule
  bool offload = false;
  std::string offload_dir;
  std::string offload_param_dir;
  Placement where;
  std::string tensorboard;            // event files' directory; empty: none
};

const std::vector<std::string> kLrSchedules{"cosine", "linear", "wsd", "constant"};
const std::vector<std::string> kPipeSchedules{"gpipe", "1f1b", "interleaved"};

void add_placement_options(CLI::App* app, Placement& where) {
  app->add_option("--device", where.device,
                  "cpu, cuda (one device per rank on each host) or cuda:N (default: ZTRAIN_DEVICE, else cpu)");
  app->add_option("--backend", where.backend,
                  "communication: mpi, or nccl with --device cuda where the build has it (default: ZTRAIN_BACKEND, "
                  "else mpi)");
}

/// init_distributed on --device and --backend when given.
zt::Runtime& start(zt::InitOptions options, const Placement& where) {
  if (where.device) {
    options.device = zt::parse_device(*where.device, "--device");
    zt::resolve_device(*options.device, "--device");  // refused here, naming the option
  }
  options.backend = where.backend;
  return zt::init_distributed(options);
}

void add_model_options(CLI::App* app, ModelArgs& m) {
  app->add_option("--preset", m.preset, "model preset: tiny, small, medium, gpt2")->capture_default_str();
  app->add_option("--d-model", m.d_model, "width (overrides the preset)");
  app->add_option("--layers", m.layers, "transformer blocks (overrides the preset)");
  app->add_option("--heads", m.heads, "attention heads (overrides the preset)");
  app->add_option("--context", m.context, "maximum sequence length (overrides the preset)");
  app->add_option("--dropout", m.dropout, "dropout probability")->capture_default_str();
  app->add_option("--dtype", m.dtype, "fp32, bf16 or fp16 (fp32 master weights for the last two)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}))
      ->capture_default_str();
  app->add_option("--zero-level", m.zero_level, "ZeRO level 0-3 for every block")
      ->check(CLI::Range(0, 3))
      ->capture_default_str();
  app->add_flag("--recompute", m.recompute, "recompute activations in backward (activation checkpointing)");
}

/// Where token files are cached unless --token-cache says: $XDG_CACHE_HOME/ztrain/tokens, else
/// ~/.cache/ztrain/tokens, else <out>/tokens.
std::string default_token_cache(const std::string& out) {
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg) return std::string(xdg) + "/ztrain/tokens";
  if (const char* home = std::getenv("HOME"); home && *home) return std::string(home) + "/.cache/ztrain/tokens";
  return out + "/tokens";
}

/// The model's vocabulary for a tokenizer's: rounded up to a multiple of 64 (whole SIMD rows for
/// the head's matmul), the same at every tp size, so a model moves between them; Gpt pads it
/// further where tp does not divide it. Ids beyond the tokenizer's are never targets, and
/// sampling leaves them out.
int64_t model_vocab(int64_t tokenizer_vocab) {
  constexpr int64_t kMultiple = 64;
  return (tokenizer_vocab + kMultiple - 1) / kMultiple * kMultiple;
}

GptConfig make_config(const ModelArgs& m, int tp_size = 1, int64_t tokenizer_vocab = 256) {
  auto c = GptConfig::preset(m.preset);
  c.vocab_size = model_vocab(tokenizer_vocab);
  if (m.d_model) c.d_model = *m.d_model;
  if (m.layers) c.n_layer = *m.layers;
  if (m.heads) c.n_head = *m.heads;
  if (m.context) c.context = *m.context;
  c.dropout = m.dropout;
  c.dtype = parse_dtype(m.dtype, "--dtype");
  c.validate(tp_size);
  return c;
}

/// A model ready for inference and the tokenizer its ids belong to.
struct LoadedModel {
  Gpt model;
  std::shared_ptr<const Tokenizer> tokenizer;
};

/// The tokenizer of a model at `path`: `option` when given; else what its configuration names
/// (`recorded`: "bytes", or a file train copied beside the model: looked for beside it and, for a
/// checkpoint, two directories up); else a tokenizer.json beside a Hugging Face model; else bytes.
std::shared_ptr<const Tokenizer> model_tokenizer(const std::string& path, const std::string& option,
                                                 const std::optional<std::string>& recorded, int64_t model_vocab_size) {
  std::string file = option;
  const fs::path dir = fs::is_directory(path) ? fs::path(path) : fs::path(path).parent_path();
  if (file.empty() && recorded && *recorded != "bytes") {
    for (const auto& d : {dir, dir.parent_path(), dir.parent_path().parent_path()}) {
      if (file.empty() && fs::exists(d / *recorded)) file = (d / *recorded).string();
    }
    ZTRAIN_CHECK(!file.empty(), "'", path, "' was trained with the tokenizer ", *recorded,
                 ", which is not beside it; pass --tokenizer");
  }
  if (file.empty() && !recorded && fs::exists(dir / "tokenizer.json")) file = (dir / "tokenizer.json").string();
  auto tokenizer = zt::gpt_app::load_tokenizer(file);
  ZTRAIN_CHECK(tokenizer->vocab_size() <= model_vocab_size, "the tokenizer ", file.empty() ? "bytes" : file, " has ",
               tokenizer->vocab_size(), " tokens, more than the model's vocabulary of ", model_vocab_size,
               file.empty() ? "; pass the model's --tokenizer" : "; pass the tokenizer it was trained with");
  return tokenizer;
}

/// The model of a file written by `train` (its configuration is in the file's metadata), of a
/// checkpoint directory (the configuration is in its manifest) or of a Hugging Face GPT-2
/// directory (config.json and model.safetensors, as save_pretrained writes them), ready for
/// inference, replicated (level 0) on every rank; with its tokenizer (model_tokenizer).
LoadedModel load_model(const std::string& path, const std::string& tokenizer_option) {
  GptConfig config;
  std::optional<std::string> recorded_tokenizer;
  std::string file = path;
  if (fs::is_directory(path) && !fs::exists(fs::path(path) / "manifest.json") &&
      fs::exists(fs::path(path) / "config.json")) {
    file = path + "/model.safetensors";
    ZTRAIN_CHECK(fs::exists(file), "'", path, "' has config.json but no model.safetensors (save_pretrained with "
                 "safe_serialization writes one)");
    std::ifstream in(path + "/config.json");
    const auto j = json::parse(in, nullptr, /*allow_exceptions=*/false);
    ZTRAIN_CHECK(!j.is_discarded(), "'", path, "/config.json' is not valid JSON");
    config = config_from_hf(j, path + "/config.json");
  } else if (fs::is_directory(path)) {
    file = path + "/model.safetensors";
    ZTRAIN_CHECK(fs::exists(path + "/manifest.json"), "'", path, "' is a directory without manifest.json: not a checkpoint");
    const auto extra = json::parse(zt::verify_checkpoint(path).extra_json);  // a damaged file is named
    ZTRAIN_CHECK(extra.contains("config"), "checkpoint '", path, "' was not written by ztrain-gpt train");
    config = config_from_json(extra.at("config"), path + "/manifest.json");
    recorded_tokenizer = zt::gpt_app::recorded_tokenizer(extra.at("config"), path + "/manifest.json");
  } else {
    zt::ckpt::SafetensorsReader reader(path);
    const auto& meta = reader.metadata();
    ZTRAIN_CHECK(meta.count("ztrain_gpt_config"), "'", path,
                 "' has no ztrain_gpt_config metadata: it was not written by ztrain-gpt train");
    config = config_from_text(meta.at("ztrain_gpt_config"), path);
    recorded_tokenizer = zt::gpt_app::recorded_tokenizer(json::parse(meta.at("ztrain_gpt_config")), path);
  }
  config.dropout = 0;
  Gpt model(config, {.zero_level = 0, .use_checkpoint = false});
  zt::load(*model, file, {.strict = false});
  model->eval();
  return {model, model_tokenizer(path, tokenizer_option, recorded_tokenizer, config.vocab_size)};
}

// ---- train ---------------------------------------------------------------------------------------

/// Crash tests: ZTRAIN_GPT_KILL="<phase>:<step>:<rank>" makes world rank <rank> die by SIGKILL at
/// the start of step <step> (phase "step") or inside the checkpoint save of step <step>, after its
/// files are written and before it is published (phase "save").
struct KillSwitch {
  std::string phase;
  int64_t step = -1;
  int rank = -1;

  static KillSwitch from_env() {
    KillSwitch k;
    if (const char* v = std::getenv("ZTRAIN_GPT_KILL")) {
      std::string s(v);
      const auto a = s.find(':'), b = s.rfind(':');
      ZTRAIN_CHECK(a != std::string::npos && b > a, "ZTRAIN_GPT_KILL must be <step|save>:<step>:<rank>, got '", s, "'");
      k = {s.substr(0, a), std::stoll(s.substr(a + 1, b - a - 1)), std::stoi(s.substr(b + 1))};
    }
    return k;
  }
  void at(const std::string& phase_now, int64_t step_now) const {
    if (phase_now == phase && step_now == step && zt::rank() == rank) ::raise(SIGKILL);
  }
};

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainArgs& a, torch::nn::Module& model) {
  const auto params = model.parameters();
  ZTRAIN_CHECK(!(a.offload && a.optimizer == "sgd"), "--offload needs --optimizer adamw or adam");
  ZTRAIN_CHECK(a.offload_dir.empty() || a.optimizer != "sgd", "--offload-dir needs --optimizer adamw or adam");
  if (a.optimizer == "sgd") return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(a.lr).momentum(0.9));
  auto options = (a.optimizer == "adam" ? zt::optim::AdamOptions::adam(a.lr) : zt::optim::AdamOptions(a.lr))
                     .betas({a.beta1, a.beta2})
                     .weight_decay(a.weight_decay);
  // Weight decay skips biases, norm weights and the embeddings (zt::optim::default_weight_decay).
  auto groups = zt::optim::weight_decay_groups(model, options);
  zt::optim::AdamEngineOptions engine;
  if (!a.offload_dir.empty()) engine.state_dir = a.offload_dir;
  if (a.offload) return std::make_unique<zt::optim::AdamOffload>(model, std::move(groups), options, engine);
  return std::make_unique<zt::optim::AdamW>(std::move(groups), options, engine);
}

std::shared_ptr<zt::LRScheduler> make_schedule(const TrainArgs& a) {
  zt::LRSchedulerOptions o{.peak_lr = a.lr, .warmup_steps = std::min(a.warmup, a.steps), .total_steps = a.steps};
  if (a.schedule == "constant") return std::make_shared<zt::lr_scheduler::NoDecay>(zt::LRSchedulerOptions{.peak_lr = a.lr, .warmup_steps = o.warmup_steps});
  o.min_lr = std::min(a.min_lr, a.lr);
  if (a.schedule == "linear") return std::make_shared<zt::lr_scheduler::Linear>(o);
  if (a.schedule == "wsd") {  // decay over the last fifth
    return std::make_shared<zt::lr_scheduler::WarmupStableDecay>(o, std::max<int64_t>(1, (a.steps - o.warmup_steps) / 5));
  }
  return std::make_shared<zt::lr_scheduler::Cosine>(o);
}

/// A validation loss: nats per token, and per byte of the text the target tokens stand for (the
/// measure that compares tokenizers; equal for bytes).
struct Validation {
  double loss = 0, loss_per_byte = 0;
};

/// Validation loss over the first `max_batches` validation batches, shared out over the
/// data-parallel ranks (batch i to dp rank i mod dp size) and summed over them. Forwards are
/// collective (ZeRO gathers, tensor- and pipeline-parallel exchanges), so every rank runs as many: a
/// rank short of one repeats its first batch and leaves it out. `loss` is the model's mean loss of
/// one batch; `byte_lengths` is the tokenizer's.
Validation evaluate(torch::nn::Module& model, const std::function<torch::Tensor(const torch::Tensor&)>& loss,
                    const Corpus& corpus, const std::vector<int64_t>& byte_lengths, int64_t seq, int64_t batch,
                    int64_t max_batches) {
  torch::NoGradGuard no_grad;
  model.eval();
  auto& dp = zt::runtime().dp();
  const auto batches = zt::gpt_app::validation_batches(corpus, seq, batch, max_batches);
  const auto n = static_cast<int64_t>(batches.size());
  double nats = 0, tokens = 0, bytes = 0;
  for (int64_t first = 0; first < n; first += dp.size()) {
    const int64_t i = first + dp.rank();
    const auto& b = batches[i < n ? i : 0];
    const double mean = loss(b.to(zt::runtime().device())).item<double>();
    if (i >= n) continue;
    const int64_t targets = b.size(0) * (b.size(1) - 1);
    nats += mean * static_cast<double>(targets);
    tokens += static_cast<double>(targets);
    const auto* ids = b.data_ptr<int64_t>();
    for (int64_t r = 0; r < b.size(0); ++r) {
      for (int64_t t = 1; t < b.size(1); ++t) bytes += static_cast<double>(byte_lengths.at(ids[r * b.size(1) + t]));
    }
  }
  auto sums = torch::tensor({nats, tokens, bytes}, torch::kFloat64).to(zt::runtime().device());
  dp.all_reduce(sums);
  sums = sums.cpu();
  const auto* s = sums.data_ptr<double>();
  model.train();
  return {s[0] / std::max(s[1], 1.0), s[0] / std::max(s[2], 1.0)};
}

/// What train runs: Gpt on the ZeRO engine, or PlainGpt under a Booster plugin (its pipeline
/// stages with --pp), behind one interface.
struct Trainee {
  std::shared_ptr<torch::nn::Module> module;
  /// A pipeline's forward and backward of one step's micro-batches through the manager's loss
  /// scaling, returning the mean loss (over the micro-batches and dp). Unset: accumulate().
  std::function<double(const std::vector<torch::Tensor>&, zt::optim::OptimManager&)> step;
  std::function<torch::Tensor(const torch::Tensor&)> loss;
  /// While the returned guard lives, backward passes hold their gradients unreduced (set by
  /// train() for a plugin, whose booster exists only once the optimizer does).
  std::function<std::shared_ptr<void>()> hold;
};

/// One step's micro-batches, forward and backward through the manager's loss scaling; the
/// gradients are reduced once, in the last micro-batch's backward. The mean loss over the
/// micro-batches and dp.
double accumulate(const Trainee& t, const std::vector<torch::Tensor>& micro_batches, zt::optim::OptimManager& mgr) {
  double sum = 0;
  for (size_t i = 0; i < micro_batches.size(); ++i) {
    std::shared_ptr<void> hold;
    if (i + 1 < micro_batches.size()) hold = t.hold();
    auto loss = t.loss(micro_batches[i]) / static_cast<double>(micro_batches.size());
    mgr.backward(loss);
    sum += loss.item<double>();
  }
  return zt::sum_loss(torch::tensor(sum)).item<double>();
}

/// The plugin --plugin names.
/// --offload-param-dir, if given.
std::optional<std::string> param_dir(const TrainArgs& a) {
  return a.offload_param_dir.empty() ? std::nullopt : std::optional<std::string>(a.offload_param_dir);
}

std::shared_ptr<zt::Plugin> make_plugin(const TrainArgs& a) {
  if (a.plugin == "ddp") return std::make_shared<zt::DataParallel>();
  if (a.plugin == "zero1" || a.plugin == "zero2") {
    return std::make_shared<zt::LowLevelZero>(zt::LowLevelZeroOptions{.stage = a.plugin == "zero1" ? 1 : 2});
  }
  if (a.plugin == "hybrid") {
    const auto schedule = zt::pipe::parse_schedule_kind(a.pipe_schedule);
    return std::make_shared<zt::HybridParallel>(zt::HybridParallelOptions{
        .tp_size = a.tp,
        .pp_size = a.pp,
        .schedule = schedule,
        .chunks = schedule == zt::pipe::ScheduleKind::kInterleaved1F1B ? a.chunks : 1,
        .zero_level = a.model.zero_level,
        .policy = zt::models::plain_gpt_policy(),
        .use_checkpoint = a.model.recompute});
  }
  return std::make_shared<zt::FullyShard>(
      zt::FullyShardOptions{.use_checkpoint = a.model.recompute, .offload_dir = param_dir(a)});
}

/// The model: the ZeRO engine's Gpt without a plugin, else PlainGpt — under HybridParallel made
/// for this rank's pipeline stage (its blocks only).
Trainee make_trainee(const TrainArgs& a, const GptConfig& config, zt::Plugin* plugin) {
  Trainee t;
  if (!plugin) {
    Gpt model(config, {.zero_level = a.model.zero_level, .use_checkpoint = a.model.recompute, .offload_dir = param_dir(a)});
    t.module = model.ptr();
    t.loss = [model](const torch::Tensor& b) mutable { return model->loss(b); };
    t.hold = [model]() mutable { return std::make_shared<zt::NoGradientSync>(*model); };
  } else {
    auto* hybrid = dynamic_cast<zt::HybridParallel*>(plugin);
    auto make = [&config] { return zt::models::PlainGpt(config); };
    auto model = hybrid ? hybrid->build(make) : make();
    t.module = model.ptr();
    t.loss = [model](const torch::Tensor& b) mutable { return model->loss(b); };
  }
  return t;
}

/// Micro-batches as a pipeline takes them: {tokens} each.
std::vector<std::vector<torch::Tensor>> as_lists(const std::vector<torch::Tensor>& micro_batches) {
  std::vector<std::vector<torch::Tensor>> lists;
  for (const auto& b : micro_batches) lists.push_back({b});
  return lists;
}

/// The file name a tokenizer gets beside a trained model ("bytes" for none).
std::string tokenizer_file_name(const Tokenizer& t) {
  return t.kind() == "bytes" ? "bytes" : t.kind() == "bpe" ? "tokenizer.json" : "tokenizer.model";
}

/// The corpus of `path` in `tokenizer`'s ids. A token file missing from the cache is written by
/// the first rank on each host while the others wait, then mapped by all; when that rank fails,
/// every rank raises. The wait's deadline grows with the corpus (the communication timeout plus
/// a second per 0.5 MB, below the slowest tokenizer measured), so that a large corpus is not
/// taken for a dead rank.
Corpus load_corpus(const std::string& path, const Tokenizer& tokenizer, double validation_fraction,
                   const std::string& cache_dir) {
  if (tokenizer.kind() == "bytes") return Corpus::load(path, validation_fraction);
  uintmax_t bytes = 0;
  for (const auto& f : zt::gpt_app::list_corpus(path)) bytes += fs::file_size(f);
  std::optional<Corpus> corpus;
  std::string error;
  if (zt::runtime().local_rank() == 0) {
    try {
      corpus = Corpus::load(path, tokenizer, validation_fraction, cache_dir);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  auto failed = torch::tensor({error.empty() ? 0.0f : 1.0f});
  auto& world = zt::runtime().world();
  const auto timeout = world.timeout();
  world.set_timeout(timeout + std::chrono::seconds(static_cast<int64_t>(bytes / 500000)));
  try {
    world.all_reduce(failed, zt::ReduceOp::kMax);
  } catch (...) {
    world.set_timeout(timeout);
    throw;
  }
  world.set_timeout(timeout);
  ZTRAIN_CHECK(error.empty(), error);
  ZTRAIN_CHECK(failed.item<float>() == 0, "tokenizing ", path, " failed on another rank (its message says why)");
  if (!corpus) corpus = Corpus::load(path, tokenizer, validation_fraction, cache_dir);
  return std::move(*corpus);
}

/// The newest checkpoint under `root` whose files match its manifest (rank 0 checks, every rank
/// gets its answer); the newer ones that do not are skipped, saying which and why. Raises when
/// there are checkpoints but none verifies: starting over would lose them to --keep-last.
std::optional<std::string> newest_verified_checkpoint(const std::string& root) {
  auto& world = zt::runtime().world();
  std::string chosen;
  int64_t skipped = 0;
  if (world.rank() == 0) {
    for (const auto& dir : zt::checkpoints(root)) {
      try {
        zt::verify_checkpoint(dir);
        chosen = dir;
        break;
      } catch (const zt::Error& e) {
        std::cout << "skipped checkpoint " << dir << ": " << e.what() << std::endl;
        ++skipped;
      }
    }
  }
  chosen = world.broadcast_bytes(chosen, 0);
  skipped = world.broadcast_object(skipped, 0);
  ZTRAIN_CHECK(!chosen.empty() || skipped == 0, "none of the ", skipped, " checkpoints under ", root,
               " verifies (each is named above); move them away to start over, or train into another --out");
  return chosen.empty() ? std::nullopt : std::optional(chosen);
}

/// Refuses a checkpoint of another model or tokenizer with what to do, before its tensors are read.
void check_resumable(const std::string& dir, const json& config) {
  std::ifstream in(dir + "/manifest.json");
  const auto extra = json::parse(in, nullptr, false);
  if (extra.is_discarded() || !extra.contains("extra") || !extra.at("extra").contains("config")) return;  // load says
  auto saved = extra.at("extra").at("config");
  if (!saved.contains("tokenizer")) saved["tokenizer"] = "bytes";
  ZTRAIN_CHECK(saved.at("tokenizer") == config.at("tokenizer") && saved.at("vocab_size") == config.at("vocab_size"),
               "checkpoint ", dir, " was trained on ", saved.at("tokenizer").get<std::string>(), " (vocabulary ",
               saved.at("vocab_size").get<int64_t>(), "), this run uses ", config.at("tokenizer").get<std::string>(),
               " (vocabulary ", config.at("vocab_size").get<int64_t>(),
               "): resume with the tokenizer it was trained with, or train into another --out");
}

int train(TrainArgs a) {
  ZTRAIN_CHECK(a.tp >= 1, "--tp must be >= 1, got ", a.tp);
  ZTRAIN_CHECK(a.pp >= 1, "--pp must be >= 1, got ", a.pp);
  ZTRAIN_CHECK(a.pp > 1 || !a.micro_batches, "--micro-batches needs --pp > 1 (use --grad-accum without pipeline stages)");
  ZTRAIN_CHECK(a.pp == 1 || a.grad_accum == 1, "with --pp, a step's micro-batches are --micro-batches, not --grad-accum");
  ZTRAIN_CHECK(a.plugin.empty() || a.plugin == "hybrid" || (a.tp == 1 && a.pp == 1), "--plugin ", a.plugin,
               " is data parallel only: --plugin hybrid takes --tp and --pp, and without --plugin --tp trains on the "
               "ZeRO engine");
  ZTRAIN_CHECK(a.offload_param_dir.empty() || a.plugin == "fsdp" || (a.plugin.empty() && a.model.zero_level >= 2),
               "--offload-param-dir keeps parameter shards on disk: it needs --zero-level 2 or 3, or --plugin fsdp");
  if (a.pp > 1) a.plugin = "hybrid";  // pipeline stages are HybridParallel's
  auto& rt = start({.seed = a.seed, .tp_size = a.tp, .pp_size = a.pp}, a.where);
  const int dp = rt.dp().size();
  const auto tokenizer = zt::gpt_app::load_tokenizer(a.tokenizer);
  const auto config = make_config(a.model, a.tp, tokenizer->vocab_size());
  a.seq = a.seq.value_or(config.context);
  ZTRAIN_CHECK(*a.seq <= config.context, "--seq ", *a.seq, " exceeds the model's context ", config.context);
  ZTRAIN_CHECK(a.steps > 0 && a.batch > 0 && a.grad_accum > 0, "--steps, --batch and --grad-accum must be > 0");
  const int64_t micro_batches = a.pp > 1 ? a.micro_batches.value_or(2 * a.pp) : a.grad_accum;
  ZTRAIN_CHECK(micro_batches > 0, "--micro-batches must be > 0, got ", micro_batches);
  const auto corpus = load_corpus(a.data, *tokenizer, a.validation_fraction,
                                  a.token_cache.empty() ? default_token_cache(a.out) : a.token_cache);
  corpus.check_sequence_length(*a.seq);
  const auto byte_lengths = tokenizer->byte_lengths();

  const auto plugin = a.plugin.empty() ? nullptr : make_plugin(a);
  auto trainee = make_trainee(a, config, plugin.get());
  auto& model = *trainee.module;
  zt::init_parameters(model, {.seed = a.seed, .init = zt::models::gpt_init(config)});
  auto opt = make_optimizer(a, model);
  const auto scaler = config.dtype == torch::kFloat16 ? zt::LossScaler::dynamic() : zt::LossScaler::off();
  std::optional<zt::Booster> booster;
  std::optional<zt::optim::OptimManager> own_manager;
  if (plugin) {
    booster.emplace(plugin, zt::BoosterOptions{.loss_scaler = scaler, .lr_scheduler = make_schedule(a)});
    booster->boost(model, *opt);
    trainee.hold = [&booster] { return std::make_shared<zt::Booster::NoSync>(booster->no_sync()); };
    if (a.pp > 1) {
      trainee.step = [&booster](const std::vector<torch::Tensor>& micro_batches, zt::optim::OptimManager&) {
        return booster->execute_pipeline(as_lists(micro_batches)).item<double>();
      };
      trainee.loss = [&booster](const torch::Tensor& b) { return booster->evaluate_pipeline(as_lists({b})); };
    }
  } else {
    own_manager.emplace(model, scaler);
    own_manager->add_optimizer(*opt, make_schedule(a));
  }
  auto& mgr = booster ? booster->manager() : *own_manager;
  // What checkpoints and the model file hold: the plugin's sharded view, or the model.
  auto& held = booster ? booster->plugin().boosted(model) : model;
  Sampler sampler(corpus.train_size(), *a.seq, a.batch, rt.dp().rank(), dp, a.seed);
  const zt::TrainingState state{held, *opt, mgr};
  const std::string ckpt_dir = a.ckpt_dir.empty() ? a.out + "/checkpoints" : a.ckpt_dir;

  const std::string tokenizer_name = tokenizer_file_name(*tokenizer);
  json model_config = config_json(config);
  model_config["tokenizer"] = tokenizer_name;
  int64_t step = 0;
  if (a.resume) {
    if (auto dir = newest_verified_checkpoint(ckpt_dir)) {
      check_resumable(*dir, model_config);
      const auto info = zt::load_checkpoint(*dir, state);
      if (booster) booster->plugin().after_update();
      sampler.set_state(json::parse(info.extra_json).at("sampler").get<zt::gpt_app::SamplerState>());
      step = info.step;
      zt::print_rank("resumed from ", *dir, " (step ", step, ", saved at ", info.world_size, " ranks)");
    } else {
      zt::print_rank("no checkpoint under ", ckpt_dir, ": starting from scratch");
    }
  }
  if (rt.rank() == 0) {
    fs::create_directories(a.out);
    // equivalent() reports an error when either file is missing (LWG 2937, GCC 13 on).
    const auto beside = a.out + "/" + tokenizer_name;
    if (tokenizer_name != "bytes" && (!fs::exists(beside) || !fs::equivalent(tokenizer->path(), beside))) {
      fs::copy_file(tokenizer->path(), beside, fs::copy_options::overwrite_existing);
    }
  }
  zt::synchronize();

  const int64_t tokens_per_step = a.batch * *a.seq * micro_batches * dp;
  const std::string pipeline =
      a.pp > 1 ? c10::str(", ", a.pipe_schedule, " pipeline of ", micro_batches, " micro-batches") : std::string();
  const bool hybrid = a.plugin == "hybrid";
  const std::string strategy =
      a.plugin.empty() ? c10::str("ZeRO level ", a.model.zero_level)
                       : c10::str("plugin ", booster->plugin().name(), " (", a.plugin,
                                  hybrid ? c10::str(", ZeRO level ", a.model.zero_level) : std::string(), ")");
  zt::print_rank("ztrain-gpt: ", config.num_parameters() / 1e6, " M parameters (", config.n_layer, " x ", config.d_model,
                 ", ", config.n_head, " heads, context ", config.context, ", ", dtype_name(config.dtype), "), ", strategy,
                 a.model.recompute && (a.plugin.empty() || a.plugin == "fsdp" || (hybrid && a.model.zero_level == 3))
                     ? " with recomputation"
                     : "", ", ", rt.world_size(), " rank(s) (dp ", dp, " x tp ", a.tp, " x pp ", a.pp, pipeline, ") x ",
                 rt.threads(), " thread(s) on ", rt.device(), "; ", tokens_per_step, " tokens per step; data ", corpus.source(), " (",
                 corpus.train_size(), " train / ", corpus.validation_size(), " validation tokens of ",
                 tokenizer_name == "bytes" ? "bytes" : tokenizer->path(), ", vocabulary ", tokenizer->vocab_size(), ")");

  std::optional<zt::gpt_app::MetricsLog> metrics;
  std::optional<zt::gpt_app::TensorBoardWriter> tensorboard;
  if (rt.rank() == 0) {
    metrics.emplace(a.out + "/metrics.jsonl");
    if (!a.tensorboard.empty()) tensorboard.emplace(a.tensorboard);
  }
  std::ostream discard(nullptr);  // other ranks' progress goes nowhere
  zt::gpt_app::ProgressBar bar(a.steps, zt::gpt_app::stdout_is_terminal() && rt.rank() == 0, {.start_step = step},
                               rt.rank() == 0 ? std::cout : discard);
  const auto kill = KillSwitch::from_env();
  const auto start = Clock::now();
  for (; step < a.steps; ++step) {
    kill.at("step", step + 1);
    const auto t0 = Clock::now();
    if (booster) {
      booster->zero_grad();
    } else {
      mgr.zero_grad();
    }
    std::vector<torch::Tensor> batches;
    for (int64_t micro = 0; micro < micro_batches; ++micro) batches.push_back(sampler.next(corpus).to(rt.device()));
    const double loss = trainee.step ? trainee.step(batches, mgr) : accumulate(trainee, batches, mgr);
    const double lr = mgr.current_lr();
    const double norm = a.grad_clip > 0 ? mgr.clip_grad_norm(a.grad_clip) : mgr.grad_norm();
    const bool applied = booster ? booster->step() : mgr.step();  // the booster's clips nothing more
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();

    const zt::gpt_app::StepMetrics m{.loss = loss, .lr = lr, .tokens_per_s = tokens_per_step / dt,
                                     .mem_bytes = zt::memory_stats(model).peak_rss_bytes,
                                     .time_s = std::chrono::duration<double>(Clock::now() - start).count()};
    json extra{{"grad_norm", norm}, {"skipped", !applied}, {"loss_scale", mgr.loss_scale()}};
    if (a.eval_interval > 0 && ((step + 1) % a.eval_interval == 0 || step + 1 == a.steps)) {
      const auto v = evaluate(model, trainee.loss, corpus, byte_lengths, *a.seq, a.batch, a.eval_batches);
      extra["val_loss"] = v.loss;
      extra["val_loss_per_byte"] = v.loss_per_byte;
      bar.print(c10::str("step ", step + 1, ": validation loss ", v.loss,
                         tokenizer_name == "bytes" ? "" : c10::str(" (", v.loss_per_byte, " per byte)")));
    }
    if (metrics) metrics->write(step + 1, m, extra);
    if (tensorboard) {
      for (const auto& [tag, value] : {std::pair<const char*, double>{"loss", m.loss}, {"lr", m.lr},
                                       {"tokens_per_s", m.tokens_per_s}, {"mem_bytes", static_cast<double>(m.mem_bytes)},
                                       {"grad_norm", norm}, {"loss_scale", mgr.loss_scale()}}) {
        tensorboard->scalar(tag, step + 1, value);
      }
      for (const char* tag : {"val_loss", "val_loss_per_byte"}) {
        if (extra.contains(tag)) tensorboard->scalar(tag, step + 1, extra[tag].get<double>());
      }
      tensorboard->flush();
    }
    bar.update(step + 1, m);
    if (a.ckpt_interval > 0 && (step + 1) % a.ckpt_interval == 0) {
      const auto dir = zt::save_checkpoint(ckpt_dir, step + 1, state,
                                           json{{"sampler", sampler.state()}, {"config", model_config}}.dump(),
                                           {.keep_last = a.keep_last, .before_publish = [&] { kill.at("save", step + 1); }});
      bar.print("checkpoint " + dir);
    }
  }
  bar.finish();
  zt::save(held, a.out + "/model.safetensors", {.metadata = {{"ztrain_gpt_config", model_config.dump()}}});
  if (rt.rank() == 0) std::ofstream(a.out + "/config.json") << hf_config_json(config).dump(2) << "\n";
  zt::print_rank("wrote ", a.out, "/model.safetensors, config.json", tokenizer_name == "bytes" ? "" : ", " + tokenizer_name,
                 " and metrics.jsonl");
  return 0;
}

// ---- eval, score, sample -------------------------------------------------------------------------

/// What eval, score and sample share: the model (a file, checkpoint or Hugging Face directory),
/// its tokenizer when not the one beside it, the device.
struct ModelSource {
  std::string model;
  std::string tokenizer;
  Placement where;
};

void add_model_source_options(CLI::App* app, ModelSource& m) {
  app->add_option("--model", m.model, "model.safetensors written by train, a checkpoint directory, or a Hugging Face "
                                      "GPT-2 directory")
      ->required();
  app->add_option("--tokenizer", m.tokenizer, "the model's tokenizer (default: the one beside the model, else bytes)");
  add_placement_options(app, m.where);
}

std::string precise(double v) {
  std::ostringstream s;
  s << std::setprecision(9) << v;
  return s.str();
}

int eval(const ModelSource& m, const std::string& data, const std::string& token_cache, double validation_fraction,
         int64_t seq, int64_t batch, int64_t max_batches) {
  start({}, m.where);
  auto [model, tokenizer] = load_model(m.model, m.tokenizer);
  const auto corpus = load_corpus(data, *tokenizer, validation_fraction, token_cache.empty() ? default_token_cache(".") : token_cache);
  const auto v = evaluate(*model, [&](const torch::Tensor& b) { return model->loss(b); }, corpus, tokenizer->byte_lengths(),
                          std::min(seq, model->config().context), batch, max_batches);
  zt::print_rank("val_loss=", precise(v.loss), " val_loss_per_byte=", precise(v.loss_per_byte));
  return 0;
}

/// The bytes of a file; raises naming it when it cannot be read.
std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  ZTRAIN_CHECK(in, "cannot read '", path, "'");
  return {(std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>()};
}

/// Mean next-token cross-entropy (nats) of a file's tokens as one sequence: windows of
/// context + 1 tokens overlapping by one, so every token after the first is predicted once, from
/// the preceding tokens of its window. Also per byte of the text the predicted tokens stand for.
int score(const ModelSource& m, const std::string& input, const std::string& logits_path) {
  auto& rt = start({}, m.where);
  auto [model, tokenizer] = load_model(m.model, m.tokenizer);
  const std::string text = read_text(input);
  const auto ids = tokenizer->encode(text);
  ZTRAIN_CHECK(ids.size() >= 2, "score: '", input, "' needs at least 2 tokens, it has ", ids.size());
  auto tokens = torch::tensor(std::vector<int64_t>(ids.begin(), ids.end()), torch::kLong).to(rt.device());
  const auto byte_lengths = tokenizer->byte_lengths();
  int64_t bytes = 0;
  for (size_t i = 1; i < ids.size(); ++i) bytes += byte_lengths.at(ids[i]);
  const int64_t window = model->config().context;
  torch::NoGradGuard no_grad;
  double total = 0;
  int64_t count = 0;
  for (int64_t begin = 0; begin + 1 < tokens.size(0); begin += window) {
    const int64_t len = std::min(window + 1, tokens.size(0) - begin);
    auto chunk = tokens.narrow(0, begin, len).unsqueeze(0);
    total += model->loss(chunk).item<double>() * (len - 1);
    count += len - 1;
  }
  zt::print_rank("loss=", precise(total / count), " loss_per_byte=", precise(total / std::max<int64_t>(bytes, 1)),
                 " tokens=", ids.size());
  if (!logits_path.empty() && rt.rank() == 0) {
    const auto first = tokens.narrow(0, 0, std::min(window, tokens.size(0))).unsqueeze(0);
    zt::ckpt::save_safetensors(logits_path, {{"logits", model(first).to(torch::kCPU, torch::kFloat32).contiguous()}});
  }
  return 0;
}

int sample(const ModelSource& m, const std::string& prompt, int64_t n, double temperature, int64_t top_k, uint64_t seed) {
  auto& rt = start({}, m.where);
  auto [model, tokenizer] = load_model(m.model, m.tokenizer);
  ZTRAIN_CHECK(temperature > 0, "--temperature must be > 0");
  auto gen = at::detail::createCPUGenerator(seed);
  auto ids = tokenizer->encode(prompt.empty() ? std::string("\n") : prompt);
  ZTRAIN_CHECK(!ids.empty(), "the prompt gives no tokens");
  const auto prompt_tokens = ids.size();
  const int64_t context = model->config().context, vocab = tokenizer->vocab_size();
  torch::NoGradGuard no_grad;
  for (int64_t i = 0; i < n; ++i) {
    const auto begin = ids.size() > static_cast<size_t>(context) ? ids.size() - context : 0;
    auto input = torch::tensor(std::vector<int64_t>(ids.begin() + static_cast<std::ptrdiff_t>(begin), ids.end()), torch::kLong)
                     .unsqueeze(0)
                     .to(rt.device());
    // The model's vocabulary may be padded beyond the tokenizer's: those ids are never drawn.
    auto logits = model(input).select(1, -1).squeeze(0).narrow(0, 0, vocab).to(torch::kCPU, torch::kFloat32) / temperature;
    if (top_k > 0 && top_k < logits.size(0)) {
      auto kth = std::get<0>(logits.topk(top_k)).min();
      logits = logits.masked_fill(logits < kth, -std::numeric_limits<float>::infinity());
    }
    ids.push_back(static_cast<int32_t>(torch::multinomial(torch::softmax(logits, -1), 1, false, gen).item<int64_t>()));
  }
  const auto text = prompt + tokenizer->decode({ids.begin() + static_cast<std::ptrdiff_t>(prompt_tokens), ids.end()});
  if (zt::rank() == 0) std::cout << text << std::endl;
  return 0;
}

// ---- tokenizer -------------------------------------------------------------------------------------

struct TokenizerTrainArgs {
  std::string data, out, kind = "bpe";
  int64_t vocab_size = 4096;
  std::vector<std::string> special{"<|endoftext|>"};
};

/// Learns a tokenizer from a corpus (a file or a directory, as train reads it).
int tokenizer_train(const TokenizerTrainArgs& a) {
  std::vector<std::string> files, texts;
  for (const auto& f : zt::gpt_app::list_corpus(a.data)) files.push_back(f.string());
  if (const auto dir = fs::path(a.out).parent_path(); !dir.empty()) fs::create_directories(dir);
  const auto t0 = Clock::now();
  if (a.kind == "bpe") {
    for (const auto& f : files) texts.push_back(read_text(f));
    const std::vector<std::string_view> views(texts.begin(), texts.end());
    const auto text = zt::gpt_app::train_bpe(views, {.vocab_size = a.vocab_size, .special_tokens = a.special});
    std::ofstream out(a.out, std::ios::binary);
    ZTRAIN_CHECK(out << text, "cannot write '", a.out, "'");
  } else {
    const std::string suffix = ".model";
    ZTRAIN_CHECK(a.out.size() > suffix.size() && a.out.compare(a.out.size() - suffix.size(), suffix.size(), suffix) == 0,
                 "a SentencePiece model's --out must end in .model, got '", a.out, "'");
    zt::gpt_app::train_sentencepiece(files, a.out.substr(0, a.out.size() - suffix.size()), a.vocab_size,
                                     a.kind == "sentencepiece-bpe" ? "bpe" : "unigram");
  }
  const auto tok = zt::gpt_app::load_tokenizer(a.out);
  std::cout << "wrote " << a.out << ": " << tok->kind() << ", vocabulary " << tok->vocab_size() << ", in "
            << std::chrono::duration<double>(Clock::now() - t0).count() << " s" << std::endl;
  return 0;
}

/// Ids of a text file as a JSON array; prints the count and the encoding's throughput.
int tokenizer_encode(const std::string& tokenizer_path, const std::string& input, const std::string& output) {
  const auto tok = zt::gpt_app::load_tokenizer(tokenizer_path);
  const auto text = read_text(input);
  const auto t0 = Clock::now();
  const auto ids = tok->encode(text);
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  if (!output.empty()) {
    std::ofstream out(output);
    ZTRAIN_CHECK(out << json(ids).dump() << "\n", "cannot write '", output, "'");
  }
  std::cout << "tokens=" << ids.size() << " bytes=" << text.size() << " seconds=" << seconds
            << " MB/s=" << static_cast<double>(text.size()) / 1e6 / seconds << std::endl;
  return 0;
}

/// Texts of a JSON array of ids (one text) or of arrays of ids (one text each), as a JSON array
/// of strings: special tokens skipped, invalid UTF-8 replaced, as `tokenizers`' decode.
int tokenizer_decode(const std::string& tokenizer_path, const std::string& input, const std::string& output) {
  const auto tok = zt::gpt_app::load_tokenizer(tokenizer_path);
  std::ifstream in(input);
  ZTRAIN_CHECK(in, "cannot read '", input, "'");
  const auto j = json::parse(in);
  ZTRAIN_CHECK(j.is_array(), "'", input, "' must hold a JSON array of ids or of arrays of ids");
  json texts = json::array();
  if (j.empty() || !j[0].is_array()) {
    texts.push_back(zt::gpt_app::utf8_lossy(tok->decode(j.get<std::vector<int32_t>>())));
  } else {
    for (const auto& ids : j) texts.push_back(zt::gpt_app::utf8_lossy(tok->decode(ids.get<std::vector<int32_t>>())));
  }
  std::ofstream out(output);
  ZTRAIN_CHECK(out << texts.dump() << "\n", "cannot write '", output, "'");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("ztrain-gpt: train a GPT-2-style language model with ztrain");
  app.require_subcommand(1);

  TrainArgs t;
  auto* train_cmd = app.add_subcommand("train", "train a model (launch with mpirun for several ranks)");
  add_model_options(train_cmd, t.model);
  train_cmd->add_option("--data", t.data, "a text file or a directory of text files")->required();
  train_cmd->add_option("--tokenizer", t.tokenizer, "a Hugging Face tokenizer.json (byte-level BPE) or a SentencePiece "
                                                    ".model (default: bytes, vocabulary 256)");
  train_cmd->add_option("--token-cache", t.token_cache, "directory of token files, so a corpus is tokenized once "
                                                        "(default: ~/.cache/ztrain/tokens)");
  train_cmd->add_option("--validation-fraction", t.validation_fraction, "share of the bytes held out")->capture_default_str();
  train_cmd->add_option("--optimizer", t.optimizer, "adamw, adam or sgd")
      ->check(CLI::IsMember({"adamw", "adam", "sgd"}))
      ->capture_default_str();
  train_cmd->add_flag("--offload", t.offload,
                      "adam/adamw: run the update on a background thread, overlapping the next forward (AdamOffload)");
  train_cmd->add_option("--offload-dir", t.offload_dir,
                        "adam/adamw: keep the optimizer state in files in this directory instead of memory, read in "
                        "before each parameter's update and written back after it (ZeRO-Infinity's offload to disk)");
  train_cmd->add_option("--offload-param-dir", t.offload_param_dir,
                        "with --zero-level 2 or 3 (or --plugin fsdp): keep each block's parameter and gradient shards in "
                        "files in this directory instead of memory, read in ahead of each gather (ZeRO-Infinity's "
                        "parameter offload; with --offload-dir the whole model state is on disk)");
  train_cmd->add_option("--lr", t.lr, "peak learning rate")->capture_default_str();
  train_cmd->add_option("--min-lr", t.min_lr, "learning rate at the end of the decay")->capture_default_str();
  std::vector<std::string> schedules;
  auto all_schedules = kLrSchedules;
  all_schedules.insert(all_schedules.end(), kPipeSchedules.begin(), kPipeSchedules.end());
  train_cmd->add_option("--schedule", schedules,
                        "the learning rate's: cosine (default), linear, wsd or constant (all with warmup); and/or the "
                        "pipeline's with --pp: 1f1b (default), gpipe or interleaved (e.g. --schedule cosine --schedule 1f1b)")
      ->check(CLI::IsMember(all_schedules));
  train_cmd->add_option("--warmup", t.warmup, "warmup steps")->capture_default_str();
  train_cmd->add_option("--weight-decay", t.weight_decay, "decoupled weight decay")->capture_default_str();
  train_cmd->add_option("--beta1", t.beta1)->capture_default_str();
  train_cmd->add_option("--beta2", t.beta2)->capture_default_str();
  train_cmd->add_option("--grad-clip", t.grad_clip, "clip the global gradient norm (0: off)")->capture_default_str();
  train_cmd->add_option("--batch", t.batch, "sequences per rank per micro-batch")->capture_default_str();
  train_cmd->add_option("--grad-accum", t.grad_accum, "micro-batches per step")->capture_default_str();
  train_cmd->add_option("--seq", t.seq, "sequence length (default: the model's context)");
  train_cmd->add_option("--steps", t.steps, "optimizer steps in total (a resumed run continues to it)")->capture_default_str();
  train_cmd->add_option("--eval-interval", t.eval_interval, "steps between validation losses (0: never)")->capture_default_str();
  train_cmd->add_option("--eval-batches", t.eval_batches, "validation batches per evaluation")->capture_default_str();
  train_cmd->add_option("--out", t.out, "directory for metrics.jsonl and model.safetensors")->capture_default_str();
  train_cmd->add_option("--ckpt-dir", t.ckpt_dir, "checkpoint directory (default: <out>/checkpoints)");
  train_cmd->add_option("--ckpt-interval", t.ckpt_interval, "steps between checkpoints (0: none)")->capture_default_str();
  train_cmd->add_option("--keep-last", t.keep_last, "checkpoints to keep (0: all)")->capture_default_str();
  train_cmd->add_flag("--resume", t.resume, "continue from the latest complete checkpoint, if any");
  train_cmd->add_option("--seed", t.seed)->capture_default_str();
  train_cmd->add_option("--tp", t.tp, "tensor-parallel size: each model replica is split over this many ranks "
                                      "(the rank count must be a multiple)")
      ->capture_default_str();
  train_cmd->add_option("--pp", t.pp, "pipeline stages: the blocks are cut into this many stages on consecutive groups "
                                      "of ranks (the rank count must be a multiple of tp x pp)")
      ->capture_default_str();
  train_cmd->add_option("--plugin", t.plugin,
                        "train the same GPT in plain modules through the Booster: ddp (DataParallel), zero1 or zero2 "
                        "(LowLevelZero stage 1 or 2), fsdp (FullyShard: ZeRO-3 per block, --recompute applies), "
                        "all in place of --zero-level and without --tp and --pp; or hybrid (HybridParallel: --tp "
                        "ranks per block, --pp stages, ZeRO --zero-level over the rest; what --pp implies)")
      ->check(CLI::IsMember({"ddp", "zero1", "zero2", "fsdp", "hybrid"}));
  train_cmd->add_option("--micro-batches", t.micro_batches,
                        "with --pp: micro-batches of --batch sequences per step (default 2 x pp)");
  train_cmd->add_option("--chunks", t.chunks, "with --schedule interleaved: model chunks per rank")->capture_default_str();
  add_placement_options(train_cmd, t.where);
  train_cmd->add_option("--tensorboard", t.tensorboard,
                        "also write the metrics as TensorBoard event files into this directory");

  std::string data, input, logits, prompt = "\n", output, token_cache;
  double validation_fraction = 0.05, temperature = 0.8;
  int64_t seq = 128, batch = 8, eval_batches = 8, tokens = 200, top_k = 40;
  uint64_t seed = 1;
  ModelSource source;
  auto* eval_cmd = app.add_subcommand("eval", "validation loss of a model: prints val_loss=<nats per token> "
                                              "val_loss_per_byte=<nats per byte>");
  add_model_source_options(eval_cmd, source);
  eval_cmd->add_option("--data", data, "the training corpus (its validation split is used)")->required();
  eval_cmd->add_option("--validation-fraction", validation_fraction)->capture_default_str();
  eval_cmd->add_option("--token-cache", token_cache, "directory of token files (default: ~/.cache/ztrain/tokens)");
  eval_cmd->add_option("--seq", seq)->capture_default_str();
  eval_cmd->add_option("--batch", batch)->capture_default_str();
  eval_cmd->add_option("--eval-batches", eval_batches)->capture_default_str();
  auto* score_cmd = app.add_subcommand("score", "mean next-token cross-entropy (nats) of a file: prints loss=<per token> "
                                                "loss_per_byte=<per byte> tokens=<count>");
  add_model_source_options(score_cmd, source);
  score_cmd->add_option("--input", input, "the text to score")->required();
  score_cmd->add_option("--logits", logits, "also write the logits of the first window (fp32) to this safetensors file");
  auto* sample_cmd = app.add_subcommand("sample", "generate text from a prompt");
  add_model_source_options(sample_cmd, source);
  sample_cmd->add_option("--prompt", prompt)->capture_default_str();
  sample_cmd->add_option("--tokens", tokens, "tokens to generate")->capture_default_str();
  sample_cmd->add_option("--temperature", temperature)->capture_default_str();
  sample_cmd->add_option("--top-k", top_k, "sample among the k likeliest tokens (0: all)")->capture_default_str();
  sample_cmd->add_option("--seed", seed)->capture_default_str();

  auto* tokenizer_cmd = app.add_subcommand("tokenizer", "train a tokenizer, or encode and decode with one");
  tokenizer_cmd->require_subcommand(1);
  TokenizerTrainArgs tt;
  auto* tok_train = tokenizer_cmd->add_subcommand("train", "learn a tokenizer from a corpus");
  tok_train->add_option("--data", tt.data, "a text file or a directory of text files")->required();
  tok_train->add_option("--vocab-size", tt.vocab_size, "tokens in the vocabulary, special tokens and bytes included")
      ->capture_default_str();
  tok_train->add_option("--out", tt.out, "tokenizer.json (bpe), or NAME.model (sentencepiece-*)")->required();
  tok_train->add_option("--kind", tt.kind, "bpe (byte-level, Hugging Face tokenizer.json), sentencepiece-bpe or "
                                           "sentencepiece-unigram")
      ->check(CLI::IsMember({"bpe", "sentencepiece-bpe", "sentencepiece-unigram"}))
      ->capture_default_str();
  tok_train->add_option("--special", tt.special, "special tokens of a bpe tokenizer, ids 0, 1, ...")->capture_default_str();
  std::string tokenizer_path;
  auto* tok_encode = tokenizer_cmd->add_subcommand("encode", "ids of a text file as a JSON array; prints their count and MB/s");
  tok_encode->add_option("--tokenizer", tokenizer_path, "tokenizer.json or a SentencePiece .model")->required();
  tok_encode->add_option("--input", input, "the text")->required();
  tok_encode->add_option("--output", output, "where the ids go (default: nowhere, only the count)");
  auto* tok_decode = tokenizer_cmd->add_subcommand("decode", "texts of ids: a JSON array of ids, or of arrays of ids, to a "
                                                             "JSON array of strings");
  tok_decode->add_option("--tokenizer", tokenizer_path, "tokenizer.json or a SentencePiece .model")->required();
  tok_decode->add_option("--input", input, "the ids (JSON)")->required();
  tok_decode->add_option("--output", output, "the texts (JSON)")->required();

  CLI11_PARSE(app, argc, argv);
  for (const auto& s : schedules) {
    const bool lr = std::find(kLrSchedules.begin(), kLrSchedules.end(), s) != kLrSchedules.end();
    (lr ? t.schedule : t.pipe_schedule) = s;
  }
  try {
    if (*train_cmd) return train(t);
    if (*eval_cmd) return eval(source, data, token_cache, validation_fraction, seq, batch, eval_batches);
    if (*score_cmd) return score(source, input, logits);
    if (*sample_cmd) return sample(source, prompt, tokens, temperature, top_k, seed);
    if (*tok_train) return tokenizer_train(tt);
    if (*tok_encode) return tokenizer_encode(tokenizer_path, input, output);
    if (*tok_decode) return tokenizer_decode(tokenizer_path, input, output);
  } catch (const zt::CommError& e) {
    std::cerr << "ztrain-gpt: " << e.what() << std::endl;  // every rank meets its own
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "ztrain-gpt: " << e.what() << std::endl;
    // Perhaps this rank's alone: the others would wait for it until their deadline.
    if (zt::is_initialized() && zt::world_size() > 1) zt::abort_distributed(1);
    return 1;
  }
  return 0;
}
