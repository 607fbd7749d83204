#include "agent/coordinator_replicas.h"

#include "absl/time/clock.h"
#include "common/coordinator_channel.h"
#include "common/grpc_auth.h"

namespace concord::agent {

CoordinatorReplicas::CoordinatorReplicas(const std::string& coordinator,
                                         const TlsMaterial& tls,
                                         std::string token)
    : tls_(tls),
      token_(std::move(token)),
      addresses_(SplitCoordinatorAddress(coordinator)) {
  for (const std::string& address : addresses_) {
    replicas_.push_back(Make(address));
  }
}

CoordinatorReplicas::Replica CoordinatorReplicas::Make(
    const std::string& address) const {
  auto channel = CoordinatorChannel(address, tls_);
  return Replica{v1::WorkerService::NewStub(channel),
                 v1::AgentService::NewStub(channel),
                 std::make_shared<grpc::GenericStub>(channel), absl::Now()};
}

std::pair<CoordinatorReplicas::Replica, size_t> CoordinatorReplicas::Current() {
  std::lock_guard<std::mutex> lock(mu_);
  return {replicas_[current_], current_};
}

void CoordinatorReplicas::Note(const grpc::Status& status, size_t used) {
  if (status.error_code() != grpc::StatusCode::UNAVAILABLE) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (absl::Now() - replicas_[used].created >
      absl::Milliseconds(kRefreshChannelAfterMs)) {
    retired_.push_back(std::move(replicas_[used]));
    replicas_[used] = Make(addresses_[used]);
  }
  if (used == current_) current_ = (current_ + 1) % replicas_.size();
}

std::vector<CoordinatorReplicas::Replica> CoordinatorReplicas::TakeRetired() {
  std::vector<Replica> retired;
  std::lock_guard<std::mutex> lock(mu_);
  retired.swap(retired_);
  return retired;
}

void CoordinatorReplicas::Prepare(
    grpc::ClientContext* context,
    std::chrono::system_clock::time_point deadline) const {
  context->set_deadline(deadline);
  AddBearerToken(*context, token_);
}

}  // namespace concord::agent
