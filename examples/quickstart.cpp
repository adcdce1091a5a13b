#include <ztrain/ztrain.h>
#include <iostream>
namespace zt = ztrain;

struct LayerImpl : torch::nn::Module {                          // the user's layer, plain libtorch
  explicit LayerImpl(int64_t d) : fc1(d, 4 * d), fc2(4 * d, d) {
    register_module("fc1", fc1);
    register_module("fc2", fc2);
  }
  torch::Tensor forward(torch::Tensor x) { return x + fc2(torch::gelu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Layer);

int main() try {
  zt::init_distributed({.seed = 0});                            // mpirun -np 4 ./quickstart
  zt::BlockList<Layer> layers(4, [](int64_t) { return Layer(64); },
                              {.zero_level = 3, .use_checkpoint = true});
  zt::init_parameters(*layers, {.seed = 42});                   // the same weights at any world size
  torch::optim::AdamW opt(layers->parameters(), torch::optim::AdamWOptions(1e-3));
  for (int step = 0; step < 10; ++step) {
    auto x = torch::randn({8, 16, 64});                         // this rank's batch
    auto loss = (layers(x) - x.flip(-1)).pow(2).mean();
    opt.zero_grad();
    loss.backward();                                            // gradients reduce-scattered over ranks
    opt.step();                                                 // each rank updates its shard
    zt::print_rank("step ", step, " loss ", zt::sum_loss(loss).item<double>());
  }
  zt::save(*layers, "quickstart.safetensors");                  // full tensors, plain libtorch names
} catch (const std::exception& e) {
  std::cerr << e.what() << '\n';
  return 1;
}
