// gpt_bench: one GPT training configuration, measured. Tokens/s, time per phase, model-state
// bytes per rank against the ZeRO formula, bytes sent per step against theory, and model FLOP/s
// against a matmul peak measured in the same run. Rank 0 prints one JSON object per run.
//
//   mpirun -np 2 --bind-to none build/bench/gpt_bench --preset small --level 3 --dtype bf16
//   (options: --data data/tinyshakespeare.txt --json results.jsonl --probe --profile trace.json)
//   build/bench/gpt_bench --system plain ...        # the same model in plain libtorch modules
//
// What runs
// ---------
// `--system ztrain`: ztrain::models::Gpt at the given ZeRO level (no recomputation), ztrain's
// fused AdamW (fp32 master weights and moments for bf16), as ztrain-gpt trains it.
// `--system plain`: the same GPT built from plain libtorch modules (the model's own GptBlock and
// GptLayerNorm layers, torch::nn::Embedding), the same initialisation (init_parameters
// draws by parameter name, so both get bit-identical weights), the same fused AdamW, and no
// ztrain engine and no communication: under mpirun every rank trains its own replica, so the
// figure is the data-parallel ceiling of the machine's cores (no gradient exchange at all).
// `--system booster --plugin ddp|zero1|zero2|fsdp`: the plain model (models::PlainGpt) trained
// through ztrain::Booster with the DataParallel, LowLevelZero (stage 1, 2) or FullyShard plugin.
// `--offload`: AdamOffload in place of AdamW (its state in host memory, pinned for a device's
// parameters; the update on the CPU), for the largest model a device holds.
//
// A step: gradients dropped (set to none), forward and loss, backward, optimizer step. Batches
// come from --data (byte tokens), rank r of n taking windows (step·n + r)·batch + i. Each step
// starts at a world barrier and its time is the max over ranks; tokens/s is the global batch
// over the median step time after --warmup steps (the count comes from rank 0). The loss,
// averaged over ranks, is read after the timer.
//
// Bytes sent are counted in MPI (bench/mpi_traffic.h) from the first timed step to the last:
// the ZeRO engine's two stream communicators (gathers, reductions: the default context's
// streams, whose MPI communicators the MPI transport names) apart from the runtime's own (the
// benchmark's barriers and loss).
// Where the engine's buffers are host-shared, its large collectives read the peers' buffers in
// place instead of sending them; those bytes are counted too (the in_place share).
// Model-state bytes are taken after the last backward, before its optimizer step: parameters,
// gradients and optimizer state all exist then. On a GPU, memory.device_peak is the most its
// caching allocator held for tensors during the run.
#include "mpi_traffic.h"

#include "../src/comm/host_shared_detail.h"

#include <ztrain/comm/mpi/transport.h>
#include <ztrain/cpu_matmul16.h>
#include <ztrain/ztrain.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <c10/core/CachingDeviceAllocator.h>
#include <torch/csrc/autograd/profiler_legacy.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>

namespace {

namespace zt = ztrain;
using zt::models::GptConfig;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

struct Spread {
  double median = 0, p10 = 0, p90 = 0;
};

Spread spread(std::vector<double> v) {
  if (v.empty()) return {};
  std::sort(v.begin(), v.end());
  auto at = [&](double q) { return v[std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5))]; };
  return {at(0.5), at(0.1), at(0.9)};
}

json to_json(const Spread& s) { return {{"median", s.median}, {"p10", s.p10}, {"p90", s.p90}}; }

using zt::models::PlainGpt;  // the same GPT in plain libtorch modules, no engine

// ---- measurements ------------------------------------------------------------------------------

