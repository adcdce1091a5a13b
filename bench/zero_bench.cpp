// zero_bench: the cost of ZeRO sharding. Step time (forward, backward, SGD step) of one model
// wrapped at level 3 with prefetch, level 3 without prefetch, level 2 and level 0, as ratios to a
// plain libtorch step of the same model on the same per-rank batch — all measured in one run.
//
//   mpirun -np 2 --bind-to none build/bench/zero_bench [--dim 512 --layers 6 --seq 128 --batch 4]
//
// How it is measured
// ------------------
// Every rank builds the same model (a GPT-style stack of pre-LayerNorm attention + MLP blocks)
// and all variants side by side, then runs --warmup + --steps rounds in which every variant
// takes one step, in an order that rotates from round to round, so that a machine whose speed
// drifts during the run (other tenants, clock changes) slows all variants alike instead of
// whichever ran last. A step is timed from a barrier to the end of the optimizer step, as the
// max over ranks. The plain variant runs the unwrapped model on every rank at once (each rank's
// single-process step, the cores busy as in the sharded runs). Reported: median and p10/p90
// over the timed rounds, and the ratio of medians to the plain step. Each variant's first-step
// loss is checked against the plain model's.
#include <ztrain/ztrain.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>

namespace {

using Clock = std::chrono::steady_clock;

struct LayerImpl : torch::nn::Module {
  LayerImpl(int64_t d, int64_t heads)
      : heads(heads), ln1(torch::nn::LayerNormOptions({d})), ln2(torch::nn::LayerNormOptions({d})),
        qkv(d, 3 * d), proj(d, d), fc(d, 4 * d), out(4 * d, d) {
    register_module("ln1", ln1);
    register_module("qkv", qkv);
    register_module("proj", proj);
    register_module("ln2", ln2);
    register_module("fc", fc);
    register_module("out", out);
  }
  torch::Tensor forward(torch::Tensor x) {
    const auto b = x.size(0), t = x.size(1), d = x.size(2);
    auto q = qkv(ln1(x)).view({b, t, 3, heads, d / heads}).permute({2, 0, 3, 1, 4});
    auto scores = torch::matmul(q[0], q[1].transpose(-2, -1)) / std::sqrt(static_cast<double>(d / heads));
    scores = scores.masked_fill(torch::ones({t, t}, torch::kBool).triu(1), -1e9);
    auto att = torch::matmul(torch::softmax(scores, -1), q[2]).transpose(1, 2).reshape({b, t, d});
    x = x + proj(att);
    return x + out(torch::gelu(fc(ln2(x)), "tanh"));
  }
  int64_t heads;
  torch::nn::LayerNorm ln1, ln2;
  torch::nn::Linear qkv, proj, fc, out;
};
TORCH_MODULE(Layer);

struct Stats {
  double median, p10, p90;
};

Stats stats(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  auto at = [&](double q) { return v[std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5))]; };
  return {at(0.5), at(0.1), at(0.9)};
}

