#pragma once
// A worker's side of durable checkpoints.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/checkpoint/config.h"
#include "worker/checkpoint/content.h"
#include "worker/checkpoint/memory.h"
#include "worker/checkpoint/persister.h"

namespace concord::checkpoint {

// A state this worker could resume from.
struct Candidate {
  int64_t step = 0;
  std::string source;  // for the log: "memory (...)" or "disk (path)"
  Content content;
};

// Note [Checkpoints]
// ~~~~~~~~~~~~~~~~~~
// Re-forming keeps a job's state in its surviving workers; a job that loses
// every worker (a node-wide failure, a preemption, a bug every rank hits)
// needs it outside them. As DLRover's flash checkpoint and PyTorch's DCP
// async_save do, a checkpoint has two tiers:
//  - memory: at the commit of every step that is a multiple of
//    Config::every, one worker per node copies the committed state (see Note
//    [Checkpoint format]) into the node's snapshot region (see Note [Snapshot
//    region]), which the node agent (concord-run) owns: it outlives the
//    workers. The training step waits for that copy and for nothing else.
//    The worker with the lowest rank of each node writes; the state of a
//    data-parallel job is the same on every rank, so one copy per node is
//    enough for any restarted worker of that node (a sharded optimizer's
//    shards are not: the node's other workers copy theirs in, see Note
//    [Shards copied where they are] in worker/elastic/state.h).
//  - disk: the agent's persister thread writes rank 0's snapshot to
//    Config::dir (see Note [Checkpoint directories]) in the background; a
//    checkpoint that falls due while the previous one is still being written
//    is skipped (counted, logged at debug), never queued. A worker started
//    without an agent keeps its region in its own memory and runs the
//    persister itself.
// Resuming: when a generation forms whose members hold no committed step
// (every worker is new: all died, or the job was started again with the
// same job id), its Sync agrees on where the state comes from (three small
// allreduces): every rank offers its node's memory snapshot, rank 0 also
// the newest checkpoint on disk that passes its checks; the newest step
// wins (memory over disk at the same step, then the lowest rank), its
// rank loads it and broadcasts it as the authoritative rank does after a
// re-form, and one line in every worker's log names the step and the
// source. A generation with a member that holds a commit goes on from that
// member as always. Config::resume = false (--no-resume) starts this run
// afresh: only the run's own checkpoints are offered (see Note [Runs] in
// coordinator/core/core.h), so a total loss later in the run resumes from
// the run's newest, and an earlier run's never wins.
//
// Note [Writes from the worker]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Durability is never lost without a word. When the memory stage fails on
// the worker that the disk tier writes from (rank 0: the node's region
// cannot grow, Docker's 64 MB /dev/shm, or the node's previous write still
// runs when the job's last checkpoint waits 5 minutes for it), that worker
// writes the checkpoint to Config::dir itself, during its step, as the
// persister would (the same files, checks and pruning), and says so once
// (one warning line until the memory stage works again). An overlapped
// snapshot whose copy fails is written so at its Fence while none of its
// live tensors moved (else it is lost, said and reported), and the next
// ones are copied during their steps. Each such write, or its failure with both
// reasons, goes to the coordinator with the worker's own credential
// (WorkerService.ReportCheckpoint: the job's status, events, /metrics and
// concordctl show it as they show a node agent's). A worker without a node
// agent reports its own persister's writes the same way, and writes the
// job's last checkpoint before it leaves (Flush).

class Checkpointer {
 public:
  // Opens the node's region (Config::memory) or makes one of its own and
  // starts its persister. UNAVAILABLE when the region cannot be opened.
  static absl::StatusOr<std::unique_ptr<Checkpointer>> Create(
      const Config& config, const std::string& job);
  // Writes what is ready to disk (its own persister), then stops.
  ~Checkpointer();

  const Config& config() const { return config_; }

  // A generation began: whether this worker writes its node's snapshot
  // (the node's lowest rank) and whether the disk tier writes it (rank 0).
  void SetRole(bool writes_memory, bool persists) {
    writes_memory_ = writes_memory;
    persists_ = persists;
  }
  bool writes_memory() const { return writes_memory_; }

