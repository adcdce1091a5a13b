#include "test_util.h"

#include <ztrain/comm/comm_stream.h>

#include <atomic>
#include <thread>

using namespace std::chrono_literals;
using ztrain::CommStream;
using ztrain::test::error_message;

namespace {
ztrain::Communicator& world() { return ztrain::runtime().world(); }
}

TEST(CommStream, RunsOperationsInSubmissionOrder) {
  CommStream stream(world(), "order");
  std::vector<int> seen;
  std::vector<ztrain::Work> works;
  for (int i = 0; i < 20; ++i) works.push_back(stream.submit([&seen, i](ztrain::Communicator&) { seen.push_back(i); }));
  auto t = torch::full({1023}, static_cast<float>(world().rank() + 1));
  auto reduced = stream.all_reduce(t);
  reduced.wait();
  for (auto& w : works) EXPECT_TRUE(w.is_completed());
  std::vector<int> expected(20);
  std::iota(expected.begin(), expected.end(), 0);
  EXPECT_EQ(seen, expected);
  EXPECT_EQ(t[0].item<float>(), world().size() * (world().size() + 1) / 2.0f);
}

TEST(CommStream, TwoStreamsProgressIndependently) {
  // Rank 0 queues an all_reduce on stream A and only then one on stream B; every other rank
  // waits for B before it joins A. With one shared queue this would deadlock: B is behind A
  // on rank 0 while A waits for ranks that wait for B.
  auto& c = world();
  CommStream a(c, "a"), b(c, "b");
  auto ta = torch::ones({1 << 16}), tb = torch::ones({1 << 16});
  ztrain::Work wa, wb;
  if (c.rank() == 0) {
    wa = a.all_reduce(ta);
    wb = b.all_reduce(tb);
  } else {
    wb = b.all_reduce(tb);
    wb.wait();
    wa = a.all_reduce(ta);
  }
  wa.wait();
  wb.wait();
  EXPECT_EQ(ta[0].item<float>(), c.size());
  EXPECT_EQ(tb[0].item<float>(), c.size());
}

TEST(CommStream, OverlapsWithTheCallerAndCompletesAsynchronously) {
  CommStream stream(world(), "async");
  std::atomic<bool> release{false};
  auto w = stream.submit([&](ztrain::Communicator&) {
    while (!release) std::this_thread::sleep_for(1ms);
  });
  EXPECT_FALSE(w.is_completed());  // submit returned before the operation ran to its end
  release = true;
  w.wait();
  EXPECT_TRUE(w.is_completed());
}

TEST(CommStream, ErrorsAreRethrownAtWaitAndPoisonLaterOperations) {
  CommStream stream(world(), "errors");
  auto bad = stream.all_reduce(torch::zeros({4, 4}).t());  // non-contiguous: rejected on every rank
  auto msg = error_message([&] { bad.wait(); });
  EXPECT_NE(msg.find("must be contiguous"), std::string::npos) << msg;
  EXPECT_TRUE(bad.error() != nullptr);
  auto later = stream.barrier();
  msg = error_message([&] { later.wait(); });
  EXPECT_NE(msg.find("must be contiguous"), std::string::npos) << "later operations carry the first error: " << msg;
  msg = error_message([&] { stream.synchronize(); });
  EXPECT_NE(msg.find("must be contiguous"), std::string::npos) << msg;
}

TEST(CommStream, WaitHasAFiniteTimeout) {
  CommStream stream(world(), "slow");
  std::atomic<bool> release{false};
  auto w = stream.submit([&](ztrain::Communicator&) {
    while (!release) std::this_thread::sleep_for(1ms);
  }, "slow operation");
  auto start = std::chrono::steady_clock::now();
  try {
    w.wait(200ms);
    ADD_FAILURE() << "wait returned although the operation was still running";
  } catch (const ztrain::CommError& e) {
    EXPECT_NE(std::string(e.what()).find("slow operation on stream 'world.slow' did not complete within 0.2 s"),
              std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s);
  release = true;
  w.wait();
}

TEST(CommStream, EmptyWorkHandleIsAnError) {
  ztrain::Work w;
  EXPECT_FALSE(w.defined());
  auto msg = error_message([&] { w.wait(); });
  EXPECT_NE(msg.find("empty Work handle"), std::string::npos) << msg;
}
