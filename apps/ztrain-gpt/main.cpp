// ztrain-gpt: train a GPT on your own text, evaluate it, score a file, sample from it, plot.
//
//   mpirun -np 2 ztrain-gpt train --data corpus.txt --preset small --steps 1000 --out runs/gpt
//   ztrain-gpt score --model runs/gpt/model.safetensors --input some.txt
//   ztrain-gpt sample --model runs/gpt/model.safetensors --prompt "ROMEO:" --tokens 200
//   ztrain-gpt plot --metrics runs/gpt/metrics.jsonl --out runs/gpt
//
// See docs/ztrain-gpt.md for every option.
#include "data.h"
#include "plot.h"
#include "progress.h"
#include "tensorboard.h"

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
using zt::gpt_app::ByteCorpus;
using zt::gpt_app::Sampler;
using zt::models::Gpt;
using zt::models::GptConfig;
using zt::models::GptPipeline;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

// ---- options -------------------------------------------------------------------------------------

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
  std::optional<int64_t> micro_batches;  // with pp: per step (default 2 × pp)
  int chunks = 2;                        // per rank, with the interleaved schedule
  bool offload = false;
  std::optional<std::string> device;  // not set: ZTRAIN_DEVICE, else the CPU
  std::string tensorboard;            // event files' directory; empty: none
};

const std::vector<std::string> kLrSchedules{"cosine", "linear", "wsd", "constant"};
const std::vector<std::string> kPipeSchedules{"gpipe", "1f1b", "interleaved"};

void add_device_option(CLI::App* app, std::optional<std::string>& device) {
  app->add_option("--device", device,
                  "cpu, cuda (one device per rank on each host) or cuda:N (default: ZTRAIN_DEVICE, else cpu)");
}

