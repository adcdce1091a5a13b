#include <ztrain/comm/comm_stream.h>

#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/StringUtil.h>

#include <sstream>

namespace ztrain {

namespace detail {
struct WorkState {
  std::string what;  // "<stream>: <operation>", for messages
  std::chrono::milliseconds timeout;
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;
  std::optional<c10::Event> done_on_device;  // a device operation's last work, written before done

  void finish(std::exception_ptr e) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      done = true;
      error = std::move(e);
    }
    cv.notify_all();
  }
};
}  // namespace detail

// ---- Work ------------------------------------------------------------------------------------

bool Work::is_completed() const {
  ZTRAIN_CHECK(state_, "Work::is_completed() on an empty Work handle");
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->done;
}

std::exception_ptr Work::error() const {
  ZTRAIN_CHECK(state_, "Work::error() on an empty Work handle");
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->error;
}

void Work::wait(std::optional<std::chrono::milliseconds> timeout) const {
  ZTRAIN_CHECK(state_, "Work::wait() on an empty Work handle");
  const auto limit = timeout.value_or(state_->timeout);
  std::unique_lock<std::mutex> lock(state_->mutex);
  if (!state_->cv.wait_for(lock, limit, [&] { return state_->done; })) {
    std::ostringstream s;
    s << "ztrain: " << state_->what << " did not complete within " << limit.count() / 1000.0
      << " s of waiting (operations queued before it may be stuck on a dead or slow peer)";
    throw CommError(s.str(), -1, state_->what, -1);
  }
  if (state_->error) std::rethrow_exception(state_->error);
  if (const auto& event = state_->done_on_device) {
    event->block(c10::impl::VirtualGuardImpl(event->device_type()).getStream(event->device()));
  }
}

// ---- CommStream ------------------------------------------------------------------------------

CommStream::CommStream(Communicator& comm, const std::string& name)
    : comm_(comm.dup(comm.name() + "." + name)), worker_([this] { run(); }) {}

CommStream::~CommStream() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

CommStream::Task::Task(std::function<void(Communicator&)> f, std::shared_ptr<detail::WorkState> s,
                       std::optional<c10::Device> device)
    : fn(std::move(f)), state(std::move(s)) {
  if (!device || device->is_cpu()) return;
  // The operation's inputs are written on the submitter's current stream up to this point.
  ready.emplace(device->type());
  ready->record(c10::impl::VirtualGuardImpl(device->type()).getStream(*device));
}

Work CommStream::submit(std::function<void(Communicator&)> fn, const std::string& what,
                        std::optional<c10::Device> device) {
  auto state = std::make_shared<detail::WorkState>();
  state->what = c10::str(what, " on stream '", comm_->name(), "'");
  state->timeout = comm_->timeout();
  Work work(state);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ZTRAIN_CHECK(!stopping_, "CommStream '", comm_->name(), "' is shutting down");
    queue_.emplace_back(std::move(fn), std::move(state), device);
    ++outstanding_;
    last_ = work;
  }
  cv_.notify_one();
  return work;
}

void CommStream::run() {
  for (;;) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and everything submitted has run
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    if (failure_) {
      task.state->finish(failure_);
    } else {
      try {
        run_ordered(task);
        task.state->finish(nullptr);
      } catch (...) {
        failure_ = std::current_exception();
        task.state->finish(failure_);
      }
    }
    task = Task();  // what the operation held goes before it counts as done
    {
      std::lock_guard<std::mutex> lock(mutex_);
      --outstanding_;
    }
    drained_.notify_all();
  }
}

void CommStream::run_ordered(Task& task) {
  if (!task.ready) {
    task.fn(*comm_);
    return;
  }
  // On the worker's current stream of the device: it waits for the submitter's, and whoever
  // waits on the Work waits for what the operation queued there.
  const c10::Device device = task.ready->device();
  const c10::Stream stream = c10::impl::VirtualGuardImpl(device.type()).getStream(device);
  task.ready->block(stream);
  task.fn(*comm_);
  task.state->done_on_device.emplace(device.type());
  task.state->done_on_device->record(stream);
}

Work CommStream::all_reduce(torch::Tensor tensor, ReduceOp op) {
  const auto device = tensor.device();
  return submit([tensor, op](Communicator& c) { c.all_reduce(tensor, op); }, "all_reduce", device);
}

Work CommStream::all_gather(torch::Tensor input, torch::Tensor output) {
  const auto device = output.device();
  return submit([input, output](Communicator& c) { c.all_gather(input, output); }, "all_gather", device);
}

Work CommStream::reduce_scatter(torch::Tensor input, torch::Tensor output, ReduceOp op) {
  const auto device = input.device();
  return submit([input, output, op](Communicator& c) { c.reduce_scatter(input, output, op); }, "reduce_scatter",
                device);
}

Work CommStream::broadcast(torch::Tensor tensor, int root) {
  const auto device = tensor.device();
  return submit([tensor, root](Communicator& c) { c.broadcast(tensor, root); }, "broadcast", device);
}

Work CommStream::send(torch::Tensor tensor, int dst, int tag) {
  const auto device = tensor.device();
  return submit([tensor, dst, tag](Communicator& c) { c.send(tensor, dst, tag); }, "send", device);
}

Work CommStream::recv(torch::Tensor tensor, int src, int tag) {
  const auto device = tensor.device();
  return submit([tensor, src, tag](Communicator& c) { c.recv(tensor, src, tag); }, "recv", device);
}

Work CommStream::barrier() {
  return submit([](Communicator& c) { c.barrier(); }, "barrier");
}

void CommStream::throttle(size_t n) {
  std::unique_lock<std::mutex> lock(mutex_);
  const auto limit = comm_->timeout();
  if (!drained_.wait_for(lock, limit, [&] { return outstanding_ <= n; })) {
    throw CommError(c10::str("ztrain: stream '", comm_->name(), "' still had ", outstanding_,
                             " operations after ", limit.count() / 1000.0,
                             " s of waiting (operations queued on it may be stuck on a dead or slow peer)"),
                    -1, comm_->name(), -1);
  }
}

void CommStream::synchronize() {
  Work last;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    last = last_;
  }
  if (last.defined()) last.wait();
}

}  // namespace ztrain
