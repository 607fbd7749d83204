// concord-coordinator: serves the worker and operator services until SIGINT
// or SIGTERM.
//
// Exit status: 0 after a clean shutdown; 2 for bad flags, missing or
// unreadable token or TLS files, an address in use, or a state directory that
// cannot be written (one line on stderr); 1 when the state directory holds
// a record that cannot be read.

#include <netdb.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>

#include "common/auth.h"
#include "common/logging.h"
#include "coordinator/server.h"

namespace {

constexpr int kUsageError = 2;

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

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Concord coordinator: membership and rendezvous for workers",
               "concord-coordinator"};
  std::string listen = "127.0.0.1:7070";
  std::string log_level = "info";
  std::string worker_token_file, operator_token_file;
  concord::TlsFiles tls_files;
  concord::coordinator::ServerOptions options;
  app.add_option("--listen", listen, "host:port to serve on (loopback default)")
      ->capture_default_str();
  app.add_option("--state-dir", options.state_dir,
                 "Directory that keeps every job across restarts (default: "
                 "none, state in memory only)");
  app.add_option("--worker-token-file", worker_token_file,
                 "File holding the workers' bearer token")
      ->required();
  app.add_option("--operator-token-file", operator_token_file,
                 "File holding the operators' bearer token")
      ->required();
  app.add_option("--tls-cert", tls_files.cert,
                 "PEM certificate chain: serve gRPC over TLS (with --tls-key)");
  app.add_option("--tls-key", tls_files.key, "PEM private key of --tls-cert");
  app.add_option("--tls-client-ca", tls_files.ca,
                 "PEM CA: require client certificates it signed (mTLS)");
  app.add_option("--metrics-listen", options.metrics_address,
                 "host:port for Prometheus metrics at /metrics (default off)");
  app.add_option("--health-listen", options.health_address,
                 "host:port for a plain HTTP health check (default off)");
  app.add_option("--log-level", log_level, "Log level")
      ->capture_default_str()
      ->check(CLI::IsMember(
          {"trace", "debug", "info", "warn", "error", "critical", "off"}));
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

  for (auto [path, token] :
       {std::pair{&worker_token_file, &options.worker_token},
        std::pair{&operator_token_file, &options.operator_token}}) {
    auto read = concord::ReadTokenFile(*path);
    if (!read.ok()) {
      std::fprintf(stderr, "concord-coordinator: %s\n",
                   std::string(read.status().message()).c_str());
      return kUsageError;
    }
    *token = *std::move(read);
  }
  auto tls = concord::LoadServerTls(
      tls_files, {"--tls-client-ca", "--tls-cert", "--tls-key"});
  if (!tls.ok()) {
    std::fprintf(stderr, "concord-coordinator: %s\n",
                 std::string(tls.status().message()).c_str());
    return kUsageError;
  }
  options.tls = *std::move(tls);
  concord::InitLogging("coordinator", log_level);

  // Block the signals before any thread starts so that every thread inherits
  // the mask and only the sigwait below ever sees them; no work is done in a
  // signal handler.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  options.listen_address = listen;
  for (const std::string& address : {listen, options.metrics_address}) {
    const std::string in_use = address.empty() ? "" : AddressInUse(address);
    if (!in_use.empty()) {
      std::fprintf(stderr, "concord-coordinator: %s\n", in_use.c_str());
      return kUsageError;
    }
  }
  auto server = concord::coordinator::Server::Start(options);
  if (!server.ok()) {
    std::fprintf(stderr, "concord-coordinator: %s\n",
                 std::string(server.status().message()).c_str());
    return server.status().code() == absl::StatusCode::kDataLoss ? 1
                                                                 : kUsageError;
  }
  spdlog::info("concord-coordinator listening on {}", (*server)->address());
  spdlog::info("gRPC transport: {}",
               options.tls.cert_pem.empty()
                   ? "plaintext"
                   : (options.tls.ca_pem.empty()
                          ? "TLS"
                          : "mTLS (client certificates required)"));
  if ((*server)->metrics_port() != 0) {
    spdlog::info("metrics on port {}", (*server)->metrics_port());
  }
  if ((*server)->health_port() != 0) {
    spdlog::info("health on port {}", (*server)->health_port());
  }

  int signal_number = 0;
  sigwait(&signals, &signal_number);
  spdlog::info("received {}, shutting down",
               signal_number == SIGINT ? "SIGINT" : "SIGTERM");
  (*server)->Shutdown();
  spdlog::info("stopped");
  return 0;
}
