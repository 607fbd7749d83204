// Membership requests: joins, assignments, heartbeats, leaves, the
// key-value store and the end-of-data agreement. Watches, timeouts and the
// forming and ending of generations are in core_lifecycle.cc; operator
// views, admin actions and persistence in core_views.cc.

#include "coordinator/core/core.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdlib>
#include <iterator>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/auth.h"
#include "common/job_ended.h"
#include "common/status_macros.h"
#include "coordinator/core/core_internal.h"
#include "coordinator/core/core_validation.h"

namespace concord::coordinator {

using internal::JobNotFound;
using internal::Seconds;

Core::Core(const Clock* clock) : clock_(clock) {}

Core::Job* Core::FindJob(const std::string& job_id) {
  auto it = jobs_.find(job_id);
  return it == jobs_.end() ? nullptr : &it->second;
}

const Core::Job* Core::FindJob(const std::string& job_id) const {
  auto it = jobs_.find(job_id);
  return it == jobs_.end() ? nullptr : &it->second;
}

bool Core::Ended(const Job& job) {
  return job.state == v1::JOB_STATE_FAILED ||
         job.state == v1::JOB_STATE_STOPPED ||
         job.state == v1::JOB_STATE_SUCCEEDED;
}

absl::Status Core::EndedError(const Job& job) {
  const std::string& id = job.spec.job_id();
  switch (job.state) {
    case v1::JOB_STATE_FAILED:
      return absl::FailedPreconditionError(
          absl::StrCat("job ", id, " failed: ", job.failure));
    case v1::JOB_STATE_STOPPED:
      return absl::FailedPreconditionError(
          absl::StrCat("job ", id, " was ", job.failure));
    case v1::JOB_STATE_SUCCEEDED:
      return absl::FailedPreconditionError(
          // See common/job_ended.h: a worker that comes after the end has
          // nothing to do.
          absl::StrCat("job ", id, " ", kJobSucceededText));
    default:
      return absl::OkStatus();
  }
}

bool Core::StartsAgain(const Job& job, const v1::JoinRequest& request) {
  if (job.state != v1::JOB_STATE_FAILED && job.state != v1::JOB_STATE_STOPPED) {
    return false;
  }
  if (request.previous_generation() != 0) return false;
  auto it = job.bindings.find(request.worker_id());
  return it == job.bindings.end() ||
         !ConstantTimeEquals(it->second, request.worker_secret());
}

void Core::StartAgain(Job& job, const std::string& worker_id) {
  const std::string ended(EndedError(job).message());
  const absl::Time now = clock_->Now();
  job.state = v1::JOB_STATE_RENDEZVOUS;
  job.failure.clear();
  job.retired = std::move(job.bindings);
  job.bindings.clear();
  job.members.clear();
  job.member_table.reset();
  job.waiting.Clear();
  job.expected.Clear();
  job.kv.clear();
  job.drained.clear();
  job.finished.clear();
  job.cooling.Clear();
  // A new run, not the next generation of the ended one: no rank change.
  job.ended_ranks.clear();
  job.ended_generation = 0;
  job.ended_world_size = 0;
  job.rendezvous_started = now;
  job.last_arrival = now;
  // The ended run's agents (and their memory) are gone with it.
  job.checkpoints.BeginRun(now);
  AddEvent(job, "job", worker_id,
           absl::StrCat("job started again (", ended, "); generation ",
                        job.generation + 1, " is next, of run ",
                        job.checkpoints.run()));
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

absl::Status Core::CheckBinding(const Job& job, const std::string& worker_id,
                                const std::string& secret) const {
  auto it = job.bindings.find(worker_id);
  if (it == job.bindings.end() || ConstantTimeEquals(it->second, secret)) {
    return absl::OkStatus();
  }
  return absl::PermissionDeniedError(absl::StrFormat(
      "worker id %s of job %s is bound to another worker process", worker_id,
      job.spec.job_id()));
}

absl::StatusOr<size_t> Core::CheckMember(const Job& job,
                                         const std::string& worker_id,
                                         const std::string& secret,
                                         int64_t generation) const {
  CONCORD_RETURN_IF_ERROR(CheckBinding(job, worker_id, secret));
  if (job.state == v1::JOB_STATE_FAILED || job.state == v1::JOB_STATE_STOPPED) {
    return EndedError(job);
  }
  CONCORD_RETURN_IF_ERROR(CheckGeneration(job, generation));
  const std::optional<size_t> member = MemberIndex(job, worker_id);
  if (!member.has_value()) {
    return absl::NotFoundError(
        absl::StrFormat("worker %s is not a member of generation %d of job %s",
                        worker_id, job.generation, job.spec.job_id()));
  }
  return *member;
}

absl::Status Core::Join(const v1::JoinRequest& request, uint64_t* call) {
  const v1::JobSpec spec = WithDefaults(request.spec());
  CONCORD_RETURN_IF_ERROR(ValidateSpec(spec));
  CONCORD_RETURN_IF_ERROR(ValidateRequest(request));
  const std::string& worker_id = request.worker_id();
  const absl::Time now = clock_->Now();

  Job* job = FindJob(spec.job_id());
  const int64_t current = job == nullptr ? 0 : job->generation;
  if (request.previous_generation() > current) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "previous_generation %d is ahead of job %s's current generation %d "
        "(did the coordinator lose its state?)",
        request.previous_generation(), spec.job_id(), current));
  }
  bool reform = false;
  const Placement before = job == nullptr ? Placement{} : PlacementOf(*job);
  if (job == nullptr) {
    if (jobs_.size() >= internal::kMaxJobs) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the coordinator already holds ", jobs_.size(), " jobs"));
    }
    job = &jobs_[spec.job_id()];
    job->spec = spec;
    job->checkpoints.BeginRun(now);
    job->rendezvous_started = now;
    AddEvent(
        *job, "job", "",
        absl::StrFormat("job created: min_workers %d, max_workers %d, run %d",
                        spec.min_workers(), spec.max_workers(),
                        job->checkpoints.run()));
  } else {
    CONCORD_ASSIGN_OR_RETURN(reform, Admit(*job, spec, request));
  }
  if (reform) {
    EndGeneration(*job,
                  absl::StrFormat("worker %s asked to re-form: %s", worker_id,
                                  request.reform_reason().empty()
                                      ? "no reason given"
                                      : request.reform_reason()),
                  /*removed=*/{});
  }
  if (job->bindings.count(worker_id) == 0) {
    // A new binding: a lost stream of an earlier holder of the id says
    // nothing about this process.
    job->watches.Rebound(worker_id);
  }
  job->bindings[worker_id] = request.worker_secret();
  job->finished.erase(worker_id);

  const uint64_t this_call = ++job->join_calls;
  if (call != nullptr) *call = this_call;
  AddWaiting(*job, request, this_call, now);
  WaitingChanged(*job, before);
  return absl::OkStatus();
}

