#pragma once
// The coordinator's core: membership, generations, rendezvous, health, the
// end-of-data agreement, operator views and admin actions, as a plain state
// machine.
//
// It knows nothing of gRPC and never blocks or sleeps: time comes from a
// Clock, and callers that want to wait (the RPC layer) re-ask when the job's
// epoch of what they wait on moves (Epochs, see Note [Asynchronous waits] in
// host.h). Not thread-safe: the service layer serialises every
// call with its own mutex. Every request is validated first
// (core_validation.h): a bad one is INVALID_ARGUMENT and changes nothing.
//
// Core is the facade. A job's state is a JobState (job_state.h), and its
// parts with their own state and tests are members of it:
//  - CheckpointRecords (checkpoint_records.h): the run, the checkpoints and
//    memory snapshots kept, what a generation resumes from;
//  - EventLog (event_log.h): the job's events;
//  - Watches (watches.h): its workers' watch streams;
//  - MemberHealth and Cooldowns (health.h): a member's progress as the hang
//    and straggler rules (hang_rule.h, pure functions) see it, and the
//    evicted stragglers' cool-downs;
//  - JobHistory (job_history.h): progress and generation history.
// Membership, generations and rendezvous are Core's own.
//
// Uneven inputs: the members agree among themselves, at every step, whether
// each still has data (see Note [Step agreement] in worker/elastic/state.h); a
// member that ran out says so with Leave(END_OF_DATA) at that step boundary
// (see Note [Re-forming]), and the job succeeds when no member that had not
// completed and no waiting worker is left.

#include <algorithm>
#include <array>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "concord/v1/coordinator_state.pb.h"
#include "concord/v1/operator.pb.h"
#include "concord/v1/worker.pb.h"
#include "coordinator/core/checkpoint_records.h"
#include "coordinator/core/event_log.h"
#include "coordinator/core/hang_rule.h"
#include "coordinator/core/health.h"
#include "coordinator/core/job_history.h"
#include "coordinator/core/job_state.h"
#include "coordinator/core/watches.h"
#include "coordinator/core/worker_list.h"

namespace concord::coordinator {

// Note [Generations]
// ~~~~~~~~~~~~~~~~~~
// A generation is a fixed set of members with ranks 0..n-1. Any membership
// change ends it; the next one gets a higher number. Anything addressed to
// another generation than the current one is refused with ABORTED. Generation
// numbers never go backwards, across restarts too (they are persisted,
// see Note [Persistence]).

struct Assignment {
  int64_t generation = 0;
  int32_t rank = -1;
  int32_t world_size = 0;
  int32_t authoritative_rank = 0;
  // Ordered by rank; shared by every assignment answered from the same
  // state of the job (a generation's formation answers all its members).
  std::shared_ptr<const std::vector<v1::Member>> members;
  absl::Duration heartbeat_interval;
  int32_t finished_workers = 0;  // left at the end of their data
  // How the ranks follow from the generation before (worker.proto).
  std::optional<v1::RankChange> rank_change;
  // The generation followed one whose members were stuck together (see Note
  // [Hangs] in hang_rule.h): its members are sent the member table, and
  // probe each other before they connect (see Note [Unreachable peers]).
  bool probe = false;
  // See Note [Resume source].
  std::optional<v1::CheckpointReport> resume_from;
  std::optional<v1::CheckpointReport> resume_memory;
  // See Note [Runs].
  int64_t run = 0;
};

// A job's figures for the per-job Prometheus metrics (see Note [Job history]).
struct JobMetricsSample {
  std::string job_id;
  v1::JobState state = v1::JOB_STATE_UNSPECIFIED;
  int64_t generation = 0;
  int32_t members = 0;
  int32_t waiting = 0;
  int64_t step = 0;  // of the newest progress point (0 before any)
  double samples_per_second = 0;
  std::optional<double> loss;
  double steps_per_second = 0;
  // Failures, the re-form histogram: see JobHistory.
  int64_t failures = 0;
  std::array<uint64_t, JobHistory::kReformBuckets.size() + 1> reform_buckets{};
  uint64_t reform_count = 0;
  double reform_seconds_sum = 0;
  std::optional<double> last_reform_seconds;
  // See Note [Checkpoints]: the totals the node agents reported, and the newest
  // complete checkpoint (step 0: none).
  v1::CheckpointTotals checkpoint_totals;
  v1::CheckpointReport last_checkpoint;
  // The running generation's members that reported step times (see Note
  // [Stragglers] in hang_rule.h): the medians of their last steps' times.
  struct Worker {
    std::string worker_id;
    double step_ms = 0;
    double own_ms = 0;
    double wait_ms = 0;
    bool straggler = false;
  };
  std::vector<Worker> workers;
};

class Core {
 public:
  explicit Core(const Clock* clock);