  // Whether the commit of `step` takes a checkpoint.
  bool Due(int64_t step) const {
    return config_.every > 0 && step > 0 && step % config_.every == 0;
  }
  // Copies `content` into the region (the step's stall). Errors are logged
  // once, never returned: training goes on without that checkpoint. A
  // checkpoint that falls due while the last one is still being written is
  // skipped, unless `wait` (training is over: the job's last commit waits
  // for the write before it, at most 5 minutes). With Config::overlap and
  // not `wait`, the CPU tensors among `deferred` (parameters and optimizer
  // state) are copied on a thread of their own while the next step runs, and
  // the snapshot is complete at the Fence that joins it (see Note [Overlapped
  // snapshots] in worker/checkpoint/memory.h).
  void Save(const Content& content, bool wait = false,
            const std::vector<at::Tensor>& deferred = {});
  // See Note [Holes] in worker/checkpoint/memory.h: what the last Save of
  // a content with holes left to do. kLaidOut: the node's other workers
  // fill them now, then Filled; kFailed: the memory stage failed on the
  // disk tier's writer, which writes the content, holes filled, with
  // WriteFilled; kSkipped: nothing (a skip, or a failure said).
  enum class HoleState { kNone, kLaidOut, kSkipped, kFailed };
  HoleState holes() const { return holes_; }
  // Whether the node's other workers filled the holes (`filled` OK) or not:
  // the snapshot is published (an overlapped one at its Fence) or dropped
  // (a warning). Nothing when the last Save laid out no holes.
  void Filled(const absl::Status& filled);
  // holes() kFailed: writes `content` (the last Save's, its holes filled)
  // to disk from this worker (see Note [Writes from the worker]).
  void WriteFilled(const Content& content);
  // The snapshot of `step` that the node's writer (process `writer_pid`)
  // has laid out in the node's region and not yet published: its tensors,
  // views of the region, for this worker to fill its holes.
  // FAILED_PRECONDITION when the region holds no such snapshot.
  absl::StatusOr<Content> LaidOut(int64_t step, int32_t writer_pid);
  // Waits for an overlapped snapshot's copy and publishes it; drops it when
  // a deferred tensor was written meanwhile (one warning line; later
  // snapshots copy everything during their step). Call before anything may
  // write a parameter or the optimizer's state; cheap when no copy is in
  // flight. Not concurrently with Save.
  void Fence();
  // Grows the region to hold `content` on a thread of its own, so that the
  // first snapshot does not make it during its step (on a worker that
  // writes its node's snapshot, once the optimizers have their state); a
  // failure is left for that snapshot to say. Save and FindCandidate wait
  // for it.
  void Prepare(const Content& content);
  // Runs when a snapshot is complete: in Save, or in the Fence that ends its
  // copy.
  void OnSaved(std::function<void(const Counters&)> callback) {
    on_saved_ = std::move(callback);
  }
  // See Note [Writes from the worker]: where this worker's own writes and
  // their failures go (its session's coordinator). Runs on the training
  // thread, or on the persister's thread of a worker without an agent.
  void OnReport(std::function<void(const PersistReport&)> callback) {
    std::lock_guard<std::mutex> lock(report_mu_);
    on_report_ = std::move(callback);
  }
  // Writes what this worker's own persister (without an agent) holds, now.
  void Flush() {
    Fence();
    if (persister_ != nullptr) persister_->Flush();
  }
  // The counters of the last snapshot this worker copied into the region
  // (step -1: none).
  const Counters& last_saved() const { return last_saved_; }

  // The newest state this worker can offer (see Note [Checkpoints]): its node's
  // memory snapshot, and with `disk` the checkpoint the coordinator `named`
  // (see Note [Resume source] in coordinator/core/core.h) when it loads, or a
  // newer one in the directory that does (its report was lost with its
  // writer).
  // With `only_run` (--no-resume: see Note [Runs] in
  // coordinator/core/core.h), only that run's checkpoints; the newest wins
  // by run, then step.
  struct Named {
    int64_t step = 0;
    std::string path;
    int64_t run = 0;
  };
  std::optional<Candidate> FindCandidate(
      bool disk, const std::optional<Named>& named = std::nullopt,
      int64_t only_run = 0);

