#pragma once
// Communicator over NCCL (CUDA tensors). Built when CONCORD_HAVE_NCCL.
//
// Rendezvous: the root rank creates the NCCL unique id and publishes it in
// the generation's store (the coordinator distributes it); the others read
// it. The communicator is non-blocking (ncclConfig_t.blocking = 0), so every
// call returns at once and a hung collective can be ended with
// ncclCommAbort: Work::Wait polls the CUDA event and ncclCommGetAsyncError,
// and aborts the communicator when the collective's timeout passes.
// Collectives run on one CUDA stream owned by the communicator, in issue
// order.

#include <memory>
#include <thread>

#include "absl/status/statusor.h"
#include "common/job_defaults.h"
#include "worker/comm/communicator.h"
#include "worker/comm/next_communicator.h"
#include "worker/comm/store.h"

namespace concord::comm {

struct NcclOptions {
  int rank = 0;
  int size = 1;
  int64_t generation = 0;
  int device = 0;  // CUDA device index of this rank
  absl::Duration connect_timeout = kDefaultCollectiveTimeout;
};

// Note [NCCL streams]
// ~~~~~~~~~~~~~~~~~~~
// As c10d's ProcessGroupNCCL does it. With a CUDA LibTorch the communicator's
// stream is one of LibTorch's pool streams; each collective first makes it wait
// (a CUDA event, no host wait) for the work already queued on the tensor's
// current stream, so that gradients written by backward kernels are final
// before NCCL reads them, and tells the caching allocator that the tensor's
// memory is in use on the NCCL stream (recordStream), so that freeing it early
// cannot hand it to another tensor while NCCL still writes. Work::Wait returns
// once the collective's event has completed, so everything issued after it sees
// the result; Work::Synchronize only makes the current stream wait for that
// event, and a watchdog thread enforces the timeout (see Note [Stream-ordered
// waits] in worker/comm/work.h). The few CPU tensors the training code hands
// over (find_unused_parameters' bitmap, the model check, SlowMo's ids) are
// staged: copied to the device, reduced there and copied back when the work
// completes, the host synchronisations PyTorch has at the same places. With
// LibTorch's CPU build (compiled, never chosen: no CUDA tensors exist there)
// the caller orders producers itself and CPU tensors are refused.

class NcclCommunicator final : public DerivableCommunicator {
 public:
  // Errors: INVALID_ARGUMENT (rank/size/device), UNAVAILABLE (NCCL or CUDA
  // failure, with ncclGetLastError's text), DEADLINE_EXCEEDED.
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Create(
      const NcclOptions& options, Store* store);
  ~NcclCommunicator() override;

  int rank() const override;
  int size() const override;
  int64_t generation() const override;

  // Supported dtypes: float32, float64, float16, bfloat16, int32, int64,
  // uint8. Tensors must live on this communicator's device.
  std::shared_ptr<Work> AllreduceSum(at::Tensor tensor,
                                     const CollectiveOptions& options) override;
  std::shared_ptr<Work> Broadcast(at::Tensor tensor, int root,
                                  const CollectiveOptions& options) override;
  std::shared_ptr<Work> ReduceSum(at::Tensor tensor, int root,
                                  const CollectiveOptions& options) override;
  // Any dtype (bytes are moved): ncclSend/ncclRecv in one NCCL group.
  std::shared_ptr<Work> Exchange(at::Tensor send, std::vector<int> to,
                                 std::vector<at::Tensor> recv,
                                 std::vector<int> from,
                                 const CollectiveOptions& options) override;
  // Any dtype (bytes are moved).
  std::shared_ptr<Work> Allgather(at::Tensor output, at::Tensor input,
                                  const CollectiveOptions& options) override;

  // Aborts the NCCL communicator: every collective in flight fails. Used when
  // the generation ends. Thread-safe, idempotent.
  void Abort() override;

  // See Note [Re-forming NCCL] in worker/comm/reform_plan.h: the next
  // generation's communicator derived from this one. Every member of this
  // communicator that stays calls the same derivation; this one is spent
  // afterwards (its collectives fail with ABORTED). Non-blocking with
  // `timeout` as the deadline; on failure this communicator is aborted.
  // Errors: FAILED_PRECONDITION (aborted already; Shrink without NCCL >=
  // 2.27), INVALID_ARGUMENT (bad ranks), UNAVAILABLE, DEADLINE_EXCEEDED.
  //
  // ncclCommShrink without the `excluded` ranks (ascending); abort mode
  // (NCCL_SHRINK_ABORT) ends the operations in flight first.
  absl::StatusOr<std::unique_ptr<Communicator>> Shrink(
      const std::vector<int>& excluded, bool abort_in_flight,
      int64_t generation, absl::Duration timeout) override;
  // ncclCommSplit: the ranks calling with the same `color` >= 0 form a
  // communicator, ordered by `key`; a rank that leaves calls with color -1
  // (NCCL_SPLIT_NOCOLOR) and gets OK with null.
  absl::StatusOr<std::unique_ptr<Communicator>> Split(
      int color, int key, int64_t generation, absl::Duration timeout) override;
  bool usable() const override;
  bool failed() const override;

  struct State;

 private:
  explicit NcclCommunicator(std::shared_ptr<State> state);
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Connected(
      std::shared_ptr<State> state, absl::Duration timeout);
  std::shared_ptr<State> state_;
  std::thread watchdog_;  // See Note [Stream-ordered waits]
};

}  // namespace concord::comm