  // Registers a worker. Creates the job on its first Join. Returns at once;
  // the assignment is available from `GetAssignment()` once the generation
  // has formed (see Note [Formation]). A member naming its running generation
  // in previous_generation ends it (see Note [Re-forming]). Errors:
  // INVALID_ARGUMENT (bad ids, secret, spec, reform_reason, or a
  // previous_generation above the current one), FAILED_PRECONDITION (spec
  // differs from the job's, the job has ended, or the worker was drained),
  // PERMISSION_DENIED (worker_id bound to another secret), ALREADY_EXISTS
  // (worker_id is a member of the current running generation and does not
  // name it in previous_generation), RESOURCE_EXHAUSTED (too many jobs).
  // `call`, when given, gets a number for this Join that CancelJoin names.
  absl::Status Join(const v1::JoinRequest& request, uint64_t* call = nullptr);

  // The Join numbered `call` was cancelled (its client went away) before its
  // worker was placed: the worker withdraws, as with a Leave while waiting,
  // so that no generation forms with a process that will never hear of it.
  // Nothing changes when the worker joined again since (a later call), was
  // placed, or is a survivor coming back (its watch speaks for it). Returns
  // whether it withdrew.
  bool CancelJoin(const std::string& job_id, const std::string& worker_id,
                  uint64_t call);

  // Note [Exited workers]
  // ~~~~~~~~~~~~~~~~~~~~~
  // A launcher that is its workers' node agent (concord-run) sees a worker
  // process exit the instant it reaps it, and says so on its Node stream
  // (agent.proto's ExitedWorker), naming the worker with the secret its calls
  // carried (see Note [Worker binding]: the agent learned it from the worker's
  // accepted Join, and the coordinator checks it as for any call of the
  // worker). Unlike a lost watch stream (see Note [Re-forming]) this is no
  // guess: the process is gone. So the worker is taken out at once, as its
  // failed Leave or its heartbeat timeout would take it out:
  //  - a member of the running generation that had not completed: a
  //    "failure" event, its binding released, the generation ends without it
  //    (the others are expected survivors) and the next one forms as soon as
  //    they are back (see Note [Formation]), not after heartbeat_timeout;
  //  - an expected survivor not back yet: dropped (a "failure" event, binding
  //    released), which may let the next generation form at once;
  //  - a waiting worker (a survivor already back too): withdrawn (a "failure"
  //    event, binding released), which may let a generation form;
  //  - anything else (a worker that completed, ran out of data, was dropped or
  //    drained already, an id the job does not hold, a job that has ended):
  //    nothing changes, and that is no error (the report came late).
  // A malformed report is INVALID_ARGUMENT, a secret that is not the worker's
  // PERMISSION_DENIED, an unknown job NOT_FOUND; none changes anything. Each
  // change is persisted and written to the history like any other (see Note
  // [Coordinator history]). The service accepts a report only for a worker
  // whose calls that Node stream carried (agent_service.h).

  // See Note [Exited workers]: the process of `worker_id` (bound to `secret`)
  // exited, `how` (for the event). Returns whether anything changed.
  // Errors: INVALID_ARGUMENT (malformed ids, secret or `how`), NOT_FOUND
  // (unknown job), PERMISSION_DENIED (the worker is bound to another
  // secret); none changes anything.
  absl::StatusOr<bool> WorkerExited(const std::string& job_id,
                                    const std::string& worker_id,
                                    const std::string& secret,
                                    const std::string& how);