  // The bytes of the region this worker has mapped, once a Prepare in
  // flight is done.
  size_t region_bytes();
  int64_t saved() const { return saved_; }
  bool persists() const { return persists_; }
  int64_t skipped() const { return skipped_; }
  // The last complete snapshot's stall (seconds): its copy during the step,
  // and an overlapped one's wait at its Fence.
  double last_stall() const { return last_stall_; }

 private:
  Checkpointer(Config config, std::string job)
      : config_(std::move(config)), job_(std::move(job)) {}
  // Publishes what BeginSnapshot `copied` into the region (or counts it
  // skipped, or warns), then Complete.
  void Finish(const absl::StatusOr<WriteResult>& copied,
              const PendingSnapshot& pending, const Versions& live,
              const Counters& counters, double stall);
  // A content with holes not laid out (`r`: skipped or failed): counts the
  // skip, says the failure, or (the disk tier's writer) keeps the failure
  // for WriteFilled.
  void HeldBack(const absl::StatusOr<WriteResult>& r,
                const PendingSnapshot& pending, const Counters& counters,
                double stall);
  // Bookkeeping of a snapshot FinishSnapshot ended.
  void Complete(const absl::StatusOr<int64_t>& finished,
                const Counters& counters);
  void Warn(int64_t step, const std::string& error);
  // See Note [Writes from the worker]: the memory stage failed (`why`) on
  // the disk tier's writer, which writes `content` to disk itself; `stall`:
  // the step's stall so far.
  void WriteDirect(const Content& content, const std::string& why,
                   double stall);
  // A write of this worker's failed: `error`, for the checkpoint of
  // `counters`.
  void ReportFailure(const Counters& counters, const std::string& error);
  // A report of this worker's own write of the checkpoint of `counters`, at
  // its path; the write's figures (or error) left to fill.
  PersistReport OwnReport(const Counters& counters) const;
  void Report(const PersistReport& report);

  const Config config_;
  const std::string job_;
  std::unique_ptr<Region> region_;
  // Without an agent: the persister and its own view of region_'s memory.
  std::unique_ptr<Region> persister_region_;
  std::unique_ptr<Persister> persister_;
  bool writes_memory_ = false;
  bool persists_ = false;
  int64_t saved_ = 0;
  Counters last_saved_{-1, 0, 0, 0, 0};
  int64_t skipped_ = 0;
  double last_stall_ = 0;
  std::string last_error_;
  std::function<void(const Counters&)> on_saved_;
  // An overlapped snapshot in flight: the thread writing it into the region
  // (BeginSnapshot's result and what FinishSnapshot publishes), its live
  // tensors' versions, its counters and its stall so far (Stage's).
  std::atomic<bool> copying_{false};
  std::thread copier_;
  absl::StatusOr<WriteResult> copied_ = WriteResult::kWritten;
  Content staged_;  // what the thread copies (kept for WriteDirect)
  PendingSnapshot pending_;
  Versions live_;
  Counters pending_counters_;
  double pending_stall_ = 0;
  // See Note [Holes]: the last Save's, whether a laid-out snapshot waits
  // for Filled and what it said, and a failure WriteFilled writes past.
  HoleState holes_ = HoleState::kNone;
  bool awaiting_fill_ = false;
  std::optional<absl::Status> filled_;
  std::string held_why_;
  double held_stall_ = 0;
  // Prepare's thread; joined before anything else touches region_.
  std::thread preparer_;
  // A dropped overlapped snapshot turns overlapping off.
  bool overlap_off_ = false;
  // See Note [Writes from the worker]: said until a snapshot is in the
  // region again.
  bool direct_said_ = false;
  std::mutex report_mu_;
  std::function<void(const PersistReport&)> on_report_;
};

}  // namespace concord::checkpoint
