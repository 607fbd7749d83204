#pragma once
// Elastic training for a LibTorch loop: what Horovod's TorchState and
// hvd.elastic.run are to PyTorch, and PyTorch's DDP join for uneven inputs,
// on top of Concord's generations (see Note [Re-forming in the worker] in
// worker/session.h).
//
// Usage:
//   auto session = *concord::worker::Session::Start(options);
//   auto ddp = *concord::ddp::Engine::Create(
//       net, session->shared_communicator(), session->authoritative_rank());
//   torch::optim::SGD opt(ddp->parameters(), 0.1);
//   concord::elastic::State state(session.get());
//   state.AddModel("model", ddp.get());          // any number of each,
//   state.AddOptimizer("optimizer", &opt);       //   See Note [Several models]
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

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "concord/elastic_events.h"
#include "concord/elastic_options.h"
#include "worker/checkpoint/checkpointer.h"
#include "worker/checkpoint/optimizer_snapshot.h"
#include "worker/ddp/engine.h"
#include "worker/elastic/retryable.h"
#include "worker/session.h"

namespace concord::elastic {

// Note [Participants in checkpoints]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// An attached participant's state is part of every checkpoint (see Note
// [Checkpoints] in worker/checkpoint/checkpointer.h), in state.pt under
// "<name>/<key>" (SlowMo: "slowmo/<module>/updates", "push_sum_weight",
// "push_sum_numerator", "fp32_masters", "slow_momentum", "old_params").
// Sharded parts are gathered whole (one allreduce over the generation), so a
// checkpoint does not depend on the world size it was taken at: at a resume
// the rank that loads it holds the whole state as if it owned every shard,
// the others hold nothing, and SyncState re-shards it over the new world as
// after a re-form.
// A participant changes the state after the commit (SlowMo performs the
// committed step's update then), and with LocalSGD or SGP the ranks'
// parameters differ between averages. A due checkpoint of a job with
// participants is therefore taken after that update: at the start of the
// next step (or by SaveFinal), and only in the same generation (every rank
// must run the gather; a re-form in between skips it). Its parameters are
// the writer's, as a re-form takes the authoritative rank's: a checkpoint
// taken where every rank's are equal (LocalSGD with a checkpoint interval
// that is a multiple of the averaging period) resumes exactly; SGP's gossip
// never makes them equal, and its resume is a re-form's. An optimizer with
// per-parameter state (SGD's momentum, Adam's moments) differs too: under
// SlowMo the ranks do not average gradients, so each rank's is its own, and
// the participant keeps every rank's in the checkpoint for each to take
// back (see Note [Each rank's optimizer state] in worker/slowmo/slowmo.h).
// Rank 0 says once, at the first checkpoint whose state differs between
// the ranks in a way it does not keep (Participant::CheckpointDivergence),
// in one warning line.

// Note [Shards copied where they are]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every node's snapshot holds the whole job's state (any node's may be the
// one a re-form resumes from), a sharded optimizer's too, and no process
// that does not write a snapshot ever holds that state whole. A rank's
// shard reaches each node's snapshot one of two ways (ShardPlacement):
//  - in place: on its own node, when the node's region is shared (concord-
//    run's, CONCORD_CHECKPOINT_MEMORY: every worker of the node maps it),
//    the rank copies its shard into the snapshot itself. Its node's writer
//    gets only the shard's entries' shapes and dtypes and lays them out as
//    holes (see Note [Holes] in worker/checkpoint/memory.h);
//  - as bytes (comm::GatherStrings) to every other node's writer, and to its
//    own where the region is a worker's own (no node agent).
// A checkpoint, on every rank of the generation: CheckpointOptimizer (the
// bytes to other nodes, the shapes to the rank's own writer), the writer's
// Save (laid out, its own tensors copied or, overlapped, being copied), an
// allgather of what each writer did ("laid <pid> <step>", "skipped" or
// "failed"), each in-place rank's FillShard through Checkpointer::LaidOut,
// an allgather of how that went, and the writer's Filled: the snapshot is
// published once every rank of its node filled its holes, dropped (one
// warning) otherwise. When the memory stage fails on the disk tier's writer
// (see Note [Writes from the worker] in worker/checkpoint/checkpointer.h),
// its node's shards are gathered to it as bytes after all and it writes
// the checkpoint to disk itself. The writer's process thus holds its own
// shard, the other nodes' and, at most, the region's mapping; a node's
// other ranks copy theirs once, with no serialization.
struct ShardPlacement {
  // Each node's snapshot writer (its lowest rank), in rank order.
  std::vector<int> writers;
  // Rank r's node's writer.
  std::vector<int> writer_of;
  // Whether rank r copies its shard into its node's snapshot itself.
  std::vector<bool> in_place;
  // Whether `rank`'s shard reaches `writer` as bytes.
  bool AsBytes(int writer, int rank) const {
    return writer != rank && !(in_place[static_cast<size_t>(rank)] &&
                               writer_of[static_cast<size_t>(rank)] == writer);
  }
  // Holes in a file rather than in a region (see Note [Shards written where
  // they are] in worker/checkpoint/disk.h): each in-place rank also sends
  // the CRC-32 of every entry it will write.
  bool crcs = false;
  // Everything to `root` as bytes (a plain loop's checkpoint).
  static ShardPlacement To(int root, int world) {
    return {{root},
            std::vector<int>(static_cast<size_t>(world), root),
            std::vector<bool>(static_cast<size_t>(world), false)};
  }
  // A plain loop's checkpoint written where the shards are: `root` writes
  // the file, the others their shards into it.
  static ShardPlacement InFile(int root, int world) {
    ShardPlacement p = To(root, world);
    p.in_place.assign(static_cast<size_t>(world), true);
    p.crcs = true;
    return p;
  }
  // Each rank's node and region path (empty: a worker's own memory) in
  // rank order: each node's lowest rank writes its snapshot, and a rank
  // whose region is its writer's copies its shard in place, unless
  // `as_bytes` (CONCORD_TEST_SHARDS_AS_BYTES).
  static ShardPlacement Over(const std::vector<std::string>& nodes,
                             const std::vector<std::string>& regions,
                             bool as_bytes = false);
  bool AnyInPlace() const {
    for (size_t r = 0; r < in_place.size(); ++r) {
      if (in_place[r] && writer_of[r] != static_cast<int>(r)) return true;
    }
    return false;
  }
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
  // See Note [Participants in checkpoints]: the state a checkpoint of the
  // committed step keeps, whole (sharded parts gathered, and each rank's
  // part of `optimizer`'s state where the ranks' differ), by name. Every
  // rank of the generation calls it at the same point (it may run
  // collectives); the checkpoint's writer keeps the result. Errors: those
  // of the collectives (the checkpoint is not taken).
  virtual absl::StatusOr<NamedTensors> CheckpointState(
      const torch::optim::Optimizer& optimizer) = 0;
  // Why the ranks' parameters or `optimizer`'s state differ at this point
  // (the participant decides what is averaged when) and the last
  // CheckpointState did not keep each rank's: a checkpoint holds one
  // rank's, so a resume from it goes on as after a re-form, not as the
  // uninterrupted run does. Empty when every rank's is the same or kept.
  // Local: no collective.
  virtual std::string CheckpointDivergence(
      const torch::optim::Optimizer& /*optimizer*/) const {
    return {};
  }
  // A generation resumes from a checkpoint: the rank that loaded it gets
  // the participant's part of it in `saved` (empty when the checkpoint has
  // none), every other rank nullptr (what it holds does not count: SyncState
  // then takes the loading rank's). FAILED_PRECONDITION naming what does not
  // fit `optimizer`'s parameters; nothing changed then.
  virtual absl::Status ResumeState(const NamedTensors* saved,
                                   torch::optim::Optimizer& optimizer) = 0;
  // Ranks whose data ran out leave cleanly (see Note [Step agreement]): when
  // HandsOver, every rank of the generation calls HandOver with who leaves
  // (`leaving[rank]`) before they go, at committed step `step`, so that
  // what only a leaving rank holds reaches one that stays. Errors: those of
  // the collectives (retryable).
  virtual bool HandsOver() const { return false; }
  virtual absl::Status HandOver(comm::Communicator& /*comm*/,
                                const std::vector<bool>& /*leaving*/,
                                int64_t /*step*/) {
    return absl::OkStatus();
  }
  // A participant that keeps an optimizer's state in its stead, sharded
  // (ZeroRedundancyOptimizer: see Note [Elastic ZeRO] in api/zero.cc), says
  // the optimizer's name: checkpoints then hold that optimizer's whole
  // state as any optimizer's (PyTorch's state_dict, `<name>.pt`), put
  // together by CheckpointOptimizer on the ranks in `placement.writers`
  // only (each node's snapshot writer, which keeps it; every rank calls it
  // where CheckpointState runs, and the others' result is not kept). See
  // Note [Shards copied where they are]: a shard of a rank
  // `placement.in_place` is a hole in its writer's result, and that rank
  // copies it in with FillShard. The rank resuming one gets it in
  // ResumeOptimizer (after ResumeState; FAILED_PRECONDITION naming what
  // does not fit, nothing changed then). Empty: none.
  virtual std::string OptimizerName() const { return {}; }
  virtual absl::StatusOr<checkpoint::OptimizerContent> CheckpointOptimizer(
      const ShardPlacement& /*placement*/) {
    return absl::UnimplementedError("no optimizer");
  }
  // This rank's shard of the last CheckpointOptimizer, copied into `laid`
  // (its node's snapshot as its writer laid it out, the shard's tensors
  // views of the region). FAILED_PRECONDITION naming an entry `laid` lacks
  // or whose shape or dtype differs.
  virtual absl::Status FillShard(const checkpoint::Content& /*laid*/) {
    return absl::OkStatus();
  }
  virtual absl::Status ResumeOptimizer(
      const checkpoint::OptimizerContent& /*saved*/) {
    return absl::OkStatus();
  }
  // A step begins after committed step `step` (State::BeginStep decided to
  // run it); it failed (State::Restore): for state the step's collectives
  // change before the commit, which must go back to the step's start.
  // `late`: the optimizer it was attached with has been seen to change only
  // after its step's last collective, as an optimizer the State then no
  // longer copies (see Note [Early optimizer steps]); what the participant
  // changes after the step's collectives, with no collective of its own
  // after that, need not be kept.
  virtual void BeginStep(int64_t /*step*/, bool /*late*/) {}
  virtual void RestoreStep() {}
};

// What a reset callback learns after a re-form, and each re-form's record:
// the public API's structs (concord/elastic_events.h).
using ResetInfo = concord::ResetInfo;
using ReformRecord = concord::ReformRecord;

enum class StepDecision {
  kRun,   // take the step
  kLeft,  // this rank had no data: it has left the job; stop training
  kDone,  // no rank has data: training is over
};

class State {
 public:
  // `session` must outlive the state. Add the modules and optimizers, then
  // Sync.
  explicit State(worker::Session* session,
                 concord::ElasticStateOptions options = {});
  // One module and its optimizer ("model", "optimizer").
  State(worker::Session* session, ddp::Engine* ddp,
        torch::optim::Optimizer* optimizer,
        concord::ElasticStateOptions options = {});
  // Ends an overlapped snapshot's copy; the gradient observers it left on
  // the modules do nothing from then on.
  ~State();
  State(const State&) = delete;
  State& operator=(const State&) = delete;

