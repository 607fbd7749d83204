#pragma once
// A plain-HTTP liveness endpoint (--health-listen) for probes that speak
// neither gRPC nor TLS: any request gets "200 SERVING", or "503 NOT_SERVING"
// once shutdown has begun. It reveals nothing else and needs no token.
// One thread; each connection is answered and closed within a second.

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace concord::coordinator {

class HealthHttpServer {
 public:
  // Binds host:port (IPv4 literal or "localhost"; port 0 picks one).
  // Errors: INVALID_ARGUMENT (malformed), UNAVAILABLE (cannot bind).
  static absl::StatusOr<std::unique_ptr<HealthHttpServer>> Start(
      const std::string& address);
  ~HealthHttpServer();

  int port() const { return port_; }
  void SetServing(bool serving) { serving_ = serving; }

 private:
  HealthHttpServer() = default;
  void Loop();

  int fd_ = -1;
  int port_ = 0;
  std::atomic<bool> serving_{true};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace concord::coordinator
