#include "coordinator/server.h"

#include <grpc/grpc.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <prometheus/collectable.h>
#include <prometheus/exposer.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <exception>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/auth.h"
#include "common/tls.h"
#include "coordinator/metrics/jobs_collector.h"
#include "coordinator/store/file_store.h"

namespace concord::coordinator {
namespace {

// Blocked calls get this long to end on their own (they notice the
// service's shutdown at once) before gRPC cancels them.
constexpr absl::Duration kShutdownGrace = absl::Seconds(1);

constexpr const char* kServices[] = {"concord.v1.WorkerService",
                                     "concord.v1.AgentService",
                                     "concord.v1.OperatorService"};

absl::Status CheckAddress(const std::string& what, const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == address.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " address '", address, "' is not host:port"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Server>> Server::Start(
    const ServerOptions& options) {
  const std::string& address = options.listen_address;
  if (absl::Status s = CheckAddress("listen", address); !s.ok()) return s;
  if (!options.metrics_address.empty()) {
    if (absl::Status s = CheckAddress("metrics", options.metrics_address);
        !s.ok()) {
      return s;
    }
  }
  if (options.tick_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("tick_interval must be positive");
  }
  for (const auto* token : {&options.worker_token, &options.operator_token}) {
    if (absl::Status s = ValidateToken(*token); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(token == &options.worker_token ? "worker" : "operator",
                       " token: ", s.message()));
    }
  }
  if (options.worker_token == options.operator_token) {
    return absl::InvalidArgumentError(
        "the worker and operator tokens must differ");
  }

  std::unique_ptr<Server> server(new Server());
  server->metrics_ = std::make_unique<Metrics>();
  if (options.store != nullptr && !options.state_dir.empty()) {
    return absl::InvalidArgumentError(
        "a state directory and another store cannot both be given");
  }
  server->store_ = options.store;
  if (!options.state_dir.empty()) {
    auto store = FileStore::Open(options.state_dir);
    if (!store.ok()) return store.status();
    server->owned_store_ = *std::move(store);
    server->store_ = server->owned_store_.get();
  }
  server->authorizer_ = std::make_unique<Authorizer>(options.worker_token,
                                                     options.operator_token);
  server->host_ = std::make_unique<CoreHost>(&server->clock_, server->store_,
                                             server->metrics_.get());
  if (!options.history_file.empty()) {
    auto history = HistoryFile::Open(options.history_file);
    if (!history.ok()) return history.status();
    server->history_ = *std::move(history);
    server->host_->SetHistory(server->history_.get());
  }
  if (absl::Status s = server->host_->Restore(); !s.ok()) return s;
  server->worker_service_ = std::make_unique<WorkerServiceImpl>(
      server->host_.get(), server->authorizer_.get(), server->metrics_.get());
  server->agent_service_ = std::make_unique<AgentServiceImpl>(
      server->host_.get(), server->authorizer_.get(), server->metrics_.get());
  server->operator_service_ = std::make_unique<OperatorServiceImpl>(
      server->host_.get(), server->authorizer_.get(), server->metrics_.get());

  if (!options.metrics_address.empty()) {
    try {
      server->exposer_ =
          std::make_unique<prometheus::Exposer>(options.metrics_address, 1);
    } catch (const std::exception& e) {
      return absl::UnavailableError(absl::StrCat("cannot serve metrics on '",
                                                 options.metrics_address,
                                                 "': ", e.what()));
    }
    server->collector_ = std::make_shared<JobsCollector>(server->host_.get());
    server->exposer_->RegisterCollectable(server->metrics_->registry());
    server->exposer_->RegisterCollectable(server->collector_);
    const std::vector<int> ports = server->exposer_->GetListeningPorts();
    server->metrics_port_ = ports.empty() ? 0 : ports.front();
  }
  if (!options.status_address.empty()) {
    auto status = StatusHttpServer::Start(
        options.status_address, options.operator_token, server->host_.get());
    if (!status.ok()) return status.status();
    server->status_ = *std::move(status);
  }
  if (!options.health_address.empty()) {
    auto health = HealthHttpServer::Start(options.health_address);
    if (!health.ok()) return health.status();
    server->health_ = *std::move(health);
  }

  // Process-wide switches of gRPC; harmless to repeat.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // Two coordinators must never share a port.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Tokens travel in metadata: use TLS (or a trusted network) beyond
  // loopback.
  builder.AddListeningPort(address, ServerCredentials(options.tls),
                           &server->port_);
  builder.RegisterService(server->worker_service_.get());
  builder.RegisterService(server->agent_service_.get());
  builder.RegisterService(server->operator_service_.get());
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || server->port_ == 0) {
    if (server->server_ != nullptr) server->server_->Shutdown();
    server->server_.reset();
    return absl::UnavailableError(
        absl::StrCat("cannot listen on '", address, "'"));
  }
  grpc::HealthCheckServiceInterface* health =
      server->server_->GetHealthCheckService();
  if (health != nullptr) {
    health->SetServingStatus(true);
    for (const char* service : kServices) {
      health->SetServingStatus(service, true);
    }
  }
  const size_t colon = address.rfind(':');
  server->address_ = absl::StrCat(address.substr(0, colon), ":", server->port_);
  server->ticker_ = std::thread(
      [s = server.get(), interval = options.tick_interval,
       on_tick = options.on_tick] { s->TickLoop(interval, on_tick); });
  return server;
}

Server::~Server() { Shutdown(); }

void Server::TickLoop(absl::Duration interval, std::function<void()> on_tick) {
  std::unique_lock<std::mutex> lock(mu_);
  while (!cv_.wait_for(lock, absl::ToChronoNanoseconds(interval),
                       [this] { return stopping_; })) {
    lock.unlock();
    host_->Tick();
    if (on_tick) on_tick();
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
  if (health_ != nullptr) health_->SetServing(false);
  if (server_ != nullptr && server_->GetHealthCheckService() != nullptr) {
    server_->GetHealthCheckService()->SetServingStatus(false);
  }
  if (host_ != nullptr) host_->Shutdown();
  if (server_ != nullptr) {
    server_->Shutdown(absl::ToChronoTime(absl::Now() + kShutdownGrace));
    server_->Wait();
  }
  exposer_.reset();
  status_.reset();
  health_.reset();
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