/// init_distributed on --device when given.
zt::Runtime& start(zt::InitOptions options, const std::optional<std::string>& device) {
  if (device) {
    options.device = zt::parse_device(*device, "--device");
    zt::resolve_device(*options.device, "--device");  // refused here, naming the option
  }
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

c10::ScalarType parse_dtype(const std::string& s) {
  if (s == "bf16") return torch::kBFloat16;
  if (s == "fp16") return torch::kFloat16;
  return torch::kFloat32;
}

std::string dtype_name(c10::ScalarType t) {
  return t == torch::kBFloat16 ? "bf16" : t == torch::kFloat16 ? "fp16" : "fp32";
}

GptConfig make_config(const ModelArgs& m, int tp_size = 1) {
  auto c = GptConfig::preset(m.preset);
  c.vocab_size = 256;  // byte-level tokens
  if (m.d_model) c.d_model = *m.d_model;
  if (m.layers) c.n_layer = *m.layers;
  if (m.heads) c.n_head = *m.heads;
  if (m.context) c.context = *m.context;
  c.dropout = m.dropout;
  c.dtype = parse_dtype(m.dtype);
  c.validate(tp_size);
  return c;
}

json config_json(const GptConfig& c) {
  return {{"vocab_size", c.vocab_size}, {"context", c.context}, {"d_model", c.d_model}, {"n_layer", c.n_layer},
          {"n_head", c.n_head},         {"dropout", c.dropout}, {"layer_norm_eps", c.layer_norm_eps},
          {"dtype", dtype_name(c.dtype)}};
}

/// The model's configuration as Hugging Face's GPT2Config (config.json beside model.safetensors),
/// so that transformers' GPT2LMHeadModel.from_pretrained loads a trained model's directory.
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

/// A GPT2Config (config.json of a Hugging Face model directory) as the model it describes;
/// refuses what this GPT does not compute the same way.
GptConfig config_from_hf(const json& j, const std::string& path) {
  auto check = [&](const char* key, const json& want) {
    ZTRAIN_CHECK(!j.contains(key) || j.at(key).is_null() || j.at(key) == want, "'", path, "': ", key, " = ",
                 j.at(key).dump(), " is not supported (this GPT has ", want.dump(), ")");
  };
  ZTRAIN_CHECK(j.value("model_type", "") == "gpt2", "'", path, "' is not a GPT-2 configuration (model_type ",
               j.value("model_type", std::string("missing")), ")");
  check("activation_function", "gelu_new");
  check("tie_word_embeddings", true);
  check("scale_attn_weights", true);
  check("scale_attn_by_inverse_layer_idx", false);
  check("add_cross_attention", false);
  ZTRAIN_CHECK(!j.contains("n_inner") || j.at("n_inner").is_null() || j.at("n_inner") == 4 * j.at("n_embd").get<int64_t>(),
               "'", path, "': n_inner must be 4 x n_embd");
  const std::string dtype = j.value("torch_dtype", "float32");
  return {.vocab_size = j.at("vocab_size"), .context = j.at("n_positions"), .d_model = j.at("n_embd"),
          .n_layer = j.at("n_layer"), .n_head = j.at("n_head"), .dropout = 0.0,
          .layer_norm_eps = j.value("layer_norm_epsilon", 1e-5),
          .dtype = dtype == "bfloat16" ? torch::kBFloat16 : dtype == "float16" ? torch::kFloat16 : torch::kFloat32};
}

GptConfig config_from_json(const json& j) {
  return {.vocab_size = j.at("vocab_size"), .context = j.at("context"), .d_model = j.at("d_model"),
          .n_layer = j.at("n_layer"), .n_head = j.at("n_head"), .dropout = j.value("dropout", 0.0),
          .layer_norm_eps = j.value("layer_norm_eps", 1e-5), .dtype = parse_dtype(j.value("dtype", "fp32"))};
}

/// The model of a file written by `train` (its configuration is in the file's metadata), of a
/// checkpoint directory (the configuration is in its manifest) or of a Hugging Face GPT-2
/// directory (config.json and model.safetensors, as save_pretrained writes them), ready for
/// inference, replicated (level 0) on every rank.
Gpt load_model(const std::string& path) {
  GptConfig config;
  std::string file = path;
  if (fs::is_directory(path) && !fs::exists(fs::path(path) / "manifest.json") &&
      fs::exists(fs::path(path) / "config.json")) {
    file = path + "/model.safetensors";
    ZTRAIN_CHECK(fs::exists(file), "'", path, "' has config.json but no model.safetensors (save_pretrained with "
                 "safe_serialization writes one)");
    std::ifstream in(path + "/config.json");
    config = config_from_hf(json::parse(in), path + "/config.json");
  } else if (fs::is_directory(path)) {
    file = path + "/model.safetensors";
    std::ifstream manifest(path + "/manifest.json");
    ZTRAIN_CHECK(manifest, "'", path, "' is a directory without manifest.json: not a checkpoint");
    const auto extra = json::parse(manifest).at("extra");
    ZTRAIN_CHECK(extra.contains("config"), "checkpoint '", path, "' was not written by ztrain-gpt train");
    config = config_from_json(extra.at("config"));
  } else {
    zt::ckpt::SafetensorsReader reader(path);
    const auto& meta = reader.metadata();
    ZTRAIN_CHECK(meta.count("ztrain_gpt_config"), "'", path,
                 "' has no ztrain_gpt_config metadata: it was not written by ztrain-gpt train");
    config = config_from_json(json::parse(meta.at("ztrain_gpt_config")));
  }
  config.dropout = 0;
  Gpt model(config, {.zero_level = 0, .use_checkpoint = false});
  zt::load(*model, file, {.strict = false});
  model->eval();
  return model;
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
  if (a.optimizer == "sgd") return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(a.lr).momentum(0.9));
  auto options = (a.optimizer == "adam" ? zt::optim::AdamOptions::adam(a.lr) : zt::optim::AdamOptions(a.lr))
                     .betas({a.beta1, a.beta2})
                     .weight_decay(a.weight_decay);
  if (a.offload) return std::make_unique<zt::optim::AdamOffload>(model, options);
  return std::make_unique<zt::optim::AdamW>(params, options);
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

/// Mean validation loss over the first `max_batches` validation batches; every rank evaluates
/// the same batches (forwards are collective). `loss` is the model's loss of one batch.
double evaluate(torch::nn::Module& model, const std::function<torch::Tensor(const torch::Tensor&)>& loss,
                const ByteCorpus& corpus, int64_t seq, int64_t batch, int64_t max_batches) {
  torch::NoGradGuard no_grad;
  model.eval();
  double sum = 0;
  int64_t count = 0;
  for (const auto& b : zt::gpt_app::validation_batches(corpus, seq, batch, max_batches)) {
    sum += loss(b.to(zt::runtime().device())).item<double>() * b.size(0);
    count += b.size(0);
  }
  model.train();
  return sum / std::max<int64_t>(count, 1);
}

double evaluate(Gpt& model, const ByteCorpus& corpus, int64_t seq, int64_t batch, int64_t max_batches) {
  return evaluate(*model, [&](const torch::Tensor& b) { return model->loss(b); }, corpus, seq, batch, max_batches);
}

/// What train runs: Gpt, or GptPipeline with several pipeline stages, behind one interface.
struct Trainee {
  std::shared_ptr<torch::nn::Module> module;
  /// Forward and backward of one step's micro-batches through the manager's loss scaling;
  /// returns the mean loss (over the micro-batches and dp).
  std::function<double(const std::vector<torch::Tensor>&, zt::optim::OptimManager&)> step;
  std::function<torch::Tensor(const torch::Tensor&)> loss;
};

Trainee make_trainee(const TrainArgs& a, const GptConfig& config) {
  const zt::BlockOptions blocks{.zero_level = a.model.zero_level, .use_checkpoint = a.model.recompute};
  if (a.pp == 1) {
    Gpt model(config, blocks);
    return {model.ptr(),
            [model](const std::vector<torch::Tensor>& micro_batches, zt::optim::OptimManager& mgr) mutable {
              double sum = 0;
              for (const auto& mb : micro_batches) {
                auto loss = model->loss(mb) / static_cast<double>(micro_batches.size());
                mgr.backward(loss);
                sum += loss.item<double>();
              }
              return zt::sum_loss(torch::tensor(sum)).item<double>();
            },
            [model](const torch::Tensor& b) mutable { return model->loss(b); }};
  }
  const auto kind = zt::pipe::parse_schedule_kind(a.pipe_schedule);
  GptPipeline model(config, blocks,
                    {.schedule = kind, .chunks = kind == zt::pipe::ScheduleKind::kInterleaved1F1B ? a.chunks : 1});
  return {model.ptr(),
          [model](const std::vector<torch::Tensor>& micro_batches, zt::optim::OptimManager& mgr) mutable {
            return model->forward_backward_step(micro_batches, mgr.loss_scale()).item<double>();
          },
          [model](const torch::Tensor& b) mutable { return model->loss({b}); }};
}

int train(TrainArgs a) {
  ZTRAIN_CHECK(a.tp >= 1, "--tp must be >= 1, got ", a.tp);
  ZTRAIN_CHECK(a.pp >= 1, "--pp must be >= 1, got ", a.pp);
  ZTRAIN_CHECK(a.pp > 1 || !a.micro_batches, "--micro-batches needs --pp > 1 (use --grad-accum without pipeline stages)");
  ZTRAIN_CHECK(a.pp == 1 || a.grad_accum == 1, "with --pp, a step's micro-batches are --micro-batches, not --grad-accum");
  auto& rt = start({.seed = a.seed, .tp_size = a.tp, .pp_size = a.pp}, a.device);
  const int dp = rt.dp().size();
  const auto config = make_config(a.model, a.tp);
  a.seq = a.seq.value_or(config.context);
  ZTRAIN_CHECK(*a.seq <= config.context, "--seq ", *a.seq, " exceeds the model's context ", config.context);
  ZTRAIN_CHECK(a.steps > 0 && a.batch > 0 && a.grad_accum > 0, "--steps, --batch and --grad-accum must be > 0");
  const int64_t micro_batches = a.pp > 1 ? a.micro_batches.value_or(2 * a.pp) : a.grad_accum;
  ZTRAIN_CHECK(micro_batches > 0, "--micro-batches must be > 0, got ", micro_batches);
  const auto corpus = ByteCorpus::load(a.data, a.validation_fraction);
  corpus.check_sequence_length(*a.seq);

  auto trainee = make_trainee(a, config);
  auto& model = *trainee.module;
  zt::init_parameters(model, {.seed = a.seed, .init = zt::models::gpt_init(config)});
  auto opt = make_optimizer(a, model);
  zt::optim::OptimManager mgr(model, config.dtype == torch::kFloat16 ? zt::LossScaler::dynamic() : zt::LossScaler::off());
  mgr.add_optimizer(*opt, make_schedule(a));
  Sampler sampler(corpus.train_size(), *a.seq, a.batch, rt.dp().rank(), dp, a.seed);
  const zt::TrainingState state{model, *opt, mgr};
  const std::string ckpt_dir = a.ckpt_dir.empty() ? a.out + "/checkpoints" : a.ckpt_dir;

  int64_t step = 0;
  if (a.resume) {
    if (auto dir = zt::latest_checkpoint(ckpt_dir)) {
      const auto info = zt::load_checkpoint(*dir, state);
      sampler.set_state(json::parse(info.extra_json).at("sampler").get<zt::gpt_app::SamplerState>());
      step = info.step;
      zt::print_rank("resumed from ", *dir, " (step ", step, ", saved at ", info.world_size, " ranks)");
    } else {
      zt::print_rank("no checkpoint under ", ckpt_dir, ": starting from scratch");
    }
  }
  if (rt.rank() == 0) fs::create_directories(a.out);
  zt::synchronize();

  const int64_t tokens_per_step = a.batch * *a.seq * micro_batches * dp;
  const std::string pipeline =
      a.pp > 1 ? c10::str(", ", a.pipe_schedule, " pipeline of ", micro_batches, " micro-batches") : std::string();
  zt::print_rank("ztrain-gpt: ", config.num_parameters() / 1e6, " M parameters (", config.n_layer, " x ", config.d_model,
                 ", ", config.n_head, " heads, context ", config.context, ", ", dtype_name(config.dtype), "), ZeRO level ",
                 a.model.zero_level, a.model.recompute ? " with recomputation" : "", ", ", rt.world_size(), " rank(s) (dp ", dp, " x tp ", a.tp, " x pp ", a.pp, pipeline, ") x ",
                 rt.threads(), " thread(s) on ", rt.device(), "; ", tokens_per_step, " tokens per step; data ", corpus.source(), " (",
                 corpus.train_size(), " train / ", corpus.validation_size(), " validation bytes)");

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
    mgr.zero_grad();
    std::vector<torch::Tensor> batches;
    for (int64_t micro = 0; micro < micro_batches; ++micro) batches.push_back(sampler.next(corpus).to(rt.device()));
    const double loss = trainee.step(batches, mgr);
    const double lr = mgr.current_lr();
    const double norm = a.grad_clip > 0 ? mgr.clip_grad_norm(a.grad_clip) : mgr.grad_norm();
    const bool applied = mgr.step();
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();

    const zt::gpt_app::StepMetrics m{.loss = loss, .lr = lr, .tokens_per_s = tokens_per_step / dt,
                                     .mem_bytes = zt::memory_stats(model).peak_rss_bytes,
                                     .time_s = std::chrono::duration<double>(Clock::now() - start).count()};
    json extra{{"grad_norm", norm}, {"skipped", !applied}, {"loss_scale", mgr.loss_scale()}};
    if (a.eval_interval > 0 && ((step + 1) % a.eval_interval == 0 || step + 1 == a.steps)) {
      extra["val_loss"] = evaluate(model, trainee.loss, corpus, *a.seq, a.batch, a.eval_batches);
      bar.print(c10::str("step ", step + 1, ": validation loss ", extra["val_loss"].get<double>()));
    }
    if (metrics) metrics->write(step + 1, m, extra);
    if (tensorboard) {
      for (const auto& [tag, value] : {std::pair<const char*, double>{"loss", m.loss}, {"lr", m.lr},
                                       {"tokens_per_s", m.tokens_per_s}, {"mem_bytes", static_cast<double>(m.mem_bytes)},
                                       {"grad_norm", norm}, {"loss_scale", mgr.loss_scale()}}) {
        tensorboard->scalar(tag, step + 1, value);
      }
      if (extra.contains("val_loss")) tensorboard->scalar("val_loss", step + 1, extra["val_loss"].get<double>());
      tensorboard->flush();
    }
    bar.update(step + 1, m);
    if (a.ckpt_interval > 0 && (step + 1) % a.ckpt_interval == 0) {
      const auto dir = zt::save_checkpoint(ckpt_dir, step + 1, state,
                                           json{{"sampler", sampler.state()}, {"config", config_json(config)}}.dump(),
                                           {.keep_last = a.keep_last, .before_publish = [&] { kill.at("save", step + 1); }});
      bar.print("checkpoint " + dir);
    }
  }
  bar.finish();
  zt::save(model, a.out + "/model.safetensors", {.metadata = {{"ztrain_gpt_config", config_json(config).dump()}}});
  if (rt.rank() == 0) std::ofstream(a.out + "/config.json") << hf_config_json(config).dump(2) << "\n";
  zt::print_rank("wrote ", a.out, "/model.safetensors, config.json and metrics.jsonl");
  return 0;
}

