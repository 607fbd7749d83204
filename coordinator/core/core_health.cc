// A running job's health (see Note [Hangs], see Note [Stragglers] and see
// Note [Evicting stragglers], all in hang_rule.h): the members' progress as
// the rules see it, and applying their verdicts (hung members taken out,
// stragglers named or evicted, evicted workers held for their cool-down). The
// rules themselves are pure functions in hang_rule.cc; the state they judge is
// each member's MemberHealth and the job's Cooldowns (health.h); the tick that
// calls these is in core_lifecycle.cc.

#include <spdlog/spdlog.h>

#include <algorithm>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "coordinator/core/core.h"
#include "coordinator/core/core_internal.h"
#include "coordinator/core/core_validation.h"

namespace concord::coordinator {

using internal::JobNotFound;
using internal::Seconds;

std::vector<MemberProgress> Core::ProgressOf(const Job& job) {
  std::vector<MemberProgress> out;
  out.reserve(job.members.size());
  for (const MemberState& m : job.members) {
    out.push_back(m.health.ProgressOf(m.worker_id, m.rank, m.committed_step));
  }
  return out;
}

absl::Status Core::ProcessSeen(const std::string& job_id,
                               const std::string& worker_id,
                               const v1::ProcessView& process) {
  CONCORD_RETURN_IF_ERROR(ValidateProcess(job_id, worker_id, process));
  Job* job = FindJob(job_id);
  if (job == nullptr) return JobNotFound(job_id);
  if (job->state != v1::JOB_STATE_RUNNING) return absl::OkStatus();
  const std::optional<size_t> index = MemberIndex(*job, worker_id);
  if (!index.has_value()) return absl::OkStatus();
  job->members[*index].health.Seen(process, clock_->Now());
  return absl::OkStatus();
}

bool Core::TakeOutHung(Job& job, absl::Time now) {
  if (job.spec.hang_timeout_ms() < 0) return false;
  // Cheap first: only a member in a collective for the floor at least can
  // make the rule say anything (a tick costs little at 10,000 members).
  const absl::Duration least =
      job.spec.hang_timeout_ms() > 0
          ? absl::Milliseconds(job.spec.hang_timeout_ms())
          : kHangFloor;
  bool someone_waits = false;
  for (const MemberState& m : job.members) {
    if (m.health.WaitsFor(now, least)) {
      someone_waits = true;
      break;
    }
  }
  if (!someone_waits) return false;
  const HangVerdict verdict =
      JudgeHang(ProgressOf(job), now, job.spec.hang_timeout_ms());
  switch (verdict.kind) {
    case HangVerdict::Kind::kNone:
      return false;
    case HangVerdict::Kind::kStuckTogether:
      // Everyone comes back (the generation's event says why), and the
      // next generation's members probe each other before they connect
      // (see Note [Unreachable peers]): a partition between them is found,
      // not re-formed into again.
      EndGeneration(job, verdict.why, {});
      job.probe_next = true;
      return true;
    case HangVerdict::Kind::kHung:
      for (size_t i = 0; i < verdict.hung.size(); ++i) {
        AddEvent(job, "failure", verdict.hung[i], verdict.details[i]);
        job.bindings.erase(verdict.hung[i]);
      }
      EndGeneration(
          job, verdict.why,
          std::set<std::string>(verdict.hung.begin(), verdict.hung.end()));
      return true;
  }
  return false;
}

bool Core::CheckStragglers(Job& job, absl::Time now) {
  job.stragglers_checked = now;
  bool any = false;
  for (const MemberState& m : job.members) {
    if (m.health.progress().has_value() && m.health.progress()->own_ms() > 0) {
      any = true;
      break;
    }
  }
  if (!any) return false;
  const std::vector<MemberProgress> progress = ProgressOf(job);
  const std::vector<bool> slow = SlowMembers(progress);
  bool changed = false;
  for (size_t i = 0; i < job.members.size(); ++i) {
    MemberState& m = job.members[i];
    if (!m.health.CountInterval(slow[i])) continue;
    changed = true;
    const v1::WorkerProgress& p = *m.health.progress();
    const std::string what =
        m.health.straggler()
            ? absl::StrFormat(
                  "straggler: rank %d's own work is %.1f ms a step against "
                  "%.1f ms for the others (it waits %.1f ms; slow for %d "
                  "heartbeat intervals)",
                  m.rank, p.own_ms(), OthersOwnMs(progress, i), p.wait_ms(),
                  kStragglerIntervals)
            : absl::StrFormat(
                  "no longer a straggler: rank %d's own work is "
                  "%.1f ms a step against %.1f ms for the others",
                  m.rank, p.own_ms(), OthersOwnMs(progress, i));
    spdlog::warn("job {}: worker {}: {}", job.spec.job_id(), m.worker_id, what);
    AddEvent(job, "straggler", m.worker_id, what);
  }
  if (job.spec.stragglers() == "evict") {
    // See Note [Evicting stragglers]: the slowest straggler only; the
    // others' figures change without it.
    std::optional<size_t> slowest;
    for (size_t i = 0; i < job.members.size(); ++i) {
      const MemberState& m = job.members[i];
      if (m.health.straggler() &&
          (!slowest.has_value() ||
           m.health.progress()->own_ms() >
               job.members[*slowest].health.progress()->own_ms())) {
        slowest = i;
      }
    }
    if (slowest.has_value()) {
      const EvictionEstimate e =
          JudgeEviction(progress, *slowest, MinWorkers(job));
      if (e.evict) {
        const MemberState& m = job.members[*slowest];
        const std::string worker_id = m.worker_id;
        const absl::Duration base =
            absl::Milliseconds(job.spec.straggler_cooldown_ms());
        const Cooldowns::Cooling& c = job.cooling.Evict(worker_id, now, base);
        const absl::Duration cooldown = CooldownAfter(c.evictions, base);
        const std::string what = absl::StrFormat(
            "evicted as a straggler (rank %d): the job's throughput is %.2f "
            "steps/s with it and %.2f without it (estimated); it may join "
            "again after a cool-down of %s (eviction %d)",
            m.rank, e.with, e.without, Seconds(cooldown), c.evictions);
        spdlog::warn("job {}: worker {}: {}", job.spec.job_id(), worker_id,
                     what);
        AddEvent(job, "straggler", worker_id, what);
        job.bindings.erase(worker_id);
        EndGeneration(
            job,
            absl::StrCat("worker ", worker_id, " was evicted as a straggler"),
            {worker_id});
        return true;
      }
    }
  }
  if (changed) Changed(job);
  return false;
}

size_t Core::Eligible(const Job& job) {
  size_t held = 0;
  for (const auto& [worker_id, cooling] : job.cooling.all()) {
    const MemberState* w = job.waiting.Find(worker_id);
    if (w != nullptr && w->held) ++held;
  }
  return job.waiting.size() - held;
}

bool Core::ReleaseHeld(Job& job, absl::Time now) {
  bool released = false;
  for (const auto& [worker_id, cooling] : job.cooling.all()) {
    MemberState* w = job.waiting.Find(worker_id);
    if (w == nullptr || !w->held || cooling.until > now) continue;
    w->held = false;
    released = true;
    AddEvent(job, "join", worker_id,
             "its cool-down as an evicted straggler is over: it may be "
             "admitted again");
  }
  return released;
}

}  // namespace concord::coordinator
