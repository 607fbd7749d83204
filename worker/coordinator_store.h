#pragma once
// comm::Store backed by the coordinator's key-value store, bound to one job
// and generation: the rendezvous of that generation's communicator.

#include "worker/comm/store.h"
#include "worker/coordinator_client.h"

namespace concord::worker {

class CoordinatorStore final : public comm::Store {
 public:
  CoordinatorStore(CoordinatorClient* client, std::string job_id,
                   int64_t generation)
      : client_(client), job_id_(std::move(job_id)), generation_(generation) {}

  absl::Status Set(const std::string& key, const std::string& value) override {
    return client_->KvSet(job_id_, generation_, key, value, absl::Minutes(1));
  }
  absl::StatusOr<std::vector<std::string>> Get(
      const std::vector<std::string>& keys, absl::Duration timeout) override {
    return client_->KvGet(job_id_, generation_, keys, timeout);
  }

 private:
  CoordinatorClient* client_;
  std::string job_id_;
  int64_t generation_;
};

}  // namespace concord::worker
