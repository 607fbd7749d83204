#include "coordinator/core/hang_rule.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace concord::coordinator {
namespace {

std::string Secs(absl::Duration d) {
  return absl::StrFormat("%.1f s", absl::ToDoubleSeconds(d));
}

// When its oldest collective in flight was issued (nullopt: none).
std::optional<absl::Time> PendingSince(const MemberProgress& m) {
  if (!m.progress.has_value() || m.progress->pending_kind().empty()) {
    return std::nullopt;
  }
  return m.reported - absl::Milliseconds(m.progress->pending_ms());
}

// A member's own hang timeout: the job's, or the start-up allowance while it
// has no step time of its own and the timeout is derived.
absl::Duration OwnTimeout(const MemberProgress& m, int64_t setting_ms,
                          absl::Duration job_timeout) {
  if (setting_ms != 0 ||
      (m.progress.has_value() && m.progress->step_ms() > 0)) {
    return job_timeout;
  }
  return std::max(job_timeout, kStartupAllowance);
}

std::string Collective(int64_t seq, const std::string& kind) {
  if (kind.empty()) return "none";
  return seq > 0 ? absl::StrCat("#", seq, " (", kind, ")")
                 : absl::StrCat("a group's ", kind);
}

// Whether its node agent last saw the member's process stopped (SIGSTOP, a
// debugger, a frozen cgroup): whatever its last heartbeat said it waited in,
// it waits in nothing.
bool Stopped(const MemberProgress& m) {
  return m.process.has_value() && m.process->state() == "stopped";
}

}  // namespace

std::string RecentCollectives(const v1::WorkerProgress& progress, size_t n) {
  std::vector<std::string> parts;
  const int size = progress.recent_size();
  for (int i = std::max(0, size - static_cast<int>(n)); i < size; ++i) {
    const v1::FlightRecord& r = progress.recent(i);
    parts.push_back(absl::StrCat(
        r.seq() > 0 ? absl::StrCat("#", r.seq(), " ") : "a group's ", r.kind(),
        r.ended_ago_ms() >= 0
            ? absl::StrCat(" ended ",
                           Secs(absl::Milliseconds(r.ended_ago_ms())), " ago")
            : absl::StrCat(" in flight ",
                           Secs(absl::Milliseconds(r.issued_ago_ms())))));
  }
  return absl::StrJoin(parts, ", ");
}

ProgressMark MarkOf(const v1::WorkerProgress& report, int64_t step,
                    absl::Time at) {
  return {report.generation(), report.collectives(), report.cpu_ms(), step, at};
}

bool ShowsProgress(const ProgressMark& mark, const v1::WorkerProgress& report,
                   int64_t step, absl::Time now) {
  if (step != mark.step || report.generation() != mark.generation ||
      report.collectives() != mark.collectives || !report.activity().empty()) {
    return true;
  }
  const double cpu_ms = static_cast<double>(report.cpu_ms() - mark.cpu_ms);
  return cpu_ms >= kIdleCpuShare * absl::ToDoubleMilliseconds(now - mark.at);
}

bool ProcessShowsProgress(const ProcessMark& mark, const v1::ProcessView& view,
                          bool waits, absl::Time now) {
  if (view.state() == "stopped" || view.state() == "zombie") return false;
  if (!waits && view.has_gpu_percent() &&
      view.gpu_percent() >= kBusyGpuPercent) {
    return true;
  }
  const double cpu_ms = static_cast<double>(view.cpu_ms() - mark.cpu_ms);
  return now > mark.at &&
         cpu_ms >= kIdleCpuShare * absl::ToDoubleMilliseconds(now - mark.at);
}

std::string DescribeProcess(const v1::ProcessView& view, absl::Duration age) {
  std::string what;
  if (view.state() == "stopped") {
    what = "stopped (SIGSTOP or a debugger)";
  } else if (view.state() == "disk") {
    what = "in uninterruptible sleep (disk or network filesystem I/O)";
  } else if (view.state() == "zombie") {
    what = "a zombie (it exited, unreaped)";
  } else {
    what = view.state().empty() ? "in an unknown state" : view.state();
  }
  absl::StrAppend(&what, " ", Secs(age), " ago");
  if (view.has_gpu_percent()) {
    absl::StrAppend(&what, ", its GPU ", view.gpu_percent(), "% busy");
  }
  return what;
}

