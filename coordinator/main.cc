// concord-coordinator: serves the worker service until SIGINT or SIGTERM.

#include <pthread.h>
#include <signal.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <memory>
#include <string>

#include "common/logging.h"
#include "coordinator/server.h"

namespace {

constexpr int kUsageError = 2;

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Concord coordinator: membership and rendezvous for workers",
               "concord-coordinator"};
  std::string listen = "127.0.0.1:7070";
  std::string log_level = "info";
  app.add_option("--listen", listen, "host:port to serve on (loopback default)")
      ->capture_default_str();
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

  concord::InitLogging("coordinator", log_level);

  // Block the signals before any thread starts so that every thread inherits
  // the mask and only the sigwait below ever sees them; no work is done in a
  // signal handler.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  concord::coordinator::ServerOptions options;
  options.listen_address = listen;
  auto server = concord::coordinator::Server::Start(options);
  if (!server.ok()) {
    spdlog::error("concord-coordinator: {}", server.status().ToString());
    return 1;
  }
  spdlog::info("concord-coordinator listening on {}", (*server)->address());

  int signal_number = 0;
  sigwait(&signals, &signal_number);
  spdlog::info("received {}, shutting down",
               signal_number == SIGINT ? "SIGINT" : "SIGTERM");
  (*server)->Shutdown();
  spdlog::info("stopped");
  return 0;
}
