#include <ztrain/pipe/boundary.h>

#include <ztrain/error.h>

#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <iterator>
#include <string>

// How it works
//
// A message is three kinds of point-to-point transfers under fixed tags: the header's length
// (one int64), the header (int64s: magic, id, count, then per tensor defined, dtype,
// requires_grad, rank and sizes), and one payload per defined, non-empty tensor, in order.
// The sender's stream runs all of them in one submitted function; so does the receiver's,
// allocating each tensor from the header before receiving into it.
//
// Communicators: a communicator is used by one thread, and a send matches only a receive on
// the same communicator, so every direction gets three duplicates of the pipeline
// communicator, A, B and W (wrap-around). Forward, rank r sends on W if it is the last rank
// (to rank 0) and otherwise on A if r is even, B if odd; it receives on W if it is rank 0 and
// otherwise on the duplicate its sender r−1 sends on. Backward mirrors this (rank 0 sends to
// the last rank on W). On every rank each duplicate thus has at most one role — sending or
// receiving — and one CommStream worker runs it.

namespace ztrain::pipe {
namespace {

constexpr int64_t kMagic = 0x7a50495045;  // "zPIPE"
constexpr int kTagLength = 11;
constexpr int kTagHeader = 12;
constexpr int kTagPayload = 13;

const char* direction(bool forward) { return forward ? "forward" : "backward"; }

std::vector<int64_t> encode(const std::vector<torch::Tensor>& tensors, int64_t id) {
  std::vector<int64_t> h{kMagic, id, static_cast<int64_t>(tensors.size())};
  for (const auto& t : tensors) {
    const auto m = meta_of(t);
    h.push_back(m.defined);
    h.push_back(static_cast<int64_t>(m.dtype));
    h.push_back(m.requires_grad);
    h.push_back(static_cast<int64_t>(m.shape.size()));
    h.insert(h.end(), m.shape.begin(), m.shape.end());
  }
  return h;
}

torch::Tensor int64_tensor(const std::vector<int64_t>& v) {
  return torch::from_blob(const_cast<int64_t*>(v.data()), {static_cast<int64_t>(v.size())}, torch::kInt64).clone();
}

}  // namespace


bool boundary_requires_grad(const torch::Tensor& t) {
  return t.defined() && t.requires_grad() && c10::isFloatingType(t.scalar_type());
}

TensorMeta meta_of(const torch::Tensor& t) {
  if (!t.defined()) return {.defined = false};
  return {.defined = true, .dtype = t.scalar_type(), .shape = t.sizes().vec(), .requires_grad = boundary_requires_grad(t)};
}

// ---- PendingMessage ----------------------------------------------------------------------------

struct PendingMessage::State {
  Work work;
  int64_t expected_id = 0;
  bool forward = true;
  int peer = 0;
  std::deque<Message>* local = nullptr;  // one stage: take from here at wait()
  bool taken = false;
  // Written by the stream's worker, read after work.wait().
  Message message;
  std::vector<TensorMeta> metas;
};

Message PendingMessage::wait() {
  ZTRAIN_CHECK(state_ != nullptr, "PendingMessage::wait() on an empty handle");
  auto& s = *state_;
  ZTRAIN_CHECK(!s.taken, "PendingMessage::wait(): the message was already taken");
  s.taken = true;
  if (s.local) {
    ZTRAIN_CHECK(!s.local->empty(), "pipeline boundary: receive ", direction(s.forward), " (id ", s.expected_id,
                 ") on a single stage, but nothing was sent; the schedule must send before it receives");
    s.message = std::move(s.local->front());
    s.local->pop_front();
    for (const auto& t : s.message.tensors) s.metas.push_back(meta_of(t));
  } else {
    s.work.wait();
    // Allocated on the worker's current stream; used, and freed, on this thread's.
    for (auto& t : s.message.tensors) {
      if (!t.defined() || t.is_cpu()) continue;
      t.record_stream(c10::impl::VirtualGuardImpl(t.device().type()).getStream(t.device()));
    }
  }
  ZTRAIN_CHECK(s.message.id == s.expected_id, "pipeline boundary: expected the ", direction(s.forward),
               " message with id ", s.expected_id, " from pipeline rank ", s.peer, " but received id ", s.message.id,
               "; both stages must run matching schedules (same kind, stages, micro-batches and chunks)");
  auto& tensors = s.message.tensors;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].defined()) {
      tensors[i] = tensors[i].detach();
      if (s.metas[i].requires_grad) tensors[i].requires_grad_(true);
    }
  }
  return std::move(s.message);
}

// ---- Boundary ----------------------------------------------------------------------------------

