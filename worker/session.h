#pragma once
// A worker's membership in a job: options, the coordinator connection, the
// current generation's communicator, and the heartbeat.
//
// Note [Worker environment]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// `concord-run` passes a job to its workers in CONCORD_* environment
// variables (the table in common/environment.h); WorkerOptions::
// FromEnvironment is the one place that reads them. Without
// CONCORD_COORDINATOR the program runs alone (world size 1, an in-process
// store), which is what a plain `concord-train ...` does.

#include <atomic>
#include <condition_variable>
#include <deque>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/job_defaults.h"
#include "common/tls.h"
#include "concord/v1/worker.pb.h"
#include "worker/checkpoint/config.h"
#include "worker/comm/communicator.h"
#include "worker/comm/flight_recorder.h"
#include "worker/comm/group.h"
#include "worker/comm/next_communicator.h"
#include "worker/comm/store.h"
#include "worker/coordinator_client.h"
#include "worker/device.h"
#include "worker/reachability.h"
#include "worker/test_fault.h"
#include "worker/trace/history.h"

namespace concord::worker {

struct WorkerOptions {
  // host:port of the coordinator; empty = run alone.
  std::string coordinator;
  // The worker token sent to the coordinator (required with a coordinator).
  std::string token;
  // TLS towards the coordinator; empty = plaintext.
  TlsMaterial tls;
  v1::JobSpec spec;
  std::string worker_id;
  // The node this worker runs on, for SlowMo's hierarchy (see Note [Node
  // hierarchy] in worker/slowmo/hierarchy.h): workers with the same one
  // share a node. Default: the hostname.
  std::string node_id;
  // Address peers use to reach this worker's communicator.
  std::string comm_host = "127.0.0.1";
  // See Note [Shared-memory allreduce]: Gloo generations whose ranks are all on
  // this host sum through shared memory (CONCORD_SHM=0: Gloo's TCP only).
  bool shared_memory = true;
  absl::Duration join_timeout = kDefaultRendezvousTimeout;
  absl::Duration collective_timeout = kDefaultCollectiveTimeout;
  // See Note [Worker device] in worker/device.h: the device asked for (default:
  // the CPU), the communicator backend, and this worker's rank among the
  // workers of its node (concord-run's CONCORD_LOCAL_RANK; -1: unknown).
  DeviceRequest device;
  BackendRequest backend = BackendRequest::kAuto;
  int local_rank = -1;
  // The level of the library's log (see Note [Library logging] in
  // common/logging.h): a name ParseLogLevel takes; empty: leave it.
  std::string log_level;
  // Where this worker writes its timeline (see Note [Trace files] in
  // worker/trace/recorder.h), set by `concord-run --trace`; empty: none.
  std::string trace_file;
  // Where this worker appends its history (see Note [History files] in
  // worker/trace/history.h), set by `concord-run --history`; empty: none.
  std::string history_file;
  // See Note [Checkpoints] in worker/checkpoint/checkpointer.h: none without a
  // dir.
  checkpoint::Config checkpoint;
  // Test hook: where this worker kills itself (worker/test_fault.h).
  std::vector<TestFault> test_faults;