absl::StatusOr<bool> Core::Admit(Job& job, const v1::JobSpec& spec,
                                 const v1::JoinRequest& request) {
  const std::string& worker_id = request.worker_id();
  CONCORD_RETURN_IF_ERROR(CompareSpecs(job.spec, spec));
  if (auto it = job.retired.find(worker_id);
      it != job.retired.end() &&
      ConstantTimeEquals(it->second, request.worker_secret())) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "worker %s belongs to a run of job %s that ended; the job was "
        "started again",
        worker_id, spec.job_id()));
  }
  if (StartsAgain(job, request)) StartAgain(job, worker_id);
  CONCORD_RETURN_IF_ERROR(EndedError(job));
  if (job.drained.count(worker_id) > 0) {
    return absl::FailedPreconditionError(
        absl::StrFormat("worker %s was taken out of job %s (drained by an "
                        "operator, or unreachable from its peers: see the "
                        "job's events)",
                        worker_id, spec.job_id()));
  }
  CONCORD_RETURN_IF_ERROR(
      CheckBinding(job, worker_id, request.worker_secret()));
  const std::optional<size_t> index = MemberIndex(job, worker_id);
  if (!index.has_value()) return false;
  const MemberState& member = job.members[*index];
  // See Note [Re-forming]: only naming the running generation ends it.
  if (request.previous_generation() != job.generation || member.completed) {
    return absl::AlreadyExistsError(absl::StrFormat(
        "worker %s is already a member of generation %d of job %s%s", worker_id,
        job.generation, spec.job_id(),
        member.completed ? " and has completed" : ""));
  }
  return true;
}

