// adam_bench: throughput of ztrain's fused AdamW step (fp32, and bf16 with an fp32 master) beside
// libtorch's torch::optim::AdamW and one core's memcpy, on one flat parameter per size.
//
//   OMP_NUM_THREADS=1 build/bench/adam_bench [--sizes 1M,4M,16M] [--reps 20] [--threads 1]
//
// How it is measured
// ------------------
// For each size N (elements of one contiguous parameter, gradient set once): every optimizer is
// built on its own copy of the same data, stepped --warmup times, then --reps timed step() calls
// each; we report the median (p10/p90 in brackets). Right before, memcpy copies a buffer of
// --memcpy-bytes (default 256 MiB, larger than the last-level cache) between two preallocated
// buffers, timed the same way.
//   params/s = N / t.
//   bytes/s  = B·N / t, B = the bytes the fused kernel reads and writes per element:
//              fp32:              read p, g, m, v (16)   + write p, m, v (12)          = 28 B
//              bf16, fp32 master: read g (2), master, m, v (12) + write master, m, v (12),
//                                 p (2)                                                 = 28 B
//   memcpy   = 2·S / t for a copy of S bytes (S read + S written), the same accounting.
// torch::optim::AdamW runs its ~10 separate tensor ops (4 of them allocate) over the same data.
// Each size is verified once before timing: one step of ours and of torch's from the same state
// must agree to 1e-6 relative (bitwise on libtorch 1.13; 2.11 rounds some elements differently in
// the last bit), and the bf16 parameter must be the master rounded to nearest even.
#include <ztrain/optim/adam.h>

#include <CLI/CLI.hpp>
#include <torch/torch.h>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace {

namespace zo = ztrain::optim;
using Clock = std::chrono::steady_clock;

constexpr int64_t kKernelBytesPerElement = 28;  // fp32 and bf16-with-master alike; see the top of the file
constexpr double kGoalVsTorch = 3.0;
constexpr double kGoalVsMemcpy = 0.6;

struct BenchOptions {
  std::vector<int64_t> sizes = {int64_t{1} << 20, int64_t{4} << 20, int64_t{16} << 20};
  int reps = 20;
  int warmup = 3;
  int threads = 1;
  std::optional<std::string> kernel;
  int64_t memcpy_bytes = int64_t{256} << 20;
};

struct Timing {
  double median = 0, p10 = 0, p90 = 0;  // seconds
};

double percentile(const std::vector<double>& sorted, double p) {
  const double pos = p * static_cast<double>(sorted.size() - 1);
  const auto lo = static_cast<size_t>(pos);
  const auto hi = std::min(lo + 1, sorted.size() - 1);
  return sorted[lo] + (pos - static_cast<double>(lo)) * (sorted[hi] - sorted[lo]);
}

Timing measure(const BenchOptions& o, const std::function<void()>& call) {
  for (int i = 0; i < o.warmup; ++i) call();
  std::vector<double> t(o.reps);
  for (auto& x : t) {
    const auto start = Clock::now();
    call();
    x = std::chrono::duration<double>(Clock::now() - start).count();
  }
  std::sort(t.begin(), t.end());
  return {percentile(t, 0.5), percentile(t, 0.1), percentile(t, 0.9)};
}

// One parameter with its gradient, in `dtype`, from the same fp32 values for every optimizer.
struct Problem {
  torch::Tensor param, grad;
};

Problem make_problem(int64_t n, c10::ScalarType dtype) {
  torch::manual_seed(0);
  auto p = (torch::randn({n}) * 0.5).to(dtype);
  auto g = (torch::randn({n}) * 1e-2).to(dtype);
  p.mutable_grad() = g;
  return {p, g};
}

zo::AdamOptions adam_options() { return zo::AdamOptions(1e-3).betas({0.9, 0.95}).eps(1e-8).weight_decay(0.1); }
torch::optim::AdamWOptions torch_options() {
  return torch::optim::AdamWOptions(1e-3).betas({0.9, 0.95}).eps(1e-8).weight_decay(0.1);
}

zo::AdamEngineOptions engine_options(const BenchOptions& o) {
  zo::AdamEngineOptions e{.num_threads = o.threads};
  if (o.kernel) {
    for (auto k : {zo::AdamKernel::kScalar, zo::AdamKernel::kAvx2, zo::AdamKernel::kAvx512}) {
      if (*o.kernel == zo::to_string(k)) e.kernel = k;
    }
  }
  return e;
}

