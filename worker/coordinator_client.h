#pragma once
// The worker's client of the coordinator's WorkerService.
//
// Every unary call (Join, Heartbeat, Leave, KvSet, KvGet, ReportCheckpoint)
// goes through one wrapper (Call in the .cc): retried with backoff while the
// coordinator is UNAVAILABLE, up to the call's own deadline.
// Every call carries the worker token (`authorization: Bearer`) and this
// process's worker id and secret (see Note [Worker binding] in
// coordinator/core/core.h): the client fills in worker_id/worker_secret of
// every request it sends. Thread-safe: the heartbeat thread, the membership
// watcher and the training thread share one client.

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/coordinator_channel.h"
#include "common/tls.h"
#include "concord/v1/worker.grpc.pb.h"

namespace concord::worker {

struct ClientIdentity {
  // The worker token; empty sends none (the coordinator then refuses calls).
  std::string token;
  std::string worker_id;
  // Random per process (common/auth.h GenerateToken); binds worker_id.
  std::string worker_secret;
  // TLS towards the coordinator (common/tls.h LoadClientTls): empty =
  // plaintext; a CA = TLS; plus a certificate and key = mTLS.
  TlsMaterial tls;
};

// How an address names its replicas (common/coordinator_channel.h).
using ::concord::SplitCoordinatorAddress;

class CoordinatorClient {
 public:
  // Does not block; the channels connect lazily. `address`: see
  // SplitCoordinatorAddress. With several replicas, a call that finds one
  // UNAVAILABLE moves on to the next (and stays there while it answers).
  CoordinatorClient(const std::string& address, ClientIdentity identity);

  // One stub per replica and the one in use.
  class Replicas {
   public:
    Replicas(const std::string& address, const TlsMaterial& tls);
    size_t current() const { return current_.load(); }
    std::shared_ptr<v1::WorkerService::Stub> stub(size_t i);
    // After replica `used` was UNAVAILABLE (`why`): gives it a fresh
    // channel if its channel is older than a second (see Note [Fresh channels]
    // in common/coordinator_channel.h), moves to the next replica; returns
    // whether that is worth trying at once (not back at the first).
    bool Next(size_t used, const absl::Status& why);

   private:
    struct Fresh {
      std::shared_ptr<v1::WorkerService::Stub> stub;
      absl::Time created;
    };
    const std::vector<std::string> addresses_;
    const TlsMaterial tls_;
    std::mutex mu_;
    std::vector<Fresh> stubs_;  // guarded by mu_
    std::atomic<size_t> current_{0};
  };

  const std::string& address() const { return address_; }
  const ClientIdentity& identity() const { return identity_; }

  // Blocks until this worker is a member of a generation.
  // Errors: as WorkerService.Join; DEADLINE_EXCEEDED after `wait`;
  // UNAVAILABLE when the coordinator stays unreachable for `wait`.
  absl::StatusOr<v1::JoinResponse> Join(v1::JoinRequest request,
                                        absl::Duration wait);
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(v1::HeartbeatRequest request,
                                                  absl::Duration timeout);
  absl::StatusOr<v1::LeaveResponse> Leave(v1::LeaveRequest request,
                                          absl::Duration timeout);
  absl::Status KvSet(const std::string& job_id, int64_t generation,
                     const std::string& key, const std::string& value,
                     absl::Duration timeout);
  // A checkpoint this worker wrote itself (see Note [Writes from the worker]
  // in worker/checkpoint/checkpointer.h).
  absl::Status ReportCheckpoint(const std::string& job_id,
                                const v1::CheckpointReport& report,
                                absl::Duration timeout);
  // Blocks until every key is set; DEADLINE_EXCEEDED after `timeout`.
  absl::StatusOr<std::vector<std::string>> KvGet(
      const std::string& job_id, int64_t generation,
      const std::vector<std::string>& keys, absl::Duration timeout);

  // Opens one WatchMembership stream and calls `on_update` for each update
  // until the stream ends or fails; returns its final status. Cancel it from
  // another thread with context->TryCancel(). MembershipWatcher keeps one
  // open across coordinator restarts.
  absl::Status WatchOnce(
      const std::string& job_id,
      const std::function<void(const v1::MembershipUpdate&)>& on_update,
      grpc::ClientContext* context);

 private:
  std::string address_;
  ClientIdentity identity_;
  Replicas replicas_;
};

// Keeps a WatchMembership stream open on a thread of its own, reconnecting
// with backoff when the coordinator goes away (a restart), and keeps the
// latest update. Stops on its own after a terminal job state.
class MembershipWatcher {
 public:
  // Starts watching at once. `client` must outlive the watcher. `on_update`
  // (optional) runs on the watcher's thread for every update, outside the
  // watcher's lock; it must not block for long.
  MembershipWatcher(
      CoordinatorClient* client, std::string job_id,
      std::function<void(const v1::MembershipUpdate&)> on_update = nullptr);
  // Stops the thread (cancels the stream); returns within about a second.
  ~MembershipWatcher();

  // Blocks until an update satisfies `pred`, or `timeout` passes (then
  // DEADLINE_EXCEEDED). Thread-safe.
  absl::StatusOr<v1::MembershipUpdate> WaitFor(
      const std::function<bool(const v1::MembershipUpdate&)>& pred,
      absl::Duration timeout);
  // Updates received so far (reconnects resend the current one).
  int64_t updates() const;
  // The latest update when the stream it came on is still open (the
  // coordinator is there to say otherwise); nullopt otherwise.
  std::optional<v1::MembershipUpdate> Live() const;

 private:
  void Run();

  CoordinatorClient* client_;
  std::string job_id_;
  std::function<void(const v1::MembershipUpdate&)> on_update_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::optional<v1::MembershipUpdate> latest_;
  int64_t updates_ = 0;
  bool live_ = false;  // `latest_` came on the stream open now
  bool stop_ = false;
  grpc::ClientContext* active_ = nullptr;  // the open stream, to cancel it
  std::thread thread_;
};

}  // namespace concord::worker
