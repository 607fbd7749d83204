#include "worker/comm/gloo/gloo_communicator.h"

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/math.h>
#include <gloo/reduce.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include <algorithm>
#include <chrono>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "spdlog/spdlog.h"
#include "worker/comm/shm/shm_allreduce.h"

namespace concord::comm {
namespace {

std::chrono::milliseconds ToMillis(absl::Duration d) {
  return std::chrono::milliseconds(absl::ToInt64Milliseconds(d));
}

// Gloo's rendezvous store over a comm::Store. Gloo reports errors by
// exception; these are caught in Create().
class GlooStoreAdapter final : public gloo::rendezvous::Store {
 public:
  GlooStoreAdapter(comm::Store* store, absl::Duration timeout)
      : store_(store), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    absl::Status s = store_->Set(key, std::string(data.begin(), data.end()));
    if (!s.ok()) throw StoreError(s);
  }
  std::vector<char> get(const std::string& key) override {
    auto values = store_->Get({key}, timeout_);
    if (!values.ok()) throw StoreError(values.status());
    const std::string& v = values->front();
    return std::vector<char>(v.begin(), v.end());
  }
  void wait(const std::vector<std::string>& keys) override {
    wait(keys, ToMillis(timeout_));
  }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    auto values = store_->Get(keys, absl::FromChrono(timeout));
    if (!values.ok()) throw StoreError(values.status());
  }

  struct StoreError : std::runtime_error {
    explicit StoreError(absl::Status s)
        : std::runtime_error(s.ToString()), status(std::move(s)) {}
    absl::Status status;
  };

 private:
  comm::Store* store_;
  absl::Duration timeout_;
};

// Gloo reports a peer that went away or a timeout as IoException.
absl::Status FromGlooException(const std::exception& e) {
  if (dynamic_cast<const gloo::IoException*>(&e) != nullptr) {
    return absl::UnavailableError(absl::StrCat("gloo: ", e.what()));
  }
  return absl::InternalError(absl::StrCat("gloo: ", e.what()));
}

template <typename Options, typename T>
void SetSum(Options& opts, T* ptr, size_t n) {
  opts.setOutput(ptr, n);
  void (*fn)(void*, const void*, const void*, size_t) = &gloo::sum<T>;
  opts.setReduceFunction(fn);
}

// Gloo has no bfloat16: sum in float, round back (what c10::BFloat16's
// operator+ does).
void SumBFloat16(void* c, const void* a, const void* b, size_t n) {
  auto* out = static_cast<c10::BFloat16*>(c);
  const auto* x = static_cast<const c10::BFloat16*>(a);
  const auto* y = static_cast<const c10::BFloat16*>(b);
  for (size_t i = 0; i < n; ++i) out[i] = x[i] + y[i];
}

// Points Gloo's allreduce or reduce at `tensor` (in place) with a sum.
template <typename Options>
absl::Status SetSumOutput(Options& opts, const at::Tensor& tensor,
                          const char* what) {
  const size_t n = static_cast<size_t>(tensor.numel());
  switch (tensor.scalar_type()) {
    case at::kFloat:
      SetSum(opts, tensor.data_ptr<float>(), n);
      break;
    case at::kDouble:
      SetSum(opts, tensor.data_ptr<double>(), n);
      break;
    case at::kHalf:
      SetSum(opts, reinterpret_cast<gloo::float16*>(tensor.data_ptr()), n);
      break;
    case at::kBFloat16:
      opts.setOutput(reinterpret_cast<uint16_t*>(tensor.data_ptr()), n);
      opts.setReduceFunction(&SumBFloat16);
      break;
    case at::kInt:
      SetSum(opts, tensor.data_ptr<int32_t>(), n);
      break;
    case at::kLong:
      SetSum(opts, tensor.data_ptr<int64_t>(), n);
      break;
    case at::kByte:
      SetSum(opts, tensor.data_ptr<uint8_t>(), n);
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("gloo ", what, " does not support dtype ",
                       std::string(c10::toString(tensor.scalar_type()))));
  }
  return absl::OkStatus();
}

// Exchange's messages: Gloo's slots for unbound buffers, away from the
// prefixes Gloo's own collectives use (gloo/types.h).
constexpr uint8_t kExchangeSlotPrefix = 0x40;

