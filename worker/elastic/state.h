#pragma once
// Elastic training for a LibTorch loop: what Horovod's TorchState and
// hvd.elastic.run are to PyTorch, and PyTorch's DDP join for uneven inputs,
// on top of Concord's generations (Note [Re-forming] in worker/session.h).
//
// Usage:
//   auto session = *concord::worker::Session::Start(options);
//   auto ddp = *concord::ddp::Engine::Create(
//       net, session->shared_communicator(), session->authoritative_rank());
//   torch::optim::SGD opt(ddp->parameters(), 0.1);
//   concord::elastic::State state(session.get(), ddp.get(), &opt);
//   state.OnReset([&](const concord::elastic::ResetInfo& r) { ...lr... });
//   CONCORD_RETURN_IF_ERROR(state.Sync());   // every rank, once
//   absl::Status done = concord::elastic::Run(state, [&](auto& st) {
//     for (; st.epoch < epochs; ++st.epoch, st.position = 0) {
//       while (has more batches) {
//         auto go = st.BeginStep(/*has_data=*/true);     // may re-form
//         if (!go.ok()) return go.status();
//         forward; backward; opt.step(); opt.zero_grad();
//         ++st.step; st.position += ...; st.Commit();
//       }
//     }
//     return absl::OkStatus();
//   });
//
// Note [Elastic step]: a step is transactional. Parameters and optimizer
// state change only in `optimizer.step()`, which runs after every collective
// of the step succeeded (the State puts its DDP in blocking wait: the host
// waits for the gradients' allreduce, which on NCCL also tells whether any
// earlier collective of the step failed, since a failure poisons the
// communicator: Note [Stream-ordered waits]); so when a collective fails
// they are still those of the last committed step. What can change half-way is
// cheap to snapshot and is: buffers (BatchNorm statistics move in forward, a
// buffer broadcast may be cut off), the counters and the user's values.
// Commit() takes that snapshot; after a failure Run restores it, re-forms (the
// survivors join the next generation with their committed step; the coordinator
// makes the one with the highest step authoritative) and every rank — survivors
// and newcomers alike — takes the authoritative rank's model, optimizer state,
// counters and values over the communicator, then runs `train` again from
// the committed position. No step is applied twice or half.
//
// Note [Step agreement]: BeginStep is one small allreduce per step: how many
// ranks have data for the step, and whether any saw workers waiting to be
// admitted. With every rank's data and nobody waiting the step just runs.
// Ranks without data leave the job (LEAVE_REASON_END_OF_DATA) and the others
// re-form and go on: PyTorch's join, without the finished ranks shadowing
// every collective with zeros until the last one is done. As in PyTorch the
// gradient sum is then divided by the initial world size (the ranks left
// plus those that finished; divide_by_initial_world_size) or by the ranks
// left; throw_on_early_termination fails every rank instead.

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/ddp/engine.h"
#include "worker/elastic/retryable.h"
#include "worker/session.h"

namespace concord::elastic {

struct ElasticOptions {
  // Note [Step agreement].
  bool divide_by_initial_world_size = true;
  bool throw_on_early_termination = false;
};

// State kept outside the model and the optimizer that must follow the
// authoritative rank after every re-form (SlowMo's slow momentum, old
// parameters and push-sum weight). Its owner keeps it transactional: it
// changes only when a step's collectives all succeeded, so a failed step
// leaves the last committed value in place and there is nothing to restore.
class Participant {
 public:
  virtual ~Participant() = default;
  // Called by State::Sync after the model, the optimizer state and the
  // counters arrived: take the authoritative rank's state over `comm` (the
  // new generation's), re-distribute what is sharded, and finish what the
  // committed step `step` still owes. Errors: retryable ones of the
  // collectives; FAILED_PRECONDITION for a state that cannot be continued.
  virtual absl::Status SyncState(std::shared_ptr<comm::Communicator> comm,
                                 int authoritative_rank, int64_t step,
                                 torch::optim::Optimizer& optimizer) = 0;
};

// What a reset callback learns after a re-form.
struct ResetInfo {
  int64_t generation = 0;
  int rank = 0;
  int world_size = 0;
  int previous_world_size = 0;
  int authoritative_rank = 0;
  int64_t step = 0;  // the committed step training goes on from
  std::string reason;
};

// One re-form, for metrics: wall-clock times (Unix epoch, microseconds).
struct ReformRecord {
  std::string reason;
  int64_t generation = 0;  // the one formed
  int world_size = 0;
  int64_t started_us = 0;     // the failure was caught / agreement reached
  int64_t rendezvous_us = 0;  // the next generation formed and connected
  int64_t synced_us = 0;      // model and state received: training resumes
};

enum class StepDecision {
  kRun,   // take the step
  kLeft,  // this rank had no data: it has left the job; stop training
  kDone,  // no rank has data: training is over
};

class State {
 public:
  // `session`, `ddp` and `optimizer` must outlive the state.
  State(worker::Session* session, ddp::Engine* ddp,
        torch::optim::Optimizer* optimizer, ElasticOptions options = {});

