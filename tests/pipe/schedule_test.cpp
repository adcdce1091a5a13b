// Pipeline schedules, checked as data: no model, no communication. Every stage's list is run
// in a simulation of the whole pipeline in which transfers are matched per channel (source
// rank, destination rank, direction), with blocking sends (rendezvous: a send waits for its
// receive) and with non-blocking ones (as the executor posts them).

#include "test_util.h"

#include <ztrain/pipe/schedule.h>

#include <deque>
#include <map>
#include <set>
#include <tuple>

namespace ztrain::pipe {
namespace schedule_test {

using test::error_message;

struct Case {
  ScheduleKind kind;
  int p, m, v;
};

std::string label(const Case& c) {
  return c10::str(to_string(c.kind), " p=", c.p, " m=", c.m, " v=", c.v);
}

std::vector<std::vector<Instruction>> all_lists(const Case& c) {
  std::vector<std::vector<Instruction>> lists;
  for (int s = 0; s < c.p; ++s) {
    lists.push_back(make_schedule(c.kind, {.stages = c.p, .stage = s, .micro_batches = c.m, .chunks = c.v}));
  }
  return lists;
}

std::string format(const std::vector<Instruction>& list) {
  std::string out;
  for (const auto& i : list) out += to_string(i) + " ";
  return out;
}

enum class Sends { kBlocking, kNonBlocking };

// A message in flight: which micro-batch, and the virtual stage that sent it.
struct Message {
  int micro_batch;
  int from_virtual;
};

bool is_send(Op op) { return op == Op::kSendForward || op == Op::kSendBackward; }
bool is_recv(Op op) { return op == Op::kRecvForward || op == Op::kRecvBackward; }
bool is_forward_direction(Op op) { return op == Op::kSendForward || op == Op::kRecvForward; }

// (src, dst, forward direction) of a transfer instruction on `stage`.
std::tuple<int, int, bool> channel_of(const Instruction& i, int stage, int p) {
  const bool fwd = is_forward_direction(i.op);
  const int next = (stage + 1) % p, prev = (stage + p - 1) % p;
  if (is_send(i.op)) return {stage, fwd ? next : prev, fwd};
  return {fwd ? prev : next, stage, fwd};
}

// The virtual stage whose message `recv` on `stage` expects.
int expected_sender(const Instruction& recv, int stage, int p) {
  const int vs = virtual_stage(stage, recv.chunk, p);
  return recv.op == Op::kRecvForward ? vs - 1 : vs + 1;
}

// Runs every stage's list; returns "" when all complete, else what went wrong.
std::string simulate(const std::vector<std::vector<Instruction>>& lists, Sends sends) {
  const int p = static_cast<int>(lists.size());
  std::vector<size_t> pc(p, 0);
  std::map<std::tuple<int, int, bool>, std::deque<Message>> channels;
  auto deliverable = [&](const Instruction& recv, int stage, const Message& m) -> std::string {
    if (m.micro_batch != recv.micro_batch || m.from_virtual != expected_sender(recv, stage, p)) {
      return c10::str("stage ", stage, " ", to_string(recv), " expected micro-batch ", recv.micro_batch,
                      " from virtual stage ", expected_sender(recv, stage, p), " but the channel delivers micro-batch ",
                      m.micro_batch, " from virtual stage ", m.from_virtual);
    }
    return "";
  };
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < p; ++s) {
      if (pc[s] == lists[s].size()) continue;
      const auto& ins = lists[s][pc[s]];
      if (ins.op == Op::kForward || ins.op == Op::kBackward) {
        ++pc[s];
        progress = true;
        continue;
      }
      const auto ch = channel_of(ins, s, p);
      auto& queue = channels[ch];
      if (is_send(ins.op)) {
        const Message msg{ins.micro_batch, virtual_stage(s, ins.chunk, p)};
        const int dst = std::get<1>(ch);
        // A transfer to oneself (one rank, interleaved) is a local hand-over, never blocking.
        if (sends == Sends::kNonBlocking || dst == s) {
          queue.push_back(msg);
          ++pc[s];
          progress = true;
          continue;
        }
        if (!queue.empty() || pc[dst] == lists[dst].size()) continue;
        const auto& other = lists[dst][pc[dst]];
        if (!is_recv(other.op) || channel_of(other, dst, p) != ch) continue;
        auto why = deliverable(other, dst, msg);
        if (!why.empty()) return why;
        ++pc[s];
        ++pc[dst];
        progress = true;
      } else if (!queue.empty()) {
        auto why = deliverable(ins, s, queue.front());
        if (!why.empty()) return why;
        queue.pop_front();
        ++pc[s];
        progress = true;
      }
    }
  }
  std::string stuck;
  for (int s = 0; s < p; ++s) {
    if (pc[s] < lists[s].size()) stuck += c10::str(" stage ", s, " at ", to_string(lists[s][pc[s]]), ";");
  }
  if (!stuck.empty()) return "deadlock:" + stuck;
  for (const auto& [ch, queue] : channels) {
    if (!queue.empty()) return c10::str(queue.size(), " messages never received");
  }
  return "";
}

