#include "coordinator/core.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdlib>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"

namespace concord::coordinator {
namespace {

constexpr int32_t kMaxWorkers = 4096;
constexpr int64_t kDefaultHeartbeatIntervalMs = 1000;
constexpr int64_t kDefaultHeartbeatTimeoutMs = 10000;
constexpr int64_t kDefaultRendezvousTimeoutMs = 300000;
// Oldest events are dropped beyond this many per job.
constexpr size_t kMaxEvents = 10000;

// "10s", "10.2s", "0.25s": whole seconds stay whole (absl::FormatDuration
// would write 300s as "5m").
std::string Seconds(absl::Duration d) {
  const int64_t ms = absl::ToInt64Milliseconds(d);
  if (ms % 1000 == 0) return absl::StrCat(ms / 1000, "s");
  std::string s = absl::StrFormat("%.3f", static_cast<double>(ms) / 1000.0);
  while (!s.empty() && s.back() == '0') s.pop_back();
  return absl::StrCat(s, "s");
}

// The spec with zero durations replaced by their defaults.
v1::JobSpec WithDefaults(v1::JobSpec spec) {
  if (spec.heartbeat_interval_ms() == 0) {
    spec.set_heartbeat_interval_ms(kDefaultHeartbeatIntervalMs);
  }
  if (spec.heartbeat_timeout_ms() == 0) {
    spec.set_heartbeat_timeout_ms(kDefaultHeartbeatTimeoutMs);
  }
  if (spec.rendezvous_timeout_ms() == 0) {
    spec.set_rendezvous_timeout_ms(kDefaultRendezvousTimeoutMs);
  }
  return spec;
}

absl::Status Validate(const v1::JobSpec& spec, const std::string& worker_id) {
  if (spec.job_id().empty()) {
    return absl::InvalidArgumentError("spec.job_id is empty");
  }
  if (worker_id.empty())
    return absl::InvalidArgumentError("worker_id is empty");
  if (spec.min_workers() < 1 || spec.min_workers() > spec.max_workers() ||
      spec.max_workers() > kMaxWorkers) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "need 1 <= min_workers <= max_workers <= %d; got min_workers %d, "
        "max_workers %d",
        kMaxWorkers, spec.min_workers(), spec.max_workers()));
  }
  if (spec.heartbeat_interval_ms() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("heartbeat_interval_ms must be positive; got ",
                     spec.heartbeat_interval_ms()));
  }
  if (spec.heartbeat_timeout_ms() <= spec.heartbeat_interval_ms()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "heartbeat_timeout_ms (%d) must exceed heartbeat_interval_ms (%d)",
        spec.heartbeat_timeout_ms(), spec.heartbeat_interval_ms()));
  }
  if (spec.rendezvous_timeout_ms() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("rendezvous_timeout_ms must be positive; got ",
                     spec.rendezvous_timeout_ms()));
  }
  return absl::OkStatus();
}

// FAILED_PRECONDITION naming the first field where `got` differs from the
// job's spec (both with defaults applied).
absl::Status CompareSpecs(const v1::JobSpec& job, const v1::JobSpec& got) {
  auto differs = [&](const char* field, int64_t have, int64_t want) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "spec.%s differs from job %s: job has %d, request has %d", field,
        job.job_id(), have, want));
  };
  if (job.min_workers() != got.min_workers()) {
    return differs("min_workers", job.min_workers(), got.min_workers());
  }
  if (job.max_workers() != got.max_workers()) {
    return differs("max_workers", job.max_workers(), got.max_workers());
  }
  if (job.heartbeat_interval_ms() != got.heartbeat_interval_ms()) {
    return differs("heartbeat_interval_ms", job.heartbeat_interval_ms(),
                   got.heartbeat_interval_ms());
  }
  if (job.heartbeat_timeout_ms() != got.heartbeat_timeout_ms()) {
    return differs("heartbeat_timeout_ms", job.heartbeat_timeout_ms(),
                   got.heartbeat_timeout_ms());
  }
  if (job.rendezvous_timeout_ms() != got.rendezvous_timeout_ms()) {
    return differs("rendezvous_timeout_ms", job.rendezvous_timeout_ms(),
                   got.rendezvous_timeout_ms());
  }
  return absl::OkStatus();
}

template <typename Members>
auto FindMember(Members& members, const std::string& worker_id) {
  return std::find_if(members.begin(), members.end(),
                      [&](const auto& m) { return m.worker_id == worker_id; });
}

