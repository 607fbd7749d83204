#pragma once
// A running coordinator: the worker and operator services on one gRPC port
// (plus grpc.health.v1 and server reflection), the thread that ticks the
// core, and optionally the Prometheus endpoint, the plain health port and
// the embedded store.

#include <grpcpp/grpcpp.h>

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/tls.h"
#include "coordinator/host/host.h"
#include "coordinator/http/health_http.h"
#include "coordinator/http/status_http.h"
#include "coordinator/metrics/metrics.h"
#include "coordinator/rpc/agent_service.h"
#include "coordinator/rpc/authorizer.h"
#include "coordinator/rpc/operator_service.h"
#include "coordinator/rpc/service.h"
#include "coordinator/store/store.h"

namespace prometheus {
class Exposer;
}

namespace concord::coordinator {

struct ServerOptions {
  // host:port; port 0 picks a free one. Loopback by default.
  std::string listen_address = "127.0.0.1:0";
  // Bearer tokens of the two roles (common/auth.h rules); required and
  // distinct.
  std::string worker_token;
  std::string operator_token;
  // TLS of the gRPC port (common/tls.h LoadServerTls): empty = plaintext;
  // cert and key = TLS; plus a CA = mTLS (clients must present a
  // certificate that CA signed).
  TlsMaterial tls;
  // The embedded store's directory (file_store.h); empty = keep state in
  // memory only.
  std::string state_dir;
  // A store owned by the caller (e.g. the etcd store, etcd_store.h), which
  // must outlive the server; when set, `state_dir` must be empty.
  Store* store = nullptr;
  // Prometheus text endpoint (http://HOST:PORT/metrics); empty = none.
  std::string metrics_address;
  // Plain HTTP health endpoint (health_http.h); empty = none.
  std::string health_address;
  // The status page (status_http.h; plain HTTP, operator token); empty =
  // none.
  std::string status_address;
  // The coordinator's history (see Note [Coordinator history] in
  // store/history_file.h), appended to; empty = none.
  std::string history_file;
  // How often timeouts are checked.
  absl::Duration tick_interval = absl::Milliseconds(100);
  // Called on the tick thread after every tick of the core returned (proof
  // that the core is not stuck: see Note [Watchdog pings] in systemd_notify.h).
  // Must be cheap and must not call into the server.
  std::function<void()> on_tick;
};

class Server {
 public:
  // Restores the state directory's jobs, then starts serving and returns
  // once the ports are bound. Errors: INVALID_ARGUMENT (malformed address,
  // bad or equal tokens, non-positive tick interval), UNAVAILABLE (an address
  // cannot be bound, e.g. in use), FAILED_PRECONDITION (the state directory
  // cannot be created, written or locked), DATA_LOSS (a record in it cannot
  // be read), INVALID_ARGUMENT for a history file that cannot be opened.
  static absl::StatusOr<std::unique_ptr<Server>> Start(
      const ServerOptions& options);

  // Shuts down (see Shutdown).
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  int port() const { return port_; }
  // host:port actually bound, e.g. "127.0.0.1:41235".
  std::string address() const { return address_; }
  // Bound ports of the optional endpoints (0 when off).
  int metrics_port() const { return metrics_port_; }
  int health_port() const { return health_ ? health_->port() : 0; }
  int status_port() const { return status_ ? status_->port() : 0; }

  // Stops the tick thread and the servers; calls blocked in Join/KvGet/
  // WatchMembership end within about a second. Idempotent and callable from
  // any thread; it returns once everything has stopped.
  void Shutdown();
  // Blocks until Shutdown has completed (from another thread).
  void Wait();

  // For tests and status.
  CoreHost& host() { return *host_; }

 private:
  Server() = default;
  void TickLoop(absl::Duration interval, std::function<void()> on_tick);

  RealClock clock_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<Store> owned_store_;  // the embedded store, if any
  Store* store_ = nullptr;
  std::unique_ptr<HistoryFile> history_;  // outlives host_
  std::unique_ptr<Authorizer> authorizer_;
  std::unique_ptr<CoreHost> host_;
  std::unique_ptr<WorkerServiceImpl> worker_service_;
  std::unique_ptr<AgentServiceImpl> agent_service_;
  std::unique_ptr<OperatorServiceImpl> operator_service_;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<prometheus::Collectable> collector_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::unique_ptr<HealthHttpServer> health_;
  std::unique_ptr<StatusHttpServer> status_;
  int port_ = 0;
  int metrics_port_ = 0;
  std::string address_;
  std::thread ticker_;

  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;  // tells the ticker to exit
  bool stopped_ = false;   // Shutdown has completed

  std::mutex shutdown_mu_;  // serialises Shutdown
};

}  // namespace concord::coordinator
