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
// order. LibTorch's CPU build has no view of CUDA streams, so the caller
// makes sure a tensor's producers have finished (e.g. a device synchronize)
// before handing it over.

#include <memory>

#include "absl/status/statusor.h"
#include "worker/comm/communicator.h"
#include "worker/comm/store.h"

namespace concord::comm {

struct NcclOptions {
  int rank = 0;
  int size = 1;
  int64_t generation = 0;
  int device = 0;  // CUDA device index of this rank
  absl::Duration connect_timeout = absl::Minutes(5);
};

class NcclCommunicator final : public Communicator {
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

  struct State;

 private:
  explicit NcclCommunicator(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;
};

}  // namespace concord::comm
