// The core's operator views, admin actions (drain, stop), the workers'
// membership view, and persistence (export/restore of job records).

#include <algorithm>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "coordinator/core/core.h"
#include "coordinator/core/core_internal.h"
#include "coordinator/core/core_validation.h"

namespace concord::coordinator {

using internal::JobNotFound;

namespace {

int64_t UnixMs(absl::Time t) { return absl::ToUnixMillis(t); }

}  // namespace

absl::StatusOr<v1::MembershipUpdate> Core::Membership(
    const v1::WatchMembershipRequest& request) const {
  CONCORD_RETURN_IF_ERROR(ValidateRequest(request));
  const Job* job = FindJob(request.job_id());
  if (job == nullptr) return JobNotFound(request.job_id());
  CONCORD_RETURN_IF_ERROR(
      CheckBinding(*job, request.worker_id(), request.worker_secret()));
  v1::MembershipUpdate update;
  update.set_generation(job->generation);
  update.set_state(job->state);
  update.set_failure(job->failure);
  update.set_authoritative_rank(job->authoritative_rank);
  update.set_world_size(static_cast<int32_t>(job->members.size()));
  update.set_rank(-1);
  update.set_waiting_workers(WaitingWorkers(*job));
  if (const std::optional<size_t> i = MemberIndex(*job, request.worker_id());
      i.has_value()) {
    update.set_is_member(true);
    update.set_rank(job->members[*i].rank);
  }
  if (request.include_members()) {
    for (const MemberState& m : job->members) {
      v1::Member& out = *update.add_members();
      out.set_worker_id(m.worker_id);
      out.set_rank(m.rank);
      out.set_host(m.host);
    }
  }
  return update;
}

v1::MemberStatus Core::StatusOf(const MemberState& m) const {
  v1::MemberStatus out;
  out.set_worker_id(m.worker_id);
  out.set_rank(m.rank);
  out.set_host(m.host);
  out.set_committed_step(m.committed_step);
  out.set_last_heartbeat_age_ms(std::max<int64_t>(
      0, absl::ToInt64Milliseconds(clock_->Now() - m.last_heartbeat)));
  out.set_samples_per_second(m.samples_per_second);
  *out.mutable_ddp() = m.ddp;
  out.set_completed(m.completed);
  if (m.loss.has_value()) out.set_loss(*m.loss);
  if (m.health.progress().has_value()) {
    *out.mutable_progress() = *m.health.progress();
  }
  if (m.health.process().has_value()) {
    *out.mutable_process() = *m.health.process();
    out.set_process_age_ms(std::max<int64_t>(
        0, absl::ToInt64Milliseconds(clock_->Now() - m.health.process_seen())));
  }
  return out;
}

v1::ListJobsResponse Core::ListJobs() const {
  v1::ListJobsResponse response;
  for (const auto& [id, job] : jobs_) {
    v1::JobSummary& s = *response.add_jobs();
    s.set_job_id(id);
    s.set_state(job.state);
    s.set_generation(job.generation);
    s.set_world_size(static_cast<int32_t>(job.members.size()));
    s.set_waiting(static_cast<int32_t>(job.waiting.size()));
    s.set_min_workers(job.spec.min_workers());
    s.set_max_workers(job.spec.max_workers());
    s.set_failure(job.failure);
  }
  return response;
}

absl::StatusOr<v1::JobStatus> Core::GetJob(
    const v1::GetJobRequest& request) const {
  CONCORD_RETURN_IF_ERROR(ValidateRequest(request));
  const Job* job = FindJob(request.job_id());
  if (job == nullptr) return JobNotFound(request.job_id());
  v1::JobStatus status;
  *status.mutable_spec() = job->spec;
  status.set_state(job->state);
  status.set_failure(job->failure);
  status.set_generation(job->generation);
  status.set_authoritative_rank(job->authoritative_rank);
  // See Note [Hangs] in hang_rule.h: the timeout in force, and how the rule
  // sees each member.
  const std::vector<MemberProgress> progress = ProgressOf(*job);
  const absl::Duration hang_timeout =
      HangTimeout(job->spec.hang_timeout_ms(), JobStepMs(progress));
  status.set_hang_timeout_ms(absl::ToInt64Milliseconds(hang_timeout));
  status.set_run(job->checkpoints.run());
  for (size_t i = 0; i < job->members.size(); ++i) {
    v1::MemberStatus& out = *status.add_members();
    out = StatusOf(job->members[i]);
    if (job->state == v1::JOB_STATE_RUNNING) {
      out.set_health(HealthOf(progress[i], clock_->Now(), hang_timeout));
      if (out.health().empty() && job->members[i].health.straggler()) {
        out.set_health("slow");
      }
    }
  }
  for (const MemberState& m : job->waiting) {
    v1::MemberStatus& out = *status.add_waiting();
    out = StatusOf(m);
    if (m.held) {
      // See Note [Evicting stragglers] in hang_rule.h.
      const absl::Duration left =
          job->cooling.all().at(m.worker_id).until - clock_->Now();
      out.set_health(absl::StrCat(
          "cooling down (",
          absl::ToInt64Seconds(std::max(left, absl::ZeroDuration())),
          " s left)"));
    }
  }
  for (const MemberState& m : job->expected) {
    if (!m.back) *status.add_expected() = StatusOf(m);
  }
  for (const v1::CheckpointReport& c : job->checkpoints.kept()) {
    *status.add_checkpoints() = c;
  }
  *status.mutable_checkpoint_totals() = job->checkpoints.totals();
  for (v1::Event& e : job->events.Recent(internal::kRecentEvents)) {
    *status.add_recent_events() = std::move(e);
  }
  return status;
}

absl::StatusOr<v1::ListEventsResponse> Core::ListEvents(
    const v1::ListEventsRequest& request) const {
  CONCORD_RETURN_IF_ERROR(ValidateRequest(request));
  const Job* job = FindJob(request.job_id());
  if (job == nullptr) return JobNotFound(request.job_id());
  const int limit = request.limit() == 0 ? 100 : request.limit();
  v1::ListEventsResponse response;
  for (v1::Event& e : job->events.Page(request.after_seq(), limit)) {
    *response.add_events() = std::move(e);
  }
  return response;
}

absl::StatusOr<v1::DrainWorkerResponse> Core::DrainWorker(
    const v1::DrainWorkerRequest& request) {
  CONCORD_RETURN_IF_ERROR(ValidateRequest(request));
  Job* job = FindJob(request.job_id());
  if (job == nullptr) return JobNotFound(request.job_id());
  CONCORD_RETURN_IF_ERROR(EndedError(*job));
  const std::string& worker_id = request.worker_id();
  const std::string why =
      request.reason().empty()
          ? std::string("drained by an operator")
          : absl::StrCat("drained by an operator: ", request.reason());
  v1::DrainWorkerResponse response;
  const bool waiting = job->waiting.Find(worker_id) != nullptr;
  const bool member = MemberIndex(*job, worker_id).has_value();
  if (!waiting && !member && job->bindings.count(worker_id) == 0) {
    return absl::NotFoundError(absl::StrFormat("worker %s is not in job %s",
                                               worker_id, request.job_id()));
  }
  job->drained.insert(worker_id);
  job->bindings.erase(worker_id);
  AddEvent(*job, "drain", worker_id, why);
  // Neither waiting nor expected any more (see Note [Re-forming]).
  Forget(*job, worker_id);
  if (member) {
    response.set_ended_generation(job->generation);
    EndGeneration(*job, absl::StrCat("worker ", worker_id, " ", why),
                  {worker_id});
  }
  MaybeFormGeneration(*job);
  Changed(*job);
  return response;
}

absl::StatusOr<v1::StopJobResponse> Core::StopJob(
    const v1::StopJobRequest& request) {
  CONCORD_RETURN_IF_ERROR(ValidateRequest(request));
  Job* job = FindJob(request.job_id());
  if (job == nullptr) return JobNotFound(request.job_id());
  v1::StopJobResponse response;
  if (!Ended(*job)) {
    job->state = v1::JOB_STATE_STOPPED;
    job->failure =
        request.reason().empty()
            ? std::string("stopped by an operator")
            : absl::StrCat("stopped by an operator: ", request.reason());
    job->waiting.Clear();
    job->expected.Clear();
    job->kv.clear();
    AddEvent(*job, "stop", "", job->failure);
    Changed(*job);
  }
  response.set_state(job->state);
  return response;
}

std::optional<v1::JobRecord> Core::ExportJob(const std::string& job_id) const {
  const Job* job = FindJob(job_id);
  if (job == nullptr) return std::nullopt;
  auto member_record = [](const MemberState& m) {
    v1::MemberRecord r;
    r.set_last_heartbeat_unix_ms(UnixMs(m.last_heartbeat));
    r.set_worker_id(m.worker_id);
    r.set_host(m.host);
    r.set_committed_step(m.committed_step);
    r.set_joined_unix_ms(UnixMs(m.joined));
    r.set_rank(m.rank);
    r.set_completed(m.completed);
    r.set_samples_per_second(m.samples_per_second);
    return r;
  };
  v1::JobRecord record;
  *record.mutable_spec() = job->spec;
  record.set_state(job->state);
  record.set_failure(job->failure);
  record.set_generation(job->generation);
  record.set_authoritative_rank(job->authoritative_rank);
  for (const MemberState& m : job->members) {
    *record.add_members() = member_record(m);
  }
  for (const MemberState& m : job->waiting) {
    *record.add_waiting() = member_record(m);
  }
  for (const MemberState& m : job->expected) {
    *record.add_expected() = member_record(m);
  }
  for (const std::string& w : job->finished) record.add_finished(w);
  job->checkpoints.Export(record);
  for (const auto& [w, s] : job->retired) {
    (*record.mutable_retired_bindings())[w] = s;
  }
  for (const auto& [k, v] : job->kv) (*record.mutable_kv())[k] = v;
  job->events.Export(record);
  for (const auto& [w, s] : job->bindings) (*record.mutable_bindings())[w] = s;
  for (const std::string& w : job->drained) record.add_drained(w);
  job->cooling.Export(record);
  return record;
}

// See Note [Re-forming]: expected survivors belong to an ended generation whose
// successor has not formed, are bound, and are neither drained nor finished;
// no worker is twice a member, waiting or expected.
absl::Status Core::CheckRestoredWorkers(const Job& job) {
  const std::string& id = job.spec.job_id();
  auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(
        absl::StrCat("job record ", id, ": ", what));
  };
  std::set<std::string> members, waiting, expected;
  for (const MemberState& m : job.members) {
    if (!members.insert(m.worker_id).second) {
      return bad(absl::StrCat("member ", m.worker_id, " is listed twice"));
    }
  }
  for (const MemberState& m : job.waiting) {
    if (!waiting.insert(m.worker_id).second || members.count(m.worker_id)) {
      return bad(absl::StrCat("waiting worker ", m.worker_id,
                              " is listed twice or is a member"));
    }
  }
  if (!job.expected.empty() && (job.state != v1::JOB_STATE_RENDEZVOUS ||
                                !job.members.empty() || job.generation < 1)) {
    return bad(
        "expected survivors outside a rendezvous after an ended generation");
  }
  for (const MemberState& m : job.expected) {
    if (absl::Status s = ValidateId("expected.worker_id", m.worker_id);
        !s.ok()) {
      return bad(std::string(s.message()));
    }
    if (!expected.insert(m.worker_id).second) {
      return bad(
          absl::StrCat("expected survivor ", m.worker_id, " is listed twice"));
    }
    if (job.bindings.count(m.worker_id) == 0 ||
        job.drained.count(m.worker_id) > 0 ||
        job.finished.count(m.worker_id) > 0) {
      return bad(absl::StrCat("expected survivor ", m.worker_id,
                              " is unbound, drained or finished"));
    }
  }
  for (const std::string& w : job.finished) {
    if (absl::Status s = ValidateId("finished", w); !s.ok()) {
      return bad(std::string(s.message()));
    }
  }
  for (const auto& [w, secret] : job.retired) {
    if (absl::Status s = ValidateId("retired binding", w); !s.ok()) {
      return bad(std::string(s.message()));
    }
  }
  return job.checkpoints.Check(id);
}

