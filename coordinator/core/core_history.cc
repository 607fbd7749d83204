// The core's progress history (see Note [Job history] in job_history.h): fed by
// heartbeats, read by the metrics collector and the status page.

#include <algorithm>

#include "common/status_macros.h"
#include "coordinator/core/core.h"
#include "coordinator/core/core_internal.h"
#include "coordinator/core/core_validation.h"

namespace concord::coordinator {

namespace {

// Note [Lazy progress]
// ~~~~~~~~~~~~~~~~~~~~
// The history's newest point follows every heartbeat with the members'
// aggregates (see Note [Job history]), which cost O(members); computed per
// heartbeat, a job of N workers at 1 Hz would cost O(N^2) per second. So a
// heartbeat only notes its time (Job::progress_pending), and the aggregates are
// computed when they are needed: before a heartbeat whose point (or the pending
// one) starts a new point rather than moving the newest, before the members
// change (a generation forms or ends), and for a reader (on a copy). A pending
// point that would only have been replaced by the next heartbeat's is skipped,
// which leaves the same points as computing every one: the history's decision
// to append depends only on the points before the newest, which a replacement
// does not change.
template <typename Members>
void Record(JobHistory& history, absl::Time at, const Members& members) {
  int64_t step = 0;
  double samples_per_second = 0;
  double loss_sum = 0;
  int losses = 0;
  for (const auto& m : members) {
    step = std::max(step, m.committed_step);
    samples_per_second += m.samples_per_second;
    if (m.loss.has_value()) {
      loss_sum += *m.loss;
      ++losses;
    }
  }
  std::optional<double> loss;
  if (losses > 0) loss = loss_sum / losses;
  history.RecordProgress(at, step, samples_per_second, loss,
                         static_cast<int32_t>(members.size()));
}

}  // namespace

void Core::BeforeProgress(Job& job, absl::Time now) {
  if (job.progress_pending.has_value() &&
      (job.history.Appends(*job.progress_pending) ||
       job.history.Appends(now))) {
    FlushProgress(job);
  }
}

void Core::FlushProgress(Job& job) {
  if (!job.progress_pending.has_value()) return;
  Record(job.history, *job.progress_pending, job.members);
  job.progress_pending.reset();
}

JobHistory Core::CurrentHistory(const Job& job) {
  JobHistory history = job.history;
  if (job.progress_pending.has_value()) {
    Record(history, *job.progress_pending, job.members);
  }
  return history;
}

absl::StatusOr<JobHistory> Core::History(const std::string& job_id) const {
  CONCORD_RETURN_IF_ERROR(ValidateId("job_id", job_id));
  const Job* job = FindJob(job_id);
  if (job == nullptr) return internal::JobNotFound(job_id);
  return CurrentHistory(*job);
}

std::vector<JobMetricsSample> Core::MetricsSamples(
    absl::Duration ended_retention) const {
  const absl::Time now = clock_->Now();
  std::vector<JobMetricsSample> samples;
  for (const auto& [id, job] : jobs_) {
    if (Ended(job) && !job.events.empty() &&
        now - job.events.back().time > ended_retention) {
      continue;
    }
    JobMetricsSample& s = samples.emplace_back();
    s.job_id = id;
    s.state = job.state;
    s.generation = job.generation;
    s.members = static_cast<int32_t>(job.members.size());
    s.waiting = static_cast<int32_t>(job.waiting.size());
    const JobHistory h = CurrentHistory(job);
    if (!h.points().empty()) {
      const ProgressPoint& last = h.points().back();
      s.step = last.step;
      // A job between generations (or ended) trains at no speed.
      if (job.state == v1::JOB_STATE_RUNNING) {
        s.samples_per_second = last.samples_per_second;
        s.steps_per_second = h.StepsPerSecond();
      }
      s.loss = last.loss;
    }
    s.failures = h.failures();
    s.reform_buckets = h.reform_buckets();
    s.reform_count = h.reform_count();
    s.reform_seconds_sum = h.reform_seconds_sum();
    if (h.last_reform().has_value()) {
      s.last_reform_seconds = absl::ToDoubleSeconds(*h.last_reform());
    }
    s.checkpoint_totals = job.checkpoints.totals();
    if (!job.checkpoints.kept().empty()) {
      s.last_checkpoint = job.checkpoints.kept().back();
    }
    if (job.state != v1::JOB_STATE_RUNNING) continue;
    for (const MemberState& m : job.members) {
      const std::optional<v1::WorkerProgress>& p = m.health.progress();
      if (!p.has_value() || !(p->step_ms() > 0)) continue;
      s.workers.push_back({m.worker_id, p->step_ms(), p->own_ms(), p->wait_ms(),
                           m.health.straggler()});
    }
  }
  return samples;
}

}  // namespace concord::coordinator
