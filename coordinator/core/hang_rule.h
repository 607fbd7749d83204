#pragma once
// Note [Hangs]
// ~~~~~~~~~~~~
// A heartbeat says a process lives, not that it trains: a worker stalled in a
// read from a hung filesystem, a deadlocked loader or a stuck kernel keeps
// heartbeating from its own thread while the others wait for it in a
// collective until the collective timeout (minutes). So every heartbeat also
// carries what the worker is doing (worker.proto's WorkerProgress): how many
// collectives it issued in its generation, the oldest one still in flight and
// for how long, the CPU time its process used, what it is busy with outside
// the step, and its recent step time. From those the coordinator tells apart,
// with the hang timeout T:
//
//  - waiting: a member whose oldest collective has been in flight for T,
//    unless its node agent sees its process stopped (SIGSTOP, a debugger):
//    stopped inside a collective, it waits in nothing, and it holds the
//    others up even in the collective they wait in (so a SIGSTOP that lands
//    mid-allreduce names it hung, not every member stuck together);
//  - hung: while some member waits, a member that is not waiting itself, has
//    not issued the collective the waiters wait in (its count is below the
//    highest waited number), reports no activity, and has shown no progress
//    of its own for T (no committed step, no collective issued, CPU below
//    kIdleCpuShare of one core between its heartbeats, or no heartbeat at
//    all: a stopped process; and, where its node agent looks at its process
//    (see Note [What the agent sees] in agent/process_view.h), no CPU there
//    either and no GPU busy: ProcessShowsProgress);
//  - busy: such a member that uses its CPU or its GPU (an evaluation pass
//    between epochs, a slow first batch) or says what it is busy with (a
//    checkpoint, a restore): left alone;
//  - stuck together: every member waits, and none has shown progress for T
//    (a hang in the network or the collective library): the generation is
//    aborted and re-formed, its links probed as after a failed collective.
//
// A member's GPU counts only while it waits in no collective: a waiter's GPU
// runs the collective's own kernel (NCCL's spins until its peers arrive), so
// members stuck together all look busy there. A hung member is taken out as
// a failed one is; the others re-form without it at once, and its event says
// what its agent last saw of its process (stopped, in a disk wait). T is
// JobSpec.hang_timeout_ms when set; derived, it is kHangFactor times the job's
// step time (the slowest member's median time between commits), at least
// kHangFloor; a member that has not yet reported a step time (before its first
// two commits: start-up, a newcomer's first batches) is judged with at least
// kStartupAllowance. The collective timeout stays the last resort. Pure
// functions of what the members reported (no clock, no core): unit-tested
// against false alarms as hard as against faults
// (tests/unit/hang_rule_test.cc).

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "concord/v1/worker.pb.h"

