#include "worker/comm/nccl/nccl_communicator.h"

#include <ATen/ATen.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "concord/config.h"
#include "worker/comm/nccl/nccl_result.h"
#if CONCORD_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace concord::comm {
namespace {

static_assert(
    static_cast<int>(NcclResult::kUnhandledCudaError) ==
            ncclUnhandledCudaError &&
        static_cast<int>(NcclResult::kSystemError) == ncclSystemError &&
        static_cast<int>(NcclResult::kInternalError) == ncclInternalError &&
        static_cast<int>(NcclResult::kInvalidArgument) == ncclInvalidArgument &&
        static_cast<int>(NcclResult::kInvalidUsage) == ncclInvalidUsage &&
        static_cast<int>(NcclResult::kRemoteError) == ncclRemoteError &&
        static_cast<int>(NcclResult::kInProgress) == ncclInProgress,
    "NcclResult mirrors nccl.h's ncclResult_t");

// Translates an NCCL result into a status: file, line, NCCL version and
// ncclGetLastError's text, with the code that says whether it re-forms (see
// Note [NCCL failures and re-forming]). ncclInProgress is not a failure.
absl::Status NcclStatus(ncclResult_t r, ncclComm_t comm, const char* file,
                        int line) {
  const absl::StatusCode code = NcclResultCode(r);
  if (code == absl::StatusCode::kOk) return absl::OkStatus();
  const char* last = ncclGetLastError(comm);
  return absl::Status(
      code, absl::StrFormat("%s:%d: NCCL %d.%d.%d error: %s (%s)", file, line,
                            NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH,
                            ncclGetErrorString(r), last ? last : ""));
}

#define CONCORD_NCCL_CHECK(expr, comm)                  \
  do {                                                  \
    ::absl::Status concord_nccl_s_ =                    \
        NcclStatus((expr), (comm), __FILE__, __LINE__); \
    if (!concord_nccl_s_.ok()) return concord_nccl_s_;  \
  } while (false)

absl::Status CudaStatus(cudaError_t e, const char* file, int line) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::UnavailableError(absl::StrFormat("%s:%d: CUDA error: %s", file,
                                                line, cudaGetErrorString(e)));
}

#define CONCORD_CUDA_CHECK(expr)                                             \
  do {                                                                       \
    ::absl::Status concord_cuda_s_ = CudaStatus((expr), __FILE__, __LINE__); \
    if (!concord_cuda_s_.ok()) return concord_cuda_s_;                       \
  } while (false)

absl::StatusOr<ncclDataType_t> NcclType(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return ncclFloat32;
    case at::kDouble:
      return ncclFloat64;
    case at::kHalf:
      return ncclFloat16;
    case at::kBFloat16:
      return ncclBfloat16;
    case at::kInt:
      return ncclInt32;
    case at::kLong:
      return ncclInt64;
    case at::kByte:
      return ncclUint8;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "nccl does not support dtype ", std::string(c10::toString(t))));
  }
}

}  // namespace

struct NcclCommunicator::State {
  NcclOptions options;
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
#if CONCORD_TORCH_CUDA
  // See Note [NCCL streams]: `stream` is this pool stream's.
  std::optional<c10::cuda::CUDAStream> torch_stream;
  // Recorded on the current stream before each collective (under `mu`):
  // one event, reused, as c10d's are.
  cudaEvent_t ready = nullptr;
#endif
  std::mutex mu;  // serialises enqueueing and abort
  std::atomic<bool> aborted{false};
  std::atomic<bool> failed{false};

  // See Note [Stream-ordered waits]: every collective's work, until the
  // watchdog has seen it end. Holding them keeps their tensors alive while
  // NCCL may still use them, whoever dropped the work (as c10d's
  // workMetaList_ does).
  std::mutex watch_mu;
  std::condition_variable watch_cv;
  std::vector<std::shared_ptr<Work>> watched;
  bool stop_watching = false;

  void Watch(std::shared_ptr<Work> work) {
    std::lock_guard<std::mutex> lock(watch_mu);
    watched.push_back(std::move(work));
  }

