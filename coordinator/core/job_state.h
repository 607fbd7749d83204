#pragma once
// A job's state in the coordinator's core (core.h): what Core keeps of each
// job and each of its workers. Its parts with their own state are members:
// the checkpoint records (checkpoint_records.h), the events (event_log.h),
// the watch streams (watches.h), the members' health and the straggler
// cool-downs (health.h), the history (job_history.h). Core alone reads and
// writes these (they are its private types); the rest of the tree sees jobs
// through Core's API.

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/time/time.h"
#include "concord/v1/coordinator_state.pb.h"
#include "concord/v1/operator.pb.h"
#include "concord/v1/worker.pb.h"
#include "coordinator/core/checkpoint_records.h"
#include "coordinator/core/event_log.h"
#include "coordinator/core/health.h"
#include "coordinator/core/job_history.h"
#include "coordinator/core/watches.h"
#include "coordinator/core/worker_list.h"

namespace concord::coordinator {

// See Note [Asynchronous waits] in host.h: which of a job's pending calls a
// change may concern, so that the host re-asks the core only for those. Each is
// the core's version() at the job's last change of that kind (never reused,
// also across RestoreJob); 0 for an unknown job.
struct JobEpochs {
  // A worker's GetAssignment answer may differ: a generation formed or
  // ended, a worker stopped waiting, the job ended. A plain arrival of one
  // more waiting worker is not one.
  uint64_t placement = 0;
  // A KvGet answer may differ: a key was set, or placement changed.
  uint64_t kv = 0;
  // A Membership view may differ: any persisted change but a KvSet.
  uint64_t view = 0;
};

namespace internal {

struct MemberState {
  std::string worker_id;
  std::string host;
  int64_t committed_step = 0;
  // When this worker process first joined the job (see Note [Formation]).
  absl::Time joined;
  absl::Time last_heartbeat;
  int32_t rank = -1;
  // Of an expected survivor: it has joined again (it is in `waiting` too).
  bool back = false;
  // Of a waiting worker: the Join that registered it last (CancelJoin).
  uint64_t join_call = 0;
  bool completed = false;
  // Its reachability probe's port, and (of a waiting worker) the members
  // of its last generation it could not reach (see Note [Unreachable peers]).
  int32_t probe_port = 0;
  std::set<std::string> unreachable;
  double samples_per_second = 0;
  std::optional<double> loss;  // of its last heartbeat that had one
  v1::DdpTimings ddp;
  // See Note [Hangs] and see Note [Stragglers] in hang_rule.h: its
  // progress as the rules see it (transient, never exported).
  MemberHealth health;
  // Of a waiting worker: an evicted straggler in its cool-down, which no
  // generation admits yet (see Note [Evicting stragglers]).
  bool held = false;
};
struct JobState {
  v1::JobSpec spec;
  v1::JobState state = v1::JOB_STATE_RENDEZVOUS;
  std::string failure;
  int64_t generation = 0;  // current; 0 before the first forms
  int32_t authoritative_rank = 0;
  std::vector<MemberState> members;  // of the current generation, by rank
  WorkerList<MemberState> waiting;   // registered for the next generation
  uint64_t join_calls = 0;           // Joins numbered so far (CancelJoin)
  // Survivors of the ended generation `generation` that the next one waits
  // for (see Note [Re-forming]); those already back are in `waiting` too.
  // Empty while a generation runs.
  WorkerList<MemberState> expected;
  absl::Time rendezvous_started;
  absl::Time last_arrival;  // of a new waiting worker (see Note [Formation])
  std::map<std::string, std::string> kv;  // of the current generation
  EventLog events;
  std::map<std::string, std::string> bindings;  // See Note [Worker binding]
  // See Note [Starting again]: the bindings of the run that ended last.
  std::map<std::string, std::string> retired;
  std::set<std::string> drained;
  // Left for good: ran out of data, or had completed when their generation
  // ended. A later Leave of theirs is a no-op.
  std::set<std::string> finished;
  // The run, the checkpoints and memory snapshots reported, and what the
  // current generation resumes from (see Note [Runs], see Note [Resume
  // source]).
  CheckpointRecords checkpoints;
  // The workers' WatchMembership streams (see Note [Re-forming];
  // transient, never exported).
  Watches watches;
  // Transient, never exported (see Note [Job history]).
  JobHistory history;
  // Transient (see Note [Asynchronous waits]).
  JobEpochs epochs;
  // When the members were last compared for stragglers (see Note
  // [Stragglers] in hang_rule.h; transient).
  absl::Time stragglers_checked;
  // See Note [Evicting stragglers] in hang_rule.h: the workers evicted as
  // stragglers (kept for the job's life, so that a worker evicted again
  // waits longer).
  Cooldowns cooling;
  // The time of the last heartbeat not yet in `history` (see Note [Lazy
  // progress] in core_history.cc); transient.
  std::optional<absl::Time> progress_pending;
  // GetAssignment's member table, valid while the core's version() is
  // `member_table_version` (transient).
  mutable std::shared_ptr<const std::vector<v1::Member>> member_table;
  mutable uint64_t member_table_version = 0;
  // `members` by worker id: index into `members`, valid while the
  // generation and the number of members are those noted (transient).
  mutable std::unordered_map<std::string, size_t> member_index;
  mutable int64_t member_index_generation = -1;
  mutable size_t member_index_size = 0;
  // Transient: the ranks of the generation that ended last, by worker,
  // its number and size; then the RankChange of the current generation
  // (absent for the first, or after a restore).
  std::unordered_map<std::string, int32_t> ended_ranks;
  int64_t ended_generation = 0;
  int32_t ended_world_size = 0;
  std::optional<v1::RankChange> rank_change;
  // See Assignment::probe: the generation that ended was stuck together
  // (probe_next), and so the current one probes (transient).
  bool probe_next = false;
  bool probe = false;
  // What every watcher of the job sees alike (see Note [Asynchronous
  // waits]): the view epoch moves only when this does (transient).
  std::string view_key;
};

}  // namespace internal
}  // namespace concord::coordinator