// ---- eval, score, sample, plot -------------------------------------------------------------------

int eval(const std::string& model_path, const std::string& data, double validation_fraction, int64_t seq,
         int64_t batch, int64_t max_batches, const std::optional<std::string>& device) {
  start({}, device);
  auto model = load_model(model_path);
  const auto corpus = ByteCorpus::load(data, validation_fraction);
  zt::print_rank("val_loss=", evaluate(model, corpus, std::min(seq, model->config().context), batch, max_batches));
  return 0;
}

/// Mean next-byte cross-entropy (nats) of a file's bytes as one sequence: windows of
/// context + 1 bytes overlapping by one, so every byte after the first is predicted once, from
/// the preceding bytes of its window.
int score(const std::string& model_path, const std::string& input, const std::string& logits_path,
          const std::optional<std::string>& device) {
  auto& rt = start({}, device);
  auto model = load_model(model_path);
  std::ifstream in(input, std::ios::binary);
  ZTRAIN_CHECK(in, "score: cannot read '", input, "'");
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ZTRAIN_CHECK(bytes.size() >= 2, "score: '", input, "' needs at least 2 bytes, it has ", bytes.size());
  auto tokens =
      torch::from_blob(bytes.data(), {static_cast<int64_t>(bytes.size())}, torch::kUInt8).to(rt.device(), torch::kLong);
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
  std::ostringstream loss;
  loss << std::setprecision(9) << total / count;
  zt::print_rank("loss=", loss.str());
  if (!logits_path.empty() && rt.rank() == 0) {
    const auto first = tokens.narrow(0, 0, std::min(window, tokens.size(0))).unsqueeze(0);
    zt::ckpt::save_safetensors(logits_path, {{"logits", model(first).to(torch::kCPU, torch::kFloat32).contiguous()}});
  }
  return 0;
}

