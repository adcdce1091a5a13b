#include "test_util.h"

#include <ztrain/comm/comm_stream.h>

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <atomic>
#include <thread>

namespace comm_stream_test {

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

TEST(CommStream, DeviceOperationsFollowTheSubmittersStream) {
  // The input is written on a side stream behind a queue of work; the operation, run by the
  // worker thread, must see it written, and its result must be complete on the device (read here
  // from another stream) once waited on.
  const auto device = ztrain::runtime().device();
  if (device.is_cpu()) GTEST_SKIP() << "orders device streams";
  const int n = world().size();
  c10::impl::VirtualGuardImpl impl(device.type());
  CommStream stream(world(), "ordered");
  for (auto op : {"all_reduce", "all_gather", "reduce_scatter"}) {
    auto t = torch::zeros({n << 16}, torch::TensorOptions().device(device));
    auto out = torch::zeros({op == std::string("all_gather") ? n * t.numel() : t.numel() / n}, t.options());
    impl.getStream(device).synchronize();
    {
      c10::StreamGuard on(impl.getStreamFromGlobalPool(device));
      auto busy = torch::rand({2048, 2048}, t.options());
      for (int i = 0; i < 40; ++i) busy = torch::tanh(busy.mm(busy));
      t.fill_(world().rank() + 1);
      ztrain::Work w = op == std::string("all_reduce")    ? stream.all_reduce(t)
                       : op == std::string("all_gather") ? stream.all_gather(t, out)
                                                          : stream.reduce_scatter(t, out);
      busy = torch::tanh(busy.mm(busy));  // queued after the submission
      w.wait();
    }
    const float sum = n * (n + 1) / 2.0f;
    if (op == std::string("all_reduce")) {
      EXPECT_TRUE(t.cpu().eq(sum).all().item<bool>()) << op << ": " << t.cpu()[0].item<float>();
    } else if (op == std::string("reduce_scatter")) {
      EXPECT_TRUE(out.cpu().eq(sum).all().item<bool>()) << op << ": " << out.cpu()[0].item<float>();
    } else {
      auto expected = torch::arange(1, n + 1, torch::kFloat).repeat_interleave(t.numel());
      EXPECT_TRUE(out.cpu().equal(expected)) << op;
    }
  }
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

}  // namespace comm_stream_test
