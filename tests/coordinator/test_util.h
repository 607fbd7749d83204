#pragma once
// Shared helpers of the coordinator's gRPC tests: tokens, options, stubs
// with credentials, bounded contexts, and a raw HTTP GET.

#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/auth.h"
#include "common/grpc_auth.h"
#include "common/http_get.h"
#include "concord/v1/operator.grpc.pb.h"
#include "concord/v1/worker.grpc.pb.h"
#include "coordinator/server.h"

namespace concord::coordinator::testing {

inline constexpr char kWorkerToken[] = "worker-token-0123456789";
inline constexpr char kOperatorToken[] = "operator-token-0123456789";
// Every call is bounded so that a bug shows as a failure, not a hang.
inline constexpr auto kCallDeadline = std::chrono::seconds(20);

inline ServerOptions Options() {
  ServerOptions options;
  options.worker_token = kWorkerToken;
  options.operator_token = kOperatorToken;
  return options;
}

inline std::string Secret(const std::string& worker) {
  return absl::StrCat(worker, "-secret-0123456789");
}

// A bounded context carrying `token` (none when empty).
inline std::unique_ptr<grpc::ClientContext> Ctx(const std::string& token) {
  auto c = std::make_unique<grpc::ClientContext>();
  c->set_deadline(std::chrono::system_clock::now() + kCallDeadline);
  AddBearerToken(*c, token);
  return c;
}

inline std::shared_ptr<grpc::Channel> Channel(const std::string& address) {
  return grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
}

inline v1::JoinRequest JoinReq(const std::string& job, int min, int max,
                               const std::string& worker,
                               int64_t wait_ms = 10000) {
  v1::JoinRequest r;
  r.mutable_spec()->set_job_id(job);
  r.mutable_spec()->set_min_workers(min);
  r.mutable_spec()->set_max_workers(max);
  r.set_worker_id(worker);
  r.set_worker_secret(Secret(worker));
  r.set_host("127.0.0.1");
  r.set_wait_timeout_ms(wait_ms);
  return r;
}

using concord::HttpGet;

}  // namespace concord::coordinator::testing