  // Committed with Commit(), restored after a failure, sent to newcomers.
  int64_t step = 0;      // optimizer steps the job has taken
  int64_t epoch = 0;     // the loop's epoch
  int64_t position = 0;  // where the sampler is in the epoch (loop's unit)
  std::map<std::string, torch::Tensor> values;  // the user's own

  // Takes the authoritative rank's state: bucket layout, optimizer state,
  // counters, values, attached participants; then sets the gradient divisor and
  // commits. Every rank of a generation calls it once after creating DDP
  // (survivors of a re-form get it from Run). Errors: those of the broadcasts
  // (retryable, Note [Elastic step]), INTERNAL for a payload that does not
  // load.
  absl::Status Sync();

  // Adds `participant` (it must outlive the state) to every Sync, after the
  // training state. Call before the first Sync.
  void Attach(Participant* participant) {
    participants_.push_back(participant);
  }

  // Note [Elastic step].
  void Commit();
  void Restore();

  // Note [Step agreement]. `admit`: whether workers waiting to join may be
  // admitted before this step (false postpones them; must be the same on
  // every rank). Errors: FAILED_PRECONDITION with
  // throw_on_early_termination; those of the allreduce and of a re-form.
  absl::StatusOr<StepDecision> BeginStep(bool has_data, bool admit = true);

  // Runs after every re-form (Horovod's reset callbacks): rescale the
  // learning rate, rebind SyncBatchNorm to the new communicator, register a
  // communication hook again.
  void OnReset(std::function<void(const ResetInfo&)> callback);

  // Note [Re-forming]: leaves the current generation and joins the next
  // (restoring the last commit first when `restore`), then Sync and the
  // reset callbacks. Collective failures during the hand-over are retried
  // with another re-form. Errors: FAILED_PRECONDITION carrying Session::
  // Reform's error (the job failed, the rendezvous timed out: never retried),
  // and non-retryable ones of Sync.
  absl::Status Reform(const std::string& reason, bool restore);

  // Workers that ran out of data and left (Note [Step agreement]), as the
  // coordinator counts them.
  int finished_ranks() const { return session_->finished_workers(); }
  int64_t reforms() const { return reforms_; }
  const std::vector<ReformRecord>& reform_records() const { return records_; }
  worker::Session& session() { return *session_; }

 private:
  struct Snapshot {
    int64_t step = 0, epoch = 0, position = 0;
    std::map<std::string, torch::Tensor> values;
    std::vector<torch::Tensor> buffers;
  };
  absl::Status SyncPayload();
  void SetDivisor();

  worker::Session* session_;
  ddp::Engine* ddp_;
  torch::optim::Optimizer* optimizer_;
  ElasticOptions options_;
  std::vector<torch::Tensor> buffers_;
  Snapshot committed_;
  int64_t reforms_ = 0;
  // The model may be half-received (a re-form's broadcast failed): this
  // worker must not become authoritative (it joins saying step 0).
  bool tainted_ = false;
  std::vector<std::function<void(const ResetInfo&)>> callbacks_;
  std::vector<Participant*> participants_;
  std::vector<ReformRecord> records_;
};

// Runs `train(state)` until it returns OK (training done) or an error that
// is not Retryable; after a retryable one (a collective failed: a peer died
// or the generation ended), restores the last commit, re-forms and runs
// `train` again from the committed position. concord::Error thrown by
// `train` (DDP's forward and backward throw) counts as returned.
absl::Status Run(State& state,
                 const std::function<absl::Status(State&)>& train);

}  // namespace concord::elastic