/// Builds the model block by block at level 3, runs one step, and reports what each rank holds
/// between steps against the formula: parameters and gradients Ψ/N each (fp32), SGD no state.
int report_memory(int64_t dim, int64_t layers, int64_t heads, int64_t seq, int64_t batch) {
  auto& rt = ztrain::runtime();
  const auto before = ztrain::memory_stats(*torch::nn::Sequential());
  ztrain::BlockList<Layer> list(layers, [&](int64_t) { return Layer(dim, heads); },
                                {.zero_level = 3, .use_checkpoint = true});
  int64_t psi = 0;
  for (const auto& block : *list) psi += block->groups()[0].layout.used_numel();
  torch::optim::SGD opt(list->parameters(), 1e-3);
  auto loss = list(torch::randn({batch, seq, dim})).pow(2).mean();
  loss.backward();
  opt.step();
  const auto m = ztrain::memory_stats(*list, &opt);
  const double n = rt.dp().size(), formula = 2.0 * 4.0 * psi / n;
  const double held = m.parameter_bytes + m.gradient_bytes + m.gathered_bytes;
  ztrain::print_rank("zero_bench --memory: ", rt.world_size(), " ranks, level 3 with recomputation, model ", layers, "x",
                     dim, " = ", psi / 1e6, " M parameters (fp32), batch ", batch, "x", seq);
  for (int r = 0; r < rt.world_size(); ++r) {
    if (r == rt.rank()) {
      std::printf("rank %d: parameters %.2f MB, gradients %.2f MB, gathered %.2f MB; held %.2f MB vs formula 2*4*psi/N = "
                  "%.2f MB (ratio %.4f); peak RSS %.1f MB (%.1f MB before the model)\n",
                  r, m.parameter_bytes / 1e6, m.gradient_bytes / 1e6, m.gathered_bytes / 1e6, held / 1e6, formula / 1e6,
                  held / formula, m.peak_rss_bytes / 1e6, before.peak_rss_bytes / 1e6);
      std::fflush(stdout);
    }
    rt.world().barrier();
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("zero_bench: ZeRO step time against a plain libtorch step");
  int64_t dim = 512, layers = 6, heads = 8, seq = 128, batch = 4;
  int steps = 10, warmup = 2;
  std::string json_path;
  bool memory = false;
  app.add_flag("--memory", memory, "instead of timing: model-state bytes per rank at level 3 against the ZeRO formula");
  app.add_option("--dim", dim, "model width");
  app.add_option("--layers", layers, "blocks");
  app.add_option("--heads", heads, "attention heads");
  app.add_option("--seq", seq, "sequence length");
  app.add_option("--batch", batch, "sequences per rank");
  app.add_option("--steps", steps, "timed rounds (one step of every variant each)");
  app.add_option("--warmup", warmup, "untimed rounds first");
  app.add_option("--json", json_path, "append results as JSON lines");
  CLI11_PARSE(app, argc, argv);

  auto& rt = ztrain::init_distributed({.seed = 1});
  auto& world = rt.world();
  if (memory) return report_memory(dim, layers, heads, seq, batch);
  torch::manual_seed(1);
  auto x = torch::randn({batch, seq, dim});

  auto make_layers = [&] {
    std::vector<Layer> out;
    torch::manual_seed(2);
    for (int64_t i = 0; i < layers; ++i) out.push_back(Layer(dim, heads));
    return out;
  };

  // Every variant is built first; the timed steps then take turns (see the header).
  struct Variant {
    std::string name;
    std::function<torch::Tensor()> step;  // one training step; returns the mean loss over ranks
    std::vector<double> times;
    double first_loss = 0;
  };
  std::vector<Variant> variants;

  // The plain libtorch step.
  auto plain_layers = make_layers();
  std::vector<torch::Tensor> plain_params;
  for (auto& l : plain_layers) {
    for (auto& p : l->parameters()) plain_params.push_back(p);
  }
  int64_t psi = 0;
  for (auto& p : plain_params) psi += p.numel();
  torch::optim::SGD plain_opt(plain_params, 1e-3);
  variants.push_back({"plain", [&] {
                        auto h = x;
                        for (auto& l : plain_layers) h = l(h);
                        auto loss = h.pow(2).mean();
                        plain_opt.zero_grad();
                        loss.backward();
                        plain_opt.step();
                        return loss.detach();
                      }});

  const std::vector<std::pair<std::string, ztrain::BlockOptions>> sharded = {
      {"level3_prefetch", {.zero_level = 3, .use_checkpoint = false, .prefetch_depth = 1}},
      {"level3_no_prefetch", {.zero_level = 3, .use_checkpoint = false, .prefetch_depth = 0}},
      {"level2", {.zero_level = 2, .use_checkpoint = false, .prefetch_depth = 1}},
      {"level0", {.zero_level = 0, .use_checkpoint = false}},
  };
  std::vector<std::unique_ptr<ztrain::BlockList<Layer>>> lists;
  std::vector<std::unique_ptr<torch::optim::SGD>> optimizers;
  for (const auto& [name, options] : sharded) {
    std::vector<ztrain::Block<Layer>> blocks;
    for (auto& l : make_layers()) blocks.emplace_back(l, options);
    auto& list = *lists.emplace_back(std::make_unique<ztrain::BlockList<Layer>>(std::move(blocks)));
    auto& opt = *optimizers.emplace_back(std::make_unique<torch::optim::SGD>(list->parameters(), 1e-3));
    variants.push_back({name, [&list, &opt, &x] {
                          auto out = list(x).pow(2).mean();
                          opt.zero_grad();
                          out.backward();
                          opt.step();
                          return ztrain::sum_loss(out);
                        }});
  }

  for (int i = 0; i < warmup + steps; ++i) {
    for (size_t k = 0; k < variants.size(); ++k) {
      auto& v = variants[(i + k) % variants.size()];
      world.barrier();
      const auto t0 = Clock::now();
      auto loss = v.step();
      auto dt = torch::tensor({std::chrono::duration<double>(Clock::now() - t0).count()}, torch::kFloat64);
      world.all_reduce(dt, ztrain::ReduceOp::kMax);
      if (i == 0) v.first_loss = loss.item<double>();
      if (i >= warmup) v.times.push_back(dt.item<double>());
    }
  }

  ztrain::print_rank("zero_bench: ", rt.world_size(), " ranks, ", rt.threads(), " threads/rank, model ", layers, "x", dim,
                     " (", heads, " heads, ", psi / 1e6, " M parameters), batch ", batch, "x", seq,
                     " per rank, fp32, no recomputation, SGD; ", steps, " timed rounds after ", warmup,
                     " warm-up, variants taking turns");
  ztrain::print_rank(c10::str("variant               median_s    p10_s    p90_s   ratio_to_plain"));
  const auto plain = stats(variants[0].times);
  for (const auto& v : variants) {
    const auto s = stats(v.times);
    ztrain::print_rank(c10::str(v.name, std::string(20 - std::min<size_t>(20, v.name.size()), ' '), "  ", s.median,
                                "  ", s.p10, "  ", s.p90, "  ", s.median / plain.median));
    if (!json_path.empty() && rt.rank() == 0) {
      std::ofstream(json_path, std::ios::app)
          << nlohmann::json{{"bench", "zero"},   {"variant", v.name},     {"ranks", rt.world_size()},
                            {"dim", dim},        {"layers", layers},      {"seq", seq},
                            {"batch", batch},    {"params", psi},         {"median_s", s.median},
                            {"p10_s", s.p10},    {"p90_s", s.p90},        {"ratio_to_plain", s.median / plain.median}}
                 .dump()
          << "\n";
    }
    if (std::abs(v.first_loss - variants[0].first_loss) > 1e-4 * std::abs(variants[0].first_loss)) {
      ztrain::print_rank("error: ", v.name, " first loss ", v.first_loss, " differs from the plain ",
                         variants[0].first_loss);
      return 1;
    }
  }
  return 0;
}
