#pragma once
// A running coordinator: the worker service on a gRPC port plus the thread
// that ticks it (heartbeat and rendezvous timeouts).

#include <grpcpp/grpcpp.h>

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "coordinator/service.h"

namespace concord::coordinator {

struct ServerOptions {
  // host:port; port 0 picks a free one. Loopback by default.
  std::string listen_address = "127.0.0.1:0";
  // How often timeouts are checked.
  absl::Duration tick_interval = absl::Milliseconds(100);
};

class Server {
 public:
  // Starts serving and returns once the port is bound. Errors:
  // INVALID_ARGUMENT (malformed address, non-positive tick interval),
  // UNAVAILABLE (the address cannot be bound, e.g. in use).
  static absl::StatusOr<std::unique_ptr<Server>> Start(
      const ServerOptions& options);

  // Shuts down (see Shutdown).
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  int port() const { return port_; }
  // host:port actually bound, e.g. "127.0.0.1:41235".
  std::string address() const { return address_; }

  // Stops the tick thread and the gRPC server; calls blocked in Join/KvGet
  // end within about a second. Idempotent and callable from any thread; it
  // returns once everything has stopped.
  void Shutdown();
  // Blocks until Shutdown has completed (from another thread).
  void Wait();

  // For tests and status.
  WorkerServiceImpl& service() { return *service_; }

 private:
  Server() = default;
  void TickLoop(absl::Duration interval);

  RealClock clock_;
  std::unique_ptr<WorkerServiceImpl> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::string address_;
  std::thread ticker_;

  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;  // tells the ticker to exit
  bool stopped_ = false;   // Shutdown has completed

  std::mutex shutdown_mu_;  // serialises Shutdown
};

}  // namespace concord::coordinator