// Note [CUDA tensors over Gloo]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// NCCL refuses two ranks on one GPU, so processes that share a GPU run Gloo
// with their CUDA tensors staged through pinned host memory, as c10d's
// ProcessGroupGloo does. The calling thread records an event on the tensor's
// current stream: the point after which its contents are final. The
// communication thread makes a side stream wait for that event, copies the
// tensor to the host on it, runs the Gloo operation on the host copy, copies
// the result back on the side stream and waits for that copy before the work
// completes; so a Wait() orders every later use of the tensor, from any stream,
// after the result, and the training thread never blocks on the device. CPU
// tensors are used in place.
class Staged {
 public:
  // Calling thread. `read`: the operation reads the tensor (otherwise it
  // only writes it: no copy to the host).
  Staged(at::Tensor tensor, bool read) : tensor_(std::move(tensor)) {
    if (!tensor_.is_cuda()) return;
    c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
    if (read) {
      ready_ = std::make_shared<c10::Event>(c10::DeviceType::CUDA);
      ready_->record(impl.getStream(tensor_.device()));
    }
  }

  // Communication thread: the tensor the Gloo operation works on.
  at::Tensor Host() {
    if (!tensor_.is_cuda()) return tensor_;
    c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
    side_ = impl.getStreamFromGlobalPool(tensor_.device());
    host_ = at::empty(tensor_.sizes(),
                      tensor_.options().device(at::kCPU).pinned_memory(true));
    if (ready_ != nullptr) {
      ready_->block(*side_);
      c10::StreamGuard guard(*side_);
      host_.copy_(tensor_, /*non_blocking=*/true);
      side_->synchronize();
    }
    return host_;
  }

  // Communication thread, after the operation: the result back in place.
  void CopyBack() {
    if (!tensor_.is_cuda()) return;
    c10::StreamGuard guard(*side_);
    tensor_.copy_(host_, /*non_blocking=*/true);
    side_->synchronize();
  }

 private:
  at::Tensor tensor_;
  at::Tensor host_;
  std::shared_ptr<c10::Event> ready_;
  std::optional<c10::Stream> side_;
};

// The dtypes the shared-memory allreduce sums as Gloo's sum<T> does;
// UNIMPLEMENTED for the others (half precision: Gloo's).
absl::Status ShmSumOf(ShmAllreduce& shm, const at::Tensor& t,
                      absl::Duration timeout) {
  const size_t n = static_cast<size_t>(t.numel());
  switch (t.scalar_type()) {
    case at::kFloat:
      return shm.Sum(t.data_ptr<float>(), n, timeout);
    case at::kDouble:
      return shm.Sum(t.data_ptr<double>(), n, timeout);
    case at::kInt:
      return shm.Sum(t.data_ptr<int32_t>(), n, timeout);
    case at::kLong:
      return shm.Sum(t.data_ptr<int64_t>(), n, timeout);
    default:
      return absl::UnimplementedError("dtype");
  }
}

absl::Status CheckTensor(const at::Tensor& t) {
  if (!t.defined()) return absl::InvalidArgumentError("undefined tensor");
  if (!t.device().is_cpu() && !t.device().is_cuda()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the gloo communicator takes CPU or CUDA tensors, not ",
                     t.device().str()));
  }
  if (!t.is_contiguous()) {
    return absl::InvalidArgumentError("collective tensor must be contiguous");
  }
  return absl::OkStatus();
}