Boundary::Boundary(Communicator& pp, c10::Device device) : rank_(pp.rank()), size_(pp.size()), device_(device) {
  if (size_ == 1) return;
  for (const char* dir : {"forward", "backward"}) {
    for (const char* kind : {"a", "b", "w"}) {
      streams_.push_back(std::make_unique<CommStream>(pp, c10::str("pipe.", dir, ".", kind)));
    }
  }
  auto parity = [](int r) { return r % 2 == 0 ? 0 : 1; };
  const int last = size_ - 1;
  auto stream = [&](int dir, int which) { return streams_[static_cast<size_t>(dir * 3 + which)].get(); };
  constexpr int kWrap = 2;
  forward_send_ = stream(0, rank_ == last ? kWrap : parity(rank_));
  forward_recv_ = stream(0, rank_ == 0 ? kWrap : parity(rank_ - 1));
  backward_send_ = stream(1, rank_ == 0 ? kWrap : parity(rank_));
  backward_recv_ = stream(1, rank_ == last ? kWrap : parity(rank_ + 1));
}

Boundary::~Boundary() {
  for (auto& w : in_flight_) {
    try {
      w.wait();
    } catch (...) {
      // Never throw from a destructor; the failure was reported to whoever waited on it.
    }
  }
}

Work Boundary::send(CommStream* stream, int dst, const std::vector<torch::Tensor>& tensors, int64_t id, bool forward) {
  if (size_ == 1) {
    Message m{.id = id};
    for (const auto& t : tensors) {
      auto copy = t.defined() ? t.detach().clone() : torch::Tensor();
      if (boundary_requires_grad(t)) copy.requires_grad_(true);
      m.tensors.push_back(copy);
    }
    (forward ? local_forward_ : local_backward_).push_back(std::move(m));
    return Work();
  }
  const auto header = encode(tensors, id);
  auto length = torch::full({1}, static_cast<int64_t>(header.size()), torch::kInt64);
  auto header_tensor = int64_tensor(header);
  std::vector<torch::Tensor> payload;
  for (const auto& t : tensors) {
    if (t.defined() && t.numel() > 0) payload.push_back(t.detach().contiguous());
  }
  auto work = stream->submit(
      [=](Communicator& c) {
        c.send(length, dst, kTagLength);
        c.send(header_tensor, dst, kTagHeader);
        for (const auto& t : payload) c.send(t, dst, kTagPayload);
      },
      c10::str("pipeline send ", direction(forward), " to rank ", dst), device_);
  // Forget the sends that finished; keep the rest for synchronize().
  std::erase_if(in_flight_, [](const Work& w) { return w.is_completed() && !w.error(); });
  in_flight_.push_back(work);
  return work;
}

PendingMessage Boundary::recv(CommStream* stream, int src, int64_t expected_id, bool forward) {
  auto state = std::make_shared<PendingMessage::State>();
  state->expected_id = expected_id;
  state->forward = forward;
  state->peer = src;
  if (size_ == 1) {
    state->local = forward ? &local_forward_ : &local_backward_;
    return PendingMessage(state);
  }
  PendingMessage::State* s = state.get();
  state->work = stream->submit(
      [s, src, device = device_, keep = state](Communicator& c) {
        auto length = torch::empty({1}, torch::kInt64);
        c.recv(length, src, kTagLength);
        const int64_t n = length.item<int64_t>();
        ZTRAIN_CHECK(n >= 3 && n < (1 << 20), "pipeline boundary: rank ", src, " announced a header of ", n,
                     " entries");
        auto header = torch::empty({n}, torch::kInt64);
        c.recv(header, src, kTagHeader);
        s->metas = detail::decode_boundary_header(header.data_ptr<int64_t>(), n, s->message.id, src);
        for (const auto& m : s->metas) {
          if (!m.defined) {
            s->message.tensors.emplace_back();
            continue;
          }
          auto t = torch::empty(m.shape, torch::TensorOptions().dtype(m.dtype).device(device));
          if (t.numel() > 0) c.recv(t, src, kTagPayload);
          s->message.tensors.push_back(std::move(t));
        }
      },
      c10::str("pipeline receive ", direction(forward), " from rank ", src), device_);
  return PendingMessage(state);
}

Work Boundary::send_forward(const std::vector<torch::Tensor>& tensors, int64_t id) {
  return send(forward_send_, next(), tensors, id, true);
}

PendingMessage Boundary::recv_forward(int64_t expected_id) {
  return recv(forward_recv_, prev(), expected_id, true);
}

