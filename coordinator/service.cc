#include "coordinator/service.h"

#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"

namespace concord::coordinator {
namespace {

constexpr absl::Duration kDefaultWait = absl::Seconds(300);
// A watch stream re-checks for cancellation at least this often.
constexpr absl::Duration kWatchPoll = absl::Milliseconds(200);

absl::Duration WaitTimeout(int64_t ms) {
  return ms == 0 ? kDefaultWait : absl::Milliseconds(ms);
}

bool Terminal(v1::JobState state) {
  return state == v1::JOB_STATE_SUCCEEDED || state == v1::JOB_STATE_FAILED ||
         state == v1::JOB_STATE_STOPPED;
}

}  // namespace

#define CONCORD_AUTHORIZE(scope, context, method)                            \
  do {                                                                       \
    absl::Status auth_status_ =                                              \
        auth_->Check(*(context), Role::kWorker, method);                     \
    if (!auth_status_.ok()) return (scope).Done(ToGrpcStatus(auth_status_)); \
  } while (false)

grpc::Status WorkerServiceImpl::Join(grpc::ServerContext* context,
                                     const v1::JoinRequest* request,
                                     v1::JoinResponse* response) {
  RpcScope scope(metrics_, "Join");
  CONCORD_AUTHORIZE(scope, context, "Join");
  const std::string& job_id = request->spec().job_id();
  const std::string& worker_id = request->worker_id();

  std::unique_lock<std::mutex> lock(host_->mu());
  if (host_->shutting_down()) {
    return scope.Done(ToGrpcStatus(
        absl::UnavailableError("the coordinator is shutting down")));
  }
  const absl::Status joined = host_->core().Join(*request);
  host_->AfterChange();
  if (!joined.ok()) return scope.Done(ToGrpcStatus(joined));

  auto assignment = host_->WaitFor(
      *context, WaitTimeout(request->wait_timeout_ms()), lock,
      [&](Core& core) { return core.GetAssignment(job_id, worker_id); });
  if (absl::IsNotFound(assignment.status())) {
    // Registered a moment ago, now gone: the generation it was placed in
    // formed and ended before this call woke up.
    return scope.Done(ToGrpcStatus(absl::AbortedError(
        absl::StrCat("the generation that worker ", worker_id,
                     " was placed in has already ended; join again"))));
  }
  if (!assignment.ok()) return scope.Done(ToGrpcStatus(assignment.status()));
  const Assignment& a = **assignment;
  response->set_generation(a.generation);
  response->set_rank(a.rank);
  response->set_world_size(a.world_size);
  response->set_authoritative_rank(a.authoritative_rank);
  response->set_finished_workers(a.finished_workers);
  response->set_heartbeat_interval_ms(
      absl::ToInt64Milliseconds(a.heartbeat_interval));
  for (const v1::Member& m : a.members) *response->add_members() = m;
  return scope.Done(grpc::Status::OK);
}

grpc::Status WorkerServiceImpl::Heartbeat(grpc::ServerContext* context,
                                          const v1::HeartbeatRequest* request,
                                          v1::HeartbeatResponse* response) {
  RpcScope scope(metrics_, "Heartbeat");
  CONCORD_AUTHORIZE(scope, context, "Heartbeat");
  absl::StatusOr<v1::HeartbeatResponse> result =
      host_->Mutate([&](Core& core) { return core.Heartbeat(*request); });
  if (!result.ok()) return scope.Done(ToGrpcStatus(result.status()));
  *response = *std::move(result);
  return scope.Done(grpc::Status::OK);
}

grpc::Status WorkerServiceImpl::Leave(grpc::ServerContext* context,
                                      const v1::LeaveRequest* request,
                                      v1::LeaveResponse* response) {
  RpcScope scope(metrics_, "Leave");
  CONCORD_AUTHORIZE(scope, context, "Leave");
  absl::StatusOr<v1::LeaveResponse> result =
      host_->Mutate([&](Core& core) { return core.Leave(*request); });
  if (!result.ok()) return scope.Done(ToGrpcStatus(result.status()));
  *response = *std::move(result);
  return scope.Done(grpc::Status::OK);
}

grpc::Status WorkerServiceImpl::KvSet(grpc::ServerContext* context,
                                      const v1::KvSetRequest* request,
                                      v1::KvSetResponse* response) {
  RpcScope scope(metrics_, "KvSet");
  CONCORD_AUTHORIZE(scope, context, "KvSet");
  return scope.Done(ToGrpcStatus(
      host_->Mutate([&](Core& core) { return core.KvSet(*request); })));
}

grpc::Status WorkerServiceImpl::KvGet(grpc::ServerContext* context,
                                      const v1::KvGetRequest* request,
                                      v1::KvGetResponse* response) {
  RpcScope scope(metrics_, "KvGet");
  CONCORD_AUTHORIZE(scope, context, "KvGet");
  std::unique_lock<std::mutex> lock(host_->mu());
  auto values =
      host_->WaitFor(*context, WaitTimeout(request->wait_timeout_ms()), lock,
                     [&](Core& core) { return core.KvGet(*request); });
  if (!values.ok()) return scope.Done(ToGrpcStatus(values.status()));
  for (std::string& v : **values) response->add_values(std::move(v));
  return scope.Done(grpc::Status::OK);
}

grpc::Status WorkerServiceImpl::WatchMembership(
    grpc::ServerContext* context, const v1::WatchMembershipRequest* request,
    grpc::ServerWriter<v1::MembershipUpdate>* writer) {
  RpcScope scope(metrics_, "WatchMembership");
  CONCORD_AUTHORIZE(scope, context, "WatchMembership");
  std::string last_sent;
  bool sent_any = false;
  std::unique_lock<std::mutex> lock(host_->mu());
  // Note [Re-forming] in core.h: the core learns of the stream once it is
  // open and of its end on every way out after that (the lock is held on
  // each); `lost` when the client went away, which a stream cut by the
  // coordinator's own shutdown is not.
  bool open = false;
  auto finish = [&](bool lost, grpc::Status status) {
    if (open) {
      host_->core().WatchClosed(request->job_id(), request->worker_id(),
                                lost && !host_->shutting_down());
      host_->AfterChange();
    }
    return scope.Done(std::move(status));
  };
  while (true) {
    if (host_->shutting_down()) {
      return finish(/*lost=*/false, ToGrpcStatus(absl::UnavailableError(
                                        "the coordinator is shutting down")));
    }
    if (context->IsCancelled()) {
      return finish(
          /*lost=*/true,
          ToGrpcStatus(absl::CancelledError("the call was cancelled")));
    }
    const uint64_t seen = host_->core().membership_version();
    absl::StatusOr<v1::MembershipUpdate> update =
        host_->core().Membership(*request);
    if (!update.ok()) {
      return finish(/*lost=*/false, ToGrpcStatus(update.status()));
    }
    if (!open) {
      host_->core().WatchOpened(request->job_id(), request->worker_id());
      open = true;
    }
    std::string bytes = update->SerializeAsString();
    if (!sent_any || bytes != last_sent) {
      lock.unlock();
      const bool written = writer->Write(*update);
      lock.lock();
      if (!written) {
        return finish(
            /*lost=*/true,
            ToGrpcStatus(absl::CancelledError("the stream was closed")));
      }
      sent_any = true;
      last_sent = std::move(bytes);
      if (Terminal(update->state())) {
        return finish(/*lost=*/false, grpc::Status::OK);
      }
    }
    host_->WaitForChange(lock, seen, kWatchPoll);
  }
}

grpc::Status WorkerServiceImpl::ReportEndOfData(
    grpc::ServerContext* context, const v1::EndOfDataRequest* request,
    v1::EndOfDataResponse* response) {
  RpcScope scope(metrics_, "ReportEndOfData");
  CONCORD_AUTHORIZE(scope, context, "ReportEndOfData");
  absl::StatusOr<v1::EndOfDataResponse> result =
      host_->Mutate([&](Core& core) { return core.ReportEndOfData(*request); });
  if (!result.ok()) return scope.Done(ToGrpcStatus(result.status()));
  *response = *std::move(result);
  return scope.Done(grpc::Status::OK);
}

#undef CONCORD_AUTHORIZE

}  // namespace concord::coordinator
