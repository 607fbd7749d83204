#include "worker/coordinator_client.h"

#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include <thread>

#include "absl/strings/str_cat.h"
#include "common/auth.h"
#include "common/backoff.h"
#include "common/grpc_status.h"

namespace concord::worker {
namespace {

// Calls `rpc(context)` until it returns something other than UNAVAILABLE or
// `timeout` has passed. Each attempt gets the remaining time as its deadline.
template <typename Rpc>
absl::Status CallWithRetry(const std::string& token, absl::Duration timeout,
                           Rpc rpc) {
  const absl::Time deadline = absl::Now() + timeout;
  Backoff backoff(absl::Milliseconds(50), absl::Seconds(2));
  for (;;) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(deadline));
    AddBearerToken(context, token);
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

bool Terminal(v1::JobState state) {
  return state == v1::JOB_STATE_SUCCEEDED || state == v1::JOB_STATE_FAILED ||
         state == v1::JOB_STATE_STOPPED;
}

}  // namespace

CoordinatorClient::CoordinatorClient(const std::string& address,
                                     ClientIdentity identity)
    : address_(address),
      identity_(std::move(identity)),
      stub_(v1::WorkerService::NewStub(
          grpc::CreateChannel(address, ChannelCredentials(identity_.tls)))) {}

absl::StatusOr<v1::JoinResponse> CoordinatorClient::Join(
    v1::JoinRequest request, absl::Duration wait) {
  request.set_wait_timeout_ms(absl::ToInt64Milliseconds(wait));
  request.set_worker_id(identity_.worker_id);
  request.set_worker_secret(identity_.worker_secret);
  v1::JoinResponse response;
  absl::Status status =
      CallWithRetry(identity_.token, wait, [&](grpc::ClientContext* ctx) {
        return stub_->Join(ctx, request, &response);
      });
  if (!status.ok()) return status;
  return response;
}

absl::StatusOr<v1::HeartbeatResponse> CoordinatorClient::Heartbeat(
    v1::HeartbeatRequest request, absl::Duration timeout) {
  request.set_worker_id(identity_.worker_id);
  request.set_worker_secret(identity_.worker_secret);
  v1::HeartbeatResponse response;
  absl::Status status =
      CallWithRetry(identity_.token, timeout, [&](grpc::ClientContext* ctx) {
        return stub_->Heartbeat(ctx, request, &response);
      });
  if (!status.ok()) return status;
  return response;
}

absl::StatusOr<v1::LeaveResponse> CoordinatorClient::Leave(
    v1::LeaveRequest request, absl::Duration timeout) {
  request.set_worker_id(identity_.worker_id);
  request.set_worker_secret(identity_.worker_secret);
  v1::LeaveResponse response;
  absl::Status status =
      CallWithRetry(identity_.token, timeout, [&](grpc::ClientContext* ctx) {
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
  request.set_worker_id(identity_.worker_id);
  request.set_worker_secret(identity_.worker_secret);
  v1::KvSetResponse response;
  return CallWithRetry(identity_.token, timeout, [&](grpc::ClientContext* ctx) {
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
  request.set_worker_id(identity_.worker_id);
  request.set_worker_secret(identity_.worker_secret);
  v1::KvGetResponse response;
  absl::Status status =
      CallWithRetry(identity_.token, timeout, [&](grpc::ClientContext* ctx) {
        return stub_->KvGet(ctx, request, &response);
      });
  if (!status.ok()) return status;
  return std::vector<std::string>(response.values().begin(),
                                  response.values().end());
}

absl::StatusOr<v1::EndOfDataResponse> CoordinatorClient::ReportEndOfData(
    const std::string& job_id, int64_t generation, int64_t last_step,
    absl::Duration timeout) {
  v1::EndOfDataRequest request;
  request.set_job_id(job_id);
  request.set_worker_id(identity_.worker_id);
  request.set_worker_secret(identity_.worker_secret);
  request.set_generation(generation);
  request.set_last_step(last_step);
  v1::EndOfDataResponse response;
  absl::Status status =
      CallWithRetry(identity_.token, timeout, [&](grpc::ClientContext* ctx) {
        return stub_->ReportEndOfData(ctx, request, &response);
      });
  if (!status.ok()) return status;
  return response;
}

absl::Status CoordinatorClient::WatchOnce(
    const std::string& job_id,
    const std::function<void(const v1::MembershipUpdate&)>& on_update,
    grpc::ClientContext* context) {
  v1::WatchMembershipRequest request;
  request.set_job_id(job_id);
  request.set_worker_id(identity_.worker_id);
  request.set_worker_secret(identity_.worker_secret);
  AddBearerToken(*context, identity_.token);
  auto reader = stub_->WatchMembership(context, request);
  v1::MembershipUpdate update;
  while (reader->Read(&update)) on_update(update);
  return FromGrpcStatus(reader->Finish());
}

MembershipWatcher::MembershipWatcher(
    CoordinatorClient* client, std::string job_id,
    std::function<void(const v1::MembershipUpdate&)> on_update)
    : client_(client),
      job_id_(std::move(job_id)),
      on_update_(std::move(on_update)) {
  thread_ = std::thread([this] { Run(); });
}

MembershipWatcher::~MembershipWatcher() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    if (active_ != nullptr) active_->TryCancel();
  }
  cv_.notify_all();
  thread_.join();
}

void MembershipWatcher::Run() {
  Backoff backoff(absl::Milliseconds(50), absl::Seconds(2));
  while (true) {
    grpc::ClientContext context;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
      active_ = &context;
    }
    bool terminal = false;
    const absl::Status status = client_->WatchOnce(
        job_id_,
        [&](const v1::MembershipUpdate& update) {
          backoff.Reset();
          if (on_update_) on_update_(update);
          std::lock_guard<std::mutex> lock(mu_);
          latest_ = update;
          ++updates_;
          terminal = Terminal(update.state());
          cv_.notify_all();
        },
        &context);
    std::unique_lock<std::mutex> lock(mu_);
    active_ = nullptr;
    if (stop_ || terminal) return;
    // Permanent refusals end the watch; anything else (coordinator
    // restarting, network) is retried with backoff.
    if (status.code() == absl::StatusCode::kPermissionDenied ||
        status.code() == absl::StatusCode::kUnauthenticated ||
        status.code() == absl::StatusCode::kInvalidArgument) {
      spdlog::warn("membership watch: {}", status.ToString());
      return;
    }
    cv_.wait_for(lock, absl::ToChronoNanoseconds(backoff.Next()),
                 [this] { return stop_; });
  }
}

std::optional<v1::MembershipUpdate> MembershipWatcher::Latest() const {
  std::lock_guard<std::mutex> lock(mu_);
  return latest_;
}

int64_t MembershipWatcher::updates() const {
  std::lock_guard<std::mutex> lock(mu_);
  return updates_;
}

absl::StatusOr<v1::MembershipUpdate> MembershipWatcher::WaitFor(
    const std::function<bool(const v1::MembershipUpdate&)>& pred,
    absl::Duration timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  const bool ok = cv_.wait_for(lock, absl::ToChronoNanoseconds(timeout), [&] {
    return latest_.has_value() && pred(*latest_);
  });
  if (!ok) {
    return absl::DeadlineExceededError(
        absl::StrCat("no matching membership update within ",
                     absl::FormatDuration(timeout)));
  }
  return *latest_;
}

}  // namespace concord::worker