  // Note [Several models]
  // ~~~~~~~~~~~~~~~~~~~~~
  // A State holds any number of DDP modules and optimizers (a GAN's generator
  // and discriminator, a student and its teacher), each by name. Every rank
  // adds the same ones in the same order: a re-form rebinds the modules in
  // that order (each a model check and a broadcast from the authoritative
  // rank, the collectives a newcomer's Engine::Create runs in its order), Sync
  // takes each module's bucket layout, every optimizer's state by name, the
  // counters and the values. Commit and Restore cover every module's
  // buffers; a step's agreement runs once, before its first forward of any
  // module.

  // See Note [Several models]: before the first Sync, in the same order on
  // every rank; each must outlive the state. AddModel puts the module in
  // blocking wait and has it call ObserveCollective.
  void AddModel(const std::string& name, ddp::Engine* ddp);
  void AddOptimizer(const std::string& name,
                    torch::optim::Optimizer* optimizer);
  // `participant` (it must outlive the state) takes part in every Sync,
  // after the training state, with `optimizer` (the one stepping the
  // parameters it averages), and in every checkpoint under `name`, which
  // must be its own (see Note [Participants in checkpoints]). Before the
  // first Sync.
  void Attach(Participant* participant, torch::optim::Optimizer* optimizer,
              const std::string& name);
  // See Note [Each rank's randomness] in worker/checkpoint/content.h: one of
  // the program's own generators, committed and checkpointed per rank with
  // the defaults. Before the first Sync. INVALID_ARGUMENT as
  // checkpoint::RandomState::Add.
  absl::Status AddGenerator(const std::string& name, at::Generator generator);