  // Reads CONCORD_COORDINATOR, CONCORD_JOB_ID, CONCORD_MIN_WORKERS,
  // CONCORD_MAX_WORKERS, CONCORD_WORKER_ID, CONCORD_COMM_HOST,
  // CONCORD_HEARTBEAT_INTERVAL_MS, CONCORD_HEARTBEAT_TIMEOUT_MS,
  // CONCORD_RENDEZVOUS_TIMEOUT_MS, CONCORD_COLLECTIVE_TIMEOUT_MS,
  // CONCORD_SETTLE_MS, CONCORD_LOG_LEVEL, CONCORD_TRACE_FILE,
  // CONCORD_HISTORY_FILE, CONCORD_NODE_ID, CONCORD_DEVICE, CONCORD_BACKEND,
  // CONCORD_LOCAL_RANK (or torchrun's LOCAL_RANK), CONCORD_TEST_FAULT,
  // CONCORD_CHECKPOINT_* (checkpoint::FromEnvironment), and the
  // worker token from the file CONCORD_TOKEN_FILE names (or CONCORD_TOKEN), and
  // the PEM files CONCORD_TLS_CA (the CA that signed the coordinator's
  // certificate: turns TLS on), CONCORD_TLS_CERT and CONCORD_TLS_KEY (this
  // worker's certificate for mTLS) name. INVALID_ARGUMENT names the variable
  // that is malformed (or its file), or the token variable when a coordinator
  // is set but no token is.
  static absl::StatusOr<WorkerOptions> FromEnvironment();
};

// The device `options` asks for on this machine (see Note [Worker device]):
// asks LibTorch how many CUDA devices are visible. Errors: those of
// ResolveDevice.
absl::StatusOr<ResolvedDevice> ResolveWorkerDevice(
    const WorkerOptions& options);
// The backend of a worker on `device` with this build (NCCL only where
// Concord has NCCL and LibTorch has CUDA). Errors: those of ChooseBackend.
absl::StatusOr<Backend> ResolveBackend(const WorkerOptions& options,
                                       const WorkerDevice& device);

// Note [Re-forming in the worker]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A Session belongs to one generation at a time. When that generation is over
// for this worker — a collective failed (a peer died), the members agreed to
// stop at a step boundary (someone ran out of data, or workers wait to be
// admitted) — Reform() aborts the communicator, asks the coordinator for the
// next generation (JoinRequest.previous_generation, so the coordinator ends
// the old one at once if nobody told it yet) and connects a new communicator. A
// membership watcher aborts the communicator as soon as the coordinator says
// the generation ended (someone else's failure or a heartbeat timeout), so that
// no collective waits out its timeout for a peer that is gone; it also raises
// reform_wanted() when workers wait to be admitted.
class Session final : public comm::GroupFactory {
 public:
  // Joins the job (blocks until a generation forms), connects the
  // communicator and starts heartbeating and watching the membership.
  // Ignores SIGPIPE for the process (a peer that died must fail the
  // collective, not kill this worker).
  // The device and backend are resolved first (ResolveWorkerDevice,
  // ResolveBackend): a CUDA worker's generations are NCCL communicators on
  // its device unless it asked for Gloo.
  // Errors: those of the resolution, CoordinatorClient::Join and the
  // communicator's Create.
  static absl::StatusOr<std::unique_ptr<Session>> Start(
      const WorkerOptions& options);
  ~Session();

  // The communicator of the current generation; Reform replaces it. Callers
  // keep the shared_ptr they hold for as long as they use it (there is no
  // reference form: it would dangle across a re-form). Null between
  // generations: during a Reform and after one that failed.
  std::shared_ptr<comm::Communicator> shared_communicator() const;
  // This worker's rank, the world size and the number of the last
  // generation it joined: the current one; after a Reform that failed, the
  // last one the coordinator formed with it (never a dangling read).
  int rank() const { return rank_.load(); }
  int world_size() const { return world_size_.load(); }
  int64_t generation() const { return generation_.load(); }
  // See Note [Runs] in coordinator/core/core.h: the job's run this worker
  // belongs to (JoinResponse.run; 0 before its first generation).
  int64_t run() const { return run_.load(); }
  int authoritative_rank() const { return authoritative_rank_; }
  // See Note [Resume source] in coordinator/core/core.h: the checkpoint the
  // coordinator named for the current generation (training thread only).
  const std::optional<v1::CheckpointReport>& resume_from() const {
    return resume_from_;
  }
  // The same, of the memory snapshot it named (JoinResponse.resume_memory).
  const std::optional<v1::CheckpointReport>& resume_memory() const {
    return resume_memory_;
  }
  // See Note [Worker device]: where this worker's tensors live, and which
  // communicator its generations use.
  const WorkerDevice& device() const { return device_; }
  // The same, as LibTorch names it: where to put the model and the batches.
  c10::Device torch_device() const;
  Backend backend() const { return backend_; }
  const WorkerOptions& options() const { return options_; }
  // WorkerOptions::history_file's log (the session writes the generations
  // it joins and its finish; the API its restores and commits); null
  // without one.
  const std::shared_ptr<trace::HistoryLog>& history() const { return history_; }
  // comm::GroupFactory: a communicator of the session's backend over some
  // ranks of the current generation, rendezvousing through the generation's
  // store; aborted with the generation's communicator (Reform, or the
  // coordinator saying the generation is over). Training thread only, like
  // Reform. Errors: those of GroupFactory, ABORTED when `parent` is not the
  // current generation's.
  absl::StatusOr<std::shared_ptr<comm::Communicator>> CreateGroup(
      const comm::Communicator& parent, const std::string& name,
      const std::vector<int>& members) override;

  // Whether a coordinator runs the job (false: a world of one).
  bool elastic() const { return client_ != nullptr; }

