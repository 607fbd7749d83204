#include "worker/session.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/auth.h"
#include "common/status_macros.h"
#include "worker/comm/gloo/gloo_communicator.h"
#include "worker/coordinator_store.h"

namespace concord::worker {
namespace {

std::string Env(const char* name, const std::string& fallback = "") {
  const char* v = std::getenv(name);
  return v == nullptr ? fallback : std::string(v);
}

absl::Status EnvInt(const char* name, int64_t fallback, int64_t min,
                    int64_t* out) {
  const std::string text = Env(name);
  if (text.empty()) {
    *out = fallback;
    return absl::OkStatus();
  }
  if (!absl::SimpleAtoi(text, out) || *out < min) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, "='", text, "': expected an integer >= ", min));
  }
  return absl::OkStatus();
}

std::string DefaultWorkerId() {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  return absl::StrCat(host, "-", getpid());
}

}  // namespace

absl::StatusOr<WorkerOptions> WorkerOptions::FromEnvironment() {
  WorkerOptions o;
  o.coordinator = Env("CONCORD_COORDINATOR");
  o.spec.set_job_id(Env("CONCORD_JOB_ID", "default"));
  int64_t min_workers, max_workers, hb_interval, hb_timeout, rdzv_timeout,
      collective_timeout;
  CONCORD_RETURN_IF_ERROR(EnvInt("CONCORD_MIN_WORKERS", 1, 1, &min_workers));
  CONCORD_RETURN_IF_ERROR(
      EnvInt("CONCORD_MAX_WORKERS", min_workers, min_workers, &max_workers));
  CONCORD_RETURN_IF_ERROR(
      EnvInt("CONCORD_HEARTBEAT_INTERVAL_MS", 1000, 1, &hb_interval));
  CONCORD_RETURN_IF_ERROR(
      EnvInt("CONCORD_HEARTBEAT_TIMEOUT_MS", 10000, 1, &hb_timeout));
  CONCORD_RETURN_IF_ERROR(
      EnvInt("CONCORD_RENDEZVOUS_TIMEOUT_MS", 300000, 1, &rdzv_timeout));
  CONCORD_RETURN_IF_ERROR(
      EnvInt("CONCORD_COLLECTIVE_TIMEOUT_MS", 300000, 1, &collective_timeout));
  o.spec.set_min_workers(static_cast<int32_t>(min_workers));
  o.spec.set_max_workers(static_cast<int32_t>(max_workers));
  o.spec.set_heartbeat_interval_ms(hb_interval);
  o.spec.set_heartbeat_timeout_ms(hb_timeout);
  o.spec.set_rendezvous_timeout_ms(rdzv_timeout);
  o.worker_id = Env("CONCORD_WORKER_ID", DefaultWorkerId());
  o.comm_host = Env("CONCORD_COMM_HOST", "127.0.0.1");
  o.join_timeout = absl::Milliseconds(rdzv_timeout);
  o.collective_timeout = absl::Milliseconds(collective_timeout);
  if (!o.coordinator.empty()) {
    const std::string token_file = Env("CONCORD_TOKEN_FILE");
    if (!token_file.empty()) {
      absl::StatusOr<std::string> token = ReadTokenFile(token_file);
      if (!token.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("CONCORD_TOKEN_FILE: ", token.status().message()));
      }
      o.token = *std::move(token);
    } else {
      o.token = Env("CONCORD_TOKEN");
      if (o.token.empty()) {
        return absl::InvalidArgumentError(
            "CONCORD_TOKEN_FILE is not set: the coordinator needs a worker "
            "token");
      }
      CONCORD_RETURN_IF_ERROR(ValidateToken(o.token));
    }
    TlsFiles files{Env("CONCORD_TLS_CA"), Env("CONCORD_TLS_CERT"),
                   Env("CONCORD_TLS_KEY")};
    CONCORD_ASSIGN_OR_RETURN(
        o.tls, LoadClientTls(files, {"CONCORD_TLS_CA", "CONCORD_TLS_CERT",
                                     "CONCORD_TLS_KEY"}));
  }
  return o;
}