// One step of each from the same state; an error message, or none.
std::optional<std::string> verify(int64_t n, const BenchOptions& o) {
  auto ours = make_problem(n, torch::kFloat32), theirs = make_problem(n, torch::kFloat32);
  zo::AdamW a({ours.param}, adam_options(), engine_options(o));
  torch::optim::AdamW b({theirs.param}, torch_options());
  a.step();
  b.step();
  const double diff = (ours.param - theirs.param).abs().max().item<double>();
  if (!torch::allclose(ours.param, theirs.param, 1e-6, 1e-9)) {
    return c10::str("fp32: ztrain and torch::optim::AdamW differ by up to ", diff);
  }
  auto low = make_problem(n, torch::kBFloat16);
  zo::AdamW c({low.param}, adam_options(), engine_options(o));
  c.step();
  if (!torch::equal(low.param, c.state_of(low.param)->master.to(torch::kBFloat16))) {
    return std::string("bf16: the parameter is not its master rounded to nearest even");
  }
  return std::nullopt;
}

struct Row {
  int64_t n = 0;
  Timing ours32, ours16, torch32, copy;
  double copy_bytes = 0;
  double params_per_s(const Timing& t) const { return static_cast<double>(n) / t.median; }
  double kernel_bw(const Timing& t) const { return static_cast<double>(kKernelBytesPerElement * n) / t.median; }
  double memcpy_bw() const { return 2 * copy_bytes / copy.median; }
};

Row bench(int64_t n, const BenchOptions& o) {
  Row r;
  r.n = n;
  {
    auto src = torch::ones({o.memcpy_bytes}, torch::kUInt8), dst = torch::zeros({o.memcpy_bytes}, torch::kUInt8);
    r.copy_bytes = static_cast<double>(o.memcpy_bytes);
    r.copy = measure(o, [&] { std::memcpy(dst.data_ptr(), src.data_ptr(), o.memcpy_bytes); });
  }
  {
    auto x = make_problem(n, torch::kFloat32);
    zo::AdamW opt({x.param}, adam_options(), engine_options(o));
    r.ours32 = measure(o, [&] { opt.step(); });
  }
  {
    auto x = make_problem(n, torch::kBFloat16);
    zo::AdamW opt({x.param}, adam_options(), engine_options(o));
    r.ours16 = measure(o, [&] { opt.step(); });
  }
  {
    auto x = make_problem(n, torch::kFloat32);
    torch::optim::AdamW opt({x.param}, torch_options());
    r.torch32 = measure(o, [&] { opt.step(); });
  }
  return r;
}

// ---- output --------------------------------------------------------------------------------

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown CPU";
}

double load_average() {
  double load[1] = {-1};
  getloadavg(load, 1);
  return load[0];
}

std::string human(int64_t n) {
  if (n % (1 << 20) == 0) return std::to_string(n >> 20) + "M";
  if (n % (1 << 10) == 0) return std::to_string(n >> 10) + "K";
  return std::to_string(n);
}

void print_configuration(const BenchOptions& o, const zo::AdamW& probe) {
  const char* omp = std::getenv("OMP_NUM_THREADS");
  std::printf(
      "# adam_bench: libtorch %s; %s; load average %.2f at start\n"
      "# ztrain AdamW: kernel %s, %d thread(s); torch::optim::AdamW: at::get_num_threads() = %d "
      "(OMP_NUM_THREADS=%s)\n"
      "# lr 1e-3, betas (0.9, 0.95), eps 1e-8, weight_decay 0.1; one contiguous parameter per size, "
      "M = 2^20 elements\n"
      "# warm-up %d, then median [p10, p90] of %d steps; memcpy of %lld MiB between two buffers, "
      "counted 2x (read + write)\n"
      "# GB/s of ours = 28 B/element / time (fp32: p,g,m,v read + p,m,v written; bf16: g,master,m,v "
      "read + master,m,v,p written); GB = 1e9 B\n",
      TORCH_VERSION, cpu_model().c_str(), load_average(), zo::to_string(probe.kernel()), probe.num_threads(),
      at::get_num_threads(), omp ? omp : "unset", o.warmup, o.reps, static_cast<long long>(o.memcpy_bytes >> 20));
}

void print_header() {
  std::printf("\n%6s | %-26s | %-26s | %-26s | %7s | %7s %7s | %7s %7s\n", "size", "ours fp32", "ours bf16+master",
              "torch::optim::AdamW fp32", "memcpy", "fp32/", "bf16/", "fp32/", "bf16/");
  std::printf("%6s | %8s %7s %9s | %8s %7s %9s | %8s %7s %9s | %7s | %7s %7s | %7s %7s\n", "", "Mpar/s", "GB/s",
              "ms", "Mpar/s", "GB/s", "ms", "Mpar/s", "GB/s", "ms", "GB/s", "torch", "torch", "memcpy", "memcpy");
}

