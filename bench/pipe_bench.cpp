// pipe_bench: the pipeline bubble and the activation memory of GPipe, 1F1B and interleaved 1F1B,
// measured in one run against the theory.
//
//   OMP_NUM_THREADS=1 mpirun -np 2 --bind-to none build/bench/pipe_bench [--dim 256 --layers 8
//       --seq 64 --micro-batch 4 --chunks 2 --rounds 5 --steps 3]
//
// How it is measured
// ------------------
// The model is a stack of --layers pre-LayerNorm MLP blocks (x + W2 gelu(W1 ln(x)), width 4d), cut
// uniformly into p stages (p = the world size; p·v chunks for interleaved, v = --chunks), each
// block a ztrain Block at ZeRO level 0 without recomputation, so every block keeps its
// activations until its backward. The first stage takes the micro-batch's input as is, the last
// ends in a mean-squared-error loss: all stages do the same work, as the theory assumes.
//
// Bubble. Ideal compute time of a step = m × t, where t is one micro-batch's forward + backward
// through one stage alone (no pipeline, no communication; t is the slowest stage's). Step time
// T = wall time of forward_backward_step from a barrier, max over ranks. Bubble = 1 − m·t / T
// against the theory (p−1)/(m+p−1), and (p−1)/(v·m+p−1) for interleaved. t is measured two
// ways: with every stage computing at once (the cores as busy as in the pipeline's steady
// state) and with the stages taking turns while the others sleep in a barrier (as in the fill
// and drain, where one stage computes). On an idle machine the two agree; when other processes
// compete for the cores they bracket the truth. Each sample is one t of each kind and one T
// taken back to back, so the machine's changing load moves them alike; reported: the median
// bubble over samples and its min–max.
//
// Activation memory. A counting CPU allocator is installed before anything is allocated: it
// wraps libtorch's default allocator and keeps the live bytes of all CPU tensors and their peak.
// For each step: peak live bytes during forward_backward_step minus the live bytes just before
// it (parameters and gradients already allocated) — the activations autograd saves, the
// boundary messages and backward's temporaries. Predicted: the schedule list itself, walked with
// each chunk's measured one-micro-batch activation bytes a (live bytes after its forward minus
// before): the largest sum of a over forwarded, not yet backwarded micro-batches. Process RSS
// would not do: its peak only grows over a process's life (later variants cannot be measured in
// the same run) and glibc keeps freed memory, so GPipe's and 1F1B's steps look alike.
//
// Verified once: every schedule's first loss equals a single-process run of the whole model
// (built on every rank from the same seeds), and each rank's gradient norm equals that of its
// layers in the single-process run.
#include <ztrain/ztrain.h>
#include <ztrain/pipe/pipe.h>
#include <ztrain/torch_compat.h>

#include <CLI/CLI.hpp>
#include <c10/core/CPUAllocator.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <array>
#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <thread>

namespace {

namespace pipe = ztrain::pipe;
using Clock = std::chrono::steady_clock;

// ---- a CPU allocator that counts live bytes ----------------------------------------------------

class CountingAllocator final : public ztrain::detail::HostAllocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate_bytes(size_t n) const override {
    auto inner = base_->allocate(n);
    void* data = inner.get();
    const auto device = inner.device();
    auto* ctx = new Context{std::move(inner), n, this};
    const int64_t now = live_.fetch_add(static_cast<int64_t>(n)) + static_cast<int64_t>(n);
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
    return {data, ctx, &release, device};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }

  int64_t live() const { return live_.load(); }
  int64_t peak() const { return peak_.load(); }
  void reset_peak() { peak_.store(live_.load()); }

 private:
  struct Context {
    c10::DataPtr inner;
    size_t bytes;
    const CountingAllocator* owner;
  };
  static void release(void* ptr) {
    auto* ctx = static_cast<Context*>(ptr);
    ctx->owner->live_.fetch_sub(static_cast<int64_t>(ctx->bytes));
    delete ctx;
  }

  c10::Allocator* base_;
  mutable std::atomic<int64_t> live_{0};
  mutable std::atomic<int64_t> peak_{0};
};

CountingAllocator& counting_allocator() {
  static CountingAllocator allocator(c10::GetDefaultCPUAllocator());
  return allocator;
}

// ---- the model ---------------------------------------------------------------------------------