  // Note [Resume source]
  // ~~~~~~~~~~~~~~~~~~~~
  // The coordinator names where a generation's state comes from when none of
  // its members holds a committed step (all joined at step 0: the job's first
  // generation, every worker died, or the job was started again) and the job
  // has a complete checkpoint reported (see Note [Checkpoints] in
  // worker/checkpoint/checkpointer.h): the newest one, in every member's
  // Assignment (JoinResponse.resume_from) and the generation's event. The
  // workers load it on the node that wrote it (a node-local disk). The node
  // agents also report the snapshots their memory holds (each written
  // checkpoint is in its writer's node's memory; the other nodes' agents report
  // theirs as memory-only, CheckpointReport.memory): the newest per node is
  // kept, and one at least as new as the disk's is named too
  // (JoinResponse.resume_memory; memory wins a tie: no disk read). The workers
  // check what they are told: every rank offers its node's memory snapshot and
  // rank 0 (or the named disk's node) the disk's, and the newest offered wins
  // (a node whose agent died with its memory offers nothing, and the disk's is
  // taken), with a log line saying whether it is the one the coordinator named.
  // Without a record (a --standalone coordinator that died with its launcher)
  // they take the newest complete checkpoint in their directory.
  //
  // Note [One job's checkpoints]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // A job's checkpoints are its own, whoever reports them:
  //  - its spec names its checkpoint folder (JobSpec.checkpoint_dir, absolute
  //    and normal; every worker of the job must name the same one). A
  //    written or failed checkpoint of step N is kept only at
  //    DIR/<job>/step-<N> (CheckpointStepPath): another path is
  //    PERMISSION_DENIED, and a generation is only ever told to resume from
  //    that path (a record kept before the check is passed over);
  //  - a node agent's report carries the credential of a worker of the job on
  //    its node (NodeCheckpoint), and the Node stream takes it only when it
  //    carried that worker's calls with that secret (the core checked it
  //    then), and only for the one node its first report named: a stream
  //    of job A, or one that never carried a worker, cannot write job B's
  //    records, and one node cannot speak for others;
  //  - the records are bounded: the newest kKeptCheckpoints complete ones,
  //    and the memory snapshots of at most MaxMemoryNodes nodes (the oldest
  //    makes room; a memory report older than all of them is
  //    RESOURCE_EXHAUSTED);
  //  - the worker checks again what it is told: it loads a named checkpoint
  //    only at its own folder's path for that step, and only when the
  //    manifest's job id is its job's (worker/checkpoint/checkpointer.cc).
  //
  // Note [Runs]
  // ~~~~~~~~~~~
  // A job's record has a run: when the record was made, or when the job was
  // started again after it failed or was stopped, in microseconds since the
  // Unix epoch, always larger than the run before it (RunAfter). Every
  // assignment carries it (JoinResponse.run); the workers stamp it on every
  // snapshot and checkpoint (manifest.json's "run"), and their reports carry
  // it: one of another run is FAILED_PRECONDITION (an earlier run's writer
  // still reporting) and changes nothing; one without (0, an older writer)
  // is taken as this run's. Checkpoints are ordered by run, then step,
  // everywhere: the records kept here and the one a generation is told to
  // resume from, the workers' offers at a resume, the folder's scan, pruning
  // and `latest`. So a run started afresh (--no-resume) is never overtaken
  // by an earlier run's higher steps, and with --no-resume a worker
  // considers only its own run's checkpoints: a total loss later in the run
  // resumes from the run's newest. The run is also the identity in the
  // job folder's writer lock (see Note [One writer per folder] in
  // worker/checkpoint/writer_lock.h). A --standalone coordinator makes a new
  // record, hence a new run, at every launch; a coordinator service keeps a
  // job's run across its own restarts (it is persisted with the record).
  static int64_t RunAfter(absl::Time now, int64_t previous) {
    return CheckpointRecords::RunAfter(now, previous);
  }

  // See Note [Checkpoints] in worker/checkpoint/checkpointer.h: a node agent
  // wrote a complete checkpoint of the job, or failed to (`error` set). The
  // job keeps the newest kKeptCheckpoints complete ones by step (one of a
  // step reported again replaces it) and the totals (written, skipped,
  // failed, the failing write until one is written again), persisted with
  // it and shown in its status, events and metrics; a failure is an event
  // once until a write succeeds. INVALID_ARGUMENT for a bad field,
  // NOT_FOUND for an unknown job, PERMISSION_DENIED for a path outside the
  // job's folder, RESOURCE_EXHAUSTED (see Note [One job's checkpoints]);
  // nothing changes then.
  absl::Status CheckpointReported(const std::string& job_id,
                                  const v1::CheckpointReport& report);
  // See Note [Writes from the worker] in worker/checkpoint/checkpointer.h: a
  // worker of the job, bound to its secret, wrote a checkpoint itself (or
  // failed to); kept as CheckpointReported keeps a node agent's, but not as
  // in its node's memory. INVALID_ARGUMENT for a bad field or a memory
  // snapshot, NOT_FOUND for an unknown job, PERMISSION_DENIED for a worker
  // not bound to that secret in the job, or a path outside its folder;
  // nothing changes then.
  absl::Status WorkerCheckpointReported(
      const v1::ReportCheckpointRequest& request);
  // The job's records are a CheckpointRecords (checkpoint_records.h).
  static constexpr size_t kKeptCheckpoints = CheckpointRecords::kKept;
  static size_t MaxMemoryNodes(const v1::JobSpec& spec) {
    return CheckpointRecords::MaxMemoryNodes(spec);
  }