  // The watchdog (a thread per communicator, c10d's ncclCommWatchdog):
  // polls the works; one past its timeout aborts the communicator (in its
  // Wait), so that a hung collective whose waiter only ordered a stream
  // after it still ends, and every later collective fails.
  void RunWatchdog() {
    cudaSetDevice(options.device);
    std::unique_lock<std::mutex> lock(watch_mu);
    while (!stop_watching) {
      watch_cv.wait_for(lock, kWatchdogPeriod);
      std::vector<std::shared_ptr<Work>> polled = watched;
      lock.unlock();
      std::vector<const Work*> ended;
      for (const auto& work : polled) {
        if (work->Wait(absl::ZeroDuration()).code() !=
            absl::StatusCode::kDeadlineExceeded) {
          ended.push_back(work.get());
        }
      }
      polled.clear();
      lock.lock();
      watched.erase(std::remove_if(watched.begin(), watched.end(),
                                   [&](const std::shared_ptr<Work>& w) {
                                     return std::find(ended.begin(),
                                                      ended.end(),
                                                      w.get()) != ended.end();
                                   }),
                    watched.end());
    }
  }

  void StopWatchdog(std::thread& watchdog) {
    {
      std::lock_guard<std::mutex> lock(watch_mu);
      stop_watching = true;
    }
    watch_cv.notify_all();
    if (watchdog.joinable()) watchdog.join();
    std::lock_guard<std::mutex> lock(watch_mu);
    watched.clear();  // the works hold this state: break the cycle
  }

  static constexpr std::chrono::milliseconds kWatchdogPeriod{100};

  // The stream collectives run on (see Note [NCCL streams]).
  absl::Status MakeStream() {
#if CONCORD_TORCH_CUDA
    torch_stream = c10::cuda::getStreamFromPool(
        /*isHighPriority=*/true, static_cast<c10::DeviceIndex>(options.device));
    stream = torch_stream->stream();
    return absl::OkStatus();
#else
    return CudaStatus(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                      __FILE__, __LINE__);
#endif
  }
  void DestroyStream() {
#if CONCORD_TORCH_CUDA
    if (ready != nullptr) cudaEventDestroy(ready);
    ready = nullptr;
#else
    if (stream != nullptr) cudaStreamDestroy(stream);
#endif
    stream = nullptr;
  }

  // Waits until the non-blocking communicator has no operation in progress.
  absl::Status WaitNotInProgress(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    for (;;) {
      ncclResult_t async = ncclSuccess;
      CONCORD_NCCL_CHECK(ncclCommGetAsyncError(comm, &async), comm);
      if (async != ncclInProgress) {
        CONCORD_NCCL_CHECK(async, comm);
        return absl::OkStatus();
      }
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError("NCCL operation still in progress");
      }
      std::this_thread::yield();
    }
  }

  void Abort() {
    std::lock_guard<std::mutex> lock(mu);
    if (aborted.exchange(true) || comm == nullptr) return;
    ncclCommAbort(comm);
  }

  // See Note [Re-forming NCCL]: issues `call(config)`, a non-blocking
  // derivation of this communicator (shrink, split), under its lock, and
  // with `wait` waits for the parent to finish its part; on failure the
  // parent is aborted.
  template <typename Call>
  absl::Status Derive(const char* what, Call call,
                      std::optional<absl::Duration> wait) {
    std::lock_guard<std::mutex> lock(mu);
    if (aborted.load()) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, ": the communicator was aborted"));
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    absl::Status st = NcclStatus(call(&config), comm, __FILE__, __LINE__);
    if (st.ok() && wait.has_value()) st = WaitNotInProgress(*wait);
    if (!st.ok()) {
      aborted.store(true);
      ncclCommAbort(comm);
    }
    return st;
  }
};

namespace {

// A collective enqueued on the communicator's stream.
class NcclWork final : public Work {
 public:
  // `copy_back`: (caller's CPU tensor, its device copy) pairs to copy back
  // once the collective has completed (see Note [NCCL streams]).
  NcclWork(std::shared_ptr<NcclCommunicator::State> state, cudaEvent_t event,
           absl::Duration timeout, std::vector<at::Tensor> keep_alive,
           std::vector<std::pair<at::Tensor, at::Tensor>> copy_back)
      : state_(std::move(state)),
        event_(event),
        deadline_(absl::Now() + timeout),
        tensors_(std::move(keep_alive)),
        copy_back_(std::move(copy_back)) {}
  ~NcclWork() override {
    if (event_ != nullptr) cudaEventDestroy(event_);
  }