void Core::AddWaiting(Job& job, const v1::JoinRequest& request, uint64_t call,
                      absl::Time now) {
  const std::string& worker_id = request.worker_id();
  if (MemberState* waiting = job.waiting.Find(worker_id); waiting != nullptr) {
    // A retried Join: keep its place.
    waiting->host = request.host();
    waiting->committed_step = request.committed_step();
    waiting->join_call = call;
    waiting->probe_port = request.probe_port();
    waiting->unreachable = {request.unreachable().begin(),
                            request.unreachable().end()};
    return;
  }
  MemberState m;
  m.worker_id = worker_id;
  m.host = request.host();
  m.committed_step = request.committed_step();
  m.last_heartbeat = now;
  m.join_call = call;
  m.probe_port = request.probe_port();
  m.unreachable = {request.unreachable().begin(), request.unreachable().end()};
  MemberState* survivor = job.expected.Find(worker_id);
  const bool back = survivor != nullptr;
  m.joined = back ? survivor->joined : now;
  if (back) job.expected.MarkBack(survivor);
  // See Note [Evicting stragglers] in hang_rule.h.
  const std::optional<absl::Time> held_until =
      job.cooling.HeldUntil(worker_id, now);
  const bool held = held_until.has_value();
  m.held = held;
  job.waiting.Add(std::move(m));
  job.last_arrival = now;
  const v1::JobSpec& spec = job.spec;
  if (held) {
    AddEvent(job, "join", worker_id,
             absl::StrFormat("joined from %s; held back until its cool-down "
                             "as an evicted straggler ends in %s",
                             request.host(), Seconds(*held_until - now)));
  } else if (back) {
    const size_t missing = job.expected.size() - job.expected.back_count();
    AddEvent(job, "join", worker_id,
             absl::StrFormat("joined again from %s at step %d after "
                             "generation %d ended (%d waiting, %d "
                             "survivor(s) not back yet; min %d, max %d)",
                             request.host(), request.committed_step(),
                             job.generation, job.waiting.size(), missing,
                             spec.min_workers(), spec.max_workers()));
  } else {
    AddEvent(job, "join", worker_id,
             absl::StrFormat("joined from %s at step %d (%d waiting; min "
                             "%d, max %d)",
                             request.host(), request.committed_step(),
                             job.waiting.size(), spec.min_workers(),
                             spec.max_workers()));
  }
}

absl::StatusOr<std::optional<Assignment>> Core::GetAssignment(
    const std::string& job_id, const std::string& worker_id) const {
  const Job* job = FindJob(job_id);
  if (job == nullptr) return JobNotFound(job_id);
  if (job->state == v1::JOB_STATE_FAILED ||
      job->state == v1::JOB_STATE_STOPPED) {
    return EndedError(*job);
  }
  const std::optional<size_t> index = MemberIndex(*job, worker_id);
  if (index.has_value()) {
    const MemberState* member = &job->members[*index];
    Assignment a;
    a.generation = job->generation;
    a.rank = member->rank;
    a.rank_change = job->rank_change;
    a.probe = job->probe;
    a.resume_from = job->checkpoints.resume_from();
    a.resume_memory = job->checkpoints.resume_memory();
    a.run = job->checkpoints.run();
    a.world_size = static_cast<int32_t>(job->members.size());
    a.authoritative_rank = job->authoritative_rank;
    a.finished_workers = static_cast<int32_t>(job->finished.size());
    a.heartbeat_interval =
        absl::Milliseconds(job->spec.heartbeat_interval_ms());
    if (job->member_table == nullptr || job->member_table_version != version_) {
      auto table = std::make_shared<std::vector<v1::Member>>();
      table->reserve(job->members.size());
      for (const MemberState& m : job->members) {
        v1::Member& out = table->emplace_back();
        out.set_worker_id(m.worker_id);
        out.set_rank(m.rank);
        out.set_host(m.host);
        out.set_committed_step(m.committed_step);
        out.set_probe_port(m.probe_port);
      }
      job->member_table = std::move(table);
      job->member_table_version = version_;
    }
    a.members = job->member_table;
    return std::optional<Assignment>(std::move(a));
  }
  if (job->waiting.Find(worker_id) != nullptr) {
    // Waiting for a generation that will never come.
    if (job->state == v1::JOB_STATE_SUCCEEDED) return EndedError(*job);
    return std::optional<Assignment>();
  }
  return absl::NotFoundError(
      absl::StrFormat("worker %s is neither waiting nor a member of job %s",
                      worker_id, job_id));
}

