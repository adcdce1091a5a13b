#include <ztrain/ztrain.h>

#include <iostream>

int main() {
  try {
    auto& rt = ztrain::init_distributed();
    auto t = torch::full({4}, static_cast<float>(rt.rank() + 1));
    rt.world().all_reduce(t);
    const float expected = rt.world_size() * (rt.world_size() + 1) / 2.0f;
    if (t[0].item<float>() != expected) {
      std::cerr << "consumer: all_reduce gave " << t[0].item<float>() << ", expected " << expected << std::endl;
      return 1;
    }
    ztrain::print_rank("consumer OK: ztrain ", ZTRAIN_VERSION, ", ", rt.world_size(), " ranks");
    return 0;
  } catch (const std::exception& e) {
    std::cerr << e.what() << std::endl;
    return 1;
  }
}
