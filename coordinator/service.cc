#include "coordinator/service.h"

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/grpc_status.h"

namespace concord::coordinator {
namespace {

constexpr absl::Duration kDefaultWait = absl::Seconds(300);
// How often a blocked call looks for cancellation even when nothing changes.
constexpr absl::Duration kCancelPoll = absl::Milliseconds(200);

absl::StatusOr<absl::Duration> WaitTimeout(int64_t ms) {
  if (ms < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("wait_timeout_ms must not be negative; got ", ms));
  }
  return ms == 0 ? kDefaultWait : absl::Milliseconds(ms);
}

}  // namespace

WorkerServiceImpl::WorkerServiceImpl(const Clock* clock) : core_(clock) {}

template <typename Poll>
auto WorkerServiceImpl::WaitFor(grpc::ServerContext* context,
                                absl::Duration timeout,
                                std::unique_lock<std::mutex>& lock, Poll poll)
    -> decltype(poll()) {
  const absl::Time deadline =
      std::min(absl::Now() + timeout, absl::FromChrono(context->deadline()));
  while (true) {
    auto result = poll();
    if (!result.ok() || result->has_value()) return result;
    if (shutting_down_) {
      return absl::UnavailableError("the coordinator is shutting down");
    }
    if (context->IsCancelled()) {
      return absl::CancelledError("the call was cancelled");
    }
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "gave up after waiting ", absl::FormatDuration(timeout)));
    }
    changed_.wait_for(
        lock, absl::ToChronoNanoseconds(std::min(deadline - now, kCancelPoll)));
  }
}

grpc::Status WorkerServiceImpl::Join(grpc::ServerContext* context,
                                     const v1::JoinRequest* request,
                                     v1::JoinResponse* response) {
  const absl::StatusOr<absl::Duration> timeout =
      WaitTimeout(request->wait_timeout_ms());
  if (!timeout.ok()) return ToGrpcStatus(timeout.status());
  const std::string& job_id = request->spec().job_id();
  const std::string& worker_id = request->worker_id();

  std::unique_lock<std::mutex> lock(mu_);
  if (shutting_down_) {
    return ToGrpcStatus(
        absl::UnavailableError("the coordinator is shutting down"));
  }
  const absl::Status joined = core_.Join(*request);
  changed_.notify_all();
  if (!joined.ok()) return ToGrpcStatus(joined);

  auto assignment = WaitFor(context, *timeout, lock, [&] {
    return core_.GetAssignment(job_id, worker_id);
  });
  if (absl::IsNotFound(assignment.status())) {
    // Registered a moment ago, now gone: the generation it was placed in
    // formed and ended before this call woke up.
    return ToGrpcStatus(absl::AbortedError(
        absl::StrCat("the generation that worker ", worker_id,
                     " was placed in has already ended; join again")));
  }
  if (!assignment.ok()) return ToGrpcStatus(assignment.status());
  const Assignment& a = **assignment;
  response->set_generation(a.generation);
  response->set_rank(a.rank);
  response->set_world_size(a.world_size);
  response->set_authoritative_rank(a.authoritative_rank);
  response->set_heartbeat_interval_ms(
      absl::ToInt64Milliseconds(a.heartbeat_interval));
  for (const v1::Member& m : a.members) *response->add_members() = m;
  return grpc::Status::OK;
}

grpc::Status WorkerServiceImpl::Heartbeat(grpc::ServerContext* context,
                                          const v1::HeartbeatRequest* request,
                                          v1::HeartbeatResponse* response) {
  std::lock_guard<std::mutex> lock(mu_);
  absl::StatusOr<v1::HeartbeatResponse> result = core_.Heartbeat(*request);
  changed_.notify_all();
  if (!result.ok()) return ToGrpcStatus(result.status());
  *response = *std::move(result);
  return grpc::Status::OK;
}

grpc::Status WorkerServiceImpl::Leave(grpc::ServerContext* context,
                                      const v1::LeaveRequest* request,
                                      v1::LeaveResponse* response) {
  std::lock_guard<std::mutex> lock(mu_);
  absl::StatusOr<v1::LeaveResponse> result = core_.Leave(*request);
  changed_.notify_all();
  if (!result.ok()) return ToGrpcStatus(result.status());
  *response = *std::move(result);
  return grpc::Status::OK;
}

grpc::Status WorkerServiceImpl::KvSet(grpc::ServerContext* context,
                                      const v1::KvSetRequest* request,
                                      v1::KvSetResponse* response) {
  std::lock_guard<std::mutex> lock(mu_);
  const absl::Status status = core_.KvSet(*request);
  changed_.notify_all();
  return ToGrpcStatus(status);
}

grpc::Status WorkerServiceImpl::KvGet(grpc::ServerContext* context,
                                      const v1::KvGetRequest* request,
                                      v1::KvGetResponse* response) {
  const absl::StatusOr<absl::Duration> timeout =
      WaitTimeout(request->wait_timeout_ms());
  if (!timeout.ok()) return ToGrpcStatus(timeout.status());
  std::unique_lock<std::mutex> lock(mu_);
  auto values =
      WaitFor(context, *timeout, lock, [&] { return core_.KvGet(*request); });
  if (!values.ok()) return ToGrpcStatus(values.status());
  for (std::string& v : **values) response->add_values(std::move(v));
  return grpc::Status::OK;
}

void WorkerServiceImpl::Tick() {
  std::lock_guard<std::mutex> lock(mu_);
  core_.Tick();
  changed_.notify_all();
}

void WorkerServiceImpl::Shutdown() {
  std::lock_guard<std::mutex> lock(mu_);
  shutting_down_ = true;
  changed_.notify_all();
}

}  // namespace concord::coordinator