absl::Status JobNotFound(const std::string& job_id) {
  return absl::NotFoundError(absl::StrCat("unknown job '", job_id, "'"));
}

absl::Status JobFailed(const std::string& job_id, const std::string& why) {
  return absl::FailedPreconditionError(
      absl::StrCat("job ", job_id, " failed: ", why));
}

}  // namespace

Core::Core(const Clock* clock) : clock_(clock) {}

Core::Job* Core::FindJob(const std::string& job_id) {
  auto it = jobs_.find(job_id);
  return it == jobs_.end() ? nullptr : &it->second;
}

const Core::Job* Core::FindJob(const std::string& job_id) const {
  auto it = jobs_.find(job_id);
  return it == jobs_.end() ? nullptr : &it->second;
}

// ABORTED unless `generation` is the job's current, still running one.
absl::Status Core::CheckGeneration(const Job& job, int64_t generation) const {
  if (generation != job.generation) {
    return absl::AbortedError(absl::StrFormat(
        "generation %d is stale; current is %d", generation, job.generation));
  }
  if (job.members.empty()) {
    return absl::AbortedError(
        absl::StrFormat("generation %d has ended; join again", job.generation));
  }
  return absl::OkStatus();
}

absl::Status Core::Join(const v1::JoinRequest& request) {
  const v1::JobSpec spec = WithDefaults(request.spec());
  CONCORD_RETURN_IF_ERROR(Validate(spec, request.worker_id()));
  const absl::Time now = clock_->Now();

  Job* job = FindJob(spec.job_id());
  if (job == nullptr) {
    job = &jobs_[spec.job_id()];
    job->spec = spec;
    job->rendezvous_started = now;
    AddEvent(*job, "job", "",
             absl::StrFormat("job created: min_workers %d, max_workers %d",
                             spec.min_workers(), spec.max_workers()));
  } else {
    CONCORD_RETURN_IF_ERROR(CompareSpecs(job->spec, spec));
    if (job->state == v1::JOB_STATE_FAILED) {
      return JobFailed(spec.job_id(), job->failure);
    }
    if (job->state == v1::JOB_STATE_SUCCEEDED) {
      return absl::FailedPreconditionError(
          absl::StrCat("job ", spec.job_id(), " has already succeeded"));
    }
    if (FindMember(job->members, request.worker_id()) != job->members.end()) {
      return absl::AlreadyExistsError(absl::StrFormat(
          "worker %s is already a member of generation %d of job %s",
          request.worker_id(), job->generation, spec.job_id()));
    }
  }

  auto waiting = FindMember(job->waiting, request.worker_id());
  if (waiting != job->waiting.end()) {
    // A retried Join: keep its place in the join order.
    waiting->host = request.host();
    waiting->committed_step = request.committed_step();
  } else {
    MemberState m;
    m.worker_id = request.worker_id();
    m.host = request.host();
    m.committed_step = request.committed_step();
    m.joined = now;
    m.last_heartbeat = now;
    job->waiting.push_back(std::move(m));
    AddEvent(*job, "join", request.worker_id(),
             absl::StrFormat("joined from %s at step %d (%d of %d waiting)",
                             request.host(), request.committed_step(),
                             job->waiting.size(), spec.max_workers()));
  }
  MaybeFormGeneration(*job);
  Changed();
  return absl::OkStatus();
}

absl::StatusOr<std::optional<Assignment>> Core::GetAssignment(
    const std::string& job_id, const std::string& worker_id) const {
  const Job* job = FindJob(job_id);
  if (job == nullptr) return JobNotFound(job_id);
  if (job->state == v1::JOB_STATE_FAILED) {
    return JobFailed(job_id, job->failure);
  }
  auto member = FindMember(job->members, worker_id);
  if (member != job->members.end()) {
    Assignment a;
    a.generation = job->generation;
    a.rank = member->rank;
    a.world_size = static_cast<int32_t>(job->members.size());
    a.authoritative_rank = job->authoritative_rank;
    a.heartbeat_interval =
        absl::Milliseconds(job->spec.heartbeat_interval_ms());
    for (const MemberState& m : job->members) {
      v1::Member& out = a.members.emplace_back();
      out.set_worker_id(m.worker_id);
      out.set_rank(m.rank);
      out.set_host(m.host);
      out.set_committed_step(m.committed_step);
    }
    return std::optional<Assignment>(std::move(a));
  }
  if (FindMember(job->waiting, worker_id) != job->waiting.end()) {
    return std::optional<Assignment>();
  }
  return absl::NotFoundError(
      absl::StrFormat("worker %s is neither waiting nor a member of job %s",
                      worker_id, job_id));
}