int sample(const std::string& model_path, const std::string& prompt, int64_t n, double temperature, int64_t top_k,
           uint64_t seed, const std::optional<std::string>& device) {
  auto& rt = start({}, device);
  auto model = load_model(model_path);
  ZTRAIN_CHECK(temperature > 0, "--temperature must be > 0");
  auto gen = at::detail::createCPUGenerator(seed);
  std::string text = prompt.empty() ? std::string("\n") : prompt;
  torch::NoGradGuard no_grad;
  for (int64_t i = 0; i < n; ++i) {
    const auto ctx = text.substr(text.size() > static_cast<size_t>(model->config().context)
                                     ? text.size() - model->config().context
                                     : 0);
    auto ids = torch::from_blob(const_cast<char*>(ctx.data()), {1, static_cast<int64_t>(ctx.size())}, torch::kUInt8)
                   .to(rt.device(), torch::kLong);
    auto logits = model(ids).select(1, -1).squeeze(0).to(torch::kCPU, torch::kFloat32) / temperature;
    if (top_k > 0 && top_k < logits.size(0)) {
      auto kth = std::get<0>(logits.topk(top_k)).min();
      logits = logits.masked_fill(logits < kth, -std::numeric_limits<float>::infinity());
    }
    const auto next = torch::multinomial(torch::softmax(logits, -1), 1, false, gen).item<int64_t>();
    text.push_back(static_cast<char>(next));
  }
  if (zt::rank() == 0) std::cout << text << std::endl;
  return 0;
}