  // See Note [Re-forming in the worker]: leaves the current generation (saying
  // `reason`) and blocks until the next one has formed and its communicator
  // connected, retrying when a member of the new generation does not connect.
  // Errors: FAILED_PRECONDITION when the job failed, was stopped (e.g. it
  // stayed below min_workers for the rendezvous timeout) or has no coordinator;
  // DEADLINE_EXCEEDED after the join timeout; UNAVAILABLE when the
  // coordinator stays unreachable.
  absl::Status Reform(int64_t committed_step, const std::string& reason);
  // Workers of the job that left when their data ran out, as of the
  // current generation's formation.
  int finished_workers() const { return finished_workers_.load(); }
  // Whether the generation joined last has other members than the one
  // before it (true for the first, and when the coordinator could not say).
  bool members_changed() const { return members_changed_; }
  // Workers are waiting to be admitted to the job (see Note [Re-forming in the
  // worker]).
  bool reform_wanted() const {
    return reform_wanted_.load(std::memory_order_relaxed);
  }

  // See Note [Writes from the worker] in worker/checkpoint/checkpointer.h: a
  // checkpoint this worker wrote itself, or failed to, told to the
  // coordinator (at most 10 s; a failure is logged). Nothing without one.
  // Thread-safe.
  void ReportCheckpoint(const v1::CheckpointReport& report);

  // Progress carried by the next heartbeat: the last committed step, this
  // worker's throughput and, when given, the step's training loss (a NaN or
  // infinite loss is not sent: the heartbeat then carries none). Thread-safe,
  // cheap.
  void ReportProgress(int64_t step, double samples_per_second,
                      std::optional<double> loss = std::nullopt);
  // Moves the progress to a newly committed step, keeping the throughput and
  // loss last reported (elastic::State::Commit). Thread-safe, cheap.
  void ReportCommittedStep(int64_t step);
  // What the next heartbeat carries (loss: none when the last report had no
  // finite one).
  struct Progress {
    int64_t step = 0;
    double samples_per_second = 0;
    std::optional<double> loss;
  };
  Progress progress() const;
  // DDP timings of the last step, carried by the next heartbeat (operators
  // see them in `concordctl status`). Thread-safe.
  void ReportDdpTimings(const v1::DdpTimings& timings);

  // See Note [Hangs] in coordinator/core/hang_rule.h: what the process is
  // busy with outside the step where that may take long and use little CPU
  // (a checkpoint's disk read, the state's broadcast to a newcomer), carried
  // by every heartbeat while a Busy lives: such a member is never taken for
  // hung. Nested: the innermost names it. Any thread.
  class Busy {
   public:
    Busy(Session* session, std::string what);
    ~Busy();
    Busy(const Busy&) = delete;
    Busy& operator=(const Busy&) = delete;

   private:
    Session* session_;
    std::string previous_;
  };
  // The WorkerProgress the next heartbeat carries (see Note [Flight
  // recorder]), as of `now`.
  v1::WorkerProgress progress_report(absl::Time now) const;
  // See Note [Flight recorder].
  const std::shared_ptr<comm::FlightRecorder>& recorder() const {
    return recorder_;
  }

  // Tells the coordinator this worker is done (or failed) and stops the
  // heartbeat. Idempotent.
  absl::Status Finish(bool ok, const std::string& message);
  // Leaves the job because this worker's data ended after `last_step`, at a
  // boundary the members agreed on (LEAVE_REASON_END_OF_DATA); the others
  // re-form without it. Stops the heartbeat. Idempotent with Finish.
  absl::Status LeaveAtEndOfData(int64_t last_step);

 private:
  // The checkpoint folder in its normal form, which the spec names too (see
  // Note [One job's checkpoints] in coordinator/core/core.h).
  explicit Session(WorkerOptions options) : options_(std::move(options)) {
    options_.checkpoint.dir = checkpoint::NormalDir(options_.checkpoint.dir);
    options_.spec.set_checkpoint_dir(options_.checkpoint.dir);
  }
  // Members of the generation `joined` placed this worker in whose
  // reachability port did not answer (see Note [Unreachable peers]).
  std::vector<std::string> UnreachableMembers(
      const v1::JoinResponse& joined) const;
  // Joins (previous_generation: see JoinRequest) and connects a communicator.
  // `parent`: the old generation's communicator where the next one may be
  // derived from it (see Note [Re-forming NCCL]); given up when not.
  absl::Status JoinAndConnect(
      int64_t previous_generation, const std::string& reason,
      int64_t committed_step, absl::Time deadline,
      std::shared_ptr<comm::Communicator> parent = nullptr);
  // JoinAndConnect's parts: the request (`probe`: ask for the members, to
  // check they answer; `unreachable`: those the last placement's did not),
  // taking the assignment (counters, resume sources, the generation's store,
  // the log and history), and what the next communicator is made from (the
  // members' labels and how they changed: see Note [Re-forming NCCL]).
  v1::JoinRequest MakeJoinRequest(
      int64_t previous_generation, const std::string& why,
      int64_t committed_step, bool probe,
      const std::vector<std::string>& unreachable) const;
  void TakeAssignment(const v1::JoinResponse& joined);
  comm::NextCommunicatorRequest PlanNextCommunicator(
      const v1::JoinResponse& joined, absl::Duration timeout);
  // A communicator of the session's backend: `rank` of `size` in
  // `generation`, rendezvousing through `store`.
  absl::StatusOr<std::unique_ptr<comm::Communicator>> Connect(
      int rank, int size, int64_t generation, comm::Store* store,
      absl::Duration timeout) const;
  void OnMembership(const v1::MembershipUpdate& update);
  // Once: says that this worker waits while the job runs at max_workers
  // (a node started with a size meant for itself alone).
  void WarnIfBeyondSize(const v1::MembershipUpdate& update);
  absl::Time JoinDeadline() const;
  void HeartbeatLoop(absl::Duration interval);
  void StopHeartbeat();
  absl::Status LeaveOnce(v1::LeaveReason reason, const std::string& message);