  bool IsCompleted() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return done_ || cudaEventQuery(event_) != cudaErrorNotReady;
  }

  absl::Status Wait(absl::Duration timeout) override {
    const absl::Time until = absl::Now() + timeout;
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (done_) return status_;
        if (state_->aborted.load())
          return Finish(absl::AbortedError("NCCL communicator aborted"));
        cudaError_t q = cudaEventQuery(event_);
        if (q == cudaSuccess) return Finish(absl::OkStatus());
        if (q != cudaErrorNotReady) {
          return Finish(CudaStatus(q, __FILE__, __LINE__));
        }
        ncclResult_t async = ncclSuccess;
        ncclCommGetAsyncError(state_->comm, &async);
        if (async != ncclSuccess && async != ncclInProgress) {
          return Finish(NcclStatus(async, state_->comm, __FILE__, __LINE__));
        }
      }
      const absl::Time now = absl::Now();
      if (now > deadline_) {
        state_->failed.store(true);
        state_->Abort();
        std::lock_guard<std::mutex> lock(mu_);
        return Finish(absl::UnavailableError(
            "NCCL collective timed out; communicator aborted"));
      }
      if (now > until) {
        return absl::DeadlineExceededError("NCCL collective still running");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  // See Note [Stream-ordered waits]: the current stream waits for the
  // collective's event; staged CPU tensors need the host (Wait).
  absl::Status Synchronize(absl::Duration timeout) override {
#if CONCORD_TORCH_CUDA
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (done_) return status_;  // the host saw the end: nothing to order
      if (copy_back_.empty()) {
        if (state_->aborted.load()) {
          return Finish(absl::AbortedError("NCCL communicator aborted"));
        }
        const auto device =
            static_cast<c10::DeviceIndex>(state_->options.device);
        cudaStream_t current = c10::cuda::getCurrentCUDAStream(device).stream();
        if (current == state_->stream) return absl::OkStatus();
        return CudaStatus(cudaStreamWaitEvent(current, event_, 0), __FILE__,
                          __LINE__);
      }
    }
#endif
    return Wait(timeout);
  }

  void Abort() override {
    state_->Abort();
    std::lock_guard<std::mutex> lock(mu_);
    (void)Finish(absl::AbortedError("collective aborted"));
  }

 private:
  absl::Status Finish(absl::Status s) {  // mu_ held
    if (!done_) {
      done_ = true;
      if (s.ok()) {
        for (auto& [user, staged] : copy_back_) user.copy_(staged);
      } else if (!absl::IsAborted(s)) {
        state_->failed.store(true);
      }
      copy_back_.clear();
      status_ = std::move(s);
    }
    return status_;
  }

  std::shared_ptr<NcclCommunicator::State> state_;
  cudaEvent_t event_;
  absl::Time deadline_;
  std::vector<at::Tensor> tensors_;
  std::vector<std::pair<at::Tensor, at::Tensor>> copy_back_;
  mutable std::mutex mu_;
  bool done_ = false;
  absl::Status status_;
};

absl::Status CheckTensor(const at::Tensor& t, int device) {
#if CONCORD_TORCH_CUDA
  const bool cpu_ok = t.defined() && t.device().is_cpu();  // staged
#else
  const bool cpu_ok = false;
#endif
  if (!cpu_ok && (!t.defined() || !t.is_cuda() || t.get_device() != device)) {
    return absl::InvalidArgumentError(
        absl::StrCat("the nccl communicator takes tensors on cuda:", device));
  }
  if (!t.is_contiguous()) {
    return absl::InvalidArgumentError("collective tensor must be contiguous");
  }
  return absl::OkStatus();
}