  // Committed with Commit(), restored after a failure, sent to newcomers.
  int64_t step = 0;      // optimizer steps the job has taken
  int64_t epoch = 0;     // the loop's epoch
  int64_t position = 0;  // where the sampler is in the epoch (loop's unit)
  std::map<std::string, torch::Tensor> values;  // the user's own

  // Takes the authoritative rank's state: every module's bucket layout,
  // every optimizer's state, the counters, values, attached participants;
  // then sets the gradient divisor and commits. Every rank of a generation
  // calls it once after creating its modules (survivors of a re-form get it
  // from Run). Errors: those of the broadcasts (retryable, see Note [Elastic
  // step]), INTERNAL for a payload that does not load.
  absl::Status Sync();

  // Note [Elastic step]
  // ~~~~~~~~~~~~~~~~~~~
  // A step is transactional. Parameters and optimizer state change only in an
  // optimizer's step(). Where that runs after every collective of the step
  // succeeded (the State puts its DDP modules in blocking wait: the host waits
  // for the gradients' allreduce, which on NCCL also tells whether any earlier
  // collective of the step failed, since a failure poisons the communicator:
  // see Note [Stream-ordered waits]), a failed collective finds them as the
  // last commit left them. An optimizer that steps before a later collective of
  // its step (a GAN's discriminator) is copied at the step's start and put back
  // after a failure (see Note [Early optimizer steps]). What can change
  // half-way besides is cheap to snapshot and is: buffers (BatchNorm statistics
  // move in forward, a buffer broadcast may be cut off), the counters and the
  // user's values. Commit() takes that snapshot; after a failure Run restores
  // it, re-forms (the survivors join the next generation with their committed
  // step; the coordinator makes the one with the highest step authoritative)
  // and every rank — survivors and newcomers alike — takes the authoritative
  // rank's model, optimizer state, counters and values over the communicator,
  // then runs `train` again from the committed position. No step is applied
  // twice or half.