absl::StatusOr<v1::HeartbeatResponse> Core::Heartbeat(
    const v1::HeartbeatRequest& request) {
  CONCORD_RETURN_IF_ERROR(ValidateRequest(request));
  Job* job = FindJob(request.job_id());
  if (job == nullptr) return JobNotFound(request.job_id());
  const absl::StatusOr<size_t> index = CheckMember(
      *job, request.worker_id(), request.worker_secret(), request.generation());
  if (!index.ok()) {
    // See Note [Re-forming]: an expected survivor still heartbeating its ended
    // generation is alive, just catching up.
    MemberState* survivor = job->expected.Find(request.worker_id());
    if (absl::IsAborted(index.status()) &&
        request.generation() <= job->generation && survivor != nullptr) {
      survivor->last_heartbeat = clock_->Now();
      Changed(*job, /*persist=*/false);
    }
    return index.status();
  }
  MemberState& member = job->members[*index];
  const absl::Time now = clock_->Now();
  BeforeProgress(*job, now);
  member.last_heartbeat = now;
  if (request.has_progress()) {
    member.health.Reported(request.progress(), request.step(), now);
  }
  member.committed_step = std::max(member.committed_step, request.step());
  member.samples_per_second = request.samples_per_second();
  if (request.has_loss()) member.loss = request.loss();
  member.ddp = request.ddp();
  job->progress_pending = clock_->Now();
  Changed(*job, /*persist=*/false);
  v1::HeartbeatResponse response;
  response.set_current_generation(job->generation);
  response.set_state(job->state);
  response.set_waiting_workers(WaitingWorkers(*job));
  return response;
}

absl::StatusOr<v1::LeaveResponse> Core::Leave(const v1::LeaveRequest& request) {
  CONCORD_RETURN_IF_ERROR(ValidateRequest(request));
  Job* job = FindJob(request.job_id());
  if (job == nullptr) return JobNotFound(request.job_id());
  const std::string& worker_id = request.worker_id();
  CONCORD_RETURN_IF_ERROR(
      CheckBinding(*job, worker_id, request.worker_secret()));
  const std::string reason = v1::LeaveReason_Name(request.reason());
  const std::string what = request.message().empty()
                               ? reason
                               : absl::StrCat(reason, ": ", request.message());
  const bool out_of_data = request.reason() == v1::LEAVE_REASON_END_OF_DATA;
  v1::LeaveResponse response;

  // A worker that left for good has nothing left to say.
  if (job->finished.count(worker_id) > 0) {
    response.set_state(job->state);
    return response;
  }
  // A worker still waiting for a generation just withdraws; it has no
  // generation to name.
  if (const MemberState* waiting = job->waiting.Find(worker_id);
      waiting != nullptr) {
    Withdraw(*job, worker_id, waiting->committed_step, request, what,
             " while waiting for a generation", "before a generation formed");
    response.set_state(job->state);
    return response;
  }
  // See Note [Re-forming]: an expected survivor naming its ended generation
  // leaves that way too (the Leave raced with the others' re-joins).
  const MemberState* survivor = job->expected.Find(worker_id);
  if (survivor != nullptr && request.generation() == job->generation &&
      request.reason() != v1::LEAVE_REASON_COMPLETED) {
    const std::string after =
        absl::StrFormat("after generation %d ended", job->generation);
    Withdraw(*job, worker_id, survivor->committed_step, request, what,
             absl::StrCat(", ", after), after);
    response.set_state(job->state);
    return response;
  }
  CONCORD_ASSIGN_OR_RETURN(const size_t index,
                           CheckMember(*job, worker_id, request.worker_secret(),
                                       request.generation()));
  MemberState& member = job->members[index];
  if (job->state == v1::JOB_STATE_SUCCEEDED || member.completed) {
    // Nothing left to change; a repeated Leave is harmless.
    response.set_state(job->state);
    return response;
  }

  if (request.reason() == v1::LEAVE_REASON_COMPLETED) {
    AddEvent(*job, "leave", worker_id, what);
    member.completed = true;
    const bool all =
        std::all_of(job->members.begin(), job->members.end(),
                    [](const MemberState& m) { return m.completed; });
    if (all) {
      job->state = v1::JOB_STATE_SUCCEEDED;
      AddEvent(
          *job, "job", "",
          absl::StrFormat("job succeeded in generation %d", job->generation));
    }
  } else if (out_of_data) {
    const int64_t step = member.committed_step;
    job->bindings.erase(worker_id);
    job->finished.insert(worker_id);
    AddEvent(*job, "leave", worker_id,
             absl::StrFormat("ran out of data at step %d%s", step,
                             request.message().empty()
                                 ? ""
                                 : absl::StrCat(": ", request.message())));
    EndGeneration(*job,
                  absl::StrFormat("worker %s ran out of data at step %d",
                                  worker_id, step),
                  {worker_id});
    if (!MaybeSucceed(*job)) MaybeFormGeneration(*job);
  } else {
    AddEvent(*job, "leave", worker_id, what);
    job->bindings.erase(worker_id);
    EndGeneration(*job,
                  absl::StrCat("worker ", worker_id, " left (", what, ")"),
                  {worker_id});
    MaybeFormGeneration(*job);
  }
  Changed(*job);
  response.set_state(job->state);
  return response;
}