std::vector<Case> all_cases() {
  std::vector<Case> out;
  for (int p : {1, 2, 3, 4}) {
    for (int m : std::set<int>{1, p, 2 * p, 4 * p}) {
      out.push_back({ScheduleKind::kGPipe, p, m, 1});
      out.push_back({ScheduleKind::k1F1B, p, m, 1});
      if (m % p == 0) {
        for (int v : {1, 2, 3}) out.push_back({ScheduleKind::kInterleaved1F1B, p, m, v});
      }
    }
  }
  // Micro-batch counts that are not multiples of the stages (GPipe and 1F1B only).
  for (int p : {2, 3, 4}) {
    for (int m : std::set<int>{p - 1, p + 1, 2 * p + 1}) {
      if (m == 1) continue;  // covered above
      out.push_back({ScheduleKind::kGPipe, p, m, 1});
      out.push_back({ScheduleKind::k1F1B, p, m, 1});
    }
  }
  return out;
}

class Schedules : public ::testing::TestWithParam<Case> {};

TEST_P(Schedules, EveryComputeOnceWithItsTransfersAroundIt) {
  const auto c = GetParam();
  const auto lists = all_lists(c);
  const int last_virtual = c.p * c.v - 1;
  for (int s = 0; s < c.p; ++s) {
    const auto& list = lists[s];
    std::map<std::pair<Op, std::pair<int, int>>, size_t> at;  // first position of (op, (mb, chunk))
    for (size_t k = 0; k < list.size(); ++k) {
      const auto& i = list[k];
      ASSERT_TRUE(i.micro_batch >= 0 && i.micro_batch < c.m && i.chunk >= 0 && i.chunk < c.v)
          << label(c) << " stage " << s << ": " << i;
      ASSERT_TRUE(at.emplace(std::make_pair(i.op, std::make_pair(i.micro_batch, i.chunk)), k).second)
          << label(c) << " stage " << s << ": " << i << " twice in " << format(list);
    }
    for (int mb = 0; mb < c.m; ++mb) {
      for (int ch = 0; ch < c.v; ++ch) {
        const auto key = std::make_pair(mb, ch);
        const int vs = virtual_stage(s, ch, c.p);
        auto pos = [&](Op op) { return at.count({op, key}) ? static_cast<long>(at[{op, key}]) : -1L; };
        const std::string where = c10::str(label(c), " stage ", s, " mb ", mb, " chunk ", ch, ": ", format(list));
        ASSERT_GE(pos(Op::kForward), 0) << where;
        ASSERT_GE(pos(Op::kBackward), 0) << where;
        EXPECT_LT(pos(Op::kForward), pos(Op::kBackward)) << where;
        EXPECT_EQ(pos(Op::kRecvForward) >= 0, vs > 0) << where;
        EXPECT_EQ(pos(Op::kSendForward) >= 0, vs < last_virtual) << where;
        EXPECT_EQ(pos(Op::kRecvBackward) >= 0, vs < last_virtual) << where;
        EXPECT_EQ(pos(Op::kSendBackward) >= 0, vs > 0) << where;
        if (vs > 0) {
          EXPECT_LT(pos(Op::kRecvForward), pos(Op::kForward)) << where;
          EXPECT_GT(pos(Op::kSendBackward), pos(Op::kBackward)) << where;
        }
        if (vs < last_virtual) {
          EXPECT_GT(pos(Op::kSendForward), pos(Op::kForward)) << where;
          EXPECT_LT(pos(Op::kRecvBackward), pos(Op::kBackward)) << where;
        }
      }
    }
    EXPECT_EQ(list.size(), at.size());
  }
}