namespace concord::coordinator {

inline constexpr absl::Duration kHangFloor = absl::Seconds(5);
inline constexpr double kHangFactor = 5.0;
inline constexpr absl::Duration kStartupAllowance = absl::Seconds(60);
// CPU below this share of one core between two heartbeats is idle.
inline constexpr double kIdleCpuShare = 0.1;

// What the coordinator knows of one member of the running generation.
struct MemberProgress {
  std::string worker_id;
  int32_t rank = 0;
  int64_t step = 0;  // committed
  // Its last WorkerProgress (absent: an older worker, never judged hung) and
  // when it arrived.
  std::optional<v1::WorkerProgress> progress;
  absl::Time reported;
  // When it last showed progress of its own (ShowsProgress,
  // ProcessShowsProgress), or joined.
  absl::Time progressed;
  // What its node agent last saw of its process (absent without one), and
  // when the agent looked.
  std::optional<v1::ProcessView> process;
  absl::Time process_seen;
};

// Where a member stood when it last showed progress (the report then).
struct ProgressMark {
  int64_t generation = 0;
  int64_t collectives = 0;
  int64_t cpu_ms = 0;
  int64_t step = 0;
  absl::Time at;
};
ProgressMark MarkOf(const v1::WorkerProgress& report, int64_t step,
                    absl::Time at);

// Whether a member's report at `now` shows progress of its own since `mark`:
// a step committed, a collective issued, a new generation, an activity, or
// CPU above kIdleCpuShare of one core over the time since (measured from the
// mark, not from the last report: a heartbeat that comes early carries
// a heartbeat thread's crumbs of CPU over no time at all).
bool ShowsProgress(const ProgressMark& mark, const v1::WorkerProgress& report,
                   int64_t step, absl::Time now);

// Where a member's process stood, as its node agent saw it, when that view
// last showed progress (or first came).
struct ProcessMark {
  int64_t cpu_ms = 0;
  absl::Time at;
};
// A GPU this busy (NVML's SM utilisation, percent) runs the process's work.
inline constexpr int kBusyGpuPercent = 1;
// Whether the agent's view of a member's process, taken at `now`, shows
// progress of its own since `mark`: CPU as in ShowsProgress, or a GPU at
// least kBusyGpuPercent busy while the member waits in no collective
// (`waits`). A stopped or zombie process never does.
bool ProcessShowsProgress(const ProcessMark& mark, const v1::ProcessView& view,
                          bool waits, absl::Time now);
// What an agent's view says, for events: "stopped (SIGSTOP or a debugger)
// 2.0 s ago", "in uninterruptible sleep (disk or network filesystem I/O)
// 0.4 s ago, its GPU 0% busy"; `age`: how long ago the agent looked.
std::string DescribeProcess(const v1::ProcessView& view, absl::Duration age);

// The hang timeout for a job whose setting is `setting_ms` (JobSpec) and
// whose slowest member's step time is `step_ms` (0: none reported yet).
// Zero when the rule is off (setting -1).
absl::Duration HangTimeout(int64_t setting_ms, double step_ms);
// The job's step time for HangTimeout: the largest step_ms reported.
double JobStepMs(const std::vector<MemberProgress>& members);

struct HangVerdict {
  enum class Kind { kNone, kHung, kStuckTogether };
  Kind kind = Kind::kNone;
  // kHung: the hung members' worker ids, in rank order.
  std::vector<std::string> hung;
  // Per hung member (same order), what it was last doing, for its event.
  std::vector<std::string> details;
  // Who waits where, for the generation's end.
  std::string why;
};

// See Note [Hangs]. `setting_ms`: JobSpec.hang_timeout_ms.
HangVerdict JudgeHang(const std::vector<MemberProgress>& members,
                      absl::Time now, int64_t setting_ms);

// Note [Stragglers]
// ~~~~~~~~~~~~~~~~~
// In data-parallel training every member takes every step, so one slow
// member (a throttled GPU, a noisy neighbour, a degraded link) slows them
// all, and its step time is everyone's: what tells it apart is how a step's
// time splits. Each member reports the median, over its last 16 steps, of
// the time its threads were blocked in collectives (wait_ms) and of the rest
// (own_ms, its own work); the straggler works longest and waits least. Once
// a heartbeat interval the coordinator compares each member's own work with
// the others' (SlowMembers): slow when it is at least kStragglerFactor times
// the median of the others' and kStragglerMarginMs more. A member slow for
// kStragglerIntervals consecutive intervals is named a straggler (an event,
// a log line, its health "slow" in the status); it stops being one after as
// many intervals that are not slow (each fast interval takes one back).
// By default reported only: the job goes on with it (but see Note
// [Evicting stragglers]).
inline constexpr double kStragglerFactor = 1.5;
inline constexpr double kStragglerMarginMs = 2.0;
inline constexpr int kStragglerIntervals = 5;

// Per member (same order), whether its last report is slow against the
// others' (see Note [Stragglers]); false for a member without a report or
// an own time, and for every member of a job with fewer than two that
// have one.
std::vector<bool> SlowMembers(const std::vector<MemberProgress>& members);
// The median of the own times reported by the members other than `index`
// (0 without any).
double OthersOwnMs(const std::vector<MemberProgress>& members, size_t index);

// Note [Evicting stragglers]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// With JobSpec.stragglers "evict" (concord-run --stragglers evict), a member
// named a straggler (see Note [Stragglers]) is also taken out when the job
// trains faster without it, as Horovod's elastic mode blacklists a failing
// host. Every member takes every step, so the job's throughput is its size
// over its step time. With the straggler that is N / S, S its step time
// (everyone's); without it (N - 1) / S', S' estimated as the median of the
// others' own work O plus what the collectives take: at most what the
// straggler waits in them (it arrives last), and at most O (a straggler
// slow at everything, a throttled CPU, is slow inside the collectives too,
// and waits longer than they take). It is taken out (JudgeEviction) when
// (N - 1) / S' is at least kEvictionGain times N / S and N - 1 is at least
// the job's min_workers: at a fifth of the others' speed in a job of 3,
// S ~ 5 S' and the job is 3.3x faster without it; a member 1.5x slower in a
// job of 3 (the naming threshold) would make it only 1.0x faster and stays.
// The margin (1.25) covers an estimate that may be optimistic where the
// collectives take longer than the own work. It waits out a cool-down
// (JobSpec.straggler_cooldown_ms, 60 s by default) before it may join
// again, as a newcomer; each later eviction doubles the cool-down
// (CooldownAfter), so a worker that stays slow stays out longer and longer
// while one that recovered (a noisy neighbour gone) comes back; a rendezvous
// that would time out below min_workers without the held ones lets them in
// early (a slow worker is better than a failed job). "report" is
// the default: taking a worker out changes the job's size, which changes
// its global batch and the learning rate it needs unless the program scales
// them, and a slow member may be slow for a reason that passes; that is the
// user's call.
inline constexpr double kEvictionGain = 1.25;

struct EvictionEstimate {
  bool evict = false;
  // The job's throughput with and without the member, in steps of one
  // member's batch a second (N / S and (N - 1) / S').
  double with = 0;
  double without = 0;
};
// See Note [Evicting stragglers]: whether to take out member `index` of
// `members` (one named a straggler) in a job that must keep `min_workers`.
EvictionEstimate JudgeEviction(const std::vector<MemberProgress>& members,
                               size_t index, size_t min_workers);
// The cool-down after a worker's `evictions`-th eviction (1 for the first):
// `base` doubled for each one before it, at most kMaxCooldownDoublings times.
inline constexpr int kMaxCooldownDoublings = 10;
absl::Duration CooldownAfter(int evictions, absl::Duration base);

// A member's last collectives (WorkerProgress.recent), newest last, at most
// `n`: "#36 allreduce ended 5.0 s ago, #37 allreduce in flight 5.0 s"; ""
// without any.
std::string RecentCollectives(const v1::WorkerProgress& progress, size_t n);

// A member's health as the status shows it: "stopped" (its agent sees its
// process stopped), "waiting", "idle", "busy" or "" (progressing), judged
// with timeout `timeout` (zero: "" but for "stopped").
std::string HealthOf(const MemberProgress& member, absl::Time now,
                     absl::Duration timeout);

}  // namespace concord::coordinator
