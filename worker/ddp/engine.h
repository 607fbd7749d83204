#pragma once
// concord::ddp::Engine: PyTorch's DDP for LibTorch modules, the engine
// behind the public concord::DistributedDataParallel (include/concord/ddp.h),
// concord-train and the elastic State.
//
// Wraps a C++-frontend `torch::nn::Module` or a TorchScript
// `torch::jit::Module`. On creation it broadcasts parameters and buffers from
// the authoritative rank; before every forward (with grad enabled) it
// broadcasts buffers again (PyTorch's broadcast_buffers=True); backward
// averages gradients with bucketed allreduce overlapping the rest of
// backward (see Note [Reducer flow]).
//
// Usage (TorchScript):
//   auto ddp = Engine::Create(module, comm, auth_rank);
//   auto out = (*ddp)->Forward({x}).toTensor();
//   loss.backward();            // gradients are averaged when this returns
//   optimizer.step();
// Usage (C++ frontend):
//   auto out = (*ddp)->Forward([&] { return net->forward(x); });
//
// Not thread-safe: one training thread drives it.

#include <torch/script.h>
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/comm/communicator.h"
#include "worker/ddp/comm_hooks.h"
#include "worker/ddp/reducer.h"
#include "worker/error.h"
#include "worker/trace/recorder.h"

namespace concord::ddp {

class Engine {
 public:
  // Verifies that every rank wraps the same model (names, shapes, dtypes,
  // order), then broadcasts parameters and buffers from the authoritative
  // rank. Blocks. Errors: INVALID_ARGUMENT (no trainable parameter, bad
  // authoritative rank, contradictory or unknown options/names),
  // FAILED_PRECONDITION (the ranks' models differ: on every rank, naming the
  // first difference), those of Work::Wait.
  static absl::StatusOr<std::unique_ptr<Engine>> Create(
      std::shared_ptr<torch::nn::Module> module,
      std::shared_ptr<comm::Communicator> comm, int authoritative_rank,
      concord::DdpOptions options = {}, ReducerInternals internals = {});
  static absl::StatusOr<std::unique_ptr<Engine>> Create(
      torch::jit::Module module, std::shared_ptr<comm::Communicator> comm,
      int authoritative_rank, concord::DdpOptions options = {},
      ReducerInternals internals = {});

  // INVALID_ARGUMENT when the options contradict each other (with a hook:
  // `has_comm_hook`). Create checks this too; tools call it before joining.
  static absl::Status ValidateOptions(const concord::DdpOptions& options,
                                      bool has_comm_hook);

  // Replaces the default allreduce (see Note [DDP Communication Hook]). Call
  // before the first forward. FAILED_PRECONDITION when one is set already or
  // apex scaling options are on.
  absl::Status RegisterCommHook(ddp::CommHook hook);

  // PyTorch's no_sync(): while the returned guard lives, forwards do not arm
  // the reducer and backward only accumulates gradients locally; the first
  // synchronised backward after it reduces the accumulated gradients.
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(Engine* ddp) : ddp_(ddp) {
      previous_ = ddp_->require_backward_grad_sync_;
      ddp_->require_backward_grad_sync_ = false;
    }
    ~NoSyncGuard() { ddp_->require_backward_grad_sync_ = previous_; }
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    Engine* ddp_;
    bool previous_;
  };
  NoSyncGuard NoSync() { return NoSyncGuard(this); }

  // Everything a forward needs first: arming the reducer (grad mode on and
  // not inside NoSync) and the buffer broadcast (when the previous forward
  // was synchronised, as PyTorch does). Errors: those of Work::Wait.
  absl::Status PrepareForward();

  // TorchScript: PrepareForward, then module.forward(inputs).
  // Throws concord::Error when PrepareForward fails.
  c10::IValue Forward(std::vector<c10::IValue> inputs);

  // C++ frontend: PrepareForward, then `forward()` (the module's own call).
  template <typename Fn>
  auto Forward(Fn&& forward) -> decltype(forward()) {
    trace::Recorder::Span span(trace_, "forward");
    ThrowIfError(PrepareForward());
    auto out = forward();
    reducer_->MarkForwardDone();
    return out;
  }

  // The halves of the C++-frontend Forward for callers that call the module
  // themselves (the public API's templates): PrepareForward before it,
  // ForwardDone after it.
  void ForwardDone() { reducer_->MarkForwardDone(); }
  // PyTorch's require_backward_grad_sync (what NoSync clears).
  void SetRequireBackwardGradSync(bool sync) {
    require_backward_grad_sync_ = sync;
  }
  bool require_backward_grad_sync() const {
    return require_backward_grad_sync_;
  }