struct LayerImpl : torch::nn::Module {
  explicit LayerImpl(int64_t d)
      : ln(torch::nn::LayerNormOptions({d})), fc1(d, 4 * d), fc2(4 * d, d) {
    register_module("ln", ln);
    register_module("fc1", fc1);
    register_module("fc2", fc2);
  }
  torch::Tensor forward(torch::Tensor x) { return x + fc2(torch::gelu(fc1(ln(x)), "tanh")); }
  torch::nn::LayerNorm ln;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Layer);

Layer make_layer(int64_t index, int64_t dim) {
  torch::manual_seed(1000 + index);
  return Layer(dim);
}

torch::Tensor loss_of(const torch::Tensor& y, const torch::Tensor& target) {
  return torch::mse_loss(y, target);
}

/// This rank's chunks of a model cut into p·v parts (chunk c holds virtual stage c·p + s).
struct StagedModel {
  std::vector<pipe::StageModule<Layer>> chunks;
  std::vector<int64_t> bounds;  // over virtual stages
  std::vector<std::shared_ptr<pipe::StageImpl>> pointers() const {
    std::vector<std::shared_ptr<pipe::StageImpl>> out;
    for (const auto& c : chunks) out.push_back(c.ptr());
    return out;
  }
};

StagedModel build_stages(int64_t layers, int64_t dim, int p, int s, int v) {
  StagedModel model;
  model.bounds = pipe::partition_uniform(layers, p * v);
  const int last = p * v - 1;
  for (int c = 0; c < v; ++c) {
    const int vs = pipe::virtual_stage(s, c, p);
    std::vector<ztrain::Block<Layer>> blocks;
    for (int64_t i = model.bounds[vs]; i < model.bounds[vs + 1]; ++i) {
      blocks.emplace_back(make_layer(i, dim), ztrain::BlockOptions{.zero_level = 0, .use_checkpoint = false});
    }
    pipe::StageModuleOptions<Layer> ends;
    if (vs == 0) ends.pre = {nullptr, [](const pipe::TensorList&, const pipe::TensorList& mb) { return pipe::TensorList{mb[0]}; }};
    if (vs == last) {
      ends.post = {nullptr, [](const pipe::TensorList& x, const pipe::TensorList& mb) {
                     return pipe::TensorList{loss_of(x[0], mb[1])};
                   }};
    }
    model.chunks.emplace_back(ztrain::BlockList<Layer>(std::move(blocks)), std::move(ends));
  }
  return model;
}

std::vector<pipe::TensorList> make_micro_batches(int m, int64_t batch, int64_t seq, int64_t dim) {
  torch::manual_seed(7);
  std::vector<pipe::TensorList> out;
  for (int i = 0; i < m; ++i) out.push_back({torch::randn({batch, seq, dim}), torch::randn({batch, seq, dim})});
  return out;
}

void zero_grads(const std::vector<torch::Tensor>& params) {
  for (const auto& p : params) {
    if (p.grad().defined()) p.grad().zero_();
  }
}

double grad_square_sum(const std::vector<torch::Tensor>& params) {
  double sum = 0;
  for (const auto& p : params) {
    if (p.grad().defined()) sum += p.grad().pow(2).sum().item<double>();
  }
  return sum;
}

// ---- one chunk alone ---------------------------------------------------------------------------

/// Forward and backward of one micro-batch through `chunk` (virtual stage vs) without the
/// pipeline: the input a stage would receive (requiring grad), the gradient it would receive.
/// Returns the live bytes its forward left behind (the saved activations and the outputs).
int64_t chunk_forward_backward(pipe::StageImpl& chunk, int vs, int last, const pipe::TensorList& mb, int m) {
  pipe::TensorList inputs;
  if (vs > 0) inputs = {mb[0].detach().clone().requires_grad_(true)};
  auto& counter = counting_allocator();
  const int64_t before = counter.live();
  auto out = chunk.forward(inputs, mb);
  const int64_t activations = counter.live() - before;
  if (vs == last) {
    (out[0] / m).backward();
  } else {
    pipe::backward_from(out, {torch::ones_like(out[0])});
  }
  return activations;
}

struct Stats {
  double median, lo, hi;
};

Stats stats(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v[v.size() / 2], v.front(), v.back()};
}

double max_over_ranks(double x) {
  auto t = torch::tensor({x}, torch::kFloat64);
  ztrain::runtime().world().all_reduce(t, ztrain::ReduceOp::kMax);
  return t.item<double>();
}

double theory_bubble(int p, int m, int v) { return (p - 1.0) / (static_cast<double>(v) * m + p - 1.0); }

