// Trains the Llama-style decoder of llama.h — plain libtorch, written without ztrain — on byte
// tokens of a text file, with the parallelism a Booster plugin picks at launch:
//
//   mpirun -np 2 build/examples/llama_train --plugin zero2 --data data/tinyshakespeare.txt
//
// --plugin ddp (DataParallel), zero1 or zero2 (LowLevelZero stage 1 or 2), fsdp (FullyShard:
// ZeRO-3 per decoder layer), hybrid (HybridParallel: --tp ranks split each layer and --pp
// pipeline stages share out the layers as llama::policy() says, ZeRO --zero-level over the
// rest). The model source is the same for every plugin; only the plugin line below differs,
// the model is made through HybridParallel::build (a stage makes its own layers only), and with
// pipeline stages the step runs micro-batches through the stages.
#include "llama.h"

#include <ztrain/ztrain.h>

#include <CLI/CLI.hpp>

#include <fstream>
#include <iostream>
#include <iterator>

namespace zt = ztrain;

int main(int argc, char** argv) try {
  CLI::App app("llama_train: a Llama-style decoder trained under a Booster plugin");
  std::string plugin_name = "zero2", data = "data/tinyshakespeare.txt", out;
  int steps = 100, batch = 8, tp = 2, pp = 1, zero_level = 1;
  app.add_option("--plugin", plugin_name, "ddp, zero1, zero2, fsdp or hybrid")->capture_default_str();
  const std::vector<CLI::Option*> hybrid_options{
      app.add_option("--tp", tp, "hybrid: tensor-parallel ranks per group")->capture_default_str(),
      app.add_option("--pp", pp, "hybrid: pipeline stages (a step runs --batch micro-batches of one sequence)")
          ->capture_default_str(),
      app.add_option("--zero-level", zero_level, "hybrid: ZeRO level 0-3 over the data-parallel ranks")
          ->capture_default_str()};
  app.add_option("--data", data, "a text file (byte tokens)")->capture_default_str();
  app.add_option("--steps", steps, "optimizer steps")->capture_default_str();
  app.add_option("--batch", batch, "sequences per data-parallel rank and step")->capture_default_str();
  app.add_option("--save", out, "write the model here at the end (safetensors)");
  CLI11_PARSE(app, argc, argv);

  for (const auto* option : hybrid_options) {
    if (plugin_name != "hybrid" && option->count() > 0) {
      throw std::invalid_argument(option->get_name() + " is an option of --plugin hybrid");
    }
  }
  auto& rt = zt::init_distributed({.seed = 0});
  std::shared_ptr<zt::Plugin> plugin;
  if (plugin_name == "ddp") {
    plugin = std::make_shared<zt::DataParallel>();
  } else if (plugin_name == "zero1" || plugin_name == "zero2") {
    plugin = std::make_shared<zt::LowLevelZero>(zt::LowLevelZeroOptions{.stage = plugin_name == "zero1" ? 1 : 2});
  } else if (plugin_name == "fsdp") {
    plugin = std::make_shared<zt::FullyShard>();
  } else if (plugin_name == "hybrid") {
    plugin = std::make_shared<zt::HybridParallel>(
        zt::HybridParallelOptions{.tp_size = tp, .pp_size = pp, .zero_level = zero_level, .policy = llama::policy()});
  } else {
    throw std::invalid_argument("--plugin must be ddp, zero1, zero2, fsdp or hybrid, got " + plugin_name);
  }

  std::ifstream in(data, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read --data " + data);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const llama::Config config;
  if (static_cast<int64_t>(text.size()) <= config.context + 1) throw std::runtime_error(data + " is too short");
  const auto corpus = torch::from_blob(const_cast<char*>(text.data()), {static_cast<int64_t>(text.size())}, torch::kUInt8)
                          .to(torch::kLong);

  // Under HybridParallel with stages, each stage makes only the decoder layers it holds; the
  // values then come by name (Llama's own rule: normal(0, 0.02) matrices, unit norms), the same
  // whichever plugin and layout.
  auto* hybrid = dynamic_cast<zt::HybridParallel*>(plugin.get());
  auto make = [&config] { return llama::Llama(config); };
  auto model = hybrid ? hybrid->build(make) : make();
  zt::init_parameters(*model);
  const auto adam = zt::optim::AdamOptions(1e-3).betas({0.9, 0.95}).weight_decay(0.1);
  zt::optim::AdamW opt(zt::optim::weight_decay_groups(*model, adam), adam);
  zt::Booster booster(plugin, {.max_grad_norm = 1.0});
  booster.boost(*model, opt);  // the model moves to the rank's device; replicas start equal

  // Each data-parallel rank its own windows (the ranks of a tensor-parallel group the same).
  auto& dp = hybrid ? hybrid->context().dp() : rt.dp();
  auto gen = at::detail::createCPUGenerator(1000 + dp.rank());
  for (int step = 0; step < steps; ++step) {
    auto starts = torch::randint(corpus.numel() - config.context - 1, {batch}, gen, torch::kLong);
    std::vector<torch::Tensor> rows;
    for (int64_t i = 0; i < batch; ++i) rows.push_back(corpus.narrow(0, starts[i].item<int64_t>(), config.context + 1));
    const auto tokens = torch::stack(rows).to(rt.device());
    booster.zero_grad();
    torch::Tensor mean;  // over the data-parallel ranks
    if (pp > 1 && hybrid) {
      std::vector<std::vector<torch::Tensor>> micro_batches;
      for (const auto& row : tokens.split(1)) micro_batches.push_back({row});
      mean = booster.execute_pipeline(micro_batches);
    } else {
      auto loss = model->loss(tokens);
      booster.backward(loss);
      mean = zt::sum_loss(loss, hybrid ? &hybrid->context() : nullptr);
    }
    booster.step();
    if (step % 10 == 0 || step + 1 == steps) {
      zt::print_rank("step ", step, " loss ", mean.item<double>(), " (", plugin->name(), ")");
    }
  }
  if (!out.empty()) booster.save_model(out);
  return 0;
} catch (const std::exception& e) {
  std::cerr << "llama_train: " << e.what() << std::endl;
  return 1;
}