  // See Note [Re-forming in the worker] in worker/session.h: moves DDP to the
  // next generation's communicator. Drops the interrupted iteration (every
  // `.grad` is undefined afterwards) and the communication hook (register it
  // again), checks that every rank of the new generation wraps the same model
  // and broadcasts parameters and buffers from `authoritative_rank`. A worker
  // that joins the new generation calls Create instead: both run the same
  // collectives. Then every rank calls SyncReducerLayout. Blocks. Errors as
  // for Create.
  absl::Status Rebind(std::shared_ptr<comm::Communicator> comm,
                      int authoritative_rank);
  // The authoritative rank's bucket layout, on every rank (a broadcast).
  absl::Status SyncReducerLayout() { return reducer_->SyncLayout(); }
  // Reducer::LayoutState / SetLayoutState.
  at::Tensor ReducerLayout() const { return reducer_->LayoutState(); }
  absl::Status SetReducerLayout(const at::Tensor& layout) {
    return reducer_->SetLayoutState(layout);
  }
  // What gradient sums are divided by (default: the world size); PyTorch's
  // join semantics divide by the initial world size.
  void SetGradientDivisor(double divisor) {
    reducer_->SetGradientDivisor(divisor);
  }
  // ReducerInternals::blocking_wait, between iterations.
  void SetBlockingWait(bool blocking) { reducer_->SetBlockingWait(blocking); }
  bool blocking_wait() const { return reducer_->blocking_wait(); }

  // Timeline (see Note [Trace files] in worker/trace/recorder.h): forward
  // (with the buffer broadcast), each bucket's allreduce and the final
  // callback's wait, on this rank's tracks; the generation is marked now
  // and at every Rebind. Tag steps with recorder->SetStep and time the
  // rest of a step (backward, optimizer) with trace::Recorder::Span. Null
  // turns it off (the default; then nothing is timed). Call between
  // iterations.
  void SetTraceRecorder(std::shared_ptr<trace::Recorder> recorder);

  // Called before each bucket's collective of each synchronised backward
  // (0: the first), on the thread running the backward
  // (Reducer::SetLaunchObserver).
  void SetBackwardObserver(std::function<void(size_t)> observer) {
    reducer_->SetLaunchObserver(std::move(observer));
  }
  // Called at each parameter's gradient of every backward, before the
  // gradient is used (Reducer::SetGradientObserver): nothing has written a
  // parameter since the forward yet.
  void SetGradientObserver(std::function<void()> observer) {
    reducer_->SetGradientObserver(std::move(observer));
  }

  // Trainable parameters, in the module's order (what the optimizer takes).
  const std::vector<torch::Tensor>& parameters() const { return params_; }
  // Every buffer of the module, also those DDP ignores.
  std::vector<torch::Tensor> AllBuffers() const {
    std::vector<torch::Tensor> out;
    for (const auto& [name, b] : named_.buffers) out.push_back(b);
    return out;
  }
  // Every named parameter and buffer (trainable or not).
  std::vector<std::pair<std::string, torch::Tensor>> NamedState() const;
  const ddp::Reducer& reducer() const { return *reducer_; }
  // Bucket sizes, rebuilds and the last iteration's timings.
  const ddp::ReducerStats& stats() const { return reducer_->stats(); }
  // Reducer::rebuilt and Reducer::buckets (indices into parameters()).
  bool BucketsRebuilt() const { return reducer_->rebuilt(); }
  std::vector<ddp::BucketInfo> Buckets() const { return reducer_->buckets(); }
  comm::Communicator& communicator() { return *comm_; }
  int authoritative_rank() const { return authoritative_rank_; }

 private:
  struct Named {
    std::vector<std::pair<std::string, torch::Tensor>> params;
    std::vector<std::pair<std::string, torch::Tensor>> buffers;
  };
  static absl::StatusOr<std::unique_ptr<Engine>> Init(
      Named named, std::shared_ptr<comm::Communicator> comm,
      int authoritative_rank, concord::DdpOptions options,
      ReducerInternals internals);
  Engine() = default;
  // VerifySameModel, then the broadcast of `synced_`.
  absl::Status VerifyAndBroadcast();

  std::optional<torch::jit::Module> script_;
  Named named_;
  std::vector<torch::Tensor> params_;
  std::vector<torch::Tensor> buffers_;
  // Parameters (trainable or not) and buffers DDP keeps equal across ranks,
  // with the description every rank checks against the authoritative one.
  std::vector<torch::Tensor> synced_;
  std::vector<std::string> description_;
  std::shared_ptr<comm::Communicator> comm_;
  int authoritative_rank_ = 0;
  // The user's options as given; what the inside adds (the collective
  // timeout, blocking waits) in `internals_`, the reducer's too.
  concord::DdpOptions options_;
  ReducerInternals internals_;
  std::unique_ptr<ddp::Reducer> reducer_;
  std::shared_ptr<trace::Recorder> trace_;
  bool require_backward_grad_sync_ = true;
  bool require_forward_param_sync_ = true;
};

}  // namespace concord::ddp