  // See Note [What the agent sees] in agent/process_view.h: a node agent saw
  // `process` of worker `worker_id` (with a heartbeat it passed on, or while
  // the worker's heartbeats are late). Kept for a member of the running
  // generation, whose progress it may show (see Note [Hangs] in
  // hang_rule.h); ignored for anyone else. It is no sign of life: the
  // worker's heartbeat deadline stays. INVALID_ARGUMENT for a bad field,
  // NOT_FOUND for an unknown job; nothing changes then. The caller checks
  // that the agent carried the worker's calls.
  absl::Status ProcessSeen(const std::string& job_id,
                           const std::string& worker_id,
                           const v1::ProcessView& process);

  // The worker's place in the current generation, or nullopt while the
  // rendezvous is still open. NOT_FOUND for an unknown job/worker;
  // FAILED_PRECONDITION when the job has failed or was stopped.
  absl::StatusOr<std::optional<Assignment>> GetAssignment(
      const std::string& job_id, const std::string& worker_id) const;

  // Records liveness, the committed step, throughput and DDP timings.
  // ABORTED when `generation` is not current (or has ended), NOT_FOUND for
  // an unknown job or a worker that is not a member, FAILED_PRECONDITION when
  // the job has failed, PERMISSION_DENIED for a wrong secret. An expected
  // survivor's ABORTED heartbeat still counts as a sign of life (see Note
  // [Re-forming]).
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(
      const v1::HeartbeatRequest& request);

  // COMPLETED marks the member done (the job succeeds when every member has
  // completed); END_OF_DATA finishes the worker and ends its generation;
  // any other reason ends the generation. A worker still waiting for a
  // generation withdraws (its `generation` is ignored; with END_OF_DATA it is
  // finished). An expected survivor naming its ended generation is finished
  // (END_OF_DATA) or dropped (ERROR, UNSPECIFIED) (see Note [Re-forming]).
  // Errors as for Heartbeat.
  absl::StatusOr<v1::LeaveResponse> Leave(const v1::LeaveRequest& request);

  // Key-value store scoped to (job, generation), for members of that
  // generation. ABORTED when the generation is not current; INVALID_ARGUMENT
  // for bad keys/sizes; NOT_FOUND for an unknown job or a caller that is not
  // a member; PERMISSION_DENIED for a wrong secret. Setting a key again
  // overwrites it.
  absl::Status KvSet(const v1::KvSetRequest& request);
  // Values of every key, or nullopt when one is not set yet.
  absl::StatusOr<std::optional<std::vector<std::string>>> KvGet(
      const v1::KvGetRequest& request) const;

  // The worker's view for WatchMembership. NOT_FOUND (unknown job),
  // PERMISSION_DENIED (the worker is bound to another secret).
  absl::StatusOr<v1::MembershipUpdate> Membership(
      const v1::WatchMembershipRequest& request) const;

  // Operator views and actions (see operator.proto). INVALID_ARGUMENT for bad
  // ids or limits, NOT_FOUND for unknown jobs/workers, FAILED_PRECONDITION
  // for draining in an ended job.
  v1::ListJobsResponse ListJobs() const;
  absl::StatusOr<v1::JobStatus> GetJob(const v1::GetJobRequest& request) const;
  absl::StatusOr<v1::ListEventsResponse> ListEvents(
      const v1::ListEventsRequest& request) const;
  absl::StatusOr<v1::DrainWorkerResponse> DrainWorker(
      const v1::DrainWorkerRequest& request);
  absl::StatusOr<v1::StopJobResponse> StopJob(
      const v1::StopJobRequest& request);

  // See Note [Re-forming]: the service reports every WatchMembership stream of
  // `worker_id` once it is open (after its first update was computed) and
  // when it closes; `lost` means the client went away (cancelled, a write
  // failed), not a shutdown or a job that ended. Counts open streams per
  // worker and remembers when the last one was lost (transient: not
  // exported, not persisted). A lost stream may drop an expected survivor,
  // now or on a later Tick. Never fail; an unknown job is ignored, and for
  // a worker the job does not hold nothing observable changes (its stream
  // is counted only so that its close pairs up). A close without an open
  // is ignored.
  void WatchOpened(const std::string& job_id, const std::string& worker_id);
  void WatchClosed(const std::string& job_id, const std::string& worker_id,
                   bool lost);

  // Forms generations whose settle period has passed, declares members whose
  // last heartbeat is older than the job's timeout failed, drops expected
  // survivors as silent for as long, and forms or fails jobs whose
  // rendezvous outlived its timeout (see Note [Formation]), and drops expected
  // survivors whose watch stream was lost (see Note [Re-forming]). Call
  // periodically (the server does every 100 ms).
  void Tick();

