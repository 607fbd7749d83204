#include "coordinator/server.h"

#include <grpc/grpc.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace concord::coordinator {
namespace {

// Blocked Join/KvGet calls get this long to end on their own (they notice
// the service's shutdown at once) before gRPC cancels them.
constexpr absl::Duration kShutdownGrace = absl::Seconds(1);

}  // namespace

absl::StatusOr<std::unique_ptr<Server>> Server::Start(
    const ServerOptions& options) {
  const std::string& address = options.listen_address;
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == address.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("listen address '", address, "' is not host:port"));
  }
  if (options.tick_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("tick_interval must be positive");
  }

  std::unique_ptr<Server> server(new Server());
  server->service_ = std::make_unique<WorkerServiceImpl>(&server->clock_);
  grpc::ServerBuilder builder;
  // Two coordinators must never share a port.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // TODO(auth): insecure for now; tokens/mTLS come with the auth work
  // (DESIGN.md: nothing is served to an unauthenticated caller).
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(),
                           &server->port_);
  builder.RegisterService(server->service_.get());
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || server->port_ == 0) {
    if (server->server_ != nullptr) server->server_->Shutdown();
    server->server_.reset();
    return absl::UnavailableError(
        absl::StrCat("cannot listen on '", address, "'"));
  }
  server->address_ = absl::StrCat(address.substr(0, colon), ":", server->port_);
  server->ticker_ =
      std::thread([s = server.get(), interval = options.tick_interval] {
        s->TickLoop(interval);
      });
  return server;
}

Server::~Server() { Shutdown(); }

void Server::TickLoop(absl::Duration interval) {
  std::unique_lock<std::mutex> lock(mu_);
  while (!cv_.wait_for(lock, absl::ToChronoNanoseconds(interval),
                       [this] { return stopping_; })) {
    lock.unlock();
    service_->Tick();
    lock.lock();
  }
}

void Server::Shutdown() {
  std::lock_guard<std::mutex> serial(shutdown_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) return;
    stopping_ = true;
  }
  cv_.notify_all();
  if (ticker_.joinable()) ticker_.join();
  if (service_ != nullptr) service_->Shutdown();
  if (server_ != nullptr) {
    server_->Shutdown(absl::ToChronoTime(absl::Now() + kShutdownGrace));
    server_->Wait();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopped_ = true;
  }
  cv_.notify_all();
}

void Server::Wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return stopped_; });
}

}  // namespace concord::coordinator
