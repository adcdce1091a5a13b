#include <ztrain/pipe/schedule.h>

#include <ztrain/error.h>

#include <algorithm>
#include <deque>
#include <optional>

// How it works
//
// Each schedule first lists every stage's computes (forward or backward of a micro-batch on a
// chunk) in order. A forward on virtual stage vs receives its input unless vs is the first
// virtual stage and sends its output unless it is the last; a backward receives its output
// gradient unless it is on the last virtual stage and sends its input gradient unless it is on
// the first. Between two computes a stage thus has up to two transfers: the send of the first
// compute's result and the receive of the second's input. Their order is decided by running
// all stages together (`order_transfers`), letting a send and a receive happen only as a
// matched pair at the same moment, as with blocking transfers: each stage's list is its
// projection of that one global sequence of events, so executing the lists with blocking sends
// and receives replays the sequence and completes, and with non-blocking sends it completes
// all the more. A stage normally hands its result over before its next compute; when every
// stage that could move is waiting for a partner to take a result (interleaved steady state),
// the first of them computes on and hands the result over later. A transfer to oneself (one rank, several chunks) is a local hand-over, placed
// in the natural order (send, then receive). Deterministic: stages are visited in order.

namespace ztrain::pipe {
namespace {

struct Compute {
  bool forward;
  int micro_batch;
  int chunk;
};

void check_shape(const ScheduleShape& s) {
  ZTRAIN_CHECK(s.stages >= 1, "pipeline schedule: stages must be >= 1, got ", s.stages);
  ZTRAIN_CHECK(s.stage >= 0 && s.stage < s.stages, "pipeline schedule: stage must be in [0, ", s.stages, "), got ",
               s.stage);
  ZTRAIN_CHECK(s.micro_batches >= 1, "pipeline schedule: micro_batches must be >= 1, got ", s.micro_batches);
  ZTRAIN_CHECK(s.chunks >= 1, "pipeline schedule: chunks (virtual stages per rank) must be >= 1, got ", s.chunks);
}

struct Transfer {
  Instruction ins;
  int peer;  // the other rank
};

std::vector<Instruction> order_transfers(const std::vector<std::vector<Compute>>& computes, int stage, int chunks) {
  const int p = static_cast<int>(computes.size());
  const int last_virtual = p * chunks - 1;
  auto recv_of = [&](int s, const Compute& c) -> std::optional<Transfer> {
    const int vs = virtual_stage(s, c.chunk, p);
    if (c.forward && vs > 0) return Transfer{{Op::kRecvForward, c.micro_batch, c.chunk}, (s + p - 1) % p};
    if (!c.forward && vs < last_virtual) return Transfer{{Op::kRecvBackward, c.micro_batch, c.chunk}, (s + 1) % p};
    return std::nullopt;
  };
  auto send_of = [&](int s, const Compute& c) -> std::optional<Transfer> {
    const int vs = virtual_stage(s, c.chunk, p);
    if (c.forward && vs < last_virtual) return Transfer{{Op::kSendForward, c.micro_batch, c.chunk}, (s + 1) % p};
    if (!c.forward && vs > 0) return Transfer{{Op::kSendBackward, c.micro_batch, c.chunk}, (s + p - 1) % p};
    return std::nullopt;
  };
  // Whether `send` on stage a is what `recv` on stage b waits for.
  auto pairs = [&](int a, const Transfer& send, int b, const Transfer& recv) {
    if (send.peer != b || recv.peer != a) return false;
    const bool forward = send.ins.op == Op::kSendForward;
    if (recv.ins.op != (forward ? Op::kRecvForward : Op::kRecvBackward)) return false;
    const int from = virtual_stage(a, send.ins.chunk, p), to = virtual_stage(b, recv.ins.chunk, p);
    return send.ins.micro_batch == recv.ins.micro_batch && to == from + (forward ? 1 : -1);
  };

  std::vector<std::vector<Instruction>> lists(p);
  std::vector<size_t> next(p, 0);
  std::vector<std::deque<Transfer>> sends(p);  // results not yet handed over, oldest first
  std::vector<std::optional<Transfer>> recv(p);  // the next compute's input, until it is here
  for (int s = 0; s < p; ++s) {
    if (!computes[s].empty()) recv[s] = recv_of(s, computes[s][0]);
  }
  auto compute = [&](int s) {
    const auto& c = computes[s][next[s]];
    lists[s].push_back({c.forward ? Op::kForward : Op::kBackward, c.micro_batch, c.chunk});
    if (auto out = send_of(s, c)) sends[s].push_back(*out);
    if (++next[s] < computes[s].size()) recv[s] = recv_of(s, computes[s][next[s]]);
  };
  auto step = [&] {
    bool progress = false;
    for (int s = 0; s < p; ++s) {
      // Local hand-overs at once, then the next compute once its input is here and every
      // earlier result is gone.
      while (!sends[s].empty() && sends[s].back().peer == s) {
        lists[s].push_back(sends[s].back().ins);
        sends[s].pop_back();
        progress = true;
      }
      if (recv[s] && recv[s]->peer == s) {
        lists[s].push_back(recv[s]->ins);
        recv[s].reset();
        progress = true;
      }
      if (sends[s].empty() && !recv[s] && next[s] < computes[s].size()) {
        compute(s);
        progress = true;
      }
    }
    for (int a = 0; a < p; ++a) {
      for (size_t k = 0; k < sends[a].size(); ++k) {
        const auto& out = sends[a][k];
        bool first_on_channel = true;  // transfers on one channel keep their order
        for (size_t j = 0; j < k; ++j) {
          first_on_channel = first_on_channel && !(sends[a][j].peer == out.peer && sends[a][j].ins.op == out.ins.op);
        }
        const int b = out.peer;
        if (!first_on_channel || !recv[b] || !pairs(a, out, b, *recv[b])) continue;
        lists[a].push_back(out.ins);
        lists[b].push_back(recv[b]->ins);
        sends[a].erase(sends[a].begin() + static_cast<std::ptrdiff_t>(k));
        recv[b].reset();
        progress = true;
        break;
      }
    }
    return progress;
  };
  while (true) {
    if (step()) continue;
    // Stuck: every stage that can move waits for a partner to take a result. The first such
    // stage goes on computing and hands the result over later (Megatron-LM's interleaved
    // schedule overlaps these transfers with the next compute too).
    bool deferred = false;
    for (int s = 0; s < p && !deferred; ++s) {
      if (!recv[s] && !sends[s].empty() && next[s] < computes[s].size()) {
        compute(s);
        deferred = true;
      }
    }
    if (!deferred) break;
  }
  for (int s = 0; s < p; ++s) {
    if (next[s] == computes[s].size() && sends[s].empty() && !recv[s]) continue;
    std::string state;
    for (int t = 0; t < p; ++t) {
      state += c10::str("\n stage ", t, ":");
      for (const auto& i : lists[t]) state += " " + to_string(i);
      state += " | pending";
      for (const auto& out : sends[t]) state += " " + to_string(out.ins);
      if (recv[t]) state += " " + to_string(recv[t]->ins);
    }
    ZTRAIN_INTERNAL_ASSERT(false, "pipeline schedule: the stages cannot proceed:", state);
  }
  return std::move(lists[stage]);
}

}  // namespace

const char* to_string(Op op) {
  switch (op) {
    case Op::kRecvForward: return "RF";
    case Op::kForward: return "F";
    case Op::kSendForward: return "SF";
    case Op::kRecvBackward: return "RB";
    case Op::kBackward: return "B";
    case Op::kSendBackward: return "SB";
  }
  return "?";
}

const char* to_string(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kGPipe: return "gpipe";
    case ScheduleKind::k1F1B: return "1f1b";
    case ScheduleKind::kInterleaved1F1B: return "interleaved";
  }
  return "?";
}