/// Waits for the work queued on `device` (kernels run asynchronously on a GPU).
void synchronize(c10::Device device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

/// The most bytes the device's caching allocator held for tensors at once (0 on the CPU).
int64_t device_peak_bytes(c10::Device device) {
  if (device.is_cpu()) return 0;
  const auto stats = c10::getDeviceAllocator(device.type())->getDeviceStats(device.index());
  return stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak;
}

/// GFLOP/s of an [m, k] × [k, n] matmul in `dtype` on the runtime's device (on the CPU, this
/// thread count): the best of a few repetitions (at least `min_s` seconds of them; of one
/// repetition when that alone takes a second).
double matmul_gflops(int64_t m, int64_t k, int64_t n, c10::ScalarType dtype, double min_s = 0.15) {
  const auto device = zt::runtime().device();
  auto a = torch::randn({m, k}).to(device, dtype), b = torch::randn({k, n}).to(device, dtype);
  torch::mm(a, b);  // warm-up (and oneDNN's kernel generation)
  synchronize(device);
  double best = 0, total = 0;
  for (int rep = 0; rep < 50 && (total < min_s || (rep < 3 && total < 1.0)); ++rep) {
    const auto t0 = Clock::now();
    auto c = torch::mm(a, b);
    synchronize(device);
    const double dt = seconds_since(t0);
    total += dt;
    best = std::max(best, 2.0 * m * k * n / dt / 1e9);
  }
  return best;
}

/// The matmul peak of this rank in the run's dtype (all ranks measure at once, as they train): the
/// best square size, and the model's largest matmul shape (tokens × d → 4d). Only the run's dtype,
/// and no larger square once one took over a second (8× the work each time): on a CPU without
/// bf16 units, where libtorch's bf16 matmuls ran at about 1.4 GFLOP/s, all three took ten minutes.
json matmul_probe(zt::Communicator& world, int64_t tokens, int64_t d, c10::ScalarType dtype) {
  double square = 0;
  for (int64_t n : {512, 1024, 2048}) {
    world.barrier();
    const double gflops = matmul_gflops(n, n, n, dtype);
    square = std::max(square, gflops);
    const bool slow = 2.0 * n * n * n / (gflops * 1e9) > 1.0;
    if (world.all_reduce_scalar(slow ? 1.0 : 0.0, zt::ReduceOp::kMax) > 0) break;  // every rank alike
  }
  world.barrier();
  const double shaped = matmul_gflops(tokens, d, 4 * d, dtype);
  return {{dtype == torch::kBFloat16 ? "bf16" : "fp32",
           {{"peak_gflops", world.all_reduce_scalar(square, zt::ReduceOp::kMin)},
            {"model_shape_gflops", world.all_reduce_scalar(shaped, zt::ReduceOp::kMin)}}}};
}

/// Bytes per parameter of each model-state category, for the ZeRO formula.
struct StateBytes {
  double param, grad, optim;
};

StateBytes state_bytes(c10::ScalarType dtype) {
  if (dtype == torch::kFloat32) return {4, 4, 8};  // weights, gradients, Adam's two moments
  return {2, 2, 12};                               // + an fp32 master copy in the optimizer
}

/// Model-state bytes per rank by formula, per category. `paper`: the ZeRO paper's stages (level 1
/// shards the optimizer state, 2 also the gradients, 3 also the parameters). `design`: what
/// ztrain's levels keep between steps (DESIGN.md §5, zero/sharded_module.h): gradients are
/// reduce-scattered from level 1 on, parameters stay sharded from level 2 on (level 2 gathers
/// them once per step and keeps them from forward to backward, level 3 twice).
json zero_formula(int64_t psi, c10::ScalarType dtype, int level, int n) {
  const auto k = state_bytes(dtype);
  auto formula = [&](int shard_optim_from, int shard_grad_from, int shard_param_from) {
    const double p = k.param * psi / (level >= shard_param_from ? n : 1),
                 g = k.grad * psi / (level >= shard_grad_from ? n : 1),
                 o = k.optim * psi / (level >= shard_optim_from ? n : 1);
    return json{{"parameter", p}, {"gradient", g}, {"optimizer", o}, {"model_state", p + g + o}};
  };
  return {{"paper", formula(1, 2, 3)}, {"design", formula(1, 1, 2)}};
}

/// The ZeRO stage of a booster plugin, for the formula.
int plugin_stage(const std::string& plugin) {
  return plugin == "ddp" ? 0 : plugin == "zero1" ? 1 : plugin == "zero2" ? 2 : 3;
}

/// Batches of byte tokens [batch, seq + 1] from a text file.
class Batches {
 public:
  Batches(const std::string& path, int64_t seq, int64_t batch, int rank, int ranks, c10::Device device)
      : seq_(seq), batch_(batch), rank_(rank), ranks_(ranks), device_(device) {
    std::ifstream in(path, std::ios::binary);
    ZTRAIN_CHECK(in, "gpt_bench: cannot read --data ", path);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    ZTRAIN_CHECK(static_cast<int64_t>(bytes.size()) > 2 * (seq + 1), "gpt_bench: ", path, " holds ", bytes.size(),
                 " bytes, too few for sequences of ", seq + 1);
    data_ = torch::from_blob(bytes.data(), {static_cast<int64_t>(bytes.size())}, torch::kUInt8).to(torch::kLong);
    windows_ = data_.numel() / (seq + 1);
  }
  torch::Tensor at(int64_t step) const {
    std::vector<torch::Tensor> rows;
    for (int64_t i = 0; i < batch_; ++i) {
      const int64_t w = ((step * ranks_ + rank_) * batch_ + i) % windows_;
      rows.push_back(data_.slice(0, w * (seq_ + 1), (w + 1) * (seq_ + 1)));
    }
    return torch::stack(rows).to(device_);
  }

 private:
  int64_t seq_, batch_;
  int rank_, ranks_;
  c10::Device device_;
  torch::Tensor data_;
  int64_t windows_ = 0;
};

struct Args {
  std::string system = "ztrain";
  std::string preset = "small";
  std::optional<int64_t> d_model, layers, heads, context, vocab;
  std::optional<double> dropout;
  std::string dtype = "fp32";
  int level = 0;
  int64_t batch = 4;
  std::optional<int64_t> seq;
  int steps = 10, warmup = 3;
  std::string data = "data/tinyshakespeare.txt";
  std::string json_path, profile_path, tag;
  std::string plugin = "ddp";
  std::string attention = "fused";
  std::optional<std::string> fused_simd;  // not set: the widest this CPU has
  bool probe = false, offload = false;
  std::optional<std::string> device;  // not set: ZTRAIN_DEVICE, else the CPU
};

int run(const Args& a) {
  std::optional<c10::Device> device_option;
  if (a.device) {
    device_option = zt::parse_device(*a.device, "--device");
    zt::resolve_device(*device_option, "--device");  // refused here, naming the option
  }
  auto& rt = zt::init_distributed({.seed = 1234, .device = device_option});
  const auto device = rt.device();
  auto& world = rt.world();
  ZTRAIN_CHECK(a.system == "ztrain" || a.system == "plain" || a.system == "booster",
               "--system must be ztrain, plain or booster, got ", a.system);
  ZTRAIN_CHECK(a.plugin == "ddp" || a.plugin == "zero1" || a.plugin == "zero2" || a.plugin == "fsdp",
               "--plugin must be ddp, zero1, zero2 or fsdp, got ", a.plugin);
  ZTRAIN_CHECK(a.level >= 0 && a.level <= 3, "--level must be 0..3, got ", a.level);
  ZTRAIN_CHECK(a.dtype == "fp32" || a.dtype == "bf16", "--dtype must be fp32 or bf16, got ", a.dtype);
  ZTRAIN_CHECK(a.attention == "fused" || a.attention == "eager", "--attention must be fused or eager, got ",
               a.attention);
  if (a.fused_simd) ztrain::models::detail::set_fused_simd(ztrain::models::detail::simd_named(*a.fused_simd));
  const int steps = world.broadcast_object(a.steps, 0), warmup = world.broadcast_object(a.warmup, 0);
  ZTRAIN_CHECK(steps >= 1 && warmup >= 0, "--steps must be >= 1 and --warmup >= 0");

  auto config = GptConfig::preset(a.preset);
  if (a.d_model) config.d_model = *a.d_model;
  if (a.layers) config.n_layer = *a.layers;
  if (a.heads) config.n_head = *a.heads;
  if (a.context) config.context = *a.context;
  if (a.vocab) {
    ZTRAIN_CHECK(*a.vocab >= 256, "--vocab must be at least 256 (the tokens are bytes), got ", *a.vocab);
    config.vocab_size = *a.vocab;
  }
  if (a.dropout) config.dropout = *a.dropout;
  config.dtype = a.dtype == "bf16" ? torch::kBFloat16 : torch::kFloat32;
  config.fused_attention = a.attention == "fused";
  const int64_t seq = a.seq.value_or(config.context);
  ZTRAIN_CHECK(seq >= 1 && seq <= config.context, "--seq must be in [1, context = ", config.context, "], got ", seq);
  const int n = rt.world_size();
  const bool plain = a.system == "plain", boosted = a.system == "booster";
  const Batches batches(a.data, seq, a.batch, rt.rank(), n, device);

  const json probe = a.probe ? matmul_probe(world, a.batch * seq, config.d_model, config.dtype) : json();
  const auto before = zt::memory_stats(*torch::nn::Sequential());

  // The model, its initialisation and the optimizer.
  std::shared_ptr<torch::nn::Module> module;
  std::function<torch::Tensor(const torch::Tensor&)> loss_of;
  if (plain || boosted) {
    PlainGpt m(config);
    m->to(device);
    loss_of = [m](const torch::Tensor& t) mutable { return m->loss(t); };
    module = m.ptr();
  } else {
    zt::models::Gpt m(config, {.zero_level = a.level, .use_checkpoint = false});
    loss_of = [m](const torch::Tensor& t) mutable { return m->loss(t); };
    module = m.ptr();
  }
  zt::init_parameters(*module, {.seed = 1234, .init = zt::models::gpt_init(config)});
  const auto adam = zt::optim::AdamOptions(1e-3).betas({0.9, 0.95}).weight_decay(0.1);
  std::unique_ptr<zt::optim::AdamW> optimizer;
  if (a.offload) {
    optimizer = std::make_unique<zt::optim::AdamOffload>(*module, adam);
  } else {
    optimizer = std::make_unique<zt::optim::AdamW>(module->parameters(), adam);
  }
  auto& opt = *optimizer;
  std::shared_ptr<zt::Plugin> plugin;
  std::optional<zt::Booster> booster;
  if (boosted) {
    if (a.plugin == "ddp") {
      plugin = std::make_shared<zt::DataParallel>();
    } else if (a.plugin == "fsdp") {
      plugin = std::make_shared<zt::FullyShard>();
    } else {
      plugin = std::make_shared<zt::LowLevelZero>(zt::LowLevelZeroOptions{.stage = a.plugin == "zero1" ? 1 : 2});
    }
    booster.emplace(plugin);
    booster->boost(*module, opt);
  }
  std::vector<MPI_Comm> streams;  // the engine's gather and reduce communicators
  if (!plain) {
    auto& ctx = rt.context();
    for (auto* stream : {&ctx.gather_stream(), &ctx.reduce_stream()}) {
      streams.push_back(dynamic_cast<zt::MpiTransport&>(stream->communicator().transport()).handle());
    }
  }
  const int64_t psi = config.num_parameters();
  int64_t counted = 0;
  for (const auto& ref : zt::named_parameter_refs(*module)) {
    int64_t numel = 1;
    for (auto d : ref.full_shape()) numel *= d;
    counted += numel;
  }
  ZTRAIN_CHECK(counted == psi, "gpt_bench: the model has ", counted, " parameters, GptConfig says ", psi);

  // Training steps.
  std::vector<double> step_s, forward_s, backward_s, optimizer_s;
  double first_loss = 0, last_loss = 0;
  std::pair<int64_t, int64_t> read_before;  // peer_traffic() at the first timed step
  zt::MemoryStats held;
  auto train_step = [&](int64_t step, bool last) {
    const auto tokens = batches.at(step);
    world.barrier();
    const auto t0 = Clock::now();
    if (booster) {
      booster->zero_grad();
    } else {
      for (auto& p : module->parameters()) p.mutable_grad().reset();
    }
    auto loss = loss_of(tokens);
    synchronize(device);
    const auto t1 = Clock::now();
    loss.backward();
    synchronize(device);
    const auto t2 = Clock::now();
    Clock::duration untimed{0};
    if (last) {
      held = zt::memory_stats(plugin ? plugin->boosted(*module) : *module, &opt);
      untimed = Clock::now() - t2;
    }
    if (booster) {
      booster->step();  // and the plugin's all-gather of updated shards
    } else {
      opt.step();
    }
    synchronize(device);
    const auto t3 = Clock::now() - untimed;
    const double dt = world.all_reduce_scalar(std::chrono::duration<double>(t3 - t0).count(), zt::ReduceOp::kMax);
    const double mean_loss = world.all_reduce_scalar(loss.item<double>(), zt::ReduceOp::kSum) / n;
    return std::make_tuple(dt, mean_loss, std::chrono::duration<double>(t1 - t0).count(),
                           std::chrono::duration<double>(t2 - t1).count(), std::chrono::duration<double>(t3 - t2).count());
  };
  for (int64_t step = 0; step < warmup + steps; ++step) {
    if (step == warmup) {
      bench::traffic_reset();
      read_before = {zt::detail::peer_traffic().all_gather, zt::detail::peer_traffic().reduction};
    }
    const auto [dt, loss, f, b, o] = train_step(step, step + 1 == warmup + steps);
    if (step == 0) first_loss = loss;
    last_loss = loss;
    if (step >= warmup) {
      step_s.push_back(dt);
      forward_s.push_back(f);
      backward_s.push_back(b);
      optimizer_s.push_back(o);
    }
  }
  const auto traffic = bench::traffic();
  const int64_t gathered_in_place = zt::detail::peer_traffic().all_gather - read_before.first;
  const int64_t reduced_in_place = zt::detail::peer_traffic().reduction - read_before.second;
  if (!a.profile_path.empty()) {  // one more step, profiled on rank 0
    std::optional<torch::autograd::profiler::RecordProfile> recording;
    if (rt.rank() == 0) recording.emplace(a.profile_path);
    train_step(warmup + steps, false);
  }

  // Bytes moved per step by this rank, by communicator kind: sent through MPI or moved in place
  // through peers' host-shared buffers.
  json comm = {{"gather", static_cast<double>(gathered_in_place) / steps},
               {"reduce", static_cast<double>(reduced_in_place) / steps},
               {"runtime", 0},
               {"native", 0},
               {"in_place", static_cast<double>(gathered_in_place + reduced_in_place) / steps}};
  for (const auto& [c, t] : traffic) {
    const bool gather = !streams.empty() && c == streams[0], reduce = streams.size() > 1 && c == streams[1];
    const char* kind = gather ? "gather" : reduce ? "reduce" : "runtime";
    comm[kind] = comm[kind].get<double>() + static_cast<double>(t.sent_bytes()) / steps;
    if (gather || reduce) comm["native"] = comm["native"].get<double>() + static_cast<double>(t.native_bytes) / steps;
  }
  // The max over ranks of every byte count (ranks hold and send equal amounts up to padding).
  auto max_over_ranks = [&](double v) { return world.all_reduce_scalar(v, zt::ReduceOp::kMax); };
  for (auto& [k, v] : comm.items()) v = max_over_ranks(v.get<double>());
  json memory = {{"parameter", held.parameter_bytes}, {"gathered", held.gathered_bytes},
                 {"gradient", held.gradient_bytes},   {"optimizer", held.optimizer_bytes},
                 {"model_state", held.model_state_bytes()}, {"peak_rss", zt::memory_stats(*module).peak_rss_bytes},
                 {"rss_before_model", before.rss_bytes}, {"device_peak", device_peak_bytes(device)}};
  for (auto& [k, v] : memory.items()) v = max_over_ranks(static_cast<double>(v.get<int64_t>()));

  // Parameters whose full buffers map the ranks' shards on this host (ShardGroup::mapped), which
  // no gather moves: in all, and in one transformer block (the blocks are alike).
  int64_t mapped_params = 0, mapped_block_params = 0;
  for (const auto& item : module->named_modules()) {
    const auto* sharded = dynamic_cast<const zt::ShardedModule*>(item.value().get());
    if (!sharded) continue;
    int64_t mapped = 0;
    for (const auto& g : sharded->groups()) mapped += g.mapped ? g.layout.used_numel() : 0;
    mapped_params += mapped;
    if (item.key().find("transformer.h.") != std::string::npos) mapped_block_params = mapped;
  }

  const auto step_spread = spread(step_s);
  const int64_t tokens_per_step = a.batch * seq * n;
  const double tokens_per_s = tokens_per_step / step_spread.median;
  const double flops_per_token = config.flops_per_token(seq);
  json out = {
      {"bench", "gpt"},
      {"tag", a.tag},
      {"system", a.system},
      {"level", plain || boosted ? json() : json(a.level)},
      {"plugin", boosted ? json(a.plugin) : json()},
      {"dtype", a.dtype},
      {"device", device.str()},
      // how the 16-bit matmuls ran on the CPU: libtorch's kernels or through fp32 (src/cpu_matmul16.cpp)
      {"cpu_matmul16", !device.is_cpu() || config.dtype == torch::kFloat32 ? json()
                       : json(ztrain::detail::cpu_matmul_through_fp32(config.dtype) ? "fp32" : "native")},
      // and the attention: libtorch's 16-bit kernel or the fused one on the widening (models/fused.h)
      {"cpu_attention16", !device.is_cpu() || config.dtype == torch::kFloat32 ? json()
                          : json(ztrain::models::detail::attention_widened(config.dtype) ? "fp32" : "native")},
      // the fused kernels' code (models/fused.h)
      {"fused_simd", ztrain::models::detail::simd_name(ztrain::models::detail::fused_simd())},
      {"ranks", n},
      {"threads", rt.threads()},
      {"cpus", rt.cpus()},  // rank 0's, where the runtime pinned its threads (InitOptions::bind_cores)
      {"model", {{"vocab", config.vocab_size}, {"context", config.context}, {"d_model", config.d_model},
                 {"layers", config.n_layer}, {"heads", config.n_head}, {"preset", a.preset},
                 {"attention", a.attention}, {"dropout", config.dropout}}},
      {"params", psi},
      {"embedding_params", config.vocab_size * config.d_model + config.context * config.d_model},
      {"batch", a.batch},
      {"seq", seq},
      {"steps", steps},
      {"warmup", warmup},
      {"optimizer", c10::str(a.offload ? "ztrain::optim::AdamOffload" : "ztrain::optim::AdamW",
                             " lr 1e-3 betas (0.9, 0.95) wd 0.1")},
      {"tokens_per_step", tokens_per_step},
      {"step_s", to_json(step_spread)},
      {"tokens_per_s", tokens_per_s},
      {"phase_s", {{"forward", spread(forward_s).median}, {"backward", spread(backward_s).median},
                   {"optimizer", spread(optimizer_s).median}}},
      {"loss_first", first_loss},
      {"loss_last", last_loss},
      {"memory", memory},
      {"formula", plain ? json() : zero_formula(psi, config.dtype, boosted ? plugin_stage(a.plugin) : a.level, n)},
      {"comm_bytes_per_step", comm},
      {"mapped_params", mapped_params},
      {"mapped_block_params", mapped_block_params},
      {"flops_per_token", flops_per_token},
      {"model_gflops_per_rank", flops_per_token * tokens_per_s / n / 1e9},
      {"matmul", probe},
      {"profile", a.profile_path.empty() ? json() : json(a.profile_path)},
  };
  if (rt.rank() == 0) {
    const auto line = out.dump() + "\n";
    std::cout << line << std::flush;
    // One write, appended whole: runs at once (bench/gpt2_peers.sh) share the file.
    if (!a.json_path.empty()) std::ofstream(a.json_path, std::ios::app) << line;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  CLI::App app("gpt_bench: one GPT training configuration — tokens/s, memory, bytes sent, FLOP/s");
  Args a;
  app.add_option("--system", a.system,
                 "ztrain (the GPT with ZeRO), plain (plain libtorch modules, no engine) or booster (the plain "
                 "modules through ztrain::Booster)");
  app.add_option("--plugin", a.plugin, "ddp, zero1, zero2 or fsdp (system booster)")->capture_default_str();
  app.add_option("--preset", a.preset, "tiny, small, medium, gpt2")->capture_default_str();
  app.add_option("--d-model", a.d_model, "override the preset's width");
  app.add_option("--layers", a.layers, "override the preset's blocks");
  app.add_option("--heads", a.heads, "override the preset's heads");
  app.add_option("--context", a.context, "override the preset's context");
  app.add_option("--vocab", a.vocab, "override the preset's vocabulary (the tokens stay bytes; at least 256)");
  app.add_option("--dropout", a.dropout, "override the preset's dropout (gpt2: 0.1, the others: 0)");
  app.add_option("--dtype", a.dtype, "fp32 or bf16 (fp32 masters)")->capture_default_str();
  app.add_option("--attention", a.attention, "fused (scaled_dot_product_attention) or eager")->capture_default_str();
  app.add_option("--fused-simd", a.fused_simd,
                 "the fused kernels' code: scalar, avx2, avx512, avx512_bf16 or amx (default: the widest this CPU "
                 "has)");
  app.add_option("--level", a.level, "ZeRO level 0..3 (system ztrain)")->capture_default_str();
  app.add_option("--batch", a.batch, "sequences per rank")->capture_default_str();
  app.add_option("--seq", a.seq, "sequence length (default: the context)");
  app.add_option("--steps", a.steps, "timed steps")->capture_default_str();
  app.add_option("--warmup", a.warmup, "untimed steps first")->capture_default_str();
  app.add_option("--data", a.data, "text file of byte tokens")->capture_default_str();
  app.add_option("--json", a.json_path, "append the result line to this file");
  app.add_option("--tag", a.tag, "a label copied into the result");
  app.add_flag("--probe", a.probe, "measure the matmul peak of the run's dtype first");
  app.add_flag("--offload", a.offload, "AdamOffload: optimizer state in (pinned) host memory, the update on the CPU");
  app.add_option("--device", a.device, "cpu, cuda or cuda:N (default: ZTRAIN_DEVICE, else cpu)");
  app.add_option("--profile", a.profile_path, "write a Chrome trace of one extra step (rank 0)");
  CLI11_PARSE(app, argc, argv);
  return run(a);
} catch (const std::exception& e) {
  std::cerr << "gpt_bench: " << e.what() << '\n';
  return 1;
}