/// The schedule's activation high-water mark on this rank: the largest sum of the chunks'
/// one-micro-batch activation bytes over forwarded, not yet backwarded micro-batches.
int64_t predicted_peak(pipe::ScheduleKind kind, int p, int s, int m, const std::vector<int64_t>& per_chunk) {
  const auto list = pipe::make_schedule(kind, {.stages = p, .stage = s, .micro_batches = m,
                                               .chunks = static_cast<int>(per_chunk.size())});
  int64_t live = 0, peak = 0;
  for (const auto& ins : list) {
    if (ins.op == pipe::Op::kForward) peak = std::max(peak, live += per_chunk[ins.chunk]);
    if (ins.op == pipe::Op::kBackward) live -= per_chunk[ins.chunk];
  }
  return peak;
}

int launcher_world_size() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"}) {
    if (const char* v = std::getenv(name)) return std::atoi(v);
  }
  return 1;
}

struct Variant {
  pipe::ScheduleKind kind;
  int chunks;
};

}  // namespace

int main(int argc, char** argv) {
  c10::SetCPUAllocator(&counting_allocator(), /*priority=*/1);

  CLI::App app("pipe_bench: pipeline bubble and activation memory of GPipe, 1F1B and interleaved 1F1B");
  int64_t dim = 256, layers = 8, seq = 64, batch = 4;
  int chunks = 2, rounds = 3, steps = 3, warmup = 1;
  app.add_option("--dim", dim, "model width (MLP hidden 4x)");
  app.add_option("--layers", layers, "blocks in the whole model (divisible by ranks x chunks for even stages)");
  app.add_option("--seq", seq, "sequence length");
  app.add_option("--micro-batch", batch, "sequences per micro-batch");
  app.add_option("--chunks", chunks, "model chunks per rank for interleaved 1F1B (1: skip interleaved)");
  app.add_option("--rounds", rounds, "measurement rounds (ideal time, then every schedule and m)");
  app.add_option("--steps", steps, "timed steps per schedule and m in a round");
  app.add_option("--warmup", warmup, "untimed steps per schedule and m in a round");
  CLI11_PARSE(app, argc, argv);

  // Every rank is a pipeline stage: the pipeline size is the world size, which Open MPI (or a
  // PMI launcher) announces before MPI starts.
  auto& rt = ztrain::init_distributed({.seed = 1, .pp_size = launcher_world_size()});
  auto& world = rt.world();
  // Every rank runs the same number of everything: rank 0's.
  rounds = world.broadcast_object(rounds, 0);
  steps = world.broadcast_object(steps, 0);
  warmup = world.broadcast_object(warmup, 0);
  chunks = world.broadcast_object(chunks, 0);
  const int p = rt.pp().size(), s = rt.pp().rank();
  const std::vector<int> ms = {p, 2 * p, 4 * p};
  std::vector<Variant> variants = {{pipe::ScheduleKind::kGPipe, 1}, {pipe::ScheduleKind::k1F1B, 1}};
  if (chunks > 1) variants.push_back({pipe::ScheduleKind::kInterleaved1F1B, chunks});

  // The models: one cut into p stages (GPipe and 1F1B share it), one into p·v chunks.
  std::vector<StagedModel> models;
  std::vector<std::unique_ptr<pipe::Pipeline>> pipelines;
  for (const auto& variant : variants) {
    if (variant.kind != pipe::ScheduleKind::k1F1B) models.push_back(build_stages(layers, dim, p, s, variant.chunks));
    pipelines.push_back(std::make_unique<pipe::Pipeline>(
        models.back().pointers(), pipe::PipelineOptions{.schedule = variant.kind, .broadcast_loss = true}));
  }
  auto model_of = [&](size_t i) -> StagedModel& { return models[i == 0 ? 0 : i - 1]; };

  const unsigned cores = std::thread::hardware_concurrency();
  int64_t stage_params = 0;
  for (const auto& t : pipelines[0]->parameters()) stage_params += t.numel();
  ztrain::print_rank("pipe_bench: ", p, " pipeline ranks (", rt.world_size(), " processes on ", cores, " cores",
                     rt.world_size() > static_cast<int>(cores) ? ", OVERSUBSCRIBED: ranks share cores, timings unreliable" : "",
                     "), ", rt.threads(), " intra-op thread(s)/rank, fp32, ZeRO level 0 in every stage, no recomputation");
  ztrain::print_rank("model: ", layers, " MLP blocks of width ", dim, " (hidden ", 4 * dim, "), ", layers / p,
                     " blocks = ", stage_params / 1e6, " M parameters per stage; micro-batch ", batch, "x", seq,
                     " tokens x ", dim, "; interleaved: ", chunks, " chunks/rank; ", rounds, " rounds x ", steps,
                     " timed steps (+", warmup, " warm-up) per schedule and m");

  // ---- verify once against the single-process model -------------------------------------------
  {
    const int m = 2 * p;
    auto micro = make_micro_batches(m, batch, seq, dim);
    std::vector<Layer> full;
    std::vector<torch::Tensor> ref_params;
    for (int64_t i = 0; i < layers; ++i) full.push_back(make_layer(i, dim));
    double ref_loss = 0;
    for (const auto& mb : micro) {
      auto h = mb[0];
      for (auto& l : full) h = l(h);
      auto loss = loss_of(h, mb[1]);
      (loss / m).backward();
      ref_loss += loss.item<double>() / m;
    }
    for (size_t i = 0; i < variants.size(); ++i) {
      auto& pipeline = *pipelines[i];
      zero_grads(pipeline.parameters());
      const double loss = pipeline.forward_backward_step(micro).item<double>();
      double ref_grad = 0;
      for (int c = 0; c < variants[i].chunks; ++c) {
        const int vs = pipe::virtual_stage(s, c, p);
        for (int64_t l = model_of(i).bounds[vs]; l < model_of(i).bounds[vs + 1]; ++l) {
          for (const auto& t : full[l]->parameters()) ref_grad += t.grad().pow(2).sum().item<double>();
        }
      }
      const double grad = grad_square_sum(pipeline.parameters());
      const bool ok = std::abs(loss - ref_loss) <= 1e-5 * std::abs(ref_loss) &&
                      std::abs(grad - ref_grad) <= 1e-4 * std::abs(ref_grad);
      if (max_over_ranks(ok ? 0.0 : 1.0) > 0) {
        std::printf("rank %d: error: %s loss %.8g (single process %.8g), |grad|^2 %.8g (single process %.8g)\n",
                    rt.rank(), pipe::to_string(variants[i].kind), loss, ref_loss, grad, ref_grad);
        return 1;
      }
    }
    ztrain::print_rank("verified: every schedule's loss and per-stage gradient norm equal the single-process model's");
  }

  // ---- activation memory ------------------------------------------------------------------------
  ztrain::print_rank("\nactivation memory: peak live CPU tensor bytes during forward_backward_step minus before it, ",
                     "per stage (MB = 1e6 bytes); predicted = the schedule's most micro-batches in flight x one ",
                     "micro-batch's saved activations (measured per chunk)");
  ztrain::print_rank("schedule      m   stage  peak_MB  predicted_MB  ratio  in_flight(stage units)");
  for (size_t i = 0; i < variants.size(); ++i) {
    auto& pipeline = *pipelines[i];
    const int v = variants[i].chunks, last = p * v - 1;
    // One micro-batch's activations per chunk, measured alone.
    auto one = make_micro_batches(1, batch, seq, dim);
    std::vector<int64_t> per_chunk;
    int64_t per_stage = 0;
    for (int c = 0; c < v; ++c) {
      per_chunk.push_back(chunk_forward_backward(*pipeline.chunks()[c], pipe::virtual_stage(s, c, p), last, one[0], 1));
      per_stage += per_chunk.back();
    }
    for (int m : ms) {
      auto micro = make_micro_batches(m, batch, seq, dim);
      zero_grads(pipeline.parameters());
      pipeline.forward_backward_step(micro);  // warm-up: gradients and buffers allocated
      zero_grads(pipeline.parameters());
      world.barrier();
      auto& counter = counting_allocator();
      const int64_t before = counter.live();
      counter.reset_peak();
      pipeline.forward_backward_step(micro);
      const int64_t peak = counter.peak() - before;
      const int64_t predicted = predicted_peak(variants[i].kind, p, s, m, per_chunk);
      const auto all = world.all_gather_object(std::array<int64_t, 3>{peak, predicted, per_stage});
      for (int r = 0; r < p; ++r) {
        const auto [pk, pr, ps] = all[r];
        char line[160];
        std::snprintf(line, sizeof(line), "%-12s %2d   %d     %7.1f  %12.1f  %5.2f  %5.2f", pipe::to_string(variants[i].kind),
                      m, r, pk / 1e6, pr / 1e6, static_cast<double>(pk) / pr, static_cast<double>(pr) / ps);
        ztrain::print_rank(line);
      }
    }
  }

  // ---- bubble -----------------------------------------------------------------------------------
  // Samples are taken in triples, back to back: t with all stages at once, t with the stages
  // taking turns, then one step T; so the load of the machine moves all three alike.
  struct Samples {
    std::vector<double> t_together, t_alone, step, bubble_together, bubble_alone;
  };
  std::vector<std::vector<Samples>> samples(variants.size(), std::vector<Samples>(ms.size()));
  std::vector<std::vector<double>> own_t(variants.size());  // this rank's t (together), per sample
  std::vector<std::vector<pipe::TensorList>> micro_of;
  for (int m : ms) micro_of.push_back(make_micro_batches(m, batch, seq, dim));
  auto seconds_since = [](Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  for (int round = 0; round < rounds; ++round) {
    for (size_t i = 0; i < variants.size(); ++i) {
      auto& pipeline = *pipelines[i];
      const int v = variants[i].chunks, last = p * v - 1;
      auto stage_alone = [&] {  // this rank's chunks, one micro-batch, no pipeline
        const auto t0 = Clock::now();
        for (int c = 0; c < v; ++c) {
          chunk_forward_backward(*pipeline.chunks()[c], pipe::virtual_stage(s, c, p), last, micro_of[0][0], ms[0]);
        }
        return seconds_since(t0);
      };
      for (size_t j = 0; j < ms.size(); ++j) {
        for (int k = 0; k < warmup + steps; ++k) {
          world.barrier();
          const double together = stage_alone();
          double alone = 0;
          for (int r = 0; r < p; ++r) {  // the others wait (and sleep) in the barrier
            world.barrier();
            if (r == s) alone = stage_alone();
          }
          zero_grads(pipeline.parameters());
          world.barrier();
          const auto t0 = Clock::now();
          pipeline.forward_backward_step(micro_of[j]);
          const double T = max_over_ranks(seconds_since(t0));
          const double t = max_over_ranks(together), ta = max_over_ranks(alone);
          if (k < warmup) continue;
          auto& x = samples[i][j];
          x.t_together.push_back(t);
          x.t_alone.push_back(ta);
          x.step.push_back(T);
          x.bubble_together.push_back(1.0 - ms[j] * t / T);
          x.bubble_alone.push_back(1.0 - ms[j] * ta / T);
          own_t[i].push_back(together);
        }
      }
    }
  }

  ztrain::print_rank("\nbubble = 1 - m*t/T. t: one micro-batch's forward+backward through one stage's chunks without ",
                     "the pipeline (slowest stage), measured with all stages computing at once (t_tog) and with the ",
                     "stages taking turns while the others sleep (t_alone); T: forward_backward_step wall time (max over ",
                     "ranks). Each sample is (t_tog, t_alone, T) taken back to back; medians and [min, max] over ",
                     rounds * steps, " samples");
  for (size_t i = 0; i < variants.size(); ++i) {
    const auto own = world.all_gather_object(stats(own_t[i]).median);
    std::string per_stage;
    for (double x : own) per_stage += c10::str(" ", std::round(x * 1e4) / 10.0);
    ztrain::print_rank(pipe::to_string(variants[i].kind), ": median t_tog per stage (ms):", per_stage);
  }
  ztrain::print_rank("schedule      m  t_tog_ms t_alone_ms    T_ms   theory  bubble(t_tog) [min, max]  bubble(t_alone) [min, max]");
  for (size_t i = 0; i < variants.size(); ++i) {
    for (size_t j = 0; j < ms.size(); ++j) {
      const auto& x = samples[i][j];
      const auto bt = stats(x.bubble_together), ba = stats(x.bubble_alone);
      char line[256];
      std::snprintf(line, sizeof(line), "%-12s %2d  %7.1f  %9.1f  %7.1f   %.3f   %6.3f [%6.3f, %6.3f]   %6.3f [%6.3f, %6.3f]",
                    pipe::to_string(variants[i].kind), ms[j], stats(x.t_together).median * 1e3,
                    stats(x.t_alone).median * 1e3, stats(x.step).median * 1e3, theory_bubble(p, ms[j], variants[i].chunks),
                    bt.median, bt.lo, bt.hi, ba.median, ba.lo, ba.hi);
      ztrain::print_rank(line);
    }
  }
  return 0;
}