Core::Placement Core::PlacementOf(const Job& job) {
  return {job.generation, job.state, job.members.size(), job.expected.size()};
}

void Core::WaitingChanged(Job& job, const Placement& before) {
  MaybeFormGeneration(job);
  // Unless a generation formed or ended, a survivor was dropped or the job
  // ended, the only news is one waiting worker more or less: the other
  // waiters' placements stand.
  Changed(job, /*persist=*/true,
          PlacementOf(job) == before ? Concerns::kArrival : Concerns::kAll);
}

bool Core::CancelJoin(const std::string& job_id, const std::string& worker_id,
                      uint64_t call) {
  Job* job = FindJob(job_id);
  if (job == nullptr || Ended(*job)) return false;
  const MemberState* waiting = job->waiting.Find(worker_id);
  if (waiting == nullptr || waiting->join_call != call || waiting->back) {
    return false;
  }
  const Placement before = PlacementOf(*job);
  Forget(*job, worker_id);
  job->bindings.erase(worker_id);
  AddEvent(*job, "leave", worker_id,
           "stopped waiting for a generation: its Join was cancelled (the "
           "client went away)");
  WaitingChanged(*job, before);
  return true;
}

absl::StatusOr<bool> Core::WorkerExited(const std::string& job_id,
                                        const std::string& worker_id,
                                        const std::string& secret,
                                        const std::string& how) {
  CONCORD_RETURN_IF_ERROR(ValidateExit(job_id, worker_id, secret, how));
  Job* job = FindJob(job_id);
  if (job == nullptr) return JobNotFound(job_id);
  CONCORD_RETURN_IF_ERROR(CheckBinding(*job, worker_id, secret));
  // See Note [Exited workers]: late reports change nothing.
  if (Ended(*job) || job->finished.count(worker_id) > 0) return false;
  const std::string what = absl::StrCat("its process exited (", how,
                                        "; reported by its node agent)");
  if (job->waiting.Find(worker_id) != nullptr) {
    const Placement before = PlacementOf(*job);
    Forget(*job, worker_id);
    job->bindings.erase(worker_id);
    AddEvent(*job, "failure", worker_id,
             absl::StrCat(what, " while waiting for a generation"));
    WaitingChanged(*job, before);
    return true;
  }
  if (job->expected.Find(worker_id) != nullptr) {
    Forget(*job, worker_id);
    job->bindings.erase(worker_id);
    AddEvent(*job, "failure", worker_id,
             absl::StrFormat("did not join again after generation %d ended: %s",
                             job->generation, what));
    MaybeFormGeneration(*job);
    Changed(*job);
    return true;
  }
  const std::optional<size_t> member = MemberIndex(*job, worker_id);
  if (!member.has_value() || job->members[*member].completed) return false;
  AddEvent(*job, "failure", worker_id, what);
  job->bindings.erase(worker_id);
  EndGeneration(*job, absl::StrCat("worker ", worker_id, " exited (", how, ")"),
                {worker_id});
  MaybeFormGeneration(*job);
  Changed(*job);
  return true;
}