absl::StatusOr<v1::HeartbeatResponse> Core::Heartbeat(
    const v1::HeartbeatRequest& request) {
  Job* job = FindJob(request.job_id());
  if (job == nullptr) return JobNotFound(request.job_id());
  if (job->state == v1::JOB_STATE_FAILED) {
    return JobFailed(request.job_id(), job->failure);
  }
  CONCORD_RETURN_IF_ERROR(CheckGeneration(*job, request.generation()));
  auto member = FindMember(job->members, request.worker_id());
  if (member == job->members.end()) {
    return absl::NotFoundError(absl::StrFormat(
        "worker %s is not a member of generation %d of job %s",
        request.worker_id(), job->generation, request.job_id()));
  }
  member->last_heartbeat = clock_->Now();
  member->committed_step = request.step();
  Changed();
  v1::HeartbeatResponse response;
  response.set_current_generation(job->generation);
  response.set_state(job->state);
  return response;
}

absl::StatusOr<v1::LeaveResponse> Core::Leave(const v1::LeaveRequest& request) {
  Job* job = FindJob(request.job_id());
  if (job == nullptr) return JobNotFound(request.job_id());
  const std::string reason = v1::LeaveReason_Name(request.reason());
  const std::string what = request.message().empty()
                               ? reason
                               : absl::StrCat(reason, ": ", request.message());
  v1::LeaveResponse response;

  // A worker still waiting for a generation just withdraws; it has no
  // generation to name.
  auto waiting = FindMember(job->waiting, request.worker_id());
  if (waiting != job->waiting.end()) {
    job->waiting.erase(waiting);
    AddEvent(*job, "leave", request.worker_id(),
             absl::StrCat("left before a generation formed: ", what));
    Changed();
    response.set_state(job->state);
    return response;
  }
  if (job->state == v1::JOB_STATE_FAILED) {
    return JobFailed(request.job_id(), job->failure);
  }
  CONCORD_RETURN_IF_ERROR(CheckGeneration(*job, request.generation()));
  auto member = FindMember(job->members, request.worker_id());
  if (member == job->members.end()) {
    return absl::NotFoundError(absl::StrFormat(
        "worker %s is not a member of generation %d of job %s",
        request.worker_id(), job->generation, request.job_id()));
  }
  if (job->state == v1::JOB_STATE_SUCCEEDED || member->completed) {
    // Nothing left to change; a repeated Leave is harmless.
    response.set_state(job->state);
    return response;
  }

  AddEvent(*job, "leave", request.worker_id(), what);
  if (request.reason() == v1::LEAVE_REASON_COMPLETED) {
    member->completed = true;
    const bool all =
        std::all_of(job->members.begin(), job->members.end(),
                    [](const MemberState& m) { return m.completed; });
    if (all) {
      job->state = v1::JOB_STATE_SUCCEEDED;
      AddEvent(
          *job, "job", "",
          absl::StrFormat("job succeeded in generation %d", job->generation));
    }
  } else {
    EndGeneration(*job, absl::StrCat("worker ", request.worker_id(), " left (",
                                     what, ")"));
  }
  Changed();
  response.set_state(job->state);
  return response;
}

absl::Status Core::KvSet(const v1::KvSetRequest& request) {
  Job* job = FindJob(request.job_id());
  if (job == nullptr) return JobNotFound(request.job_id());
  if (request.key().empty()) return absl::InvalidArgumentError("empty key");
  CONCORD_RETURN_IF_ERROR(CheckGeneration(*job, request.generation()));
  job->kv[request.key()] = request.value();
  Changed();
  return absl::OkStatus();
}

absl::StatusOr<std::optional<std::vector<std::string>>> Core::KvGet(
    const v1::KvGetRequest& request) const {
  const Job* job = FindJob(request.job_id());
  if (job == nullptr) return JobNotFound(request.job_id());
  for (const std::string& key : request.keys()) {
    if (key.empty()) return absl::InvalidArgumentError("empty key");
  }
  CONCORD_RETURN_IF_ERROR(CheckGeneration(*job, request.generation()));
  std::vector<std::string> values;
  values.reserve(request.keys_size());
  for (const std::string& key : request.keys()) {
    auto it = job->kv.find(key);
    if (it == job->kv.end()) return std::optional<std::vector<std::string>>();
    values.push_back(it->second);
  }
  return std::optional<std::vector<std::string>>(std::move(values));
}

