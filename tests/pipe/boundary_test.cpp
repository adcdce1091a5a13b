// The stage boundary protocol: a chain of stages, one per rank of the world communicator,
// passes (hidden float32 requiring grad, bool mask, int64 positions, float64 side value
// requiring grad, an undefined slot) forward and the gradients back, with shapes changing
// from micro-batch to micro-batch and several micro-batches in flight. Every rank also runs
// the whole chain in one process; losses, parameter gradients and the input gradient must
// match. Registered for 1, 2 and 4 ranks (one rank: local hand-over).

#include "test_util.h"

#include <ztrain/pipe/boundary.h>

namespace ztrain::pipe {
namespace boundary_test {

using test::error_message;
using test::tensors_equal;

constexpr int64_t kDim = 5;
using Tensors = std::vector<torch::Tensor>;

struct StageParams {
  torch::Tensor weight, bias;
};

StageParams params_of(int stage) {
  auto gen = at::detail::createCPUGenerator(100 + stage);
  StageParams p{torch::randn({kDim, kDim}, gen) * 0.5, torch::randn({kDim}, gen) * 0.1};
  p.weight.requires_grad_(true);
  p.bias.requires_grad_(true);
  return p;
}

// One stage: hidden' = tanh(hidden W + b) masked, plus the positions; side' = side·2 + Σ hidden.
Tensors stage_forward(const StageParams& p, const Tensors& in) {
  const auto& hidden = in[0];
  const auto& mask = in[1];
  const auto& pos = in[2];
  const auto& side = in[3];
  auto h = torch::tanh(torch::matmul(hidden, p.weight) + p.bias) * mask.unsqueeze(-1).to(torch::kFloat32) +
           pos.unsqueeze(-1).to(torch::kFloat32) * 0.01;
  auto s = side * 2 + hidden.sum(-1).to(torch::kFloat64);
  return {h, mask, pos, s, in[4]};
}

torch::Tensor loss_of(const Tensors& out) { return out[0].pow(2).mean() + out[3].to(torch::kFloat32).mean() * 0.1; }

// Micro-batch `mb` of batch `step`: a different (batch, seq) every time.
Tensors micro_batch(int step, int mb) {
  const int64_t b = 1 + (step + mb) % 3, t = 2 + (2 * step + mb) % 4;
  auto gen = at::detail::createCPUGenerator(1000 + 10 * step + mb);
  auto hidden = torch::randn({b, t, kDim}, gen);
  auto mask = torch::rand({b, t}, gen) > 0.3;
  auto pos = torch::arange(t, torch::kInt64).expand({b, t}).contiguous();
  auto side = torch::randn({b, t}, gen).to(torch::kFloat64);
  return {hidden, mask, pos, side, torch::Tensor()};
}

struct Result {
  std::vector<double> losses;
  Tensors grads;  // weight, bias of every stage (reference) or of this stage
  Tensors input_grads;  // hidden and side of every micro-batch (reference or stage 0)
};

constexpr int kSteps = 3;
constexpr int kMicroBatches = 3;

Result reference(int stages) {
  std::vector<StageParams> params;
  for (int s = 0; s < stages; ++s) params.push_back(params_of(s));
  Result r;
  for (int step = 0; step < kSteps; ++step) {
    for (int mb = 0; mb < kMicroBatches; ++mb) {
      auto x = micro_batch(step, mb);
      x[0].requires_grad_(true);
      x[3].requires_grad_(true);
      auto h = x;
      for (int s = 0; s < stages; ++s) h = stage_forward(params[s], h);
      auto loss = loss_of(h);
      loss.backward();
      r.losses.push_back(loss.item<double>());
      r.input_grads.push_back(x[0].grad());
      r.input_grads.push_back(x[3].grad());
    }
  }
  for (auto& p : params) {
    r.grads.push_back(p.weight.grad());
    r.grads.push_back(p.bias.grad());
  }
  return r;
}

// GPipe order with the boundary: all forwards, then all backwards, every step.
Result pipelined(Boundary& boundary) {
  const int s = boundary.rank(), p = boundary.size();
  auto params = params_of(s);
  Result r;
  for (int step = 0; step < kSteps; ++step) {
    std::vector<Tensors> inputs(kMicroBatches), outputs(kMicroBatches);
    for (int mb = 0; mb < kMicroBatches; ++mb) {
      if (s == 0) {
        inputs[mb] = micro_batch(step, mb);
        inputs[mb][0].requires_grad_(true);
        inputs[mb][3].requires_grad_(true);
      } else {
        inputs[mb] = boundary.recv_forward(mb).wait().tensors;
        // What arrived carries the sender's shapes, dtypes and flags.
        const auto expected = micro_batch(step, mb);
        EXPECT_EQ(inputs[mb].size(), 5u);
        EXPECT_EQ(inputs[mb][0].sizes(), expected[0].sizes());
        EXPECT_EQ(inputs[mb][0].scalar_type(), torch::kFloat32);
        EXPECT_TRUE(inputs[mb][0].requires_grad());
        EXPECT_TRUE(inputs[mb][0].is_leaf());
        EXPECT_TRUE(tensors_equal(inputs[mb][1], expected[1]));
        EXPECT_FALSE(inputs[mb][1].requires_grad());
        EXPECT_TRUE(tensors_equal(inputs[mb][2], expected[2]));
        EXPECT_FALSE(inputs[mb][2].requires_grad());
        EXPECT_EQ(inputs[mb][3].scalar_type(), torch::kFloat64);
        EXPECT_TRUE(inputs[mb][3].requires_grad());
        EXPECT_FALSE(inputs[mb][4].defined());
      }
      outputs[mb] = stage_forward(params, inputs[mb]);
      if (s < p - 1) boundary.send_forward(outputs[mb], mb);
    }
    for (int mb = 0; mb < kMicroBatches; ++mb) {
      if (s == p - 1) {
        auto loss = loss_of(outputs[mb]);
        loss.backward();
        r.losses.push_back(loss.item<double>());
      } else {
        auto grads = boundary.recv_backward(mb).wait().tensors;
        EXPECT_EQ(grads.size(), 2u);  // hidden and side; never the mask or positions
        backward_from(outputs[mb], grads);
      }
      if (s > 0) boundary.send_backward(input_gradients(inputs[mb]), mb);
      if (s == 0) {
        r.input_grads.push_back(inputs[mb][0].grad());
        r.input_grads.push_back(inputs[mb][3].grad());
      }
    }
    boundary.synchronize();
  }
  r.grads = {params.weight.grad(), params.bias.grad()};
  return r;
}

TEST(Boundary, PassesMixedTensorsThroughEveryStageWithChangingShapes) {
  auto& world = runtime().world();
  ASSERT_EQ(world.size(), test::expected_world_size());
  Boundary boundary(world);
  const int s = boundary.rank(), p = boundary.size();
  const auto ref = reference(p);
  // Run the protocol twice on one Boundary: state carries over correctly between steps.
  for (int round = 0; round < 2; ++round) {
    const auto got = pipelined(boundary);
    if (s == p - 1) {
      ASSERT_EQ(got.losses.size(), ref.losses.size());
      for (size_t i = 0; i < ref.losses.size(); ++i) EXPECT_NEAR(got.losses[i], ref.losses[i], 1e-6) << i;
    }
    // Gradients accumulated over steps and micro-batches, in the same order as the reference.
    EXPECT_TRUE(tensors_equal(got.grads[0], ref.grads[2 * s], 1e-5, 1e-6)) << "weight of stage " << s;
    EXPECT_TRUE(tensors_equal(got.grads[1], ref.grads[2 * s + 1], 1e-5, 1e-6)) << "bias of stage " << s;
    if (s == 0) {
      ASSERT_EQ(got.input_grads.size(), ref.input_grads.size());
      for (size_t i = 0; i < ref.input_grads.size(); ++i) {
        EXPECT_TRUE(tensors_equal(got.input_grads[i], ref.input_grads[i], 1e-5, 1e-6)) << "input gradient " << i;
      }
    }
  }
}

TEST(Boundary, IntegerAndBoolTensorsNeverRequireGrad) {
  auto f = torch::ones({2}, torch::kFloat32).requires_grad_(true);
  EXPECT_TRUE(meta_of(f).requires_grad);
  EXPECT_FALSE(meta_of(torch::ones({2}, torch::kFloat32)).requires_grad);
  EXPECT_FALSE(meta_of(torch::ones({2}, torch::kInt64)).requires_grad);
  EXPECT_FALSE(meta_of(torch::ones({2}, torch::kBool)).requires_grad);
  EXPECT_FALSE(meta_of(torch::Tensor()).defined);
  EXPECT_EQ(meta_of(torch::ones({2, 0, 3}, torch::kInt32)).shape, (std::vector<int64_t>{2, 0, 3}));
}

TEST(Boundary, EveryDtypeAndEmptyTensorsArriveIntact) {
  auto& world = runtime().world();
  Boundary boundary(world);
  auto make = [](int rank) {
    Tensors out;
    for (auto dtype : test::kDtypes) {
      for (int64_t n : {0, 1, 17}) {
        auto v = (torch::arange(n, torch::kInt64) * 3 + rank) % 7;
        out.push_back(dtype == torch::kBool ? (v % 2 == 0) : v.to(dtype).reshape({n, 1}));
      }
    }
    return out;
  };
  // A ring: everyone sends to next() and receives from prev() (the last rank wraps to rank 0).
  boundary.send_forward(make(boundary.rank()), 7);
  auto got = boundary.recv_forward(7).wait().tensors;
  boundary.synchronize();
  const auto expected = make(boundary.prev());
  ASSERT_EQ(got.size(), expected.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(tensors_equal(got[i], expected[i])) << i;
}

TEST(Boundary, AnUnexpectedMessageIsAnError) {
  auto& world = runtime().world();
  Boundary boundary(world);
  boundary.send_forward({torch::ones({3})}, 5);
  auto msg = error_message([&] { boundary.recv_forward(6).wait(); });
  EXPECT_NE(msg.find("expected the forward message with id 6"), std::string::npos) << msg;
  EXPECT_NE(msg.find("received id 5"), std::string::npos) << msg;
  boundary.synchronize();
}

// What a neighbour sends is checked before anything is allocated for it.
TEST(Boundary, AMalformedHeaderIsRefusedNamingTheSender) {
  constexpr int64_t kMagic = 0x7a50495045;
  auto decode = [](std::vector<int64_t> h) {
    int64_t id = 0;
    return error_message([&] { detail::decode_boundary_header(h.data(), static_cast<int64_t>(h.size()), id, 3); });
  };
  const int64_t f32 = static_cast<int64_t>(torch::kFloat32);
  int64_t id = 0;
  std::vector<int64_t> good{kMagic, 9, 1, 1, f32, 1, 2, 4, 5};
  auto metas = detail::decode_boundary_header(good.data(), static_cast<int64_t>(good.size()), id, 3);
  ASSERT_EQ(metas.size(), 1u);
  EXPECT_EQ(id, 9);
  EXPECT_EQ(metas[0].shape, (std::vector<int64_t>{4, 5}));
  for (const auto& [header, what] : std::vector<std::pair<std::vector<int64_t>, std::string>>{
           {{1, 9, 0}, "not a message header"},
           {{kMagic, 9, int64_t{1} << 60}, "announces 1152921504606846976 tensors"},
           {{kMagic, 9, -1}, "announces -1 tensors"},
           {{kMagic, 9, 1, 1, 999, 0, 0}, "names dtype 999"},
           {{kMagic, 9, 1, 1, static_cast<int64_t>(torch::kComplexFloat), 0, 0}, "names dtype"},
           {{kMagic, 9, 1, 1, f32, 0, -2}, "gives a tensor -2 dimensions"},
           {{kMagic, 9, 1, 1, f32, 0, 1, -5}, "then a dimension of -5"},
           {{kMagic, 9, 1, 1, f32, 0, 2, int64_t{1} << 40, int64_t{1} << 40}, "then a dimension of"},
           {{kMagic, 9}, "ends early"},
           {{kMagic, 9, 1, 1, f32, 0, 0, 7}, "1 trailing entries"}}) {
    const auto msg = decode(header);
    EXPECT_NE(msg.find(what), std::string::npos) << msg;
    EXPECT_NE(msg.find("rank 3"), std::string::npos) << msg;
  }
}

}  // namespace boundary_test
}  // namespace ztrain::pipe