ScheduleKind parse_schedule_kind(const std::string& name) {
  for (auto k : {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved1F1B}) {
    if (name == to_string(k)) return k;
  }
  ZTRAIN_CHECK(false, "unknown pipeline schedule '", name, "'; use gpipe, 1f1b or interleaved");
  return ScheduleKind::k1F1B;
}

std::string to_string(const Instruction& i) {
  std::string s = c10::str(to_string(i.op), i.micro_batch);
  if (i.chunk != 0) s += c10::str(".", i.chunk);
  return s;
}

std::ostream& operator<<(std::ostream& out, const Instruction& i) { return out << to_string(i); }

namespace {

std::vector<Compute> gpipe_computes(int /*stages*/, int /*stage*/, int micro_batches) {
  std::vector<Compute> computes;
  for (int mb = 0; mb < micro_batches; ++mb) computes.push_back({true, mb, 0});
  for (int mb = 0; mb < micro_batches; ++mb) computes.push_back({false, mb, 0});
  return computes;
}

std::vector<Compute> one_f_one_b_computes(int stages, int stage, int micro_batches) {
  const int warmup = std::min(stages - stage - 1, micro_batches);
  std::vector<Compute> computes;
  int next_forward = 0, next_backward = 0;
  for (int i = 0; i < warmup; ++i) computes.push_back({true, next_forward++, 0});
  while (next_forward < micro_batches) {
    computes.push_back({true, next_forward++, 0});
    computes.push_back({false, next_backward++, 0});
  }
  while (next_backward < micro_batches) computes.push_back({false, next_backward++, 0});
  return computes;
}

std::vector<Compute> interleaved_computes(int stages, int stage, int micro_batches, int chunks) {
  const int total = micro_batches * chunks;
  const int group = stages * chunks;
  auto micro_batch_of = [&](int k) { return (k / group) * stages + k % stages; };
  auto forward_chunk = [&](int k) { return (k % group) / stages; };
  auto backward_chunk = [&](int k) { return chunks - 1 - forward_chunk(k); };
  const int warmup =
      micro_batches == stages ? total : std::min(total, (stages - stage - 1) * 2 + (chunks - 1) * stages);
  std::vector<Compute> computes;
  int f = 0, b = 0;
  for (; f < warmup; ++f) computes.push_back({true, micro_batch_of(f), forward_chunk(f)});
  for (; f < total; ++f, ++b) {
    computes.push_back({true, micro_batch_of(f), forward_chunk(f)});
    computes.push_back({false, micro_batch_of(b), backward_chunk(b)});
  }
  for (; b < total; ++b) computes.push_back({false, micro_batch_of(b), backward_chunk(b)});
  return computes;
}

/// The list of `shape.stage`, from every stage's computes.
template <class F>
std::vector<Instruction> schedule_from(const ScheduleShape& shape, F&& computes_of) {
  check_shape(shape);
  std::vector<std::vector<Compute>> all;
  for (int s = 0; s < shape.stages; ++s) all.push_back(computes_of(s));
  return order_transfers(all, shape.stage, shape.chunks);
}

}  // namespace