  // Bumped on every state change; the jobs' epochs take their values from it.
  uint64_t version() const { return version_; }

  // Note [Persistence]
  // ~~~~~~~~~~~~~~~~~~
  // Every change except a plain heartbeat (or a stale one that refreshes an
  // expected survivor) marks its job dirty; the service writes dirty jobs
  // (ExportJob) to its Store before it answers. An arrival (a Join that only
  // adds a waiting worker) is saved in a group instead: with its job's next
  // other change or on the next tick, since its Join is not answered before the
  // generation forms, which is saved before the answer; a coordinator that dies
  // in between loses the registration, and the worker, its Join broken
  // (UNAVAILABLE), joins again. Saved one by one, a rendezvous of N would write
  // N records of up to N workers. After a restart, RestoreJob brings each job
  // back with the same generation, members, waiting workers, expected
  // survivors, first-join times, bindings, finished workers and events;
  // heartbeat ages and rendezvous timers restart from the restore time, so
  // workers get a full timeout to reconnect.

  // See Note [Persistence]: ids of jobs changed since the last call; without
  // `arrivals`, not those whose only changes were arrivals (they stay
  // dirty).
  std::vector<std::string> TakeDirtyJobs(bool arrivals = true);
  // Whether the job has changes not yet taken by TakeDirtyJobs, arrivals
  // aside (an answer computed now could tell what is not saved yet).
  bool Dirty(const std::string& job_id) const {
    return dirty_.count(job_id) > 0;
  }
  // See Note [Asynchronous waits]: ids of jobs whose epochs moved since the
  // last call, and a job's epochs.
  std::vector<std::string> TakeWokenJobs();
  JobEpochs Epochs(const std::string& job_id) const;
  // The job's state for the Store; nullopt for an unknown job.
  std::optional<v1::JobRecord> ExportJob(const std::string& job_id) const;
  // Replaces (or adds) a job from its record. INVALID_ARGUMENT when the
  // record is inconsistent.
  absl::Status RestoreJob(const v1::JobRecord& record);

  // See Note [Job history]: a copy of the job's progress and generation
  // history; NOT_FOUND for an unknown job, INVALID_ARGUMENT for a malformed id.
  absl::StatusOr<JobHistory> History(const std::string& job_id) const;
  // Every job's figures for the metrics, except jobs that ended more than
  // `ended_retention` ago (the time of their last event), so that the
  // number of exported series stays bounded by the live jobs and not by
  // every job the coordinator still remembers.
  std::vector<JobMetricsSample> MetricsSamples(
      absl::Duration ended_retention) const;

  // For status and tests.
  std::vector<Event> Events(const std::string& job_id) const;
  // The job's events numbered above `after`, oldest first (see Note
  // [Coordinator history]); `lost`: how many of those the per-job cap
  // dropped already.
  std::vector<Event> EventsAfter(const std::string& job_id, int64_t after,
                                 int64_t* lost) const;
  // The number of the job's last event (0: none, or no such job).
  int64_t LastEventSeq(const std::string& job_id) const;
  std::optional<v1::JobState> State(const std::string& job_id) const;
  // Why the job failed or was stopped ("" otherwise, or no such job).
  std::string Failure(const std::string& job_id) const;
  int64_t CurrentGeneration(const std::string& job_id) const;
  size_t job_count() const { return jobs_.size(); }

 private:
  // A job's state and its members' (job_state.h).
  using MemberState = internal::MemberState;
  using Job = internal::JobState;

  // The index in `job.members` of `worker_id`, or nullopt.
  static std::optional<size_t> MemberIndex(const Job& job,
                                           const std::string& worker_id);
  // What the job's watchers all see (generation, state, sizes).
  static std::string ViewKey(const Job& job);
  Job* FindJob(const std::string& job_id);
  const Job* FindJob(const std::string& job_id) const;
  absl::Status CheckGeneration(const Job& job, int64_t generation) const;

  // Note [Worker binding]
  // ~~~~~~~~~~~~~~~~~~~~~
  // The worker token says "some worker", not which one. So the first Join of
  // (job, worker_id) binds that pair to the random worker_secret the worker
  // process chose; every later call naming the worker must carry the same
  // secret (else PERMISSION_DENIED). The binding lasts while the worker waits,
  // is a member, or is a survivor expected to join again
  // (see Note [Re-forming]); it is released when the worker withdraws, leaves
  // with an error, is declared failed (or dropped as an expected survivor), is
  // drained, runs out of data (Leave(END_OF_DATA)), or had completed when its
  // generation ended, so a restarted process (new secret) can take the id
  // again. The worker's first-join time (see Note [Formation]) lives as long as
  // its binding. KvSet/KvGet must come from a bound member of the named
  // generation, so a worker can act neither for another worker nor in another
  // job.

