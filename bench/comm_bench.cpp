// comm_bench: bandwidth of all_gather, reduce_scatter and all_reduce on float32 (or, --dtype bf16,
// bfloat16) tensors, side by side with one core's memcpy rate, over message sizes from --min-bytes to --max-bytes (x4).
//
//   mpirun -np 2 --bind-to none build/bench/comm_bench [--ops all_reduce] [--json out.jsonl]
//
// How it is measured
// ------------------
// Message size S: the all_reduce tensor, the all_gather output (input S/n per rank), the
// reduce_scatter input (output S/n per rank); rounded down to a whole element per rank.
// For each op and size: the result is checked once against an exact expectation (small integers,
// exact in either dtype, so any sum order is exact), then the op is warmed up, rank 0 picks the iteration count
// from the warm-up time and --target-seconds-per-size and broadcasts it, and every timed call
// runs after a barrier. Each rank times its own call; the time of a call is the max over ranks,
// and we report the median (and p10/p90) over iterations.
//   algbw = S / t.
//   busbw = algbw * factor, the NCCL-tests definition: the bytes each rank must move through its
//   link in an optimal (ring) algorithm, so that numbers compare across rank counts. all_gather
//   and reduce_scatter move (n-1)/n * S per rank; all_reduce is a reduce_scatter followed by an
//   all_gather, 2(n-1)/n * S.
//   memcpy = S / t_copy, where every rank at once copies S bytes between two preallocated
//   buffers of its own (timed like a collective: barrier first, max over ranks). S is counted
//   once, not as read plus write: it is the rate at which one core copies.
// Buffers: host-shared (ztrain::host_shared_empty) by default, so that ranks on one host read
// each other's buffers in place; --buffers private measures the transport with ordinary tensors.
// The "shm" column says whether the timed calls took the host-shared path.
#include <ztrain/ztrain.h>

#include <CLI/CLI.hpp>
#include <mpi.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>
#include <torch/version.h>

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

extern char** environ;

