// concord-coordinator: serves the worker and operator services until SIGINT
// or SIGTERM.
//
// With --store etcd several replicas run against one etcd cluster: one leads
// and serves, the others stand by without listening on --listen and take
// over when it goes (see Note [etcd leadership] in etcd_store.h). A leader that
// loses its lease stops serving and stands by again.
//
// Exit status: 0 after a clean shutdown; 2 for bad flags, missing or
// unreadable token or TLS files, an address in use, a state directory that
// cannot be written, or an etcd that cannot be reached at startup (one line
// on stderr); 1 when the store holds a record that cannot be read.
//
// Under systemd with Type=notify (NOTIFY_SOCKET set) it reports READY=1 once
// the gRPC port accepts connections (an etcd standby: once it stands by),
// STATUS= lines (leader or standby, and changes), WATCHDOG=1 from the tick
// thread when WatchdogSec= is set (see Note [Watchdog pings] in
// systemd_notify.h), and STOPPING=1 on SIGINT/SIGTERM.

#include <netdb.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/auth.h"
#include "common/crash_trace.h"
#include "common/host.h"
#include "common/logging.h"
#include "coordinator/http/health_http.h"
#include "coordinator/server.h"
#include "coordinator/store/etcd_store.h"
#include "coordinator/systemd_notify.h"

namespace {

constexpr int kUsageError = 2;

// How long startup waits for etcd to answer before giving up.
constexpr absl::Duration kEtcdStartupTimeout = absl::Seconds(10);

// SIGINT/SIGTERM, received by a thread in sigwait (no work is done in a
// signal handler).
class StopSignal {
 public:
  // Call before any other thread starts, so every thread inherits the mask.
  StopSignal() {
    sigemptyset(&signals_);
    sigaddset(&signals_, SIGINT);
    sigaddset(&signals_, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &signals_, nullptr);
  }
  void StartListening() {
    std::thread([this] {
      int number = 0;
      sigwait(&signals_, &number);
      std::lock_guard<std::mutex> lock(mu_);
      signal_ = number;
      cv_.notify_all();
    }).detach();
  }
  bool requested() {
    std::lock_guard<std::mutex> lock(mu_);
    return signal_ != 0;
  }
  // Whether a signal came within `timeout`.
  bool WaitFor(absl::Duration timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, absl::ToChronoNanoseconds(timeout),
                        [this] { return signal_ != 0; });
  }
  const char* name() {
    std::lock_guard<std::mutex> lock(mu_);
    return signal_ == SIGINT ? "SIGINT" : "SIGTERM";
  }

 private:
  sigset_t signals_;
  std::mutex mu_;
  std::condition_variable cv_;
  int signal_ = 0;
};

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "concord-coordinator: %s\n",
               std::string(status.message()).c_str());
  return status.code() == absl::StatusCode::kDataLoss ? 1 : kUsageError;
}

void LogServing(const concord::coordinator::Server& server,
                const concord::coordinator::ServerOptions& options) {
  spdlog::info("concord-coordinator listening on {}", server.address());
  spdlog::info("gRPC transport: {}",
               options.tls.cert_pem.empty()
                   ? "plaintext"
                   : (options.tls.ca_pem.empty()
                          ? "TLS"
                          : "mTLS (client certificates required)"));
  if (server.metrics_port() != 0) {
    spdlog::info("metrics on port {}", server.metrics_port());
  }
  if (server.health_port() != 0) {
    spdlog::info("health on port {}", server.health_port());
  }
  if (server.status_port() != 0) {
    spdlog::info("status page on port {}", server.status_port());
  }
}

