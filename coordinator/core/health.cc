#include "coordinator/core/health.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace concord::coordinator {

void MemberHealth::Reported(const v1::WorkerProgress& progress, int64_t step,
                            absl::Time now) {
  // See Note [Hangs] in hang_rule.h.
  if (!progress_.has_value() || ShowsProgress(mark_, progress, step, now)) {
    mark_ = MarkOf(progress, step, now);
  }
  progress_ = progress;
  progress_reported_ = now;
}

void MemberHealth::Seen(const v1::ProcessView& process, absl::Time now) {
  const absl::Time seen =
      now - absl::Milliseconds(std::min<int64_t>(process.age_ms(), 60000));
  // See Note [Hangs] in hang_rule.h: the GPU of a member in a collective
  // runs that collective's kernel.
  const bool waits =
      progress_.has_value() && !progress_->pending_kind().empty();
  // At first sight the mark is where it stands (no CPU over no time; a busy
  // GPU is progress already).
  if (!process_.has_value()) process_mark_ = {process.cpu_ms(), seen};
  if (ProcessShowsProgress(process_mark_, process, waits, seen)) {
    process_mark_ = {process.cpu_ms(), seen};
    process_progressed_ = seen;
  }
  process_ = process;
  process_seen_ = seen;
}

void MemberHealth::Restart(int64_t step, absl::Time now) {
  mark_ = progress_.has_value() ? MarkOf(*progress_, step, now)
                                : ProgressMark{0, 0, 0, 0, now};
  if (progress_.has_value()) {
    progress_->set_pending_seq(0);
    progress_->clear_pending_kind();
    progress_->set_pending_ms(0);
  }
}

bool MemberHealth::WaitsFor(absl::Time now, absl::Duration least) const {
  return progress_.has_value() && !progress_->pending_kind().empty() &&
         now - progress_reported_ +
                 absl::Milliseconds(progress_->pending_ms()) >=
             least;
}

MemberProgress MemberHealth::ProgressOf(const std::string& worker_id,
                                        int32_t rank, int64_t step) const {
  MemberProgress p;
  p.worker_id = worker_id;
  p.rank = rank;
  p.step = step;
  p.progress = progress_;
  p.reported = progress_reported_;
  p.progressed = std::max(mark_.at, process_progressed_);
  p.process = process_;
  p.process_seen = process_seen_;
  return p;
}

bool MemberHealth::CountInterval(bool slow) {
  slow_count_ =
      std::clamp(slow_count_ + (slow ? 1 : -1), 0, 2 * kStragglerIntervals);
  const bool was = straggler_;
  if (!straggler_ && slow_count_ >= kStragglerIntervals) {
    straggler_ = true;
  } else if (straggler_ && slow_count_ == 0) {
    straggler_ = false;
  }
  return straggler_ != was;
}

const Cooldowns::Cooling& Cooldowns::Evict(const std::string& worker_id,
                                           absl::Time now,
                                           absl::Duration base) {
  Cooling& c = cooling_[worker_id];
  ++c.evictions;
  c.until = now + CooldownAfter(c.evictions, base);
  return c;
}

std::optional<absl::Time> Cooldowns::HeldUntil(const std::string& worker_id,
                                               absl::Time now) const {
  auto it = cooling_.find(worker_id);
  if (it == cooling_.end() || it->second.until <= now) return std::nullopt;
  return it->second.until;
}

void Cooldowns::Export(v1::JobRecord& record) const {
  for (const auto& [w, c] : cooling_) {
    v1::CoolingRecord& r = *record.add_cooling();
    r.set_worker_id(w);
    r.set_evictions(c.evictions);
    r.set_until_unix_ms(absl::ToUnixMillis(c.until));
  }
}

absl::Status Cooldowns::Restore(const v1::JobRecord& record,
                                const std::string& job_id) {
  for (const v1::CoolingRecord& r : record.cooling()) {
    if (r.worker_id().empty() || r.evictions() < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("job record ", job_id,
                       ": a cooling entry without a worker or an eviction"));
    }
    Cooling& c = cooling_[r.worker_id()];
    c.evictions = r.evictions();
    c.until = absl::FromUnixMillis(r.until_unix_ms());
  }
  return absl::OkStatus();
}

}  // namespace concord::coordinator
