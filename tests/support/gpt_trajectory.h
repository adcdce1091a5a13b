#pragma once
// What the GPT parity tests share: a deterministic batch per step, and the per-step losses and
// gradient norms of a reference run kept in a text file between launches.

#include <ztrain/runtime/init.h>

#include <torch/torch.h>

#include <fstream>
#include <string>
#include <vector>

namespace ztrain::test {

/// Step `step`'s tokens [global_batch / dp, 13] of this dp rank: counting sequences from random
/// starts with small noise, the global batch split evenly over dp.
inline torch::Tensor counting_batch(int step, int64_t global_batch, int64_t vocab) {
  const int dp = runtime().dp().size(), r = runtime().dp().rank();
  auto starts = torch::randint(vocab, {global_batch, 1}, at::detail::createCPUGenerator(100 + step), torch::kLong);
  auto noise = torch::randint(3, {global_batch, 13}, at::detail::createCPUGenerator(200 + step), torch::kLong);
  auto tokens = (starts + torch::arange(13) + noise) % vocab;
  const int64_t per = global_batch / dp;
  return tokens.slice(0, per * r, per * (r + 1));
}

struct LossTrajectory {
  std::vector<double> losses, norms;
};

inline void write_trajectory(const std::string& path, const LossTrajectory& t) {
  std::ofstream f(path);
  f.precision(17);
  for (size_t i = 0; i < t.losses.size(); ++i) f << t.losses[i] << ' ' << t.norms[i] << '\n';
}

inline LossTrajectory read_trajectory(const std::string& path) {
  std::ifstream f(path);
  LossTrajectory t;
  double l, n;
  while (f >> l >> n) {
    t.losses.push_back(l);
    t.norms.push_back(n);
  }
  return t;
}

}  // namespace ztrain::test