absl::Duration HangTimeout(int64_t setting_ms, double step_ms) {
  if (setting_ms < 0) return absl::ZeroDuration();
  if (setting_ms > 0) return absl::Milliseconds(setting_ms);
  if (!(step_ms > 0)) return kStartupAllowance;
  return std::max(kHangFloor, absl::Milliseconds(kHangFactor * step_ms));
}

double JobStepMs(const std::vector<MemberProgress>& members) {
  double step_ms = 0;
  for (const MemberProgress& m : members) {
    if (m.progress.has_value())
      step_ms = std::max(step_ms, m.progress->step_ms());
  }
  return step_ms;
}

HangVerdict JudgeHang(const std::vector<MemberProgress>& members,
                      absl::Time now, int64_t setting_ms) {
  HangVerdict verdict;
  const absl::Duration timeout = HangTimeout(setting_ms, JobStepMs(members));
  if (timeout <= absl::ZeroDuration() || members.empty()) return verdict;
  // Who waits, in which collective, and the highest number waited in (of
  // the newest generation reported: a member not connected to it yet has
  // issued nothing in it).
  std::vector<const MemberProgress*> waiters;
  int64_t waited_generation = 0;
  int64_t waited_seq = 0;
  bool all_reported = true;
  for (const MemberProgress& m : members) {
    if (!m.progress.has_value()) {
      all_reported = false;
      continue;
    }
    const std::optional<absl::Time> since = PendingSince(m);
    if (!since.has_value() || now - *since < timeout) continue;
    if (Stopped(m)) continue;  // in a collective, but waiting in nothing
    waiters.push_back(&m);
    const int64_t g = m.progress->generation();
    if (g > waited_generation) {
      waited_generation = g;
      waited_seq = 0;
    }
    if (g == waited_generation) {
      waited_seq = std::max(waited_seq, m.progress->pending_seq());
    }
  }
  if (waiters.empty()) return verdict;
  std::vector<std::string> waiting;
  for (const MemberProgress* w : waiters) {
    waiting.push_back(absl::StrCat(
        w->rank, " in ",
        Collective(w->progress->pending_seq(), w->progress->pending_kind()),
        " for ", Secs(now - *PendingSince(*w))));
  }
  const std::string who_waits =
      absl::StrCat("rank(s) ", absl::StrJoin(waiting, ", "));
  if (all_reported && waiters.size() == members.size()) {
    for (const MemberProgress& m : members) {
      if (now - m.progressed < timeout) return verdict;  // still moving
    }
    verdict.kind = HangVerdict::Kind::kStuckTogether;
    verdict.why =
        absl::StrCat("every member waits: ", who_waits,
                     ", none progressing (hang timeout ", Secs(timeout), ")");
    return verdict;
  }
  for (const MemberProgress& m : members) {
    if (!m.progress.has_value()) continue;
    const v1::WorkerProgress& p = *m.progress;
    const std::optional<absl::Time> since = PendingSince(m);
    const bool stopped = Stopped(m);
    if (!stopped && since.has_value() && now - *since >= timeout) {
      continue;  // a waiter
    }
    if (!p.activity().empty()) continue;  // busy
    const absl::Duration own = OwnTimeout(m, setting_ms, timeout);
    if (now - m.progressed < own) continue;  // progressing, or computing
    // It must hold the waiters up: not have issued what they wait in.
    const int64_t issued =
        p.generation() == waited_generation ? p.collectives() : 0;
    // (A stopped process holds them up wherever it stopped, even inside the
    // collective they wait in.)
    if (waited_seq > 0 && issued >= waited_seq && !stopped) continue;
    verdict.hung.push_back(m.worker_id);
    verdict.details.push_back(absl::StrFormat(
        "hung at step %d (rank %d): no progress of its own for %s (no step, "
        "no collective, CPU idle; last heartbeat %s ago); it issued %d "
        "collective(s), the last finished %s (%s ago)%s, while %s (hang "
        "timeout %s)",
        m.step, m.rank, Secs(now - m.progressed), Secs(now - m.reported),
        issued, p.last_kind().empty() ? "none" : p.last_kind(),
        Secs(absl::Milliseconds(p.last_ago_ms()) + (now - m.reported)),
        since.has_value()
            ? absl::StrCat(", ", Collective(p.pending_seq(), p.pending_kind()),
                           " in flight")
            : "",
        who_waits, Secs(own)));
    if (p.recent_size() > 0) {
      absl::StrAppend(&verdict.details.back(),
                      "; its last collectives: ", RecentCollectives(p, 4),
                      " (as of its last heartbeat)");
    }
    if (m.process.has_value()) {
      absl::StrAppend(&verdict.details.back(),
                      "; its node agent saw its process ",
                      DescribeProcess(*m.process, now - m.process_seen));
    }
  }
  if (!verdict.hung.empty()) {
    verdict.kind = HangVerdict::Kind::kHung;
    verdict.why = absl::StrCat("worker(s) ", absl::StrJoin(verdict.hung, ", "),
                               " hung while ", who_waits);
  }
  return verdict;
}