// --store etcd: campaign, serve while leading, stand by again when the
// lease is lost, resign on a signal.
int RunReplica(concord::coordinator::EtcdStore& store,
               concord::coordinator::ServerOptions options, StopSignal& stop,
               concord::coordinator::SystemdNotifier& notifier) {
  using concord::coordinator::HealthHttpServer;
  using concord::coordinator::Server;
  // The plain health port belongs to the replica, not to one term: it says
  // SERVING only while this replica leads (readiness), and stays bound.
  std::unique_ptr<HealthHttpServer> health;
  if (!options.health_address.empty()) {
    auto started = HealthHttpServer::Start(options.health_address);
    if (!started.ok()) return Fail(started.status());
    health = *std::move(started);
    health->SetServing(false);
    spdlog::info("health on port {}", health->port());
    options.health_address.clear();
  }
  const std::string identity =
      absl::StrCat(concord::HostName(), " pid ", getpid(), " serving ",
                   options.listen_address);
  while (true) {
    // The campaign polls etcd and checks `stop` every poll: a live standby.
    absl::Status campaign = store.Campaign(
        identity,
        [&] {
          notifier.Alive();
          return stop.requested();
        },
        [&](const std::string& leader) {
          spdlog::info("standing by; the leader is {}", leader);
          notifier.Ready(absl::StrCat("standby; the leader is ", leader));
        });
    if (absl::IsCancelled(campaign)) break;
    if (!campaign.ok()) {
      spdlog::error("campaign failed: {}", campaign.ToString());
      continue;
    }
    options.store = &store;
    auto server = Server::Start(options);
    if (!server.ok()) {
      store.Resign();
      return Fail(server.status());
    }
    LogServing(**server, options);
    if (health != nullptr) health->SetServing(true);
    notifier.Ready(
        absl::StrCat("leader; serving on ", (*server)->address(), " (etcd)"));
    std::string lost;
    while (!stop.WaitFor(absl::Milliseconds(100))) {
      lost = store.WaitLost(absl::ZeroDuration());
      if (!lost.empty()) break;
    }
    if (health != nullptr) health->SetServing(false);
    (*server)->Shutdown();
    if (stop.requested()) break;
    spdlog::warn("stopped serving ({}); standing by", lost);
    notifier.Status(absl::StrCat("standby; lost leadership: ", lost));
  }
  spdlog::info("received {}, resigning", stop.name());
  notifier.Stopping(absl::StrCat("received ", stop.name(), ", resigning"));
  store.Resign();
  spdlog::info("stopped");
  return 0;
}

// An address already in use, found before gRPC tries it (gRPC would log its
// own multi-line error first). Empty when the address looks free or cannot
// be checked here (gRPC then decides).
std::string AddressInUse(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return "";
  std::string host = address.substr(0, colon);
  const std::string port = address.substr(colon + 1);
  if (port == "0") return "";
  if (host.size() > 2 && host.front() == '[')
    host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints,
                  &found) != 0) {
    return "";
  }
  std::string in_use;
  for (addrinfo* a = found; a != nullptr && in_use.empty(); a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 && errno == EADDRINUSE) {
      in_use = "cannot listen on '" + address + "': address already in use";
    }
    close(fd);
  }
  freeaddrinfo(found);
  return in_use;
}

// The command line, as parsed.
struct Flags {
  std::string listen = "127.0.0.1:7070";
  std::string log_level = "info";
  std::string worker_token_file, operator_token_file;
  concord::TlsFiles tls_files;
  concord::coordinator::ServerOptions options;
  std::string store_kind = "embedded";
  std::vector<std::string> etcd_endpoints;
  concord::TlsFiles etcd_tls_files;
  concord::coordinator::EtcdStoreOptions etcd_options;
};