void print_row(const Row& r) {
  std::printf("%6s | %8.1f %7.2f %9.3f | %8.1f %7.2f %9.3f | %8.1f %7.2f %9.3f | %7.2f | %7.2f %7.2f | %7.2f %7.2f\n",
              human(r.n).c_str(), r.params_per_s(r.ours32) / 1e6, r.kernel_bw(r.ours32) / 1e9, r.ours32.median * 1e3,
              r.params_per_s(r.ours16) / 1e6, r.kernel_bw(r.ours16) / 1e9, r.ours16.median * 1e3,
              r.params_per_s(r.torch32) / 1e6, r.kernel_bw(r.torch32) / 1e9, r.torch32.median * 1e3,
              r.memcpy_bw() / 1e9, r.torch32.median / r.ours32.median, r.torch32.median / r.ours16.median,
              r.kernel_bw(r.ours32) / r.memcpy_bw(), r.kernel_bw(r.ours16) / r.memcpy_bw());
  std::printf("%6s | [%6.3f, %6.3f] ms%7s | [%6.3f, %6.3f] ms%7s | [%6.3f, %6.3f] ms%7s | [%4.1f, %4.1f] ms\n", "",
              r.ours32.p10 * 1e3, r.ours32.p90 * 1e3, "", r.ours16.p10 * 1e3, r.ours16.p90 * 1e3, "",
              r.torch32.p10 * 1e3, r.torch32.p90 * 1e3, "", r.copy.p10 * 1e3, r.copy.p90 * 1e3);
  std::fflush(stdout);
}

void print_goals(const std::vector<Row>& rows) {
  std::printf("\n# load average %.2f at the end\n", load_average());
  const Row* worst_torch = nullptr;
  const Row* worst_copy = nullptr;
  for (const auto& r : rows) {
    if (!worst_torch || r.torch32.median / r.ours32.median < worst_torch->torch32.median / worst_torch->ours32.median) {
      worst_torch = &r;
    }
    if (!worst_copy || r.kernel_bw(r.ours32) / r.memcpy_bw() < worst_copy->kernel_bw(worst_copy->ours32) /
                                                                   worst_copy->memcpy_bw()) {
      worst_copy = &r;
    }
  }
  if (!worst_torch) return;
  const double vs_torch = worst_torch->torch32.median / worst_torch->ours32.median;
  const double vs_copy = worst_copy->kernel_bw(worst_copy->ours32) / worst_copy->memcpy_bw();
  std::printf("# goal: fp32 step >= %.0fx torch::optim::AdamW   %s  (lowest %.2fx, at %s)\n", kGoalVsTorch,
              vs_torch >= kGoalVsTorch ? "PASS" : "MISS", vs_torch, human(worst_torch->n).c_str());
  std::printf("# goal: fp32 bytes/s >= %.0f%% of memcpy        %s  (lowest %.2f, at %s)\n", kGoalVsMemcpy * 100,
              vs_copy >= kGoalVsMemcpy ? "PASS" : "MISS", vs_copy, human(worst_copy->n).c_str());
}

std::optional<int> parse(int argc, char** argv, BenchOptions& o) {
  CLI::App app{"Throughput of ztrain's fused AdamW beside torch::optim::AdamW and memcpy."};
  app.add_option("--sizes", o.sizes, "parameter sizes in elements (1M = 2^20)")
      ->delimiter(',')
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  app.add_option("--reps", o.reps, "timed steps per optimizer and size")->check(CLI::Range(1, 100000))->capture_default_str();
  app.add_option("--warmup", o.warmup, "untimed steps before timing")->check(CLI::Range(0, 1000))->capture_default_str();
  app.add_option("--threads", o.threads, "threads of ztrain's AdamW (AdamEngineOptions::num_threads)")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app.add_option("--kernel", o.kernel, "ztrain kernel (default: the best this CPU supports)")
      ->check(CLI::IsMember({"scalar", "avx2", "avx512"}));
  app.add_option("--memcpy-bytes", o.memcpy_bytes, "size of the memcpy reference (larger than the cache)")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  try {
    app.parse(argc, argv);
    for (auto n : o.sizes) {
      if (n < 1) throw CLI::ValidationError("--sizes", "sizes must be >= 1");
    }
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return std::nullopt;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    BenchOptions o;
    if (auto code = parse(argc, argv, o)) return *code;
    auto probe_param = torch::zeros({1});
    zo::AdamW probe({probe_param}, adam_options(), engine_options(o));
    print_configuration(o, probe);
    print_header();
    std::vector<Row> rows;
    for (int64_t n : o.sizes) {
      if (auto error = verify(n, o)) {
        std::fprintf(stderr, "adam_bench: size %s: %s\n", human(n).c_str(), error->c_str());
        return 1;
      }
      rows.push_back(bench(n, o));
      print_row(rows.back());
    }
    print_goals(rows);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "adam_bench: %s\n", e.what());
    return 1;
  }
}