  // See Note [Elastic step].
  void Commit();
  // Back to the last commit: buffers, counters, values, and the optimizers
  // copied at this step's start (see Note [Early optimizer steps]).
  void Restore();

  // Note [Step agreement]
  // ~~~~~~~~~~~~~~~~~~~~~
  // BeginStep is one small allreduce per step: how many ranks have data for the
  // step, and whether any saw workers waiting to be admitted. With every rank's
  // data and nobody waiting the step just runs. Ranks without data leave the
  // job (LEAVE_REASON_END_OF_DATA) and the others re-form and go on: PyTorch's
  // join, without the finished ranks shadowing every collective with zeros
  // until the last one is done. As in PyTorch the gradient sum is then divided
  // by the initial world size (the ranks left plus those that finished;
  // divide_by_initial_world_size) or by the ranks left;
  // throw_on_early_termination fails every rank instead.

  // See Note [Step agreement]. `admit`: whether workers waiting to join may be
  // admitted before this step (false postpones them; must be the same on
  // every rank). On kRun the step has begun (see Note [Early optimizer steps]).
  // Errors: FAILED_PRECONDITION with throw_on_early_termination; those of
  // the allreduce and of a re-form.
  absl::StatusOr<StepDecision> BeginStep(bool has_data, bool admit = true);