int plot(const std::string& metrics, const std::string& out) {
  for (const auto& p : zt::gpt_app::plot_metrics(metrics, out)) std::cout << "wrote " << p << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("ztrain-gpt: train a GPT-2-style byte-level language model with ztrain");
  app.require_subcommand(1);

  TrainArgs t;
  auto* train_cmd = app.add_subcommand("train", "train a model (launch with mpirun for several ranks)");
  add_model_options(train_cmd, t.model);
  train_cmd->add_option("--data", t.data, "a text file or a directory of text files")->required();
  train_cmd->add_option("--validation-fraction", t.validation_fraction, "share of the bytes held out")->capture_default_str();
  train_cmd->add_option("--optimizer", t.optimizer, "adamw, adam or sgd")
      ->check(CLI::IsMember({"adamw", "adam", "sgd"}))
      ->capture_default_str();
  train_cmd->add_flag("--offload", t.offload,
                      "adam/adamw: run the update on a background thread, overlapping the next forward (AdamOffload)");
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
  train_cmd->add_option("--micro-batches", t.micro_batches,
                        "with --pp: micro-batches of --batch sequences per step (default 2 x pp)");
  train_cmd->add_option("--chunks", t.chunks, "with --schedule interleaved: model chunks per rank")->capture_default_str();
  add_device_option(train_cmd, t.device);
  train_cmd->add_option("--tensorboard", t.tensorboard,
                        "also write the metrics as TensorBoard event files into this directory");

  std::string model_path, data, input, logits, prompt = "\n", metrics, out = ".";
  double validation_fraction = 0.05, temperature = 0.8;
  int64_t seq = 128, batch = 8, eval_batches = 8, tokens = 200, top_k = 40;
  uint64_t seed = 1;
  std::optional<std::string> device;
  auto* eval_cmd = app.add_subcommand("eval", "validation loss of a model file or a checkpoint");
  eval_cmd->add_option("--model", model_path, "model.safetensors written by train, or a checkpoint directory")
      ->required();
  eval_cmd->add_option("--data", data, "the training corpus (its validation split is used)")->required();
  eval_cmd->add_option("--validation-fraction", validation_fraction)->capture_default_str();
  eval_cmd->add_option("--seq", seq)->capture_default_str();
  eval_cmd->add_option("--batch", batch)->capture_default_str();
  eval_cmd->add_option("--eval-batches", eval_batches)->capture_default_str();
  add_device_option(eval_cmd, device);
  auto* score_cmd = app.add_subcommand("score", "mean next-byte cross-entropy (nats) of a file: prints loss=<value>");
  score_cmd->add_option("--model", model_path)->required();
  score_cmd->add_option("--input", input, "the text to score")->required();
  score_cmd->add_option("--logits", logits, "also write the logits of the first window (fp32) to this safetensors file");
  add_device_option(score_cmd, device);
  auto* sample_cmd = app.add_subcommand("sample", "generate text from a prompt");
  sample_cmd->add_option("--model", model_path)->required();
  sample_cmd->add_option("--prompt", prompt)->capture_default_str();
  sample_cmd->add_option("--tokens", tokens, "bytes to generate")->capture_default_str();
  sample_cmd->add_option("--temperature", temperature)->capture_default_str();
  sample_cmd->add_option("--top-k", top_k, "sample among the k likeliest bytes (0: all)")->capture_default_str();
  sample_cmd->add_option("--seed", seed)->capture_default_str();
  add_device_option(sample_cmd, device);
  auto* plot_cmd = app.add_subcommand("plot", "PNG plots of a metrics.jsonl: loss.png and throughput.png");
  plot_cmd->add_option("--metrics", metrics)->required();
  plot_cmd->add_option("--out", out, "output directory")->capture_default_str();

  CLI11_PARSE(app, argc, argv);
  for (const auto& s : schedules) {
    const bool lr = std::find(kLrSchedules.begin(), kLrSchedules.end(), s) != kLrSchedules.end();
    (lr ? t.schedule : t.pipe_schedule) = s;
  }
  try {
    if (*train_cmd) return train(t);
    if (*eval_cmd) return eval(model_path, data, validation_fraction, seq, batch, eval_batches, device);
    if (*score_cmd) return score(model_path, input, logits, device);
    if (*sample_cmd) return sample(model_path, prompt, tokens, temperature, top_k, seed, device);
    if (*plot_cmd) return plot(metrics, out);
  } catch (const std::exception& e) {
    std::cerr << "ztrain-gpt: " << e.what() << std::endl;
    return 1;
  }
  return 0;
}