TEST_P(Schedules, CompletesWithBlockingSends) {
  const auto c = GetParam();
  EXPECT_EQ(simulate(all_lists(c), Sends::kBlocking), "") << label(c);
}

TEST_P(Schedules, CompletesWithNonBlockingSends) {
  const auto c = GetParam();
  EXPECT_EQ(simulate(all_lists(c), Sends::kNonBlocking), "") << label(c);
}

TEST_P(Schedules, KeepsItsKindsOrderAndInFlightBound) {
  const auto c = GetParam();
  const auto lists = all_lists(c);
  for (int s = 0; s < c.p; ++s) {
    int in_flight = 0, peak = 0;
    bool backward_seen = false, forward_after_backward = false;
    for (const auto& i : lists[s]) {
      if (i.op == Op::kForward) {
        peak = std::max(peak, ++in_flight);
        forward_after_backward = forward_after_backward || backward_seen;
      } else if (i.op == Op::kBackward) {
        --in_flight;
        backward_seen = true;
      }
    }
    const std::string where = c10::str(label(c), " stage ", s, ": ", format(lists[s]));
    switch (c.kind) {
      case ScheduleKind::kGPipe:
        EXPECT_FALSE(forward_after_backward) << where;
        EXPECT_EQ(peak, c.m) << where;
        break;
      case ScheduleKind::k1F1B:
        EXPECT_LE(peak, c.p - s) << where;
        EXPECT_EQ(peak, std::min(c.p - s, c.m)) << where;
        break;
      case ScheduleKind::kInterleaved1F1B: {
        const int warmup = c.m == c.p ? c.m * c.v : std::min(c.m * c.v, (c.p - s - 1) * 2 + (c.v - 1) * c.p);
        EXPECT_EQ(peak, std::min(c.m * c.v, warmup + 1)) << where;
        break;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, Schedules, ::testing::ValuesIn(all_cases()), [](const auto& info) {
  const auto& c = info.param;
  return c10::str(to_string(c.kind) == std::string("1f1b") ? "OneFOneB" : to_string(c.kind), "_p", c.p, "_m", c.m,
                  "_v", c.v);
});

std::vector<std::string> computes(const std::vector<Instruction>& list) {
  std::vector<std::string> out;
  for (const auto& i : list) {
    if (i.op == Op::kForward || i.op == Op::kBackward) out.push_back(to_string(i));
  }
  return out;
}

using Names = std::vector<std::string>;

TEST(Schedule, GPipeIsAllForwardsThenAllBackwards) {
  EXPECT_EQ(computes(gpipe_schedule(3, 1, 3)), (Names{"F0", "F1", "F2", "B0", "B1", "B2"}));
  // The middle stage of three: each transfer as soon as its partner is ready.
  EXPECT_EQ(format(gpipe_schedule(3, 1, 2)), "RF0 F0 RF1 SF0 F1 SF1 RB0 B0 SB0 RB1 B1 SB1 ");
  EXPECT_EQ(format(gpipe_schedule(3, 0, 2)), "F0 SF0 F1 SF1 RB0 B0 RB1 B1 ");
}

TEST(Schedule, OneFOneBWarmsUpSteadiesAndDrains) {
  // Four stages, six micro-batches: stage 0 warms up with three forwards.
  EXPECT_EQ(computes(one_f_one_b_schedule(4, 0, 6)),
            (Names{"F0", "F1", "F2", "F3", "B0", "F4", "B1", "F5", "B2", "B3", "B4", "B5"}));
  EXPECT_EQ(computes(one_f_one_b_schedule(4, 2, 6)),
            (Names{"F0", "F1", "B0", "F2", "B1", "F3", "B2", "F4", "B3", "F5", "B4", "B5"}));
  EXPECT_EQ(computes(one_f_one_b_schedule(4, 3, 6)),
            (Names{"F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "F4", "B4", "F5", "B5"}));
  // Fewer micro-batches than stages: warm-up is cut to m.
  EXPECT_EQ(computes(one_f_one_b_schedule(4, 0, 2)), (Names{"F0", "F1", "B0", "B1"}));
  EXPECT_EQ(format(one_f_one_b_schedule(2, 1, 2)), "RF0 F0 B0 RF1 SB0 F1 B1 SB1 ");
}

TEST(Schedule, InterleavedFollowsMegatronOrder) {
  // p = 2, m = 4, v = 2. Forward k runs chunk (k % 4) / 2 on micro-batch (k / 4) * 2 + k % 2;
  // backward k runs chunk 1 - (k % 4) / 2 on the same micro-batch. Stage 0 warms up with
  // (2-0-1)*2 + (2-1)*2 = 4 forwards, stage 1 with 0*2 + 2 = 2.
  EXPECT_EQ(computes(interleaved_schedule(2, 0, 4, 2)),
            (Names{"F0", "F1", "F0.1", "F1.1",                       // warm-up
                   "F2", "B0.1", "F3", "B1.1", "F2.1", "B0", "F3.1", "B1",  // steady
                   "B2.1", "B3.1", "B2", "B3"}));                    // drain
  EXPECT_EQ(computes(interleaved_schedule(2, 1, 4, 2)),
            (Names{"F0", "F1",                                             // warm-up
                   "F0.1", "B0.1", "F1.1", "B1.1", "F2", "B0", "F3", "B1",  // steady
                   "F2.1", "B2.1", "F3.1", "B3.1",                         //
                   "B2", "B3"}));
  // m == p: every forward first (Megatron's rule).
  EXPECT_EQ(computes(interleaved_schedule(2, 1, 2, 2)),
            (Names{"F0", "F1", "F0.1", "F1.1", "B0.1", "B1.1", "B0", "B1"}));
  // Chunk 0 of the last rank sends to chunk 1 of the first rank.
  const auto last = interleaved_schedule(2, 1, 2, 2);
  EXPECT_NE(std::find(last.begin(), last.end(), Instruction{Op::kSendForward, 0, 0}), last.end());
  const auto first = interleaved_schedule(2, 0, 2, 2);
  EXPECT_NE(std::find(first.begin(), first.end(), Instruction{Op::kRecvForward, 0, 1}), first.end());
  EXPECT_NE(std::find(first.begin(), first.end(), Instruction{Op::kSendBackward, 0, 1}), first.end());
}

TEST(Schedule, RejectsInvalidShapes) {
  auto msg = error_message([] { interleaved_schedule(4, 0, 6, 2); });
  EXPECT_NE(msg.find("multiple of the pipeline stages"), std::string::npos) << msg;
  msg = error_message([] { make_schedule(ScheduleKind::k1F1B, {.stages = 2, .stage = 0, .micro_batches = 2, .chunks = 2}); });
  EXPECT_NE(msg.find("interleaved"), std::string::npos) << msg;
  msg = error_message([] { gpipe_schedule(2, 2, 4); });
  EXPECT_NE(msg.find("stage must be in [0, 2)"), std::string::npos) << msg;
  msg = error_message([] { gpipe_schedule(2, 0, 0); });
  EXPECT_NE(msg.find("micro_batches must be >= 1"), std::string::npos) << msg;
  msg = error_message([] { parse_schedule_kind("zigzag"); });
  EXPECT_NE(msg.find("gpipe, 1f1b or interleaved"), std::string::npos) << msg;
  EXPECT_EQ(parse_schedule_kind("interleaved"), ScheduleKind::kInterleaved1F1B);
}

}  // namespace schedule_test
}  // namespace ztrain::pipe