absl::Status Core::CheckpointReported(const std::string& job_id,
                                      const v1::CheckpointReport& report) {
  CONCORD_RETURN_IF_ERROR(ValidateId("job_id", job_id));
  Job* job = FindJob(job_id);
  if (job == nullptr) return JobNotFound(job_id);
  CONCORD_RETURN_IF_ERROR(ValidateCheckpoint(job_id, report));
  CONCORD_RETURN_IF_ERROR(
      CheckCheckpointPath(job_id, job->spec.checkpoint_dir(), report));
  return Reported(*job, report, /*writer=*/"");
}

absl::Status Core::WorkerCheckpointReported(
    const v1::ReportCheckpointRequest& request) {
  CONCORD_RETURN_IF_ERROR(ValidateRequest(request));
  const std::string& job_id = request.job_id();
  Job* job = FindJob(job_id);
  if (job == nullptr) return JobNotFound(job_id);
  auto bound = job->bindings.find(request.worker_id());
  if (bound == job->bindings.end() ||
      !ConstantTimeEquals(bound->second, request.worker_secret())) {
    return absl::PermissionDeniedError(absl::StrFormat(
        "worker %s is not a worker of job %s bound to that secret: a worker "
        "reports its own job's checkpoints only",
        request.worker_id(), job_id));
  }
  CONCORD_RETURN_IF_ERROR(CheckCheckpointPath(
      job_id, job->spec.checkpoint_dir(), request.report()));
  return Reported(*job, request.report(), request.worker_id());
}

absl::Status Core::Reported(Job& job, const v1::CheckpointReport& report,
                            const std::string& writer) {
  CONCORD_ASSIGN_OR_RETURN(const std::string event,
                           job.checkpoints.Record(job.spec, report, writer));
  if (!event.empty()) AddEvent(job, "checkpoint", "", event);
  Changed(job);
  return absl::OkStatus();
}

void Core::Withdraw(Job& job, const std::string& worker_id, int64_t step,
                    const v1::LeaveRequest& request, const std::string& what,
                    const std::string& out_of_data_when,
                    const std::string& left_when) {
  const bool out_of_data = request.reason() == v1::LEAVE_REASON_END_OF_DATA;
  Forget(job, worker_id);
  job.bindings.erase(worker_id);
  if (out_of_data) {
    job.finished.insert(worker_id);
    AddEvent(job, "leave", worker_id,
             absl::StrFormat("ran out of data at step %d%s%s", step,
                             out_of_data_when,
                             request.message().empty()
                                 ? ""
                                 : absl::StrCat(": ", request.message())));
  } else {
    AddEvent(job, "leave", worker_id,
             absl::StrCat("left ", left_when, ": ", what));
  }
  if (!(out_of_data && MaybeSucceed(job))) MaybeFormGeneration(job);
  Changed(job);
}

absl::Status Core::KvSet(const v1::KvSetRequest& request) {
  CONCORD_RETURN_IF_ERROR(ValidateRequest(request));
  Job* job = FindJob(request.job_id());
  if (job == nullptr) return JobNotFound(request.job_id());
  CONCORD_RETURN_IF_ERROR(CheckMember(*job, request.worker_id(),
                                      request.worker_secret(),
                                      request.generation())
                              .status());
  job->kv[request.key()] = request.value();
  Changed(*job, /*persist=*/true, Concerns::kKv);
  return absl::OkStatus();
}

absl::StatusOr<std::optional<std::vector<std::string>>> Core::KvGet(
    const v1::KvGetRequest& request) const {
  CONCORD_RETURN_IF_ERROR(ValidateRequest(request));
  const Job* job = FindJob(request.job_id());
  if (job == nullptr) return JobNotFound(request.job_id());
  CONCORD_RETURN_IF_ERROR(CheckMember(*job, request.worker_id(),
                                      request.worker_secret(),
                                      request.generation())
                              .status());
  std::vector<std::string> values;
  values.reserve(request.keys_size());
  for (const std::string& key : request.keys()) {
    auto it = job->kv.find(key);
    if (it == job->kv.end()) return std::optional<std::vector<std::string>>();
    values.push_back(it->second);
  }
  return std::optional<std::vector<std::string>>(std::move(values));
}

}  // namespace concord::coordinator