  absl::Status CheckBinding(const Job& job, const std::string& worker_id,
                            const std::string& secret) const;
  // The index in `members` of a bound member of the current generation
  // `generation`.
  absl::StatusOr<size_t> CheckMember(const Job& job,
                                     const std::string& worker_id,
                                     const std::string& secret,
                                     int64_t generation) const;

  // Note [Formation]
  // ~~~~~~~~~~~~~~~~
  // With expected survivors of an ended generation (see Note [Re-forming]) the
  // next generation forms as soon as every one of them is waiting again and at
  // least min_workers are waiting, without a settle period, and not before,
  // even with max_workers newcomers waiting (the survivors hold the model and
  // its progress); an expected survivor not back within heartbeat_timeout of
  // its last heartbeat (or, sooner, once its connection to the coordinator
  // broke: see Note [Re-forming]) is dropped (a "failure" event; its binding is
  // released), which may let the generation form. With no expected survivors
  // (the first generation, or every one was dropped) a generation forms as soon
  // as max_workers are waiting, or once at least min_workers are waiting and no
  // new worker has arrived for the job's settle period (JobSpec.settle_ms,
  // default 2 s). A generation admits at most max_workers: survivors first,
  // then the others, each group by the time the worker process first joined the
  // job (kept across its re-joins), which is also the rank order; so survivors
  // keep their relative order and newcomers get the highest ranks. The
  // authoritative rank is the member with the highest committed step
  // (re-joining workers report theirs in JoinRequest.committed_step), ties to
  // the lowest rank, i.e. the longest-lived. When the rendezvous outlives its
  // timeout with at least min_workers waiting, the expected survivors still
  // missing are dropped and the generation forms with those waiting; with fewer
  // the job fails, and the reason says how many were there.

  // See Note [Formation]: forms the next generation when its rule allows, after
  // dropping the expected survivors whose connection broke and taking out
  // the workers unreachable from others (see Note [Unreachable peers]).
  void MaybeFormGeneration(Job& job);

  // Note [Unreachable peers]
  // ~~~~~~~~~~~~~~~~~~~~~~~~
  // A network partition between workers that all still reach the coordinator
  // (each heartbeats) would have them re-form together forever: every
  // generation's collectives time out. So a worker whose collective timed out
  // (or whose communicator did not connect) asks for the next generation's
  // member table, probes each member's reachability port
  // (JoinRequest.probe_port: a TCP listener on its host) before connecting, and
  // when some do not answer within a second it gives that generation up at
  // once, naming them in JoinRequest.unreachable. A newcomer does the same with
  // the members of a running job it is admitted to
  // (JoinRequest.members_if_running), so that a worker restarted on the wrong
  // side of a partition costs the job two quick re-forms, not a collective
  // timeout. The coordinator keeps those reports of the waiting workers and,
  // before forming a generation, drains workers until no waiting worker reports
  // another: each round the one in the most such pairs, ties to the one that
  // joined the job last (the longest-lived, which holds the model, stays). A
  // drained worker's Join fails (FAILED_PRECONDITION, "taken out"), so a
  // partition costs the job the smaller side and the job goes on without
  // flapping; the drain is an event and is persisted like an operator's.

  // See Note [Unreachable peers]: drains waiting workers until no two of them
  // are unreachable from one another.
  void ExcludeUnreachable(Job& job);
  // See Note [Re-forming]: drops the expected survivors whose watch stream was
  // lost at least the grace ago; returns whether it dropped any.
  bool DropDisconnected(Job& job);
  static size_t MinWorkers(const Job& job);
  // Forms the next generation from the first `n` waiting workers (survivors
  // first, then by first-join time).
  void FormGeneration(Job& job, size_t n);