absl::Status CheckAllgather(const at::Tensor& output, const at::Tensor& input,
                            int size) {
  if (absl::Status s = CheckTensor(output); !s.ok()) return s;
  if (absl::Status s = CheckTensor(input); !s.ok()) return s;
  if (output.scalar_type() != input.scalar_type() ||
      output.numel() != input.numel() * size) {
    return absl::InvalidArgumentError(
        absl::StrCat("allgather output must hold ", size, " x ", input.numel(),
                     " elements of the input's dtype, got ", output.numel()));
  }
  if (input.numel() > 0 && output.is_alias_of(input)) {
    return absl::InvalidArgumentError("allgather output aliases its input");
  }
  if (output.device() != input.device()) {
    return absl::InvalidArgumentError(
        "allgather output and input are on different devices");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<GlooCommunicator>> GlooCommunicator::Create(
    const GlooOptions& options, Store* store) {
  if (options.size < 1 || options.rank < 0 || options.rank >= options.size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bad rank ", options.rank, " for world size ", options.size));
  }
  auto context =
      std::make_shared<gloo::rendezvous::Context>(options.rank, options.size);
  context->setTimeout(ToMillis(options.connect_timeout));
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = options.hostname;
    auto device = gloo::transport::tcp::CreateDevice(attr);
    // See Note [Rank tables]: each rank reads the others' keys in O(1) Gets.
    RankTableStore tables(store, options.size, {"rank_", ""},
                          static_cast<size_t>(options.keys_per_get));
    GlooStoreAdapter adapter(&tables, options.connect_timeout);
    context->connectFullMesh(adapter, device);
  } catch (const GlooStoreAdapter::StoreError& e) {
    return e.status;
  } catch (const std::exception& e) {
    return FromGlooException(e);
  }
  std::unique_ptr<ShmAllreduce> shm;
  if (options.size > 1) {
    // Every rank takes part, wanting it or not: all reach one verdict.
    ShmAllreduceOptions so;
    so.rank = options.rank;
    so.size = options.size;
    so.enabled = options.shared_memory;
    so.setup_timeout = options.connect_timeout;
    auto made = ShmAllreduce::Create(so, store);
    if (made.ok()) {
      shm = std::move(*made);
    } else if (made.status().code() == absl::StatusCode::kFailedPrecondition) {
      // Every rank reached the same verdict: Gloo's TCP for all.
      Log()->debug("generation {}: allreduce over Gloo's TCP ({})",
                   options.generation, std::string(made.status().message()));
    } else {
      return made.status();
    }
  }
  return std::unique_ptr<GlooCommunicator>(
      new GlooCommunicator(options, std::move(context), std::move(shm)));
}

GlooCommunicator::GlooCommunicator(const GlooOptions& options,
                                   std::shared_ptr<gloo::Context> context,
                                   std::unique_ptr<ShmAllreduce> shm)
    : options_(options), context_(std::move(context)), shm_(std::move(shm)) {
  thread_ = std::thread([this] { Loop(); });
}

GlooCommunicator::~GlooCommunicator() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

std::shared_ptr<Work> GlooCommunicator::Enqueue(
    std::function<absl::Status(uint32_t)> op) {
  auto work = std::make_shared<PromiseWork>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_) {
      work->MarkDone(absl::AbortedError(
          absl::StrCat("the communicator of generation ", options_.generation,
                       " was aborted")));
      return work;
    }
    queue_.push_back(Task{std::move(op), work});
  }
  cv_.notify_all();
  return work;
}

void GlooCommunicator::Loop() {
  for (;;) {
    Task task;
    uint32_t tag;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, nothing left
      task = std::move(queue_.front());
      queue_.pop_front();
      tag = next_tag_++;
      if (task.work->IsCompleted()) continue;  // aborted before it ran
      running_ = task.work;
    }
    absl::Status status;
    try {
      status = task.op(tag);
    } catch (const std::exception& e) {
      status = FromGlooException(e);
    }
    task.work->MarkDone(std::move(status));
    std::lock_guard<std::mutex> lock(mu_);
    running_.reset();
  }
}

void GlooCommunicator::Abort() {
  std::deque<Task> queued;
  std::shared_ptr<PromiseWork> running;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_) return;
    aborted_ = true;
    queued.swap(queue_);
    running = running_;
  }
  const absl::Status aborted = absl::AbortedError(absl::StrCat(
      "the communicator of generation ", options_.generation, " was aborted"));
  for (Task& task : queued) task.work->MarkDone(aborted);
  if (running) running->MarkDone(aborted);
  if (shm_ != nullptr) shm_->Abort();
  // Closing the pairs wakes Gloo's operation in flight (it fails with an
  // IoException on the communication thread) and the peers blocked on us.
  try {
    context_->closeConnections();
  } catch (const std::exception& e) {
    // The connections are going away either way.
  }
}