absl::Status CheckAllgather(const at::Tensor& output, const at::Tensor& input,
                            int size, int device) {
  if (absl::Status s = CheckTensor(output, device); !s.ok()) return s;
  if (absl::Status s = CheckTensor(input, device); !s.ok()) return s;
  if (output.scalar_type() != input.scalar_type() ||
      output.numel() != input.numel() * size) {
    return absl::InvalidArgumentError(
        absl::StrCat("allgather output must hold ", size, " x ", input.numel(),
                     " elements of the input's dtype, got ", output.numel()));
  }
  return absl::OkStatus();
}

// The tensors of one collective as NCCL sees them: CUDA tensors as they
// are, CPU tensors (CUDA LibTorch only) as device copies that go back to the
// caller's tensor when the work completes (see Note [NCCL streams]).
class Operands {
 public:
  explicit Operands(int device) : device_(device) {}
  // The tensor to hand NCCL for `t`; `written`: NCCL writes it.
  at::Tensor Use(const at::Tensor& t, bool written) {
    used_.push_back(t);
    if (t.is_cuda()) return t;
    at::Tensor staged =
        t.to(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device_)));
    used_.push_back(staged);
    if (written) copy_back_.emplace_back(t, staged);
    return staged;
  }
  std::vector<at::Tensor>& used() { return used_; }
  std::vector<std::pair<at::Tensor, at::Tensor>>& copy_back() {
    return copy_back_;
  }

 private:
  int device_;
  std::vector<at::Tensor> used_;
  std::vector<std::pair<at::Tensor, at::Tensor>> copy_back_;
};

// See Note [NCCL streams]: the NCCL stream waits for what is queued on the
// current stream of the operands' device, and the allocator learns that
// their memory is in use on the NCCL stream.
absl::Status OrderAfterCurrentStream(NcclCommunicator::State& s,
                                     const std::vector<at::Tensor>& tensors) {
#if CONCORD_TORCH_CUDA
  const auto device = static_cast<c10::DeviceIndex>(s.options.device);
  cudaStream_t current = c10::cuda::getCurrentCUDAStream(device).stream();
  if (current != s.stream) {
    if (s.ready == nullptr) {
      CONCORD_CUDA_CHECK(
          cudaEventCreateWithFlags(&s.ready, cudaEventDisableTiming));
    }
    // The wait captures the event as recorded now: re-recording it for the
    // next collective does not change what this one waits for.
    CONCORD_CUDA_CHECK(cudaEventRecord(s.ready, current));
    CONCORD_CUDA_CHECK(cudaStreamWaitEvent(s.stream, s.ready, 0));
  }
  for (const at::Tensor& t : tensors) {
    if (t.is_cuda() && t.storage().data_ptr().get() != nullptr) {
      c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(),
                                                    *s.torch_stream);
    }
  }
#else
  (void)s;
  (void)tensors;
#endif
  return absl::OkStatus();
}

// Enqueues `launch` on the stream and returns the work that tracks it.
template <typename Launch>
std::shared_ptr<Work> Enqueue(const std::shared_ptr<NcclCommunicator::State>& s,
                              Operands& operands,
                              const CollectiveOptions& options, Launch launch) {
  auto fail = [](absl::Status st) { return PromiseWork::Done(std::move(st)); };
  std::lock_guard<std::mutex> lock(s->mu);
  if (s->aborted.load()) {
    return fail(absl::AbortedError("NCCL communicator aborted"));
  }
  if (absl::Status st = OrderAfterCurrentStream(*s, operands.used());
      !st.ok()) {
    return fail(st);
  }
  if (absl::Status st = NcclStatus(launch(), s->comm, __FILE__, __LINE__);
      !st.ok()) {
    s->failed.store(true);
    return fail(st);
  }
  if (absl::Status st = s->WaitNotInProgress(options.timeout); !st.ok()) {
    s->failed.store(true);
    return fail(st);
  }
  cudaEvent_t event = nullptr;
  if (absl::Status st =
          CudaStatus(cudaEventCreateWithFlags(&event, cudaEventDisableTiming),
                     __FILE__, __LINE__);
      !st.ok()) {
    return fail(st);
  }
  cudaEventRecord(event, s->stream);
  auto work = std::make_shared<NcclWork>(s, event, options.timeout,
                                         std::move(operands.used()),
                                         std::move(operands.copy_back()));
  s->Watch(work);
  return work;
}