  // Note [Re-forming]
  // ~~~~~~~~~~~~~~~~~
  // When a generation ends (a re-form request, a Leave with another reason than
  // COMPLETED, a heartbeat failure, an end-of-data Leave, a drain), its members
  // that did not cause the end become expected survivors of the next one
  // (see Note [Formation]): not the failed, drained, erroring or finished ones,
  // nor those that had completed (they are finished too). Each keeps its
  // binding, its first-join time and its last heartbeat time. Expected
  // survivors that join again stay expected (and waiting) until the next
  // generation forms.
  //  - Join with previous_generation = the current, running generation from a
  //    member of it: the worker says that generation is over (its communicator
  //    failed, or the members agreed to re-form at a step boundary). The
  //    generation ends (the event names the worker and its reform_reason) and
  //    the worker, a survivor, is waiting at once. Without previous_generation
  //    (0) or naming an older one, a member of the running generation is
  //    ALREADY_EXISTS, as is a member that has completed. From anyone else an
  //    older or ended previous_generation is a plain join (a survivor catching
  //    up). A previous_generation above the job's current one (0 for a job the
  //    coordinator does not know) is INVALID_ARGUMENT.
  //  - A Heartbeat from an expected survivor naming its ended generation (or
  //    an older one) refreshes its liveness (it is alive, just catching up)
  //    and is still ABORTED.
  //  - Leave(END_OF_DATA) from a member of the running generation: the worker
  //    is finished (its binding released) and the generation ends without it.
  //    From an expected survivor naming its ended generation (such a Leave
  //    races with the others' re-joins, so it is not ABORTED): it is finished
  //    and no longer expected. Either way, once no member, expected survivor
  //    or waiting worker is left, the job has succeeded. A repeated Leave of a
  //    finished worker is a harmless no-op. Leave(ERROR) (or UNSPECIFIED) from
  //    an expected survivor naming its ended generation drops it (released).
  //    Leave(COMPLETED) keeps its meaning: a member completed, and the job
  //    succeeds when every member has.
  //  - An expected survivor whose connection to the coordinator broke is
  //    dropped without waiting for heartbeat_timeout: every worker keeps a
  //    WatchMembership stream open, and the service reports each stream to
  //    the core (WatchOpened, WatchClosed; transient, never persisted). A
  //    stream is lost when the client went away (the call was cancelled, a
  //    write failed: a killed process's connection closes), not when the
  //    coordinator shuts down or the job ended. An expected survivor not back
  //    yet that has no stream open, lost its last one at least the grace ago,
  //    and has not heartbeated since, is dropped like a silent one (a
  //    "failure" event saying its connection broke; its binding is released),
  //    which may let the next generation form at once. The grace is the job's
  //    heartbeat_interval_ms clamped to [100 ms, 1 s]: time for a watcher to
  //    reconnect after a transient error (a stream opened again, or a heartbeat
  //    after the loss, keeps the worker). The rule is applied whenever the
  //    core considers forming (Join, Leave, ...), when a stream is lost, and
  //    on every Tick, so the drop comes within the grace plus one tick period
  //    of the loss. Only expected survivors are dropped this way: a running
  //    member whose stream is lost stays until heartbeats decide (its
  //    communicator fails the others at once anyway), and a worker that never
  //    watched (or watched only before its binding) waits for
  //    heartbeat_timeout as before.
  //  - HeartbeatResponse and MembershipUpdate carry waiting_workers, the number
  //    of waiting workers the next generation could admit: min(waiting,
  //    max_workers - members) while running, else 0; members re-form at a step
  //    boundary to let them in. Every Join changes the membership version, so
  //    watchers see it change.