std::shared_ptr<Work> GlooCommunicator::AllreduceSum(
    at::Tensor tensor, const CollectiveOptions& options) {
  if (absl::Status s = CheckTensor(tensor); !s.ok()) {
    return PromiseWork::Done(s);
  }
  if (options_.size == 1 || tensor.numel() == 0) {
    return PromiseWork::Done(absl::OkStatus());
  }
  auto staged = std::make_shared<Staged>(tensor, /*read=*/true);
  return Enqueue([this, staged, options](uint32_t tag) -> absl::Status {
    const at::Tensor host = staged->Host();
    if (shm_ != nullptr) {
      absl::Status s = ShmSumOf(*shm_, host, options.timeout);
      if (s.code() != absl::StatusCode::kUnimplemented) {
        if (s.ok()) staged->CopyBack();
        return s;
      }
    }
    gloo::AllreduceOptions opts(context_);
    opts.setTag(tag);
    opts.setTimeout(ToMillis(options.timeout));
    CONCORD_RETURN_IF_ERROR(SetSumOutput(opts, host, "allreduce"));
    gloo::allreduce(opts);
    staged->CopyBack();
    return absl::OkStatus();
  });
}

std::shared_ptr<Work> GlooCommunicator::Broadcast(
    at::Tensor tensor, int root, const CollectiveOptions& options) {
  if (absl::Status s = CheckTensor(tensor); !s.ok()) {
    return PromiseWork::Done(s);
  }
  if (root < 0 || root >= options_.size) {
    return PromiseWork::Done(absl::InvalidArgumentError(
        absl::StrCat("broadcast root ", root, " out of range")));
  }
  if (options_.size == 1 || tensor.numel() == 0) {
    return PromiseWork::Done(absl::OkStatus());
  }
  auto staged = std::make_shared<Staged>(tensor, /*read=*/rank() == root);
  return Enqueue([this, staged, root, options](uint32_t tag) -> absl::Status {
    const at::Tensor host = staged->Host();
    if (shm_ != nullptr) {
      // See Note [Shared-memory broadcast].
      CONCORD_RETURN_IF_ERROR(
          shm_->Broadcast(host.data_ptr(), static_cast<size_t>(host.nbytes()),
                          root, options.timeout));
      staged->CopyBack();
      return absl::OkStatus();
    }
    gloo::BroadcastOptions opts(context_);
    opts.setTag(tag);
    opts.setTimeout(ToMillis(options.timeout));
    opts.setRoot(root);
    // Broadcast moves bytes: the dtype does not matter.
    opts.setOutput(static_cast<uint8_t*>(host.data_ptr()),
                   static_cast<size_t>(host.nbytes()));
    gloo::broadcast(opts);
    staged->CopyBack();
    return absl::OkStatus();
  });
}

std::shared_ptr<Work> GlooCommunicator::ReduceSum(
    at::Tensor tensor, int root, const CollectiveOptions& options) {
  if (absl::Status s = CheckTensor(tensor); !s.ok()) {
    return PromiseWork::Done(s);
  }
  if (root < 0 || root >= options_.size) {
    return PromiseWork::Done(absl::InvalidArgumentError(
        absl::StrCat("reduce root ", root, " out of range")));
  }
  if (options_.size == 1 || tensor.numel() == 0) {
    return PromiseWork::Done(absl::OkStatus());
  }
  auto staged = std::make_shared<Staged>(tensor, /*read=*/true);
  return Enqueue([this, staged, root, options](uint32_t tag) -> absl::Status {
    const at::Tensor host = staged->Host();
    gloo::ReduceOptions opts(context_);
    opts.setTag(tag);
    opts.setTimeout(ToMillis(options.timeout));
    opts.setRoot(root);
    CONCORD_RETURN_IF_ERROR(SetSumOutput(opts, host, "reduce"));
    gloo::reduce(opts);
    staged->CopyBack();
    return absl::OkStatus();
  });
}