// What every collective on one tensor in place starts with: the tensor
// checked against the communicator's device, the root (if any, kNoRoot
// otherwise) in range, the element type NCCL's (unless the tensor goes as
// bytes), nothing for an empty tensor; then the operand staged and
// `launch(ptr, count, type)` enqueued, count in elements or bytes.
constexpr int kNoRoot = -1;
enum class Units { kElements, kBytes };

template <typename Launch>
std::shared_ptr<Work> InPlace(const std::shared_ptr<NcclCommunicator::State>& s,
                              at::Tensor tensor, int root,
                              absl::string_view what, Units units,
                              const CollectiveOptions& options, Launch launch) {
  if (absl::Status st = CheckTensor(tensor, s->options.device); !st.ok()) {
    return PromiseWork::Done(st);
  }
  if (root != kNoRoot && (root < 0 || root >= s->options.size)) {
    return PromiseWork::Done(absl::InvalidArgumentError(
        absl::StrCat(what, " root ", root, " out of range")));
  }
  ncclDataType_t type = ncclUint8;
  if (units == Units::kElements) {
    absl::StatusOr<ncclDataType_t> t = NcclType(tensor.scalar_type());
    if (!t.ok()) return PromiseWork::Done(t.status());
    type = *t;
  }
  if (tensor.numel() == 0) return PromiseWork::Done(absl::OkStatus());
  Operands operands(s->options.device);
  at::Tensor t = operands.Use(tensor, /*written=*/true);
  void* ptr = t.data_ptr();
  const size_t count =
      units == Units::kBytes ? t.nbytes() : static_cast<size_t>(t.numel());
  return Enqueue(s, operands, options,
                 [&] { return launch(ptr, count, type); });
}

}  // namespace

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(
    const NcclOptions& options, Store* store) {
  if (options.size < 1 || options.rank < 0 || options.rank >= options.size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bad rank ", options.rank, " for world size ", options.size));
  }
  int devices = 0;
  CONCORD_CUDA_CHECK(cudaGetDeviceCount(&devices));
  if (options.device < 0 || options.device >= devices) {
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA device ", options.device, " does not exist (",
                     devices, " visible)"));
  }
  CONCORD_CUDA_CHECK(cudaSetDevice(options.device));

  ncclUniqueId id;
  const std::string key = "nccl/unique_id";
  if (options.rank == 0) {
    CONCORD_NCCL_CHECK(ncclGetUniqueId(&id), nullptr);
    absl::Status s = store->Set(
        key, std::string(reinterpret_cast<const char*>(&id), sizeof(id)));
    if (!s.ok()) return s;
  } else {
    auto values = store->Get({key}, options.connect_timeout);
    if (!values.ok()) return values.status();
    if (values->front().size() != sizeof(id)) {
      return absl::InternalError("malformed NCCL unique id in the store");
    }
    std::memcpy(&id, values->front().data(), sizeof(id));
  }

  auto state = std::make_shared<State>();
  state->options = options;
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  CONCORD_NCCL_CHECK(ncclCommInitRankConfig(&state->comm, options.size, id,
                                            options.rank, &config),
                     nullptr);
  return Connected(std::move(state), options.connect_timeout);
}

// A communicator whose non-blocking initialisation (init, shrink or split)
// was issued: waits for it until `timeout`, then makes its stream.
absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Connected(
    std::shared_ptr<State> state, absl::Duration timeout) {
  if (absl::Status s = state->WaitNotInProgress(timeout); !s.ok()) {
    state->Abort();
    return s;
  }
  if (absl::Status s = state->MakeStream(); !s.ok()) {
    state->Abort();
    return s;
  }
  return std::unique_ptr<NcclCommunicator>(
      new NcclCommunicator(std::move(state)));
}

NcclCommunicator::NcclCommunicator(std::shared_ptr<State> state)
    : state_(std::move(state)),
      watchdog_([s = state_.get()] { s->RunWatchdog(); }) {}