  // Ends the running generation; its members other than `removed` become
  // expected survivors (see Note [Re-forming]). Does not form the next one.
  void EndGeneration(Job& job, const std::string& why,
                     const std::set<std::string>& removed);
  // Removes `worker_id` from `expected` (and `waiting`).
  static void Forget(Job& job, const std::string& worker_id);
  // Once no member, expected survivor or waiting worker is left after a
  // worker ran out of data, the job has succeeded; returns whether it has.
  bool MaybeSucceed(Job& job);
  // See Note [Re-forming]: waiting workers the next generation could admit.
  static int32_t WaitingWorkers(const Job& job);
  // See Note [Hangs] in hang_rule.h: the members' progress as the rule sees
  // it, and applying its verdict on a running job (taking the hung out, or
  // ending a generation stuck together); returns whether anything changed.
  static std::vector<MemberProgress> ProgressOf(const Job& job);
  bool TakeOutHung(Job& job, absl::Time now);
  // See Note [Stragglers] in hang_rule.h: once a heartbeat interval, counts
  // each member's slow intervals and names (or stops naming) stragglers,
  // with an event and a log line.
  // With JobSpec.stragglers "evict", takes out one straggler when the job
  // is faster without it (see Note [Evicting stragglers]): true when that
  // ended the generation.
  bool CheckStragglers(Job& job, absl::Time now);
  // See Note [Evicting stragglers]: the waiting workers a generation may
  // admit now (the held ones excluded), and lets those whose cool-down is
  // over be admitted (true when one was).
  static size_t Eligible(const Job& job);
  bool ReleaseHeld(Job& job, absl::Time now);
  // Join's parts. Admit: whether `request` may join the existing `job`
  // (its spec, its binding, a run that ended or was started again, a
  // drained worker), and whether it is a member asking to re-form (see Note
  // [Re-forming]). AddWaiting: the worker waits for the next generation (a
  // retried Join keeps its place; an expected survivor is back), with its
  // event.
  absl::StatusOr<bool> Admit(Job& job, const v1::JobSpec& spec,
                             const v1::JoinRequest& request);
  void AddWaiting(Job& job, const v1::JoinRequest& request, uint64_t call,
                  absl::Time now);
  // A checkpoint report checked (CheckpointReported and
  // WorkerCheckpointReported): kept in job.checkpoints (`writer` as for
  // CheckpointRecords::Record), with its event.
  absl::Status Reported(Job& job, const v1::CheckpointReport& report,
                        const std::string& writer);
  // Leave from a worker that is no member of the running generation (still
  // waiting for one, or an expected survivor of the one that ended): it is
  // forgotten, and finished when out of data; the event says `*_when`
  // (`what`: the reason and message).
  void Withdraw(Job& job, const std::string& worker_id, int64_t step,
                const v1::LeaveRequest& request, const std::string& what,
                const std::string& out_of_data_when,
                const std::string& left_when);
  // See Note [Job history]: a heartbeat at `now` is about to change a member's
  // progress. The history gets the members' aggregates after each heartbeat,
  // but lazily (see Note [Lazy progress] in core_history.cc): this records the
  // pending point only when the history's next decision needs it.
  static void BeforeProgress(Job& job, absl::Time now);
  // Records the pending point, if any (before the members change).
  static void FlushProgress(Job& job);
  // The job's history with the pending point applied.
  static JobHistory CurrentHistory(const Job& job);
  void AddEvent(Job& job, std::string kind, std::string worker_id,
                std::string message);
  // What a change concerns besides the Store (see Note [Asynchronous waits]):
  // everything; only one more waiting worker (the others' placements stand);
  // only a key of the generation's store.
  enum class Concerns { kAll, kArrival, kKv };
  // `persist`: whether the change must reach the Store (see Note
  // [Persistence]); a change that is not persisted (a heartbeat) concerns no
  // waiter.
  void Changed(Job& job, bool persist = true,
               Concerns concerns = Concerns::kAll);
  // What a change to a job's waiting workers can move besides them: its
  // generation, state, members and expected survivors.
  struct Placement {
    int64_t generation = 0;
    v1::JobState state = v1::JOB_STATE_RENDEZVOUS;
    size_t members = 0;
    size_t expected = 0;
    bool operator==(const Placement& o) const {
      return generation == o.generation && state == o.state &&
             members == o.members && expected == o.expected;
    }
  };
  static Placement PlacementOf(const Job& job);
  // After a worker was added to or taken from job.waiting: forms a
  // generation if one can form, and records the change (as an arrival,
  // see Note [Persistence], unless a placement moved).
  void WaitingChanged(Job& job, const Placement& before);
  static bool Ended(const Job& job);

  // Note [Starting again]
  // ~~~~~~~~~~~~~~~~~~~~~
  // A job that FAILED or was STOPPED is not the end of its training: the same
  // command run again (new worker processes, the same job id) starts it again,
  // as torchrun's users re-run a job after a total loss. A Join of such a job
  // from a process that is not of the run that ended (no previous generation,
  // and an id that is not bound, or bound to another secret) puts the job back
  // into its rendezvous: a "job" event says so and what ended it, the members,
  // waiting workers, kv and end-of-data state of the ended run are dropped, the
  // generation numbers go on, and the checkpoints reported stay. The ended
  // run's bindings are retired: a process of that run (its id with its secret)
  // that comes back is refused (FAILED_PRECONDITION), so a straggler never
  // joins the new run with the old state. A SUCCEEDED job stays succeeded.

  // See Note [Starting again]: whether `request` starts the ended `job` again,
  // and doing it.
  static bool StartsAgain(const Job& job, const v1::JoinRequest& request);
  void StartAgain(Job& job, const std::string& worker_id);
  static absl::Status EndedError(const Job& job);
  v1::MemberStatus StatusOf(const MemberState& m) const;
  // RestoreJob's consistency checks of a job's workers.
  static absl::Status CheckRestoredWorkers(const Job& job);

  const Clock* clock_;
  std::map<std::string, Job> jobs_;
  std::set<std::string> dirty_;
  std::set<std::string> dirty_arrivals_;  // See Note [Persistence]
  std::set<std::string> woken_;
  uint64_t version_ = 0;
};

}  // namespace concord::coordinator