std::shared_ptr<Work> GlooCommunicator::Exchange(
    at::Tensor send, std::vector<int> to, std::vector<at::Tensor> recv,
    std::vector<int> from, const CollectiveOptions& options) {
  if (absl::Status s = CheckExchangeArguments(send, to, recv, from,
                                              options_.rank, options_.size);
      !s.ok()) {
    return PromiseWork::Done(s);
  }
  if (absl::Status s = CheckTensor(send); !s.ok()) return PromiseWork::Done(s);
  // Every rank takes a tag, so that the tags of later collectives agree,
  // even where this rank has nothing to move.
  const bool moves = send.numel() > 0 && !(to.empty() && from.empty());
  auto staged_send = std::make_shared<Staged>(send, /*read=*/!to.empty());
  std::vector<std::shared_ptr<Staged>> staged_recv;
  for (const at::Tensor& r : recv) {
    staged_recv.push_back(std::make_shared<Staged>(r, /*read=*/false));
  }
  return Enqueue([this, moves, staged_send, to = std::move(to),
                  staged_recv = std::move(staged_recv), from = std::move(from),
                  options](uint32_t tag) -> absl::Status {
    if (!moves) return absl::OkStatus();
    const at::Tensor send_host = staged_send->Host();
    const uint64_t slot = gloo::Slot::build(kExchangeSlotPrefix, tag);
    const size_t bytes = static_cast<size_t>(send_host.nbytes());
    auto out = context_->createUnboundBuffer(send_host.data_ptr(), bytes);
    std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> in;
    for (size_t i = 0; i < from.size(); ++i) {
      const at::Tensor recv_host = staged_recv[i]->Host();
      in.push_back(context_->createUnboundBuffer(recv_host.data_ptr(), bytes));
      in.back()->recv(from[i], slot);
    }
    for (int peer : to) out->send(peer, slot);
    const auto timeout = ToMillis(options.timeout);
    for (size_t i = 0; i < to.size(); ++i) {
      if (!out->waitSend(timeout)) {
        return absl::UnavailableError(
            "gloo: exchange send was aborted or timed out");
      }
    }
    for (auto& buffer : in) {
      if (!buffer->waitRecv(timeout)) {
        return absl::UnavailableError(
            "gloo: exchange receive was aborted or timed out");
      }
    }
    for (auto& r : staged_recv) r->CopyBack();
    return absl::OkStatus();
  });
}

std::shared_ptr<Work> GlooCommunicator::Allgather(
    at::Tensor output, at::Tensor input, const CollectiveOptions& options) {
  if (absl::Status s = CheckAllgather(output, input, options_.size); !s.ok()) {
    return PromiseWork::Done(s);
  }
  if (input.numel() == 0) return PromiseWork::Done(absl::OkStatus());
  if (options_.size == 1) {
    output.copy_(input.view_as(output));
    return PromiseWork::Done(absl::OkStatus());
  }
  auto staged_in = std::make_shared<Staged>(input, /*read=*/true);
  auto staged_out = std::make_shared<Staged>(output, /*read=*/false);
  return Enqueue(
      [this, staged_in, staged_out, options](uint32_t tag) -> absl::Status {
        const at::Tensor in = staged_in->Host();
        const at::Tensor out = staged_out->Host();
        gloo::AllgatherOptions opts(context_);
        opts.setTag(tag);
        opts.setTimeout(ToMillis(options.timeout));
        // Allgather moves bytes: the dtype does not matter.
        opts.setInput(static_cast<uint8_t*>(in.data_ptr()),
                      static_cast<size_t>(in.nbytes()));
        opts.setOutput(static_cast<uint8_t*>(out.data_ptr()),
                       static_cast<size_t>(out.nbytes()));
        gloo::allgather(opts);
        staged_out->CopyBack();
        return absl::OkStatus();
      });
}

absl::StatusOr<std::shared_ptr<Communicator>> GlooGroupFactory::CreateGroup(
    const Communicator& parent, const std::string& name,
    const std::vector<int>& members) {
  CONCORD_RETURN_IF_ERROR(CheckGroupMembers(parent, members));
  GlooOptions options = base_;
  options.size = static_cast<int>(members.size());
  options.rank = static_cast<int>(
      std::find(members.begin(), members.end(), parent.rank()) -
      members.begin());
  options.generation = parent.generation();
  PrefixStore store(absl::StrCat("group/", parent.generation(), "/", name, "/"),
                    store_);
  CONCORD_ASSIGN_OR_RETURN(auto comm,
                           GlooCommunicator::Create(options, &store));
  return std::shared_ptr<Communicator>(std::move(comm));
}

}  // namespace concord::comm