absl::StatusOr<std::unique_ptr<Session>> Session::Start(
    const WorkerOptions& options) {
  std::unique_ptr<Session> session(new Session(options));
  comm::GlooOptions gloo;
  gloo.hostname = options.comm_host;
  gloo.connect_timeout = options.join_timeout;
  absl::Duration heartbeat_interval = absl::ZeroDuration();

  if (options.coordinator.empty()) {
    // Alone: world size 1, nothing to rendezvous with.
    session->store_ = std::make_unique<comm::InMemoryStore>();
  } else {
    // A fresh secret per process binds the worker id (Note [Worker binding]
    // in coordinator/core.h).
    session->client_ = std::make_unique<CoordinatorClient>(
        options.coordinator, ClientIdentity{options.token, options.worker_id,
                                            GenerateToken(), options.tls});
    v1::JoinRequest request;
    *request.mutable_spec() = options.spec;
    request.set_worker_id(options.worker_id);
    request.set_host(options.comm_host);
    CONCORD_ASSIGN_OR_RETURN(
        v1::JoinResponse joined,
        session->client_->Join(request, options.join_timeout));
    gloo.rank = joined.rank();
    gloo.size = joined.world_size();
    gloo.generation = joined.generation();
    session->authoritative_rank_ = joined.authoritative_rank();
    session->generation_ = joined.generation();
    heartbeat_interval = absl::Milliseconds(joined.heartbeat_interval_ms());
    session->store_ = std::make_unique<CoordinatorStore>(
        session->client_.get(), options.spec.job_id(), joined.generation());
    spdlog::info("joined job '{}' generation {} as rank {} of {}",
                 options.spec.job_id(), joined.generation(), joined.rank(),
                 joined.world_size());
    // Heartbeat while the communicator connects: that can take a while.
    session->heartbeat_ = std::thread([s = session.get(), heartbeat_interval] {
      s->HeartbeatLoop(heartbeat_interval);
    });
  }
  comm::PrefixStore gloo_store("gloo/", session->store_.get());
  CONCORD_ASSIGN_OR_RETURN(session->comm_,
                           comm::GlooCommunicator::Create(gloo, &gloo_store));
  return session;
}

Session::~Session() { StopHeartbeat(); }

void Session::ReportProgress(int64_t step, double samples_per_second) {
  step_.store(step, std::memory_order_relaxed);
  samples_per_second_.store(samples_per_second, std::memory_order_relaxed);
}

void Session::ReportDdpTimings(const v1::DdpTimings& timings) {
  std::lock_guard<std::mutex> lock(timings_mu_);
  timings_ = timings;
}

void Session::HeartbeatLoop(absl::Duration interval) {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    lock.unlock();
    v1::HeartbeatRequest request;
    request.set_job_id(options_.spec.job_id());
    request.set_worker_id(options_.worker_id);
    request.set_generation(generation_);
    request.set_step(step_.load(std::memory_order_relaxed));
    request.set_samples_per_second(
        samples_per_second_.load(std::memory_order_relaxed));
    {
      std::lock_guard<std::mutex> timings_lock(timings_mu_);
      if (timings_) *request.mutable_ddp() = *timings_;
    }
    auto response = client_->Heartbeat(std::move(request), interval);
    if (!response.ok()) {
      spdlog::warn("heartbeat: {}", response.status().ToString());
    }
    lock.lock();
    cv_.wait_for(lock, absl::ToChronoNanoseconds(interval),
                 [this] { return stop_; });
  }
}

void Session::StopHeartbeat() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (heartbeat_.joinable()) heartbeat_.join();
}

absl::Status Session::Finish(bool ok, const std::string& message) {
  StopHeartbeat();
  if (finished_ || client_ == nullptr) return absl::OkStatus();
  finished_ = true;
  v1::LeaveRequest request;
  request.set_job_id(options_.spec.job_id());
  request.set_worker_id(options_.worker_id);
  request.set_generation(generation_);
  request.set_reason(ok ? v1::LEAVE_REASON_COMPLETED : v1::LEAVE_REASON_ERROR);
  request.set_message(message);
  return client_->Leave(std::move(request), absl::Seconds(10)).status();
}

}  // namespace concord::worker