void Core::Tick() {
  const absl::Time now = clock_->Now();
  for (auto& [job_id, job] : jobs_) {
    if (job.state == v1::JOB_STATE_RUNNING) {
      const absl::Duration timeout =
          absl::Milliseconds(job.spec.heartbeat_timeout_ms());
      std::vector<std::string> failed;
      for (const MemberState& m : job.members) {
        const absl::Duration silent = now - m.last_heartbeat;
        if (m.completed || silent <= timeout) continue;
        failed.push_back(m.worker_id);
        AddEvent(job, "failure", m.worker_id,
                 absl::StrFormat("no heartbeat for %s (timeout %s)",
                                 Seconds(silent), Seconds(timeout)));
      }
      if (!failed.empty()) {
        EndGeneration(job,
                      absl::StrCat("worker(s) ", absl::StrJoin(failed, ", "),
                                   " stopped heartbeating"));
        Changed();
      }
    } else if (job.state == v1::JOB_STATE_RENDEZVOUS) {
      const absl::Duration timeout =
          absl::Milliseconds(job.spec.rendezvous_timeout_ms());
      if (now - job.rendezvous_started <= timeout) continue;
      job.state = v1::JOB_STATE_FAILED;
      job.failure = absl::StrFormat(
          "rendezvous timed out after %s with %d of %d workers",
          Seconds(timeout), job.waiting.size(), job.spec.max_workers());
      job.waiting.clear();
      AddEvent(job, "job", "", absl::StrCat("job failed: ", job.failure));
      Changed();
    }
  }
}

std::vector<Event> Core::Events(const std::string& job_id) const {
  const Job* job = FindJob(job_id);
  return job == nullptr ? std::vector<Event>() : job->events;
}

std::optional<v1::JobState> Core::State(const std::string& job_id) const {
  const Job* job = FindJob(job_id);
  if (job == nullptr) return std::nullopt;
  return job->state;
}

int64_t Core::CurrentGeneration(const std::string& job_id) const {
  const Job* job = FindJob(job_id);
  return job == nullptr ? 0 : job->generation;
}

// Note [Formation]: for now a generation forms only when max_workers are
// waiting; min_workers bounds how few may wait when the rendezvous times out
// (a later slice forms smaller generations once min_workers are there).
void Core::MaybeFormGeneration(Job& job) {
  const size_t n = static_cast<size_t>(job.spec.max_workers());
  if (job.state != v1::JOB_STATE_RENDEZVOUS || job.waiting.size() < n) return;
  const absl::Time now = clock_->Now();
  job.members.assign(std::make_move_iterator(job.waiting.begin()),
                     std::make_move_iterator(job.waiting.begin() + n));
  job.waiting.erase(job.waiting.begin(), job.waiting.begin() + n);
  // Ranks follow the join order, so a strict comparison in rank order breaks
  // ties in favour of the longest-lived member.
  job.authoritative_rank = 0;
  for (size_t i = 0; i < job.members.size(); ++i) {
    MemberState& m = job.members[i];
    m.rank = static_cast<int32_t>(i);
    m.last_heartbeat = now;
    m.completed = false;
    if (m.committed_step > job.members[job.authoritative_rank].committed_step) {
      job.authoritative_rank = m.rank;
    }
  }
  ++job.generation;
  job.kv.clear();
  job.state = v1::JOB_STATE_RUNNING;
  AddEvent(job, "generation", "",
           absl::StrFormat("generation %d formed with %d members, "
                           "authoritative rank %d",
                           job.generation, job.members.size(),
                           job.authoritative_rank));
}

void Core::EndGeneration(Job& job, const std::string& why) {
  AddEvent(job, "generation", "",
           absl::StrFormat("generation %d ended: %s", job.generation, why));
  // Survivors are not carried over: each must Join again, which is how a
  // worker learns that its generation is gone (Note [Generations]).
  job.members.clear();
  job.kv.clear();
  job.authoritative_rank = 0;
  job.state = v1::JOB_STATE_RENDEZVOUS;
  job.rendezvous_started = clock_->Now();
  MaybeFormGeneration(job);
}

void Core::AddEvent(Job& job, std::string kind, std::string worker_id,
                    std::string message) {
  spdlog::info("job {}: {}{}{}: {}", job.spec.job_id(), kind,
               worker_id.empty() ? "" : " ", worker_id, message);
  if (job.events.size() >= kMaxEvents) job.events.erase(job.events.begin());
  job.events.push_back(Event{clock_->Now(), std::move(kind),
                             std::move(worker_id), std::move(message)});
}

}  // namespace concord::coordinator