NcclCommunicator::~NcclCommunicator() {
  state_->StopWatchdog(watchdog_);
  if (!state_->aborted.load() && state_->comm != nullptr) {
    ncclCommFinalize(state_->comm);
    state_->WaitNotInProgress(absl::Seconds(30)).IgnoreError();
    ncclCommDestroy(state_->comm);
  }
  // else ncclCommAbort (or a derivation) already released it.
  state_->DestroyStream();
}

int NcclCommunicator::rank() const { return state_->options.rank; }
int NcclCommunicator::size() const { return state_->options.size; }
int64_t NcclCommunicator::generation() const {
  return state_->options.generation;
}

void NcclCommunicator::Abort() { state_->Abort(); }
bool NcclCommunicator::usable() const { return !state_->aborted.load(); }
bool NcclCommunicator::failed() const { return state_->failed.load(); }

absl::StatusOr<std::unique_ptr<Communicator>> NcclCommunicator::Shrink(
    const std::vector<int>& excluded, bool abort_in_flight, int64_t generation,
    absl::Duration timeout) {
#if NCCL_VERSION_CODE >= 22700
  const int size = state_->options.size;
  if (excluded.empty()) {
    return absl::InvalidArgumentError(
        "shrink: no rank to leave out (ncclCommShrink needs one; the same "
        "members split)");
  }
  for (size_t i = 0; i < excluded.size(); ++i) {
    if (excluded[i] < 0 || excluded[i] >= size ||
        (i > 0 && excluded[i] <= excluded[i - 1]) ||
        excluded[i] == state_->options.rank) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shrink: excluded ranks must be ascending ranks of ", size,
          " other than this one's (", state_->options.rank, ")"));
    }
  }
  auto next = std::make_shared<State>();
  next->options = state_->options;
  next->options.size = size - static_cast<int>(excluded.size());
  next->options.rank = state_->options.rank -
                       static_cast<int>(std::count_if(
                           excluded.begin(), excluded.end(),
                           [&](int r) { return r < state_->options.rank; }));
  next->options.generation = generation;
  // A copy: NCCL sorts the list in place.
  std::vector<int> ranks = excluded;
  if (absl::Status st = state_->Derive(
          "shrink",
          [&](ncclConfig_t* config) {
            return ncclCommShrink(
                state_->comm, ranks.data(), static_cast<int>(ranks.size()),
                &next->comm, config,
                abort_in_flight ? NCCL_SHRINK_ABORT : NCCL_SHRINK_DEFAULT);
          },
          std::nullopt);
      !st.ok()) {
    return st;
  }
  auto made = Connected(std::move(next), timeout);
  // The parent is spent either way (see Note [Re-forming NCCL]).
  state_->Abort();
  return made;
#else
  (void)excluded;
  (void)abort_in_flight;
  (void)generation;
  (void)timeout;
  return absl::FailedPreconditionError(absl::StrFormat(
      "shrink: NCCL %d.%d.%d has no ncclCommShrink (2.27 or later)", NCCL_MAJOR,
      NCCL_MINOR, NCCL_PATCH));
#endif
}

absl::StatusOr<std::unique_ptr<Communicator>> NcclCommunicator::Split(
    int color, int key, int64_t generation, absl::Duration timeout) {
  auto next = std::make_shared<State>();
  next->options = state_->options;
  next->options.generation = generation;
  // The split completes on the parent (non-blocking): wait for it there.
  if (absl::Status st = state_->Derive(
          "split",
          [&](ncclConfig_t* config) {
            return ncclCommSplit(state_->comm,
                                 color < 0 ? NCCL_SPLIT_NOCOLOR : color, key,
                                 &next->comm, config);
          },
          timeout);
      !st.ok()) {
    return st;
  }
  if (color < 0 || next->comm == nullptr) {
    state_->Abort();
    return std::unique_ptr<Communicator>();
  }
  auto made = Connected(std::move(next), timeout);
  state_->Abort();
  if (!made.ok()) return made.status();
  // The child's place, once its initialisation has completed.
  State& child = *(*made)->state_;
  int rank = 0, size = 0;
  CONCORD_NCCL_CHECK(ncclCommUserRank(child.comm, &rank), child.comm);
  CONCORD_NCCL_CHECK(ncclCommCount(child.comm, &size), child.comm);
  child.options.rank = rank;
  child.options.size = size;
  return std::unique_ptr<Communicator>(std::move(*made));
}

