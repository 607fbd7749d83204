#include "worker/coordinator_client.h"

#include <grpcpp/grpcpp.h>

#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/auth.h"
#include "common/backoff.h"
#include "common/grpc_auth.h"
#include "common/grpc_status.h"
#include "common/logging.h"

namespace concord::worker {
namespace {

// Calls `rpc(stub, context)` until it returns something other than
// UNAVAILABLE or `timeout` has passed, moving to the next replica after each
// UNAVAILABLE. Each attempt gets the remaining time as its deadline.
template <typename Rpc>
absl::Status CallWithRetry(CoordinatorClient::Replicas& replicas,
                           const std::string& token, absl::Duration timeout,
                           Rpc rpc) {
  const absl::Time deadline = absl::Now() + timeout;
  Backoff backoff(absl::Milliseconds(50), absl::Seconds(2));
  for (;;) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(deadline));
    AddBearerToken(context, token);
    const size_t used = replicas.current();
    absl::Status status =
        FromGrpcStatus(rpc(replicas.stub(used).get(), &context));
    if (status.code() != absl::StatusCode::kUnavailable) return status;
    if (replicas.Next(used, status)) continue;  // try the other replica at once
    const absl::Duration pause = backoff.Next();
    if (absl::Now() + pause >= deadline) {
      return absl::UnavailableError(
          absl::StrCat("coordinator unreachable: ", status.message()));
    }
    std::this_thread::sleep_for(absl::ToChronoNanoseconds(pause));
  }
}

// A unary WorkerService method of the stub, as
// `&v1::WorkerService::Stub::Join`.
template <typename Request, typename Response>
using UnaryMethod = grpc::Status (v1::WorkerService::Stub::*)(
    grpc::ClientContext*, const Request&, Response*);

// Every unary call of the client: `request`, stamped with this process's
// worker id and secret (see Note [Worker binding] in
// coordinator/core/core.h), sent with CallWithRetry; its response, or the
// call's error.
template <typename Request, typename Response>
absl::StatusOr<Response> Call(CoordinatorClient::Replicas& replicas,
                              const ClientIdentity& identity,
                              absl::Duration timeout,
                              UnaryMethod<Request, Response> method,
                              Request& request) {
  request.set_worker_id(identity.worker_id);
  request.set_worker_secret(identity.worker_secret);
  Response response;
  absl::Status status = CallWithRetry(
      replicas, identity.token, timeout,
      [&](v1::WorkerService::Stub* stub, grpc::ClientContext* context) {
        return (stub->*method)(context, request, &response);
      });
  if (!status.ok()) return status;
  return response;
}

bool Terminal(v1::JobState state) {
  return state == v1::JOB_STATE_SUCCEEDED || state == v1::JOB_STATE_FAILED ||
         state == v1::JOB_STATE_STOPPED;
}

// See Note [Fresh channels] in common/coordinator_channel.h.
constexpr absl::Duration kRefreshAfter =
    absl::Milliseconds(kRefreshChannelAfterMs);

}  // namespace

CoordinatorClient::Replicas::Replicas(const std::string& address,
                                      const TlsMaterial& tls)
    : addresses_(SplitCoordinatorAddress(address)), tls_(tls) {
  for (const std::string& replica : addresses_) {
    stubs_.push_back(
        Fresh{v1::WorkerService::NewStub(CoordinatorChannel(replica, tls_)),
              absl::Now()});
  }
}

std::shared_ptr<v1::WorkerService::Stub> CoordinatorClient::Replicas::stub(
    size_t i) {
  std::lock_guard<std::mutex> lock(mu_);
  return stubs_[i].stub;
}

bool CoordinatorClient::Replicas::Next(size_t used, const absl::Status& why) {
  {
    // See Note [Fresh channels].
    std::lock_guard<std::mutex> lock(mu_);
    Fresh& failing = stubs_[used];
    if (absl::Now() - failing.created > kRefreshAfter) {
      failing.stub = v1::WorkerService::NewStub(
          CoordinatorChannel(addresses_[used], tls_));
      failing.created = absl::Now();
    }
  }
  if (stubs_.size() < 2) return false;
  size_t expected = used;
  const size_t next = (used + 1) % stubs_.size();
  if (current_.compare_exchange_strong(expected, next)) {
    Log()->info("coordinator {}: {}; trying {}", addresses_[used],
                std::string(why.message()), addresses_[next]);
  }
  // One pass over the others right away; the backoff paces the rounds.
  return (used + 1) % stubs_.size() != 0;
}