  // Note [Early optimizer steps]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // A GAN's step runs the discriminator's optimizer before the generator's
  // forward and backward, whose collectives may still fail: its parameters
  // and Adam moments would then be a step ahead of the commit, and the step
  // taken again would apply that update twice. The State watches each
  // optimizer's parameters (their version counters, which every in-place
  // update moves) at the start of every collective of a step
  // (ObserveCollective, which the modules call before their forward's and
  // their backward's first collective): an optimizer whose parameters
  // changed before a later collective of the step steps early. At the start
  // of a step (BeginStep, after the agreement) the State copies every
  // optimizer that steps early or that it has not yet seen step (an
  // OptimizerSnapshot: parameters, per-parameter state, group options), and
  // Restore puts those copies back. An optimizer seen stepping only after
  // the step's last collective (the usual single-model loop) is copied no
  // more: after the first step, a plain loop pays nothing. One that first
  // steps early in a later step (its program changed pattern) is copied
  // from the next step on; if that very step fails, its update is taken
  // again, and the State says so in one warning line naming it. The
  // optimizer a participant is attached with is watched the same way, and
  // the participant told at each step's start whether it is seen late
  // (Participant::BeginStep): a sharded optimizer whose every member steps
  // every shard then keeps no copy either (see Note [Elastic ZeRO] in
  // api/zero.cc).

  // See Note [Early optimizer steps]: a collective of the current step is about
  // to start. Cheap (a version counter per parameter); any thread that
  // runs the step's collectives, one at a time.
  void ObserveCollective();

  // Runs after every re-form (Horovod's reset callbacks): rescale the
  // learning rate, rebind SyncBatchNorm to the new communicator, register a
  // communication hook again.
  void OnReset(std::function<void(const ResetInfo&)> callback);

  // See Note [Re-forming in the worker]: leaves the current generation and
  // joins the next (restoring the last commit first when `restore`), rebinds
  // every module, then Sync and the reset callbacks. Collective failures during
  // the hand-over are retried with another re-form. Errors: FAILED_PRECONDITION
  // carrying Session::Reform's error (the job failed, the rendezvous timed
  // out: never retried), and non-retryable ones of Sync.
  absl::Status Reform(const std::string& reason, bool restore);

  // See Note [Checkpoints]: training is over: the last commit becomes the
  // newest checkpoint, if it is not one yet (waiting for the write of the
  // one before).
  void SaveFinal();
  // See Note [Checkpoints]: the checkpoints of the session's
  // WorkerOptions::checkpoint, when it has a dir (null otherwise; made by the
  // first Sync).
  const checkpoint::Checkpointer* checkpointer() const {
    return checkpointer_.get();
  }

  // See Note [Checkpoints]: the checkpoint the last Sync resumed from ("memory"
  // or "disk", its step), taken once; nullopt when it resumed from none.
  struct Resumed {
    std::string source;
    int64_t step = 0;
  };
  std::optional<Resumed> TakeResumed() {
    std::optional<Resumed> r = std::move(resumed_);
    resumed_.reset();
    return r;
  }

  int64_t reforms() const { return reforms_; }
  const std::vector<ReformRecord>& reform_records() const { return records_; }
  worker::Session& session() { return *session_; }
  const concord::ElasticStateOptions& options() const { return options_; }
  // Whether the last re-form changed the members (lost or admitted a
  // worker); true until there was one (see Note [Re-form loops]).
  bool members_changed() const { return members_changed_; }