std::shared_ptr<Work> NcclCommunicator::AllreduceSum(
    at::Tensor tensor, const CollectiveOptions& options) {
  auto state = state_;
  return InPlace(state, tensor, kNoRoot, "allreduce", Units::kElements, options,
                 [&](void* ptr, size_t n, ncclDataType_t type) {
                   return ncclAllReduce(ptr, ptr, n, type, ncclSum, state->comm,
                                        state->stream);
                 });
}

std::shared_ptr<Work> NcclCommunicator::Broadcast(
    at::Tensor tensor, int root, const CollectiveOptions& options) {
  auto state = state_;
  return InPlace(state, tensor, root, "broadcast", Units::kBytes, options,
                 [&](void* ptr, size_t bytes, ncclDataType_t type) {
                   return ncclBroadcast(ptr, ptr, bytes, type, root,
                                        state->comm, state->stream);
                 });
}

std::shared_ptr<Work> NcclCommunicator::ReduceSum(
    at::Tensor tensor, int root, const CollectiveOptions& options) {
  auto state = state_;
  return InPlace(state, tensor, root, "reduce", Units::kElements, options,
                 [&](void* ptr, size_t n, ncclDataType_t type) {
                   return ncclReduce(ptr, ptr, n, type, ncclSum, root,
                                     state->comm, state->stream);
                 });
}

std::shared_ptr<Work> NcclCommunicator::Exchange(
    at::Tensor send, std::vector<int> to, std::vector<at::Tensor> recv,
    std::vector<int> from, const CollectiveOptions& options) {
  if (absl::Status s = CheckExchangeArguments(
          send, to, recv, from, state_->options.rank, state_->options.size);
      !s.ok()) {
    return PromiseWork::Done(s);
  }
  if (absl::Status s = CheckTensor(send, state_->options.device); !s.ok()) {
    return PromiseWork::Done(s);
  }
  if (send.numel() == 0 || (to.empty() && from.empty())) {
    return PromiseWork::Done(absl::OkStatus());
  }
  Operands operands(state_->options.device);
  at::Tensor out = operands.Use(send, /*written=*/false);
  std::vector<at::Tensor> in;
  for (const at::Tensor& r : recv) in.push_back(operands.Use(r, true));
  const size_t bytes = static_cast<size_t>(send.nbytes());
  auto state = state_;
  return Enqueue(state_, operands, options, [&]() -> ncclResult_t {
    ncclResult_t r = ncclGroupStart();
    if (r != ncclSuccess) return r;
    for (int peer : to) {
      r = ncclSend(out.data_ptr(), bytes, ncclUint8, peer, state->comm,
                   state->stream);
      if (r != ncclSuccess && r != ncclInProgress) break;
    }
    for (size_t i = 0;
         i < from.size() && (r == ncclSuccess || r == ncclInProgress); ++i) {
      r = ncclRecv(in[i].data_ptr(), bytes, ncclUint8, from[i], state->comm,
                   state->stream);
    }
    const ncclResult_t end = ncclGroupEnd();
    return r == ncclSuccess || r == ncclInProgress ? end : r;
  });
}

std::shared_ptr<Work> NcclCommunicator::Allgather(
    at::Tensor output, at::Tensor input, const CollectiveOptions& options) {
  if (absl::Status s = CheckAllgather(output, input, state_->options.size,
                                      state_->options.device);
      !s.ok()) {
    return PromiseWork::Done(s);
  }
  if (input.numel() == 0) return PromiseWork::Done(absl::OkStatus());
  Operands operands(state_->options.device);
  const void* in = operands.Use(input, /*written=*/false).data_ptr();
  void* out = operands.Use(output, /*written=*/true).data_ptr();
  // Bytes are moved: any dtype, NCCL's element type is uint8.
  const size_t bytes = static_cast<size_t>(input.nbytes());
  auto state = state_;
  return Enqueue(state_, operands, options, [&] {
    return ncclAllGather(in, out, bytes, ncclUint8, state->comm, state->stream);
  });
}

}  // namespace concord::comm