namespace {

using ztrain::Communicator;
using ztrain::ReduceOp;
using Clock = std::chrono::steady_clock;

constexpr int64_t kKiB = 1024, kMiB = 1024 * kKiB;
constexpr int64_t kGoalMinBytes = 16 * kMiB;  // the goal: busbw >= kGoalRatio * memcpy from here on
constexpr double kGoalRatio = 0.5;
constexpr double kGB = 1e9;  // bandwidths in GB/s = 1e9 bytes/s, as NCCL-tests
// all_gather_in_place gathers into a buffer whose own slice already holds this rank's input, as
// ZeRO gathers a flat parameter: no local copy of the own slice.
const std::vector<std::string> kOps = {"all_gather", "all_gather_in_place", "reduce_scatter", "all_reduce"};

struct BenchOptions {
  int64_t min_bytes = kKiB;
  int64_t max_bytes = 256 * kMiB;
  std::vector<std::string> ops = kOps;
  double target_seconds = 0.4;  // timed calls per op and size (memcpy gets the same again)
  int warmup = 3;
  int min_iters = 5;
  int max_iters = 10000;
  std::string buffers = "host-shared";
  std::string dtype = "fp32";
  std::optional<std::string> json;
};

struct Timing {
  int iters = 0;
  double median = 0, p10 = 0, p90 = 0, min = 0, max = 0;  // seconds
};

struct Result {
  std::string op;
  int64_t size = 0;   // requested S
  int64_t bytes = 0;  // S actually moved (rounded to whole floats per rank)
  Timing time, copy;
  double algbw = 0, busbw = 0, memcpy_bw = 0;
  bool host_shared = false;  // the timed calls read the peers' buffers directly
  double ratio() const { return busbw / memcpy_bw; }
};

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::string human(int64_t bytes) {
  if (bytes >= kMiB && bytes % kMiB == 0) return std::to_string(bytes / kMiB) + " MiB";
  if (bytes >= kKiB && bytes % kKiB == 0) return std::to_string(bytes / kKiB) + " KiB";
  return std::to_string(bytes) + " B";
}

// Linear interpolation between the closest ranks of a sorted sample.
double percentile(const std::vector<double>& sorted, double p) {
  const double pos = p * static_cast<double>(sorted.size() - 1);
  const auto lo = static_cast<size_t>(pos);
  const auto hi = std::min(lo + 1, sorted.size() - 1);
  return sorted[lo] + (pos - static_cast<double>(lo)) * (sorted[hi] - sorted[lo]);
}

// Warm up, agree on an iteration count (rank 0's choice), then time each call after a barrier.
Timing measure(Communicator& comm, const BenchOptions& o, const std::function<void()>& call) {
  comm.barrier();
  call();  // first touch of the buffers, lazy set-up inside MPI
  const auto start = Clock::now();
  for (int i = 0; i < o.warmup; ++i) {
    comm.barrier();
    call();
  }
  const double per_iter = seconds_since(start) / o.warmup;
  const int wanted = static_cast<int>(std::min(o.target_seconds / per_iter, 1e9));
  const int iters = comm.broadcast_object(std::clamp(wanted, o.min_iters, o.max_iters), 0);

  std::vector<double> t(iters);
  for (int i = 0; i < iters; ++i) {
    comm.barrier();
    const auto t0 = Clock::now();
    call();
    t[i] = seconds_since(t0);
  }
  comm.all_reduce(torch::from_blob(t.data(), {iters}, torch::kDouble), ReduceOp::kMax);
  std::sort(t.begin(), t.end());
  return {iters, percentile(t, 0.5), percentile(t, 0.1), percentile(t, 0.9), t.front(), t.back()};
}

// NCCL-tests' bus bandwidth factor (see the top of the file).
double bus_factor(const std::string& op, int n) {
  const double ring = static_cast<double>(n - 1) / n;
  return op == "all_reduce" ? 2 * ring : ring;
}

// 1, 2, ..., 16, 1, 2, ... as floats: small integers, so every sum over ranks is exact.
torch::Tensor pattern(int64_t numel, c10::ScalarType dtype) {
  return torch::arange(numel, torch::kInt64).remainder(16).add(1).to(dtype);
}

c10::ScalarType scalar_type(const std::string& dtype) { return dtype == "bf16" ? torch::kBFloat16 : torch::kFloat; }

// One collective at one size: its buffers, the timed call, and a one-off exact check.
struct Collective {
  int64_t bytes = 0;
  std::function<void()> call;
  std::function<std::optional<std::string>()> check;  // fills, calls once, compares; an error or none
};

std::optional<std::string> compare(const torch::Tensor& got, const torch::Tensor& want) {
  if (torch::equal(got, want)) return std::nullopt;
  const auto i = (got != want).nonzero()[0][0].item<int64_t>();
  return c10::str("element ", i, " of ", got.numel(), " is ", got[i].item<float>(), ", expected ",
                  want[i].item<float>());
}

Collective make_collective(const std::string& op, Communicator& comm, int64_t size, const BenchOptions& o) {
  const int n = comm.size(), r = comm.rank();
  const auto dtype = scalar_type(o.dtype);
  auto buffer = [&](int64_t numel) {
    return o.buffers == "host-shared" ? ztrain::host_shared_empty({numel}, dtype) : torch::empty({numel}, dtype);
  };
  const auto pattern = [dtype](int64_t numel) { return ::pattern(numel, dtype); };
  const int64_t shard = size / c10::elementSize(dtype) / n;  // elements per rank
  const float rank_sum = n * (n + 1) / 2.0f;  // rank q contributes (q + 1) * pattern
  Collective c;
  if (op == "all_reduce") {
    auto x = buffer(shard * n);
    c.bytes = x.nbytes();
    c.call = [&comm, x] { comm.all_reduce(x, ReduceOp::kSum); };
    c.check = [&comm, x, r, rank_sum, pattern] {
      x.copy_(pattern(x.numel()) * (r + 1));
      comm.all_reduce(x, ReduceOp::kSum);
      auto error = compare(x, pattern(x.numel()) * rank_sum);
      x.zero_();  // the timed calls sum in place: keep the values from growing
      return error;
    };
  } else if (op == "all_gather" || op == "all_gather_in_place") {
    auto out = buffer(shard * n);
    auto in = op == "all_gather" ? buffer(shard) : out.narrow(0, r * shard, shard);
    c.bytes = out.nbytes();
    c.call = [&comm, in, out] { comm.all_gather(in, out); };
    c.check = [&comm, in, out, n, r, pattern] {
      out.fill_(-1);
      in.copy_(pattern(in.numel()) * (r + 1));
      comm.all_gather(in, out);
      std::vector<torch::Tensor> want;
      for (int q = 0; q < n; ++q) want.push_back(pattern(in.numel()) * (q + 1));
      return compare(out, torch::cat(want));
    };
  } else {
    ZTRAIN_INTERNAL_ASSERT(op == "reduce_scatter", "unknown op ", op);
    auto in = buffer(shard * n), out = buffer(shard);
    c.bytes = in.nbytes();
    c.call = [&comm, in, out] { comm.reduce_scatter(in, out, ReduceOp::kSum); };
    c.check = [&comm, in, out, r, rank_sum, pattern] {
      in.copy_(pattern(in.numel()) * (r + 1));
      out.fill_(-1);
      comm.reduce_scatter(in, out, ReduceOp::kSum);
      return compare(out, pattern(in.numel()).narrow(0, r * out.numel(), out.numel()) * rank_sum);
    };
  }
  return c;
}

// Runs the one-off check on every rank; false (on all ranks) when any rank got a wrong result.
bool verified(Communicator& comm, const Collective& c, const std::string& op, int64_t size) {
  const auto error = c.check();
  if (error) {
    std::fprintf(stderr, "comm_bench: rank %d: %s of %s gave a wrong result: %s\n", comm.rank(), op.c_str(),
                 human(size).c_str(), error->c_str());
  }
  return comm.all_reduce_scalar(int64_t{error.has_value()}) == 0;
}

// Times the collective and, right before it, memcpy of the same bytes (see the top of the file).
Result bench(Communicator& comm, const BenchOptions& o, const std::string& op, int64_t size,
             const Collective& c) {
  Result r;
  r.op = op;
  r.size = size;
  r.bytes = c.bytes;
  auto src = torch::ones({c.bytes}, torch::kUInt8), dst = torch::empty({c.bytes}, torch::kUInt8);
  r.copy = measure(comm, o, [&] { std::memcpy(dst.data_ptr(), src.data_ptr(), c.bytes); });
  const auto shared_before = comm.stats().host_shared_calls;
  r.time = measure(comm, o, c.call);
  r.host_shared = comm.stats().host_shared_calls > shared_before;
  r.memcpy_bw = r.bytes / r.copy.median;
  r.algbw = r.bytes / r.time.median;
  r.busbw = r.algbw * bus_factor(op, comm.size());
  return r;
}

// ---- output --------------------------------------------------------------------------------

std::string mpi_library() {
  char text[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  MPI_Get_library_version(text, &len);
  std::string s(text, len);
  return s.substr(0, s.find_first_of(",\n"));
}

// "host (k ranks)", one entry per host, from every rank's hostname.
std::string hosts(Communicator& comm) {
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  std::map<std::string, int> count;
  for (const auto& h : comm.all_gather_bytes(name)) ++count[h];
  std::string out;
  for (const auto& [h, k] : count) out += c10::str(out.empty() ? "" : ", ", h, " (", k, " ranks)");
  return out;
}

// The environment that shapes these numbers: Open MPI settings (mpirun --mca NAME VALUE reaches
// the ranks as OMPI_MCA_NAME) less the launcher's own bookkeeping, threads, allocator, ztrain.
std::string environment_settings() {
  constexpr std::string_view kMca = "OMPI_MCA_";
  const std::vector<std::string_view> launcher = {"orte_", "ess", "pmix", "shmem_", "initial_wdir"};
  const std::vector<std::string_view> others = {"OMP_NUM_THREADS=", "GLIBC_TUNABLES=", "ZTRAIN_"};
  auto starts = [](std::string_view v) { return [v](std::string_view p) { return v.starts_with(p); }; };
  std::string out;
  for (char** e = environ; *e; ++e) {
    const std::string_view v(*e);
    const bool mca =
        v.starts_with(kMca) && std::none_of(launcher.begin(), launcher.end(), starts(v.substr(kMca.size())));
    if (mca || std::any_of(others.begin(), others.end(), starts(v))) {
      out += c10::str(out.empty() ? "" : " ", v);
    }
  }
  return out.empty() ? "(none)" : out;
}

// The 1-minute load average: other work on the machine skews every number here.
double load_average() {
  double load[1] = {-1};
  getloadavg(load, 1);
  return load[0];
}

int usable_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  return sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : -1;
}

void print_configuration(ztrain::Runtime& rt, const BenchOptions& o) {
  const auto host_list = hosts(rt.world());  // collective: before the rank check
  if (rt.rank() != 0) return;
  std::string ops;
  for (const auto& op : o.ops) ops += (ops.empty() ? "" : ",") + op;
  std::printf(
      "# comm_bench: ztrain %s, libtorch %s, %s\n"
      "# ranks %d on %s; %d core(s) usable by rank 0; intra-op threads per rank %d\n"
      "# dtype %s, reduce op sum; buffers %s; timeout %.0f s; debug collectives %s; load average %.2f at "
      "start\n"
      "# environment: %s\n"
      "# ops %s; sizes %s .. %s (x4); target %.2f s per op and size; warm-up %d; iterations %d..%d\n"
      "# time: one call, barrier before each, max over ranks; median and p10/p90 over iterations\n"
      "# algbw = S / time; S = all_reduce tensor, all_gather output, reduce_scatter input; "
      "GB/s = 1e9 B/s\n"
      "# busbw = algbw * 2(n-1)/n for all_reduce, algbw * (n-1)/n for all_gather and "
      "reduce_scatter (NCCL-tests)\n"
      "# memcpy = S / time of one std::memcpy of S bytes between two preallocated buffers, run by "
      "every rank at once,\n"
      "#          timed like the collectives; S counted once (not read + write): one core's copy "
      "rate\n",
      ZTRAIN_VERSION, TORCH_VERSION, mpi_library().c_str(), rt.world_size(), host_list.c_str(),
      usable_cores(), rt.threads(), o.dtype == "bf16" ? "bfloat16" : "float32", o.buffers.c_str(),
      rt.timeout().count() / 1000.0, rt.debug_collectives() ? "on" : "off",
      load_average(), environment_settings().c_str(), ops.c_str(), human(o.min_bytes).c_str(),
      human(o.max_bytes).c_str(), o.target_seconds, o.warmup, o.min_iters, o.max_iters);
}

void print_header(const std::string& op, int ranks) {
  std::printf("\n# %s, %d ranks, %s\n%12s %9s %7s %10s %10s %10s %8s %8s %8s %7s %4s\n", op.c_str(), ranks,
              op == "all_reduce" || op == "all_gather_in_place" ? "in place" : "out of place", "bytes", "size",
              "iters", "time_us", "p10_us", "p90_us", "algbw", "busbw", "memcpy", "bus/cpy", "shm");
  std::printf("%12s %9s %7s %10s %10s %10s %8s %8s %8s %7s\n", "", "", "", "median", "", "", "GB/s", "GB/s",
              "GB/s", "");
}

void print_row(const Result& r) {
  std::printf("%12lld %9s %7d %10.1f %10.1f %10.1f %8.3f %8.3f %8.3f %7.3f %4s\n",
              static_cast<long long>(r.bytes), human(r.size).c_str(), r.time.iters, r.time.median * 1e6,
              r.time.p10 * 1e6, r.time.p90 * 1e6, r.algbw / kGB, r.busbw / kGB, r.memcpy_bw / kGB, r.ratio(),
              r.host_shared ? "yes" : "no");
  std::fflush(stdout);
}

nlohmann::json to_json(const Timing& t) {
  return {{"iters", t.iters}, {"median_s", t.median}, {"p10_s", t.p10},
          {"p90_s", t.p90},   {"min_s", t.min},       {"max_s", t.max}};
}

nlohmann::json to_json(const Result& r, int ranks, const BenchOptions& o) {
  return {{"op", r.op},
          {"buffers", o.buffers},
          {"host_shared_path", r.host_shared},
          {"ranks", ranks},
          {"dtype", o.dtype == "bf16" ? "bfloat16" : "float32"},
          {"size", r.size},
          {"bytes", r.bytes},
          {"time", to_json(r.time)},
          {"memcpy_time", to_json(r.copy)},
          {"algbw_GBps", r.algbw / kGB},
          {"busbw_GBps", r.busbw / kGB},
          {"memcpy_GBps", r.memcpy_bw / kGB},
          {"busbw_over_memcpy", r.ratio()}};
}

// One line per op: PASS when busbw >= kGoalRatio * memcpy at every measured size >= kGoalMinBytes.
void print_goal(const std::vector<Result>& results, const std::vector<std::string>& ops, int ranks) {
  std::printf(
      "\n# load average %.2f at the end\n# goal: bus bandwidth >= %.0f%% of memcpy bandwidth at >= %s\n",
      load_average(), kGoalRatio * 100, human(kGoalMinBytes).c_str());
  if (ranks == 1) {
    std::printf("#   n/a  (one rank moves no bytes between ranks)\n");
    return;
  }
  for (const auto& op : ops) {
    const Result* worst = nullptr;
    for (const auto& r : results) {
      if (r.op == op && r.size >= kGoalMinBytes && (!worst || r.ratio() < worst->ratio())) worst = &r;
    }
    if (!worst) {
      std::printf("#   %-15s n/a  (no size >= %s in this sweep)\n", op.c_str(), human(kGoalMinBytes).c_str());
    } else {
      std::printf("#   %-15s %s  (lowest bus/memcpy %.3f, at %s)\n", op.c_str(),
                  worst->ratio() >= kGoalRatio ? "PASS" : "MISS", worst->ratio(), human(worst->size).c_str());
    }
  }
  std::fflush(stdout);
}

// ---- main ----------------------------------------------------------------------------------

// Parses argv; on --help or a bad option prints (rank 0) and returns the exit code.
std::optional<int> parse(int argc, char** argv, int rank, int ranks, BenchOptions& o) {
  CLI::App app{"Bandwidth of ztrain's collectives next to memcpy (run under mpirun)."};
  app.add_option("--min-bytes", o.min_bytes, "smallest message size S (e.g. 1KiB)")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  app.add_option("--max-bytes", o.max_bytes, "largest message size S (sizes grow x4)")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  app.add_option("--ops", o.ops, "comma-separated ops")
      ->delimiter(',')
      ->check(CLI::IsMember(kOps))
      ->capture_default_str();
  app.add_option("--target-seconds-per-size", o.target_seconds, "timed seconds per op and size")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--warmup", o.warmup, "untimed calls per op and size before timing")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  app.add_option("--min-iters", o.min_iters, "fewest timed calls")
      ->check(CLI::Range(1, 1000000))
      ->capture_default_str();
  app.add_option("--max-iters", o.max_iters, "most timed calls")
      ->check(CLI::Range(1, 1000000))
      ->capture_default_str();
  app.add_option("--buffers", o.buffers, "host-shared (peers on one host read them in place) or private")
      ->check(CLI::IsMember({"host-shared", "private"}))
      ->capture_default_str();
  app.add_option("--dtype", o.dtype, "element type of the buffers: fp32 or bf16 (sums in bf16 round once per addition)")
      ->check(CLI::IsMember({"fp32", "bf16"}))
      ->capture_default_str();
  app.add_option("--json", o.json, "also write the results to FILE as JSON lines")->type_name("FILE");
  try {
    app.parse(argc, argv);
    const int64_t smallest = static_cast<int64_t>(sizeof(float)) * ranks;
    if (o.min_bytes < smallest) {
      throw CLI::ValidationError("--min-bytes",
                                 c10::str("must be at least one float per rank, ", smallest, " bytes"));
    }
    if (o.max_bytes < o.min_bytes) throw CLI::ValidationError("--max-bytes", "must be >= --min-bytes");
    if (o.max_iters < o.min_iters) throw CLI::ValidationError("--max-iters", "must be >= --min-iters");
  } catch (const CLI::ParseError& e) {
    if (rank == 0) return app.exit(e);
    return e.get_exit_code();
  }
  return std::nullopt;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    auto& rt = ztrain::init_distributed();
    auto& comm = rt.world();
    const bool root = rt.rank() == 0;
    BenchOptions o;
    if (auto code = parse(argc, argv, rt.rank(), rt.world_size(), o)) return *code;

    std::ofstream json;
    if (root && o.json) json.open(*o.json);
    if (!comm.broadcast_object(!o.json || json.is_open(), 0)) {
      if (root) std::fprintf(stderr, "comm_bench: cannot open %s for writing\n", o.json->c_str());
      return 2;
    }
    print_configuration(rt, o);

    std::vector<Result> results;
    for (const auto& op : o.ops) {
      if (root) print_header(op, rt.world_size());
      for (int64_t size = o.min_bytes; size <= o.max_bytes; size *= 4) {
        const auto c = make_collective(op, comm, size, o);
        if (!verified(comm, c, op, size)) return 1;
        results.push_back(bench(comm, o, op, size, c));
        if (root) {
          print_row(results.back());
          if (json.is_open()) json << to_json(results.back(), rt.world_size(), o).dump() << '\n' << std::flush;
        }
      }
    }
    if (root) print_goal(results, o.ops, rt.world_size());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "comm_bench: %s\n", e.what());
    return 1;
  }
}
