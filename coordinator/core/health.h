#pragma once
// A running job's health, one part of the coordinator's core (core.h): what
// each member's heartbeats and its node agent tell of its progress and where
// it last showed progress of its own (see Note [Hangs] in hang_rule.h), its
// straggler count (see Note [Stragglers] in hang_rule.h), and the job's
// workers evicted as stragglers with their cool-downs (see Note [Evicting
// stragglers] in hang_rule.h).
//
// The rules that judge them are the pure functions of hang_rule.h; the core
// applies their verdicts to its membership (taking members out, ending a
// generation) and makes the events. Time is passed in.

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "concord/v1/coordinator_state.pb.h"
#include "concord/v1/worker.pb.h"
#include "coordinator/core/hang_rule.h"

namespace concord::coordinator {

// One member's health. Transient: never exported (a restored member starts
// with none).
class MemberHealth {
 public:
  // A heartbeat at `now` carried `progress`, at committed step `step`.
  void Reported(const v1::WorkerProgress& progress, int64_t step,
                absl::Time now);
  // See Note [What the agent sees] in agent/process_view.h: at `now` its node
  // agent said what it saw of the member's process (process.age_ms ago, at
  // most a minute).
  void Seen(const v1::ProcessView& process, absl::Time now);
  // A generation formed at `now` with this member at committed step `step`:
  // a fresh start, what was in flight belonged to the last one.
  void Restart(int64_t step, absl::Time now);

  // Whether, at `now`, its oldest collective has been in flight for `least`
  // at least (the hang rule can say nothing while no member's has).
  bool WaitsFor(absl::Time now, absl::Duration least) const;
  // As the rules see it, for the member `worker_id` of rank `rank` at
  // committed step `step`.
  MemberProgress ProgressOf(const std::string& worker_id, int32_t rank,
                            int64_t step) const;
  // See Note [Stragglers] in hang_rule.h: one heartbeat interval, slow or
  // not. Returns whether that made it a straggler or ended its being one.
  bool CountInterval(bool slow);

  bool straggler() const { return straggler_; }
  // Its last WorkerProgress.
  const std::optional<v1::WorkerProgress>& progress() const {
    return progress_;
  }
  // What its node agent saw last, and when.
  const std::optional<v1::ProcessView>& process() const { return process_; }
  absl::Time process_seen() const { return process_seen_; }

 private:
  // Its last WorkerProgress, when it arrived, and where it stood when it
  // last showed progress of its own.
  std::optional<v1::WorkerProgress> progress_;
  absl::Time progress_reported_;
  ProgressMark mark_;
  // What its node agent last saw of its process and when the agent looked,
  // where that view last showed progress, and when.
  std::optional<v1::ProcessView> process_;
  absl::Time process_seen_;
  ProcessMark process_mark_;
  absl::Time process_progressed_ = absl::InfinitePast();
  // Slow intervals counted up, fast ones down (0..2 x kStragglerIntervals),
  // and whether it is named a straggler.
  int slow_count_ = 0;
  bool straggler_ = false;
};

// See Note [Evicting stragglers] in hang_rule.h: a job's workers evicted as
// stragglers, how often, and until when each is held back. Kept for the
// job's life (a worker evicted again waits longer) and persisted with it.
class Cooldowns {
 public:
  struct Cooling {
    int evictions = 0;
    absl::Time until;
  };

  // `worker_id` is evicted at `now`: its cool-down is CooldownAfter its
  // evictions so far with this one, from `base`.
  const Cooling& Evict(const std::string& worker_id, absl::Time now,
                       absl::Duration base);
  // When the cool-down of `worker_id` ends, while it lasts at `now`.
  std::optional<absl::Time> HeldUntil(const std::string& worker_id,
                                      absl::Time now) const;
  // By worker id.
  const std::map<std::string, Cooling>& all() const { return cooling_; }
  bool empty() const { return cooling_.empty(); }
  void Clear() { cooling_.clear(); }

  // See Note [Persistence] in core.h. Restore adds the record's entries;
  // INVALID_ARGUMENT (naming the job `job_id`) for one without a worker or
  // an eviction.
  void Export(v1::JobRecord& record) const;
  absl::Status Restore(const v1::JobRecord& record, const std::string& job_id);

 private:
  std::map<std::string, Cooling> cooling_;
};

}  // namespace concord::coordinator
