#pragma once
// PowerSGD's state as part of the elastic state (see Note [PowerSGD across
// re-forms] in worker/ddp/powersgd.h): kept across re-forms, put back after
// a failed step, given to newcomers, and in checkpoints.

#include <ATen/core/Tensor.h>

#include <memory>

#include "worker/comm/communicator.h"
#include "worker/ddp/powersgd.h"
#include "worker/elastic/state.h"

namespace concord::elastic {

class PowerSgdParticipant final : public Participant {
 public:
  // `options`: the module's gradients' dtype and device (where a newcomer
  // makes its memories).
  PowerSgdParticipant(std::shared_ptr<ddp::PowerSgdState> state,
                      at::TensorOptions options, comm::CollectiveOptions opts)
      : state_(std::move(state)), options_(options), opts_(opts) {}

  // The authoritative rank's count, generator and Q memories to every rank;
  // each keeps its own error feedback (a newcomer has none).
  absl::Status SyncState(std::shared_ptr<comm::Communicator> comm,
                         int authoritative_rank, int64_t step,
                         torch::optim::Optimizer& optimizer) override;
  // "replicated" (SaveReplicated's archive, as uint8), "iteration" and
  // "error/<bucket>",
  // the sum of every rank's error feedback (three collectives: the buckets'
  // sizes, checked alike on every rank, then one allreduce).
  absl::StatusOr<NamedTensors> CheckpointState(
      const torch::optim::Optimizer& optimizer) override;
  // The loading rank takes the count, generator, memories and the summed
  // error feedback; the others drop their error feedback.
  absl::Status ResumeState(const NamedTensors* saved,
                           torch::optim::Optimizer& optimizer) override;
  void BeginStep(int64_t /*step*/, bool /*late*/) override {
    state_->BeginStep();
  }
  void RestoreStep() override { state_->Restore(); }

 private:
  std::shared_ptr<ddp::PowerSgdState> state_;
  at::TensorOptions options_;
  comm::CollectiveOptions opts_;
  std::shared_ptr<comm::Communicator> comm_;  // the generation's
};

}  // namespace concord::elastic