void AddFlags(CLI::App& app, Flags* f) {
  concord::coordinator::ServerOptions& options = f->options;
  app.add_option("--listen", f->listen,
                 "host:port to serve on (loopback default)")
      ->capture_default_str();
  app.add_option("--state-dir", options.state_dir,
                 "Directory that keeps every job across restarts (default: "
                 "none, state in memory only)");
  app.add_option("--history-file", options.history_file,
                 "Append what this coordinator decided and saved (joins, "
                 "generations with their members, leaves, failures; JSON "
                 "lines) to this file")
      ->type_name("FILE");
  app.add_option("--worker-token-file", f->worker_token_file,
                 "File holding the workers' bearer token")
      ->required();
  app.add_option("--operator-token-file", f->operator_token_file,
                 "File holding the operators' bearer token")
      ->required();
  app.add_option("--tls-cert", f->tls_files.cert,
                 "PEM certificate chain: serve gRPC over TLS (with --tls-key)");
  app.add_option("--tls-key", f->tls_files.key,
                 "PEM private key of --tls-cert");
  app.add_option("--tls-client-ca", f->tls_files.ca,
                 "PEM CA: require client certificates it signed (mTLS)");
  app.add_option("--metrics-listen", options.metrics_address,
                 "host:port for Prometheus metrics at /metrics (default off)");
  app.add_option("--health-listen", options.health_address,
                 "host:port for a plain HTTP health check (default off)");
  app.add_option("--status-listen", options.status_address,
                 "host:port for the status page (plain HTTP, operator token; "
                 "default off)");
  app.add_option("--store", f->store_kind,
                 "Where jobs are kept: embedded (--state-dir, or memory) or "
                 "etcd (--etcd-endpoints; replicas with one leader)")
      ->capture_default_str()
      ->check(CLI::IsMember({"embedded", "etcd"}));
  app.add_option("--etcd-endpoints", f->etcd_endpoints,
                 "etcd client URLs, comma-separated (http://HOST:PORT or "
                 "https://HOST:PORT)")
      ->delimiter(',');
  app.add_option("--etcd-prefix", f->etcd_options.prefix,
                 "Key prefix of this coordinator's data in etcd")
      ->capture_default_str();
  app.add_option("--etcd-lease-ttl", f->etcd_options.lease_ttl,
                 "Seconds a leader that stopped renewing keeps leadership "
                 "(failover time)")
      ->capture_default_str()
      ->check(CLI::Range(2, 600));
  app.add_option("--etcd-ca", f->etcd_tls_files.ca,
                 "PEM CA that signed etcd's certificate (https endpoints)");
  app.add_option("--etcd-cert", f->etcd_tls_files.cert,
                 "PEM client certificate for etcd (--client-cert-auth)");
  app.add_option("--etcd-key", f->etcd_tls_files.key,
                 "PEM private key of --etcd-cert");
  app.add_option("--log-level", f->log_level, "Log level")
      ->capture_default_str()
      ->check(CLI::IsMember(
          {"trace", "debug", "info", "warn", "error", "critical", "off"}));
}