std::vector<Instruction> gpipe_schedule(int stages, int stage, int micro_batches) {
  return schedule_from({.stages = stages, .stage = stage, .micro_batches = micro_batches},
                       [&](int s) { return gpipe_computes(stages, s, micro_batches); });
}

std::vector<Instruction> one_f_one_b_schedule(int stages, int stage, int micro_batches) {
  return schedule_from({.stages = stages, .stage = stage, .micro_batches = micro_batches},
                       [&](int s) { return one_f_one_b_computes(stages, s, micro_batches); });
}

std::vector<Instruction> interleaved_schedule(int stages, int stage, int micro_batches, int chunks) {
  check_shape({.stages = stages, .stage = stage, .micro_batches = micro_batches, .chunks = chunks});
  ZTRAIN_CHECK(micro_batches % stages == 0, "interleaved 1F1B needs the number of micro-batches to be a multiple of "
               "the pipeline stages (micro-batches enter in groups of one per stage); got ", micro_batches,
               " micro-batches for ", stages, " stages — use a multiple of ", stages, " or the 1f1b schedule");
  return schedule_from({.stages = stages, .stage = stage, .micro_batches = micro_batches, .chunks = chunks},
                       [&](int s) { return interleaved_computes(stages, s, micro_batches, chunks); });
}

std::vector<Instruction> make_schedule(ScheduleKind kind, const ScheduleShape& shape) {
  check_shape(shape);
  ZTRAIN_CHECK(kind == ScheduleKind::kInterleaved1F1B || shape.chunks == 1, "pipeline schedule ", to_string(kind),
               " runs one model chunk per rank; got chunks = ", shape.chunks, " (use the interleaved schedule)");
  switch (kind) {
    case ScheduleKind::kGPipe: return gpipe_schedule(shape.stages, shape.stage, shape.micro_batches);
    case ScheduleKind::k1F1B: return one_f_one_b_schedule(shape.stages, shape.stage, shape.micro_batches);
    case ScheduleKind::kInterleaved1F1B:
      return interleaved_schedule(shape.stages, shape.stage, shape.micro_batches, shape.chunks);
  }
  ZTRAIN_INTERNAL_ASSERT(false, "unknown schedule kind");
  return {};
}

}  // namespace ztrain::pipe