 private:
  struct Model {
    std::string name;
    ddp::Engine* engine;
  };
  // See Note [Early optimizer steps]: when an optimizer (or an attached
  // participant's) changes within a step.
  enum class Timing { kUnseen, kLate, kEarly };
  struct Watch {
    std::string signature;  // OptimizerSnapshot::Signature at the step start
    Timing timing = Timing::kUnseen;
    bool early_this_step = false;
    void Start(const torch::optim::Optimizer& optimizer);
    bool Changed(const torch::optim::Optimizer& optimizer) const;
    // A collective of the step starts; true when this makes it early.
    bool Observe(const torch::optim::Optimizer& optimizer);
    // The step commits.
    void Commit(const torch::optim::Optimizer& optimizer);
  };
  struct Optimizer {
    std::string name;
    torch::optim::Optimizer* optimizer;
    Watch watch;
    bool copied = false;  // `copy` holds this step's start
    checkpoint::OptimizerSnapshot copy;
  };
  struct Snapshot {
    int64_t step = 0, epoch = 0, position = 0;
    std::map<std::string, torch::Tensor> values;
    std::vector<torch::Tensor> buffers;
    torch::Tensor random;  // see Note [Each rank's randomness]
  };
  absl::Status SyncPayload(int root);
  // Commit; a checkpoint when `may_checkpoint` and the step is due.
  void CommitState(bool may_checkpoint);
  // Saves the committed state, with the participants' states (see Note
  // [Participants in checkpoints]: a collective); a history record when it
  // was taken.
  void TakeCheckpoint(bool wait);
  // See Note [Shards copied where they are]: the rest of a checkpoint whose
  // shards some ranks copy in place, on every rank: `content` is what this
  // rank saved (`saved`: it is a writer and Save ran).
  void PlaceShards(checkpoint::Content& content, bool saved);
  // See Note [Each rank's randomness]: every rank's committed generators
  // ("rng/ranks", "rng/sizes"; none when the ranks' differ). A collective.
  absl::StatusOr<NamedTensors> GatherRandomness();
  // The same entries' shapes, zeros (no collective), to size the snapshot
  // region ahead.
  NamedTensors RandomnessPlaceholder() const;
  // At a resume: the checkpoint's rows, from the rank that loaded it
  // (`winner`) to every rank, each taking its own.
  absl::Status ResumeRandomness(int winner, comm::Communicator& comm,
                                const comm::CollectiveOptions& opts);
  // See Note [Checkpoints]: the committed state as a checkpoint's content, and
  // putting one in place (FAILED_PRECONDITION naming what does not fit).
  // Waits for an overlapped snapshot's copy (see Note [Overlapped
  // snapshots] in worker/checkpoint/memory.h): before anything writes a
  // parameter or the optimizer's state.
  void FenceCheckpoint();
  // `sharded`: the whole state of optimizers participants keep sharded.
  checkpoint::Content Capture(
      NamedTensors participants,
      std::vector<checkpoint::OptimizerContent> sharded = {}) const;
  absl::Status Apply(const checkpoint::Content& content);
  // See Note [Checkpoints]: at a Sync, who writes the node's snapshot, and
  // whether the generation resumes from a checkpoint: the rank whose state
  // the others take (`*root`, unchanged when none).
  absl::Status SyncCheckpoints(int* root);
  // Its parts: the node's checkpointer, made at the first Sync; which rank's
  // checkpoint the generation resumes from (winner -1: none, or a member
  // holds a committed step); that rank loading it and the others taking
  // its state; the log line saying so.
  struct ResumeChoice {
    int winner = -1;
    int64_t step = 0;
    bool memory = false;                        // a node's memory snapshot
    std::optional<checkpoint::Candidate> mine;  // this rank's offer
  };
  absl::Status MakeCheckpointer();
  absl::StatusOr<ResumeChoice> ChooseResume(
      comm::Communicator& comm, const std::vector<std::string>& nodes,
      const comm::CollectiveOptions& opts);
  absl::Status ResumeFrom(const ResumeChoice& choice, comm::Communicator& comm,
                          const comm::CollectiveOptions& opts);
  void LogResume(const ResumeChoice& choice,
                 const std::vector<std::string>& nodes, int me) const;
  void SetDivisor();
  // See Participant::HandOver: ranks leave at the end of their data (a
  // collective of the generation when a participant hands over).
  absl::Status HandOver(comm::Communicator& comm, bool has_data);
  // See Note [Early optimizer steps]: the step begins (versions, copies).
  void StartStep();

