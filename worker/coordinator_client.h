#pragma once
// The worker's client of the coordinator's WorkerService.
//
// Idempotent calls (KvSet, KvGet, Heartbeat, Join) are retried with backoff
// while the coordinator is UNAVAILABLE, up to the call's own deadline.
// Thread-safe: the heartbeat thread and the training thread share one client.

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "concord/v1/worker.grpc.pb.h"

namespace concord::worker {

class CoordinatorClient {
 public:
  // Does not block; the channel connects lazily.
  explicit CoordinatorClient(const std::string& address);

  const std::string& address() const { return address_; }

  // Blocks until this worker is a member of a generation.
  // Errors: as WorkerService.Join; DEADLINE_EXCEEDED after `wait`;
  // UNAVAILABLE when the coordinator stays unreachable for `wait`.
  absl::StatusOr<v1::JoinResponse> Join(v1::JoinRequest request,
                                        absl::Duration wait);
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(
      const v1::HeartbeatRequest& request, absl::Duration timeout);
  absl::StatusOr<v1::LeaveResponse> Leave(const v1::LeaveRequest& request,
                                          absl::Duration timeout);
  absl::Status KvSet(const std::string& job_id, int64_t generation,
                     const std::string& key, const std::string& value,
                     absl::Duration timeout);
  // Blocks until every key is set; DEADLINE_EXCEEDED after `timeout`.
  absl::StatusOr<std::vector<std::string>> KvGet(
      const std::string& job_id, int64_t generation,
      const std::vector<std::string>& keys, absl::Duration timeout);

 private:
  std::string address_;
  std::unique_ptr<v1::WorkerService::Stub> stub_;
};

}  // namespace concord::worker
