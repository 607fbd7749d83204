#include "worker/coordinator_client.h"

#include <grpcpp/grpcpp.h>

#include <thread>

#include "absl/strings/str_cat.h"
#include "common/backoff.h"
#include "common/grpc_status.h"

namespace concord::worker {
namespace {

// Calls `rpc(context)` until it returns something other than UNAVAILABLE or
// `timeout` has passed. Each attempt gets the remaining time as its deadline.
template <typename Rpc>
absl::Status CallWithRetry(absl::Duration timeout, Rpc rpc) {
  const absl::Time deadline = absl::Now() + timeout;
  Backoff backoff(absl::Milliseconds(50), absl::Seconds(2));
  for (;;) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(deadline));
    absl::Status status = FromGrpcStatus(rpc(&context));
    if (status.code() != absl::StatusCode::kUnavailable) return status;
    const absl::Duration pause = backoff.Next();
    if (absl::Now() + pause >= deadline) {
      return absl::UnavailableError(
          absl::StrCat("coordinator unreachable: ", status.message()));
    }
    std::this_thread::sleep_for(absl::ToChronoNanoseconds(pause));
  }
}

}  // namespace

CoordinatorClient::CoordinatorClient(const std::string& address)
    : address_(address),
      stub_(v1::WorkerService::NewStub(
          grpc::CreateChannel(address, grpc::InsecureChannelCredentials()))) {}

absl::StatusOr<v1::JoinResponse> CoordinatorClient::Join(
    v1::JoinRequest request, absl::Duration wait) {
  request.set_wait_timeout_ms(absl::ToInt64Milliseconds(wait));
  v1::JoinResponse response;
  absl::Status status = CallWithRetry(wait, [&](grpc::ClientContext* ctx) {
    return stub_->Join(ctx, request, &response);
  });
  if (!status.ok()) return status;
  return response;
}

absl::StatusOr<v1::HeartbeatResponse> CoordinatorClient::Heartbeat(
    const v1::HeartbeatRequest& request, absl::Duration timeout) {
  v1::HeartbeatResponse response;
  absl::Status status = CallWithRetry(timeout, [&](grpc::ClientContext* ctx) {
    return stub_->Heartbeat(ctx, request, &response);
  });
  if (!status.ok()) return status;
  return response;
}

absl::StatusOr<v1::LeaveResponse> CoordinatorClient::Leave(
    const v1::LeaveRequest& request, absl::Duration timeout) {
  v1::LeaveResponse response;
  absl::Status status = CallWithRetry(timeout, [&](grpc::ClientContext* ctx) {
    return stub_->Leave(ctx, request, &response);
  });
  if (!status.ok()) return status;
  return response;
}

absl::Status CoordinatorClient::KvSet(const std::string& job_id,
                                      int64_t generation,
                                      const std::string& key,
                                      const std::string& value,
                                      absl::Duration timeout) {
  v1::KvSetRequest request;
  request.set_job_id(job_id);
  request.set_generation(generation);
  request.set_key(key);
  request.set_value(value);
  v1::KvSetResponse response;
  return CallWithRetry(timeout, [&](grpc::ClientContext* ctx) {
    return stub_->KvSet(ctx, request, &response);
  });
}

absl::StatusOr<std::vector<std::string>> CoordinatorClient::KvGet(
    const std::string& job_id, int64_t generation,
    const std::vector<std::string>& keys, absl::Duration timeout) {
  v1::KvGetRequest request;
  request.set_job_id(job_id);
  request.set_generation(generation);
  for (const auto& k : keys) request.add_keys(k);
  request.set_wait_timeout_ms(absl::ToInt64Milliseconds(timeout));
  v1::KvGetResponse response;
  absl::Status status = CallWithRetry(timeout, [&](grpc::ClientContext* ctx) {
    return stub_->KvGet(ctx, request, &response);
  });
  if (!status.ok()) return status;
  return std::vector<std::string>(response.values().begin(),
                                  response.values().end());
}

}  // namespace concord::worker
