#include "coordinator/rpc/service.h"

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/grpc_status.h"
#include "coordinator/rpc/core_stream.h"

namespace concord::coordinator {
namespace {

constexpr absl::Duration kDefaultWait = absl::Seconds(300);

absl::Duration WaitTimeout(int64_t ms) {
  return ms == 0 ? kDefaultWait : absl::Milliseconds(ms);
}

// A unary call answered in its handler.
template <typename Fn>
grpc::ServerUnaryReactor* AnswerNow(grpc::CallbackServerContext* context,
                                    const Authorizer* auth, Metrics* metrics,
                                    const char* method, Fn&& fn) {
  RpcScope scope(metrics, method);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::Status status = auth->Check(*context, Role::kWorker, method);
  if (status.ok()) status = std::forward<Fn>(fn)();
  reactor->Finish(scope.Done(ToGrpcStatus(status)));
  return reactor;
}

// Runs `fn(core)` (an absl::StatusOr<Response>) as a change of the core and
// moves its value into `*response`.
template <typename Response, typename Fn>
absl::Status MutateInto(CoreHost* host, Response* response, Fn&& fn) {
  auto result = host->Mutate(std::forward<Fn>(fn));
  if (result.ok()) *response = *std::move(result);
  return result.status();
}

// A unary call that waits on the core (see Note [Asynchronous waits] in
// host.h). Owned by gRPC: deleted in OnDone, which comes after Finish. Its
// fields are guarded by the host's mutex.
class PendingUnary : public grpc::ServerUnaryReactor, public CoreHost::Waiter {
 public:
  PendingUnary(CoreHost* host, Metrics* metrics, const char* method,
               absl::Duration timeout)
      : host_(host),
        scope_(std::make_unique<RpcScope>(metrics, method)),
        timeout_(timeout) {}

  // With the host's mutex held: answers once; the finish runs after the
  // mutex is released.
  void Answer(const absl::Status& status) {
    if (answered_) return;
    answered_ = true;
    grpc::Status out = scope_->Done(ToGrpcStatus(status));
    host_->Defer([this, out = std::move(out)] { Finish(out); });
  }
  // With the host's mutex held: registers with the host until `deadline`
  // unless the first poll answers.
  void WaitOn(const std::string& job_id, CoreHost::WaitKind kind,
              absl::Time deadline) {
    if (answered_) return;  // cancelled before it got here
    id_ = host_->Wait(job_id, kind, deadline, this);
  }

  void Abandon(absl::Status status) override {
    if (absl::IsDeadlineExceeded(status)) {
      status = absl::DeadlineExceededError(absl::StrCat(
          "gave up after waiting ", absl::FormatDuration(timeout_)));
    }
    Answer(status);
  }
  void OnCancel() override {
    CoreHost::Lock lock(host_);
    if (answered_) return;
    if (id_ != 0) host_->Cancel(id_);
    Cancelled(host_->core());
    Answer(absl::CancelledError("the call was cancelled"));
  }
  void OnDone() override { delete this; }

 protected:
  bool answered() const { return answered_; }
  // With the host's mutex held: the client went away before the answer.
  virtual void Cancelled(Core& core) {}

 private:
  CoreHost* host_;
  std::unique_ptr<RpcScope> scope_;
  absl::Duration timeout_;
  CoreHost::WaiterId id_ = 0;
  bool answered_ = false;
};

class JoinCall final : public PendingUnary {
 public:
  JoinCall(CoreHost* host, Metrics* metrics, const v1::JoinRequest* request,
           v1::JoinResponse* response)
      : PendingUnary(host, metrics, "Join",
                     WaitTimeout(request->wait_timeout_ms())),
        request_(request),
        response_(response) {}

  // The Core::Join this call made.
  uint64_t* join_call() { return &join_call_; }

  bool Poll(Core& core) override {
    if (answered()) return true;
    std::optional<absl::Status> answer = JoinAnswer(core, *request_, response_);
    if (!answer.has_value()) return false;
    Answer(*answer);
    return true;
  }

 protected:
  void Cancelled(Core& core) override {
    core.CancelJoin(request_->spec().job_id(), request_->worker_id(),
                    join_call_);
  }

 private:
  const v1::JoinRequest* request_;
  v1::JoinResponse* response_;
  uint64_t join_call_ = 0;
};

class KvGetCall final : public PendingUnary {
 public:
  KvGetCall(CoreHost* host, Metrics* metrics, const v1::KvGetRequest* request,
            v1::KvGetResponse* response)
      : PendingUnary(host, metrics, "KvGet",
                     WaitTimeout(request->wait_timeout_ms())),
        request_(request),
        response_(response) {}