  WorkerOptions options_;
  WorkerDevice device_;
  Backend backend_ = Backend::kGloo;
  std::unique_ptr<CoordinatorClient> client_;
  std::shared_ptr<trace::HistoryLog> history_;
  // See Note [Unreachable peers]: this worker's reachability port (null when
  // it could not be bound).
  std::unique_ptr<ProbeListener> probe_;
  std::unique_ptr<comm::Store> store_;
  mutable std::mutex comm_mu_;
  std::shared_ptr<comm::Communicator> comm_;  // guarded by comm_mu_
  // Groups of comm_'s generation (CreateGroup), guarded by comm_mu_.
  std::vector<std::weak_ptr<comm::Communicator>> groups_;
  std::atomic<int> authoritative_rank_{0};
  std::optional<v1::CheckpointReport> resume_from_;
  std::optional<v1::CheckpointReport> resume_memory_;
  // Of the last generation joined and connected (rank(), world_size(),
  // generation()).
  std::atomic<int> rank_{0};
  std::atomic<int> world_size_{1};
  std::atomic<int64_t> generation_{0};
  std::atomic<int64_t> run_{0};
  std::atomic<bool> reform_wanted_{false};
  std::atomic<bool> beyond_size_warned_{false};
  std::atomic<int> finished_workers_{0};
  // The current generation's workers by rank (comm::NextRankLabels), that
  // generation, and how many workers of the job had finished when it formed
  // (see Note [Re-forming NCCL]). Training thread only.
  std::vector<std::string> members_;
  int64_t members_generation_ = 0;
  int finished_at_formation_ = 0;
  bool members_changed_ = true;
  // The generation of the communicator Reform has taken over to derive the
  // next one from (-1: none); the membership watcher's abort leaves that one
  // alone (see Note [Re-forming NCCL]). Shared: the watcher's abort threads may
  // outlive the session.
  std::shared_ptr<std::atomic<int64_t>> taken_for_reform_ =
      std::make_shared<std::atomic<int64_t>>(-1);
  std::unique_ptr<MembershipWatcher> watcher_;

  // See Note [Flight recorder]: its last kRecentSent entries go with a
  // heartbeat while a collective has been in flight for kRecentAfter, or
  // none was issued for that long.
  static constexpr size_t kRecentSent = 16;
  static constexpr absl::Duration kRecentAfter = absl::Seconds(1);
  std::shared_ptr<comm::FlightRecorder> recorder_ =
      std::make_shared<comm::FlightRecorder>();
  // See Busy (guarded by activity_mu_).
  mutable std::mutex activity_mu_;
  std::string activity_;
  // The times between the last commits (ReportCommittedStep), and the parts
  // of them spent waiting for collectives, for WorkerProgress's step_ms,
  // wait_ms and own_ms; guarded by activity_mu_.
  static constexpr size_t kStepTimesKept = 16;
  struct StepTime {
    absl::Duration step;
    absl::Duration wait;
  };
  std::deque<StepTime> step_times_;
  std::optional<absl::Time> last_commit_;
  absl::Duration last_commit_waited_;
  int64_t last_commit_step_ = -1;

  std::atomic<int64_t> step_{0};
  std::atomic<double> samples_per_second_{0};
  // NaN: no loss to report.
  std::atomic<double> loss_{std::numeric_limits<double>::quiet_NaN()};
  std::mutex timings_mu_;
  std::optional<v1::DdpTimings> timings_;  // guarded by timings_mu_
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  bool finished_ = false;
  std::thread heartbeat_;
};

}  // namespace concord::worker