Work Boundary::send_backward(const std::vector<torch::Tensor>& grads, int64_t id) {
  for (const auto& g : grads) {
    ZTRAIN_CHECK(!g.defined() || c10::isFloatingType(g.scalar_type()), "pipeline boundary: a gradient sent backward must "
                 "be floating-point, got ", g.scalar_type());
  }
  return send(backward_send_, prev(), grads, id, false);
}

PendingMessage Boundary::recv_backward(int64_t expected_id) {
  return recv(backward_recv_, next(), expected_id, false);
}

void Boundary::synchronize() {
  auto works = std::move(in_flight_);
  in_flight_.clear();
  for (auto& w : works) w.wait();
}

// ---- autograd across the boundary --------------------------------------------------------------

void backward_from(const std::vector<torch::Tensor>& outputs, const std::vector<torch::Tensor>& grads) {
  std::vector<torch::Tensor> roots, root_grads;
  size_t next = 0;
  for (const auto& out : outputs) {
    if (!boundary_requires_grad(out)) continue;
    ZTRAIN_CHECK(next < grads.size(), "pipeline backward: ", grads.size(), " gradients received for more outputs "
                 "requiring grad");
    const auto& g = grads[next++];
    if (!g.defined()) continue;
    ZTRAIN_CHECK(g.sizes() == out.sizes() && g.scalar_type() == out.scalar_type(), "pipeline backward: the gradient ",
                 next - 1, " is ", g.scalar_type(), g.sizes(), " but its output is ", out.scalar_type(), out.sizes());
    roots.push_back(out);
    root_grads.push_back(g);
  }
  ZTRAIN_CHECK(next == grads.size(), "pipeline backward: ", grads.size(), " gradients received for ", next,
               " outputs requiring grad");
  if (!roots.empty()) torch::autograd::backward(roots, root_grads);
}

std::vector<torch::Tensor> input_gradients(const std::vector<torch::Tensor>& inputs) {
  std::vector<torch::Tensor> grads;
  for (const auto& t : inputs) {
    if (boundary_requires_grad(t)) grads.push_back(t.grad());
  }
  return grads;
}

}  // namespace ztrain::pipe

namespace ztrain::detail {

std::vector<pipe::TensorMeta> decode_boundary_header(const int64_t* h, int64_t n, int64_t& id, int src) {
  int64_t at = 0;
  auto take = [&]() {
    ZTRAIN_CHECK(at < n, "pipeline boundary: the header from rank ", src, " ends early (", n, " entries)");
    return h[at++];
  };
  ZTRAIN_CHECK(take() == pipe::kMagic, "pipeline boundary: rank ", src, " sent something that is not a message header");
  id = take();
  const int64_t count = take();
  // Each tensor takes at least four entries (defined, dtype, requires_grad, dims).
  ZTRAIN_CHECK(count >= 0 && count <= (n - at) / 4, "pipeline boundary: the header from rank ", src, " announces ",
               count, " tensors in ", n - at, " entries");
  std::vector<pipe::TensorMeta> metas(static_cast<size_t>(count));
  for (auto& m : metas) {
    m.defined = take() != 0;
    const int64_t dtype = take();
    // The dtypes a communicator moves (comm/communicator.h).
    constexpr c10::ScalarType kMovable[] = {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf,
                                            at::kInt,   at::kLong,   at::kByte,     at::kBool};
    ZTRAIN_CHECK(std::any_of(std::begin(kMovable), std::end(kMovable),
                             [&](c10::ScalarType t) { return static_cast<int64_t>(t) == dtype; }),
                 "pipeline boundary: the header from rank ", src, " names dtype ", dtype,
                 ", which is not one a communicator moves");
    m.dtype = static_cast<c10::ScalarType>(dtype);
    m.requires_grad = take() != 0;
    const int64_t dims = take();
    ZTRAIN_CHECK(dims >= 0 && dims <= std::min<int64_t>(n - at, 64), "pipeline boundary: the header from rank ", src,
                 " gives a tensor ", dims, " dimensions");
    int64_t numel = 1;
    for (int64_t d = 0; d < dims; ++d) {
      const int64_t size = take();
      ZTRAIN_CHECK(size >= 0 && (size == 0 || numel <= (int64_t{1} << 48) / size), "pipeline boundary: the header "
                   "from rank ", src, " gives a tensor of shape ", c10::IntArrayRef(m.shape), " then a dimension of ", size);
      numel *= size;
      m.shape.push_back(size);
    }
  }
  ZTRAIN_CHECK(at == n, "pipeline boundary: the header from rank ", src, " has ", n - at, " trailing entries");
  return metas;
}

}  // namespace ztrain::detail