CoordinatorClient::CoordinatorClient(const std::string& address,
                                     ClientIdentity identity)
    : address_(address),
      identity_(std::move(identity)),
      replicas_(address, identity_.tls) {}

absl::StatusOr<v1::JoinResponse> CoordinatorClient::Join(
    v1::JoinRequest request, absl::Duration wait) {
  request.set_wait_timeout_ms(absl::ToInt64Milliseconds(wait));
  return Call(replicas_, identity_, wait, &v1::WorkerService::Stub::Join,
              request);
}

absl::StatusOr<v1::HeartbeatResponse> CoordinatorClient::Heartbeat(
    v1::HeartbeatRequest request, absl::Duration timeout) {
  return Call(replicas_, identity_, timeout,
              &v1::WorkerService::Stub::Heartbeat, request);
}

absl::StatusOr<v1::LeaveResponse> CoordinatorClient::Leave(
    v1::LeaveRequest request, absl::Duration timeout) {
  return Call(replicas_, identity_, timeout, &v1::WorkerService::Stub::Leave,
              request);
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
  return Call(replicas_, identity_, timeout, &v1::WorkerService::Stub::KvSet,
              request)
      .status();
}

absl::Status CoordinatorClient::ReportCheckpoint(
    const std::string& job_id, const v1::CheckpointReport& report,
    absl::Duration timeout) {
  v1::ReportCheckpointRequest request;
  request.set_job_id(job_id);
  *request.mutable_report() = report;
  return Call(replicas_, identity_, timeout,
              &v1::WorkerService::Stub::ReportCheckpoint, request)
      .status();
}

absl::StatusOr<std::vector<std::string>> CoordinatorClient::KvGet(
    const std::string& job_id, int64_t generation,
    const std::vector<std::string>& keys, absl::Duration timeout) {
  v1::KvGetRequest request;
  request.set_job_id(job_id);
  request.set_generation(generation);
  for (const auto& k : keys) request.add_keys(k);
  request.set_wait_timeout_ms(absl::ToInt64Milliseconds(timeout));
  absl::StatusOr<v1::KvGetResponse> response = Call(
      replicas_, identity_, timeout, &v1::WorkerService::Stub::KvGet, request);
  if (!response.ok()) return response.status();
  return std::vector<std::string>(response->values().begin(),
                                  response->values().end());
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
  const size_t used = replicas_.current();
  // Held for the stream's life: Next may replace the replica's stub.
  const std::shared_ptr<v1::WorkerService::Stub> stub = replicas_.stub(used);
  auto reader = stub->WatchMembership(context, request);
  v1::MembershipUpdate update;
  while (reader->Read(&update)) on_update(update);
  absl::Status status = FromGrpcStatus(reader->Finish());
  if (status.code() == absl::StatusCode::kUnavailable)
    replicas_.Next(used, status);
  return status;
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
          live_ = true;
          ++updates_;
          terminal = Terminal(update.state());
          cv_.notify_all();
        },
        &context);
    std::unique_lock<std::mutex> lock(mu_);
    active_ = nullptr;
    live_ = false;
    if (stop_ || terminal) return;
    // Permanent refusals end the watch; anything else (coordinator
    // restarting, network) is retried with backoff.
    if (status.code() == absl::StatusCode::kPermissionDenied ||
        status.code() == absl::StatusCode::kUnauthenticated ||
        status.code() == absl::StatusCode::kInvalidArgument) {
      Log()->warn("membership watch: {}", status.ToString());
      return;
    }
    cv_.wait_for(lock, absl::ToChronoNanoseconds(backoff.Next()),
                 [this] { return stop_; });
  }
}

int64_t MembershipWatcher::updates() const {
  std::lock_guard<std::mutex> lock(mu_);
  return updates_;
}

std::optional<v1::MembershipUpdate> MembershipWatcher::Live() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!live_) return std::nullopt;
  return latest_;
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