absl::Status Core::RestoreJob(const v1::JobRecord& record) {
  CONCORD_RETURN_IF_ERROR(ValidateSpec(record.spec()));
  if (record.generation() < 0 || record.run() < 0 ||
      !v1::JobState_IsValid(record.state()) ||
      record.state() == v1::JOB_STATE_UNSPECIFIED) {
    return absl::InvalidArgumentError(absl::StrCat(
        "job record ", record.spec().job_id(), " has a bad generation/state"));
  }
  const absl::Time now = clock_->Now();
  Job job;
  // A record from before a field was added holds no value for it.
  job.spec = WithDefaults(record.spec());
  job.state = record.state();
  job.failure = record.failure();
  job.generation = record.generation();
  job.authoritative_rank = record.authoritative_rank();
  auto restore_member = [&](const v1::MemberRecord& r) {
    MemberState m;
    m.worker_id = r.worker_id();
    m.host = r.host();
    m.committed_step = r.committed_step();
    m.joined = absl::FromUnixMillis(r.joined_unix_ms());
    m.last_heartbeat = now;  // a full timeout to reconnect
    m.rank = r.rank();
    m.completed = r.completed();
    m.samples_per_second = r.samples_per_second();
    return m;
  };
  for (const auto& r : record.members()) {
    job.members.push_back(restore_member(r));
  }
  // A worker listed twice is refused below (CheckRestoredWorkers).
  for (const auto& r : record.waiting()) job.waiting.Add(restore_member(r));
  for (const auto& r : record.expected()) {
    MemberState m = restore_member(r);
    m.back = job.waiting.Find(r.worker_id()) != nullptr;
    job.expected.Add(std::move(m));
  }
  for (size_t i = 0; i < job.members.size(); ++i) {
    if (job.members[i].rank != static_cast<int32_t>(i)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "job record ", record.spec().job_id(), ": ranks out of order"));
    }
  }
  job.bindings.insert(record.bindings().begin(), record.bindings().end());
  job.drained.insert(record.drained().begin(), record.drained().end());
  job.finished.insert(record.finished().begin(), record.finished().end());
  job.checkpoints.Restore(record, now);
  job.retired.insert(record.retired_bindings().begin(),
                     record.retired_bindings().end());
  // See Note [Evicting stragglers] in hang_rule.h: a worker waiting out its
  // cool-down is still held back.
  CONCORD_RETURN_IF_ERROR(job.cooling.Restore(record, record.spec().job_id()));
  for (const auto& [worker_id, c] : job.cooling.all()) {
    if (MemberState* w = job.waiting.Find(worker_id);
        w != nullptr && c.until > now) {
      w->held = true;
    }
  }
  CONCORD_RETURN_IF_ERROR(CheckRestoredWorkers(job));
  job.rendezvous_started = now;
  job.last_arrival = now;
  job.kv.insert(record.kv().begin(), record.kv().end());
  job.events.Restore(record);

  Job* existing = FindJob(record.spec().job_id());
  if (existing != nullptr && existing->generation > job.generation) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "job %s: the record's generation %d is behind the current %d",
        record.spec().job_id(), job.generation, existing->generation));
  }
  // Open watch streams outlive a replaced record (see Note [Re-forming]).
  if (existing != nullptr) {
    job.watches = std::move(existing->watches);
  }
  ++version_;
  job.epochs = JobEpochs{version_, version_, version_};
  woken_.insert(record.spec().job_id());
  jobs_[record.spec().job_id()] = std::move(job);
  return absl::OkStatus();
}

}  // namespace concord::coordinator