  bool Poll(Core& core) override {
    if (answered()) return true;
    auto values = core.KvGet(*request_);
    if (!values.ok()) {
      Answer(values.status());
      return true;
    }
    if (!values->has_value()) return false;
    for (std::string& v : **values) response_->add_values(std::move(v));
    Answer(absl::OkStatus());
    return true;
  }

 private:
  const v1::KvGetRequest* request_;
  v1::KvGetResponse* response_;
};

// A WatchMembership stream: a view waiter that writes the worker's view
// whenever it changes (see Note [Core streams] in core_stream.h; a newer view
// waits in `pending_`, replacing an older one). See Note [Re-forming] in
// core.h: the core learns of the stream once its first view was computed and
// of its end on every way out.
class WatchCall final
    : public CoreStream<grpc::ServerWriteReactor<v1::MembershipUpdate>,
                        v1::MembershipUpdate> {
 public:
  WatchCall(CoreHost* host, Metrics* metrics,
            const v1::WatchMembershipRequest* request)
      : CoreStream(host,
                   std::make_unique<RpcScope>(metrics, "WatchMembership")),
        request_(request) {}

  // With the host's mutex held.
  void Start() {
    if (ended()) return;
    id_ = host_->Wait(request_->job_id(), CoreHost::WaitKind::kView,
                      absl::InfiniteFuture(), this);
  }

  bool Poll(Core& core) override {
    if (ended() || terminal_) return true;
    absl::StatusOr<v1::MembershipUpdate> update = core.Membership(*request_);
    if (!update.ok()) {
      End(core, /*lost=*/false, update.status());
      return true;
    }
    if (!open_) {
      core.WatchOpened(request_->job_id(), request_->worker_id());
      open_ = true;
    }
    std::string bytes = update->SerializeAsString();
    if (sent_any_ && bytes == last_) return false;
    sent_any_ = true;
    last_ = std::move(bytes);
    terminal_ = Terminal(update->state());
    if (writing()) {
      pending_ = *std::move(update);
    } else {
      Write(*std::move(update));
    }
    return terminal_;
  }
  void Abandon(absl::Status status) override {
    End(host_->core(), /*lost=*/false, status);
  }

 private:
  void StopWaiting() override { host_->Cancel(id_); }
  // An error before any view was computed is only that; a stream cut by the
  // coordinator's own shutdown says nothing of the worker.
  void Ending(Core& core, bool lost) override {
    if (open_) {
      core.WatchClosed(request_->job_id(), request_->worker_id(),
                       lost && !host_->shutting_down());
    }
    pending_.reset();
  }
  void WriteQueued() override {
    if (pending_.has_value()) {
      v1::MembershipUpdate next = *std::move(pending_);
      pending_.reset();
      Write(std::move(next));
      return;
    }
    if (terminal_) End(host_->core(), /*lost=*/false, absl::OkStatus());
  }

  const v1::WatchMembershipRequest* request_;
  CoreHost::WaiterId id_ = 0;
  bool open_ = false;      // the core was told of the stream
  bool sent_any_ = false;  // a view was written (or is being written)
  bool terminal_ = false;  // the last view written says the job ended
  std::string last_;       // the last view, serialised
  std::optional<v1::MembershipUpdate> pending_;
};

}  // namespace

std::optional<absl::Status> JoinAnswer(Core& core,
                                       const v1::JoinRequest& request,
                                       v1::JoinResponse* response) {
  auto assignment =
      core.GetAssignment(request.spec().job_id(), request.worker_id());
  if (absl::IsNotFound(assignment.status())) {
    // Registered a moment ago, now gone: the generation it was placed in
    // formed and ended before this call was answered.
    return absl::AbortedError(
        absl::StrCat("the generation that worker ", request.worker_id(),
                     " was placed in has already ended; join again"));
  }
  if (!assignment.ok()) return assignment.status();
  if (!assignment->has_value()) return std::nullopt;
  const Assignment& a = **assignment;
  response->set_generation(a.generation);
  response->set_rank(a.rank);
  response->set_world_size(a.world_size);
  response->set_authoritative_rank(a.authoritative_rank);
  response->set_finished_workers(a.finished_workers);
  response->set_run(a.run);
  response->set_heartbeat_interval_ms(
      absl::ToInt64Milliseconds(a.heartbeat_interval));
  if (a.resume_memory.has_value()) {
    *response->mutable_resume_memory() = *a.resume_memory;
  }
  if (a.resume_from.has_value()) {
    *response->mutable_resume_from() = *a.resume_from;
  }
  if (a.rank_change.has_value()) {
    *response->mutable_rank_change() = *a.rank_change;
  }
  if (request.include_members() || a.probe ||
      (request.members_if_running() && a.rank_change.has_value())) {
    response->mutable_members()->Reserve(static_cast<int>(a.members->size()));
    for (const v1::Member& m : *a.members) *response->add_members() = m;
  }
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* WorkerServiceImpl::Join(
    grpc::CallbackServerContext* context, const v1::JoinRequest* request,
    v1::JoinResponse* response) {
  auto* call = new JoinCall(host_, metrics_, request, response);
  const absl::Time deadline =
      std::min(absl::Now() + WaitTimeout(request->wait_timeout_ms()),
               absl::FromChrono(context->deadline()));
  absl::Status auth = auth_->Check(*context, Role::kWorker, "Join");
  CoreHost::Lock lock(host_);
  if (!auth.ok()) {
    call->Answer(auth);
  } else if (host_->shutting_down()) {
    call->Answer(absl::UnavailableError("the coordinator is shutting down"));
  } else if (absl::Status joined =
                 host_->core().Join(*request, call->join_call());
             !joined.ok()) {
    call->Answer(joined);
  } else {
    call->WaitOn(request->spec().job_id(), CoreHost::WaitKind::kPlacement,
                 deadline);
  }
  return call;
}

grpc::ServerUnaryReactor* WorkerServiceImpl::KvGet(
    grpc::CallbackServerContext* context, const v1::KvGetRequest* request,
    v1::KvGetResponse* response) {
  auto* call = new KvGetCall(host_, metrics_, request, response);
  const absl::Time deadline =
      std::min(absl::Now() + WaitTimeout(request->wait_timeout_ms()),
               absl::FromChrono(context->deadline()));
  absl::Status auth = auth_->Check(*context, Role::kWorker, "KvGet");
  CoreHost::Lock lock(host_);
  if (!auth.ok()) {
    call->Answer(auth);
  } else {
    call->WaitOn(request->job_id(), CoreHost::WaitKind::kKv, deadline);
  }
  return call;
}

grpc::ServerWriteReactor<v1::MembershipUpdate>*
WorkerServiceImpl::WatchMembership(grpc::CallbackServerContext* context,
                                   const v1::WatchMembershipRequest* request) {
  auto* call = new WatchCall(host_, metrics_, request);
  absl::Status auth = auth_->Check(*context, Role::kWorker, "WatchMembership");
  CoreHost::Lock lock(host_);
  if (!auth.ok()) {
    call->End(host_->core(), /*lost=*/false, auth);
  } else {
    call->Start();
  }
  return call;
}

grpc::ServerUnaryReactor* WorkerServiceImpl::Heartbeat(
    grpc::CallbackServerContext* context, const v1::HeartbeatRequest* request,
    v1::HeartbeatResponse* response) {
  return AnswerNow(context, auth_, metrics_, "Heartbeat", [&] {
    return MutateInto(host_, response,
                      [&](Core& core) { return core.Heartbeat(*request); });
  });
}

grpc::ServerUnaryReactor* WorkerServiceImpl::Leave(
    grpc::CallbackServerContext* context, const v1::LeaveRequest* request,
    v1::LeaveResponse* response) {
  return AnswerNow(context, auth_, metrics_, "Leave", [&] {
    return MutateInto(host_, response,
                      [&](Core& core) { return core.Leave(*request); });
  });
}

grpc::ServerUnaryReactor* WorkerServiceImpl::ReportCheckpoint(
    grpc::CallbackServerContext* context,
    const v1::ReportCheckpointRequest* request,
    v1::ReportCheckpointResponse* /*response*/) {
  return AnswerNow(context, auth_, metrics_, "ReportCheckpoint", [&] {
    return host_->Mutate(
        [&](Core& core) { return core.WorkerCheckpointReported(*request); });
  });
}

grpc::ServerUnaryReactor* WorkerServiceImpl::KvSet(
    grpc::CallbackServerContext* context, const v1::KvSetRequest* request,
    v1::KvSetResponse* /*response*/) {
  return AnswerNow(context, auth_, metrics_, "KvSet", [&] {
    return host_->Mutate([&](Core& core) { return core.KvSet(*request); });
  });
}

}  // namespace concord::coordinator
