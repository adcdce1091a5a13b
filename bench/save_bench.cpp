// save_bench: how long a save of the optimizer state holds the training thread, synchronous
// against asynchronous (save_optimizer_state vs save_optimizer_state_async), and what the
// background write costs the steps it overlaps.
//
//   mpirun -np 2 --bind-to none build/bench/save_bench [--level 3 --dim 512 --layers 6 --reps 7]
//
// Model: a BlockList of `layers` pre-LayerNorm MLP-and-projection blocks of width `dim` at the
// given ZeRO level, ztrain AdamW (fp32 exp_avg and exp_avg_sq). Every figure is the max over
// ranks of one repetition, reported as median (min–max) over the repetitions. The file goes to
// --dir (default: the system temporary directory), which every rank must see.

#include <ztrain/ztrain.h>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <filesystem>

namespace {

using Clock = std::chrono::steady_clock;

struct LayerImpl : torch::nn::Module {
  explicit LayerImpl(int64_t d) : ln(torch::nn::LayerNormOptions({d})), qkv(d, 3 * d), proj(d, d), fc(d, 4 * d), out(4 * d, d) {
    register_module("ln", ln);
    register_module("qkv", qkv);
    register_module("proj", proj);
    register_module("fc", fc);
    register_module("out", out);
  }
  torch::Tensor forward(torch::Tensor x) {
    x = x + proj(qkv(ln(x)).chunk(3, -1)[2]);
    return x + out(torch::gelu(fc(x)));
  }
  torch::nn::LayerNorm ln;
  torch::nn::Linear qkv, proj, fc, out;
};
TORCH_MODULE(Layer);

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

double max_over_ranks(double v) {
  return ztrain::runtime().world().all_reduce_scalar(v, ztrain::ReduceOp::kMax);
}

std::string summary(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return c10::str(v[v.size() / 2] * 1e3, " ms (", v.front() * 1e3, "-", v.back() * 1e3, ")");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"save_bench: time the training thread spends in synchronous and asynchronous optimizer-state saves"};
  int level = 3, reps = 7;
  int64_t dim = 512, layers = 6;
  std::string dir = std::filesystem::temp_directory_path().string();
  app.add_option("--level", level, "ZeRO level 0-3")->check(CLI::Range(0, 3))->capture_default_str();
  app.add_option("--dim", dim, "model width")->capture_default_str();
  app.add_option("--layers", layers, "blocks")->capture_default_str();
  app.add_option("--reps", reps, "repetitions")->check(CLI::Range(1, 1000))->capture_default_str();
  app.add_option("--dir", dir, "directory for the files (shared by the ranks)")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  auto& rt = ztrain::init_distributed({.seed = 1});
  ztrain::BlockList<Layer> model(layers, [&](int64_t) { return Layer(dim); }, {.zero_level = level, .use_checkpoint = false});
  ztrain::optim::AdamW opt(model->parameters(), ztrain::optim::AdamOptions(1e-3));
  int64_t psi = 0;
  for (const auto& r : ztrain::named_parameter_refs(*model)) psi += c10::multiply_integers(r.shape);
  const auto x = torch::randn({2, 64, dim});
  auto step = [&] {
    opt.zero_grad();
    model(x).pow(2).mean().backward();
    opt.step();
  };
  step();  // creates the optimizer state
  const auto base = rt.world().broadcast_bytes(c10::str(dir, "/save_bench_", ::getpid()), 0);
  ztrain::print_rank("save_bench: ", rt.world_size(), " ranks x ", rt.threads(), " threads, ZeRO level ", level, ", ",
                     psi / 1e6, " M parameters, AdamW state ", 2.0 * psi * 4 / 1e6, " MB, ", reps, " repetitions");

  // The first asynchronous save also duplicates the communicators the background thread uses.
  rt.world().barrier();
  auto t0 = Clock::now();
  auto first = ztrain::save_optimizer_state_async(*model, opt, base + ".async.safetensors");
  const double first_block = max_over_ranks(seconds_since(t0));
  first.wait();

  std::vector<double> sync_block, async_block, async_total, step_alone, step_during;
  for (int i = 0; i < reps; ++i) {
    rt.world().barrier();
    t0 = Clock::now();
    step();
    step_alone.push_back(max_over_ranks(seconds_since(t0)));

    rt.world().barrier();
    t0 = Clock::now();
    ztrain::save_optimizer_state(*model, opt, base + ".sync.safetensors");
    sync_block.push_back(max_over_ranks(seconds_since(t0)));

    rt.world().barrier();
    t0 = Clock::now();
    auto pending = ztrain::save_optimizer_state_async(*model, opt, base + ".async.safetensors");
    async_block.push_back(max_over_ranks(seconds_since(t0)));
    const auto t1 = Clock::now();
    step();
    step_during.push_back(max_over_ranks(seconds_since(t1)));
    pending.wait();
    async_total.push_back(max_over_ranks(seconds_since(t0)));
  }
  ztrain::print_rank("first asynchronous save (duplicates communicators) blocks ", first_block * 1e3, " ms");
  ztrain::print_rank("synchronous save blocks         ", summary(sync_block));
  ztrain::print_rank("asynchronous save blocks        ", summary(async_block));
  ztrain::print_rank("asynchronous save until written ", summary(async_total));
  ztrain::print_rank("training step alone             ", summary(step_alone));
  ztrain::print_rank("training step during the write  ", summary(step_during));
  rt.world().barrier();
  if (rt.rank() == 0) {
    std::filesystem::remove(base + ".sync.safetensors");
    std::filesystem::remove(base + ".async.safetensors");
  }
  return 0;
}