double OthersOwnMs(const std::vector<MemberProgress>& members, size_t index) {
  std::vector<double> own;
  own.reserve(members.size());
  for (size_t j = 0; j < members.size(); ++j) {
    const auto& p = members[j].progress;
    if (j != index && p.has_value() && p->own_ms() > 0) {
      own.push_back(p->own_ms());
    }
  }
  if (own.empty()) return 0;
  std::nth_element(own.begin(), own.begin() + own.size() / 2, own.end());
  return own[own.size() / 2];
}

std::vector<bool> SlowMembers(const std::vector<MemberProgress>& members) {
  std::vector<bool> slow(members.size(), false);
  // The others' median, once: the median of all, or (for a member on the
  // median's side) its neighbour; exact for one straggler among many, and
  // computed exactly below for small jobs.
  std::vector<double> own;
  for (const MemberProgress& m : members) {
    if (m.progress.has_value() && m.progress->own_ms() > 0) {
      own.push_back(m.progress->own_ms());
    }
  }
  if (own.size() < 2) return slow;
  std::sort(own.begin(), own.end());
  for (size_t i = 0; i < members.size(); ++i) {
    const auto& p = members[i].progress;
    if (!p.has_value() || !(p->own_ms() > 0)) continue;
    double others;
    if (own.size() <= 16) {
      others = OthersOwnMs(members, i);
    } else {
      // Removing one value from n sorted ones moves the median by at most one
      // place: the lower median of the rest.
      const size_t mid = (own.size() - 1) / 2;
      others = p->own_ms() >= own[mid] ? own[mid] : own[mid + 1];
    }
    slow[i] = p->own_ms() >= kStragglerFactor * others &&
              p->own_ms() - others >= kStragglerMarginMs;
  }
  return slow;
}

EvictionEstimate JudgeEviction(const std::vector<MemberProgress>& members,
                               size_t index, size_t min_workers) {
  EvictionEstimate e;
  if (index >= members.size() || members.size() < 2 ||
      members.size() - 1 < std::max<size_t>(min_workers, 1)) {
    return e;
  }
  const auto& p = members[index].progress;
  if (!p.has_value() || !(p->own_ms() > 0)) return e;
  const double others = OthersOwnMs(members, index);
  if (!(others > 0)) return e;
  const double n = static_cast<double>(members.size());
  const double step_ms =
      p->step_ms() > 0 ? p->step_ms() : p->own_ms() + p->wait_ms();
  // The collectives take at most what the straggler waits in them (it
  // arrives last); one slow at everything (a throttled CPU reduces slowly
  // too) waits longer than they take, so they are also capped at the
  // others' own work.
  const double without_ms = others + std::clamp(p->wait_ms(), 0.0, others);
  e.with = n * 1000.0 / step_ms;
  e.without = (n - 1) * 1000.0 / without_ms;
  e.evict = e.without >= kEvictionGain * e.with;
  return e;
}

absl::Duration CooldownAfter(int evictions, absl::Duration base) {
  const int doublings = std::clamp(evictions - 1, 0, kMaxCooldownDoublings);
  return base * (int64_t{1} << doublings);
}

std::string HealthOf(const MemberProgress& member, absl::Time now,
                     absl::Duration timeout) {
  if (Stopped(member)) {
    return "stopped";
  }
  if (timeout <= absl::ZeroDuration() || !member.progress.has_value()) {
    return "";
  }
  const std::optional<absl::Time> since = PendingSince(member);
  if (since.has_value() && now - *since >= timeout) return "waiting";
  if (!member.progress->activity().empty()) return "busy";
  if (now - member.progressed >= timeout) return "idle";
  return "";
}

}  // namespace concord::coordinator