  worker::Session* session_;
  concord::ElasticStateOptions options_;
  std::vector<Model> models_;
  std::vector<Optimizer> optimizers_;
  struct Attached {
    Participant* participant;
    torch::optim::Optimizer* optimizer;  // may be null
    std::string name;
    Watch watch;
  };
  std::vector<Attached> participants_;
  std::vector<torch::Tensor> buffers_;  // every module's
  // See Note [Each rank's randomness]: this rank's generators; a resumed
  // checkpoint's rows (Apply on the rank that loaded it, until
  // ResumeRandomness sent them); whether rank 0 said the ranks' differ.
  checkpoint::RandomState random_;
  torch::Tensor resumed_rows_;
  bool random_differs_said_ = false;
  // This rank left the job (its data ran out): no checkpoint of its own.
  bool left_ = false;
  Snapshot committed_;
  bool in_step_ = false;  // between StartStep and Commit/Restore
  int64_t reforms_ = 0;
  bool members_changed_ = true;
  // The model may be half-received (a re-form's broadcast failed): this
  // worker must not become authoritative (it joins saying step 0).
  bool tainted_ = false;
  std::vector<std::function<void(const ResetInfo&)>> callbacks_;
  std::vector<ReformRecord> records_;
  // What the modules' gradient observers reach this state through (they
  // may outlive it): reset first by the destructor.
  std::shared_ptr<State*> self_ = std::make_shared<State*>(this);
  // Whether this generation's commits grew the snapshot region ahead of
  // its first checkpoint (Checkpointer::Prepare).
  bool region_prepared_ = false;
  std::unique_ptr<checkpoint::Checkpointer> checkpointer_;
  // This generation's ranks that write their node's snapshot (each node's
  // lowest) and how a sharded optimizer's shards reach them (see Note
  // [Shards copied where they are]).
  ShardPlacement placement_;
  bool in_place_said_ = false;
  int64_t checkpointed_step_ = -1;  // the last commit's step
  // See Note [Participants in checkpoints]: the divergence was said.
  bool divergence_said_ = false;
  // See Note [Participants in checkpoints]: the generation whose next BeginStep
  // takes the last commit's due checkpoint.
  std::optional<int64_t> deferred_;
  std::optional<Resumed> resumed_;
};

// Note [Re-form loops]
// ~~~~~~~~~~~~~~~~~~~~
// A failure that re-forming cannot cure (a program bug that throws a
// retryable error, a peer that fails the same collective every time) would
// re-form forever. Run counts the failures of one step that follow a
// re-form which changed nobody (same members, no step committed since):
// ElasticStateOptions::max_repeated_failures of them end the loop with
// FAILED_PRECONDITION naming the step and the error. Between them it waits
// 0.2 s, doubling, at most 5 s. A re-form that lost or admitted a worker,
// or a commit, starts the count again: workers dying one after the other
// still re-form as often as they die.

// Runs `train(state)` until it returns OK (training done) or an error that
// is not Retryable; after a retryable one (a collective failed: a peer died
// or the generation ended), restores the last commit, re-forms and runs
// `train` again from the committed position. concord::Error thrown by
// `train` (DDP's forward and backward throw) counts as returned. A step
// that keeps failing with nothing changed ends it (see Note [Re-form loops]).
absl::Status Run(State& state,
                 const std::function<absl::Status(State&)>& train);

}  // namespace concord::elastic
