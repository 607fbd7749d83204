#pragma once
// A worker's membership in a job: options, the coordinator connection, the
// current generation's communicator, and the heartbeat.
//
// Note [Worker environment]: `concord-run` passes a job to its workers in
// CONCORD_* environment variables; WorkerOptions::FromEnvironment is the one
// place that reads them. Without CONCORD_COORDINATOR the program runs alone
// (world size 1, an in-process store), which is what a plain
// `concord-train ...` does.

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/tls.h"
#include "concord/v1/worker.pb.h"
#include "worker/comm/communicator.h"
#include "worker/comm/store.h"
#include "worker/coordinator_client.h"

namespace concord::worker {

struct WorkerOptions {
  // host:port of the coordinator; empty = run alone.
  std::string coordinator;
  // The worker token sent to the coordinator (required with a coordinator).
  std::string token;
  // TLS towards the coordinator; empty = plaintext.
  TlsMaterial tls;
  v1::JobSpec spec;
  std::string worker_id;
  // Address peers use to reach this worker's communicator.
  std::string comm_host = "127.0.0.1";
  absl::Duration join_timeout = absl::Minutes(5);
  absl::Duration collective_timeout = absl::Minutes(5);

  // Reads CONCORD_COORDINATOR, CONCORD_JOB_ID, CONCORD_MIN_WORKERS,
  // CONCORD_MAX_WORKERS, CONCORD_WORKER_ID, CONCORD_COMM_HOST,
  // CONCORD_HEARTBEAT_INTERVAL_MS, CONCORD_HEARTBEAT_TIMEOUT_MS,
  // CONCORD_RENDEZVOUS_TIMEOUT_MS, CONCORD_COLLECTIVE_TIMEOUT_MS, and the
  // worker token from the file CONCORD_TOKEN_FILE names (or CONCORD_TOKEN),
  // and the PEM files CONCORD_TLS_CA (the CA that signed the coordinator's
  // certificate: turns TLS on), CONCORD_TLS_CERT and CONCORD_TLS_KEY (this
  // worker's certificate for mTLS) name. INVALID_ARGUMENT names the
  // variable that is malformed (or its file), or the token variable when a
  // coordinator is set but no token is.
  static absl::StatusOr<WorkerOptions> FromEnvironment();
};

class Session {
 public:
  // Joins the job (blocks until a generation forms), connects the
  // communicator and starts heartbeating.
  // Errors: those of CoordinatorClient::Join and GlooCommunicator::Create.
  static absl::StatusOr<std::unique_ptr<Session>> Start(
      const WorkerOptions& options);
  ~Session();

  comm::Communicator& communicator() { return *comm_; }
  std::shared_ptr<comm::Communicator> shared_communicator() { return comm_; }
  int rank() const { return comm_->rank(); }
  int world_size() const { return comm_->size(); }
  int64_t generation() const { return comm_->generation(); }
  int authoritative_rank() const { return authoritative_rank_; }
  const WorkerOptions& options() const { return options_; }

  // Progress carried by the next heartbeat. Thread-safe, cheap.
  void ReportProgress(int64_t step, double samples_per_second);
  // DDP timings of the last step, carried by the next heartbeat (operators
  // see them in `concordctl status`). Thread-safe.
  void ReportDdpTimings(const v1::DdpTimings& timings);

  // Tells the coordinator this worker is done (or failed) and stops the
  // heartbeat. Idempotent.
  absl::Status Finish(bool ok, const std::string& message);

 private:
  explicit Session(WorkerOptions options) : options_(std::move(options)) {}
  void HeartbeatLoop(absl::Duration interval);
  void StopHeartbeat();

  WorkerOptions options_;
  std::unique_ptr<CoordinatorClient> client_;
  std::unique_ptr<comm::Store> store_;
  std::shared_ptr<comm::Communicator> comm_;
  int authoritative_rank_ = 0;
  int64_t generation_ = 0;  // set before the heartbeat thread starts

  std::atomic<int64_t> step_{0};
  std::atomic<double> samples_per_second_{0};
  std::mutex timings_mu_;
  std::optional<v1::DdpTimings> timings_;  // guarded by timings_mu_
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  bool finished_ = false;
  std::thread heartbeat_;
};

}  // namespace concord::worker