// The files the flags name, read into the server's options (the tokens, the
// TLS material; the history file opened once to check it), and the flags
// that go together checked. INVALID_ARGUMENT and the like: one line each.
absl::Status LoadFiles(Flags& f) {
  for (auto [path, token] :
       {std::pair{&f.worker_token_file, &f.options.worker_token},
        std::pair{&f.operator_token_file, &f.options.operator_token}}) {
    absl::StatusOr<std::string> read = concord::ReadTokenFile(*path);
    if (!read.ok()) return read.status();
    *token = *std::move(read);
  }
  auto tls = concord::LoadServerTls(
      f.tls_files, {"--tls-client-ca", "--tls-cert", "--tls-key"});
  if (!tls.ok()) return tls.status();
  f.options.tls = *std::move(tls);
  if (!f.options.history_file.empty()) {
    // Checked before serving or campaigning (each term opens it again).
    auto history =
        concord::coordinator::HistoryFile::Open(f.options.history_file);
    if (!history.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--history-file: ", history.status().message()));
    }
  }
  const bool etcd = f.store_kind == "etcd";
  if (etcd && f.etcd_endpoints.empty()) {
    return absl::InvalidArgumentError("--store etcd needs --etcd-endpoints");
  }
  if (etcd && !f.options.state_dir.empty()) {
    return absl::InvalidArgumentError(
        "--state-dir and --store etcd exclude each other");
  }
  if (!etcd &&
      (!f.etcd_endpoints.empty() || !f.etcd_tls_files.ca.empty() ||
       !f.etcd_tls_files.cert.empty() || !f.etcd_tls_files.key.empty())) {
    return absl::InvalidArgumentError("--etcd-* flags need --store etcd");
  }
  f.options.listen_address = f.listen;
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<concord::coordinator::EtcdStore>> MakeEtcdStore(
    const Flags& f) {
  auto etcd_tls = concord::LoadClientTls(
      f.etcd_tls_files, {"--etcd-ca", "--etcd-cert", "--etcd-key"});
  if (!etcd_tls.ok()) return etcd_tls.status();
  auto client = concord::coordinator::EtcdClient::Create(
      f.etcd_endpoints, *etcd_tls, absl::Seconds(2));
  if (!client.ok()) return client.status();
  return concord::coordinator::EtcdStore::Create(*std::move(client),
                                                 f.etcd_options);
}

// The addresses to serve on: one in use is an error; a status page off
// loopback is a warning (it is plain HTTP: the operator token would cross
// the network in the clear, docs/operators.md "Status page").
absl::Status CheckAddresses(const concord::coordinator::ServerOptions& o) {
  if (!o.status_address.empty()) {
    const std::string host =
        o.status_address.substr(0, o.status_address.rfind(':'));
    if (host != "localhost" && host != "[::1]" && host.rfind("127.", 0) != 0) {
      spdlog::warn(
          "the status page on {} is plain HTTP: keep it on loopback or "
          "behind a TLS proxy",
          o.status_address);
    }
  }
  for (const std::string& address :
       {o.listen_address, o.metrics_address, o.status_address}) {
    const std::string in_use = address.empty() ? "" : AddressInUse(address);
    if (!in_use.empty()) return absl::InvalidArgumentError(in_use);
  }
  return absl::OkStatus();
}

// Fails fast on an etcd that is not there at all; later outages are ridden
// out (a standby waits, a leader steps down).
absl::Status AwaitEtcd(concord::coordinator::EtcdStore& store,
                       const std::vector<std::string>& endpoints,
                       StopSignal& stop) {
  const absl::Time give_up = absl::Now() + kEtcdStartupTimeout;
  absl::StatusOr<std::string> leader = store.Leader();
  while (!leader.ok() && absl::Now() < give_up && !stop.requested()) {
    absl::SleepFor(absl::Milliseconds(500));
    leader = store.Leader();
  }
  if (!leader.ok()) {
    return absl::UnavailableError(
        absl::StrCat("cannot reach etcd at ", absl::StrJoin(endpoints, ","),
                     ": ", leader.status().message()));
  }
  return absl::OkStatus();
}

// --store embedded: serves until a signal.
int RunEmbedded(const concord::coordinator::ServerOptions& options,
                StopSignal& stop,
                concord::coordinator::SystemdNotifier& notifier) {
  auto server = concord::coordinator::Server::Start(options);
  if (!server.ok()) return Fail(server.status());
  LogServing(**server, options);
  notifier.Ready(absl::StrCat(
      "serving on ", (*server)->address(), " (",
      options.state_dir.empty() ? std::string("state in memory")
                                : absl::StrCat("state in ", options.state_dir),
      ")"));
  while (!stop.WaitFor(absl::Hours(1))) {
  }
  spdlog::info("received {}, shutting down", stop.name());
  notifier.Stopping(absl::StrCat("received ", stop.name(), ", shutting down"));
  (*server)->Shutdown();
  spdlog::info("stopped");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  concord::InstallCrashTraces("concord-coordinator", argv[0]);
  // Block the signals before any thread starts (gRPC channels start threads)
  // so that every thread inherits the mask and only the signal thread ever
  // sees them.
  StopSignal stop;
  auto notifier = concord::coordinator::SystemdNotifier::FromEnvironment();
  CLI::App app{"Concord coordinator: membership and rendezvous for workers",
               "concord-coordinator"};
  Flags flags;
  AddFlags(app, &flags);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "concord-coordinator: %s\n", e.what());
    return kUsageError;
  }
  if (absl::Status loaded = LoadFiles(flags); !loaded.ok()) {
    return Fail(loaded);
  }
  std::unique_ptr<concord::coordinator::EtcdStore> etcd_store;
  if (flags.store_kind == "etcd") {
    auto store = MakeEtcdStore(flags);
    if (!store.ok()) return Fail(store.status());
    etcd_store = *std::move(store);
  }
  concord::InitLogging("coordinator", flags.log_level);
  concord::coordinator::ServerOptions& options = flags.options;
  options.on_tick = [&notifier] { notifier.Alive(); };
  if (absl::Status free = CheckAddresses(options); !free.ok()) {
    return Fail(free);
  }
  stop.StartListening();
  if (etcd_store == nullptr) return RunEmbedded(options, stop, notifier);
  if (absl::Status up = AwaitEtcd(*etcd_store, flags.etcd_endpoints, stop);
      !up.ok()) {
    return Fail(up);
  }
  return RunReplica(*etcd_store, options, stop, notifier);
}
