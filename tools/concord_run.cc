// concord-run: starts N worker processes of a training program, like
// `torchrun`. With --standalone it also runs a coordinator on a free loopback
// port for them; otherwise the workers join --coordinator HOST:PORT.
//
// Tokens: with --coordinator, the worker token comes from --token-file (or
// CONCORD_TOKEN_FILE); --standalone makes fresh worker and operator tokens
// for its embedded coordinator. Either way the workers get the token file's
// path in CONCORD_TOKEN_FILE.
//
// Elasticity: the job takes --min-workers to --max-workers members (both
// default to --nproc). A worker that fails is restarted, as a new worker
// that joins the running job, up to --max-restarts times per local worker;
// the healthy ones are never restarted. While the job can still have
// --min-workers members the others go on without a failed worker; below
// that, concord-run stops them all.
//
// Node agent (Note [Node agents] in agent/node_agent.h): unless --no-agent,
// concord-run is its workers' agent towards the coordinator. The workers
// dial it on a unix socket in a directory only this user can enter
// (CONCORD_COORDINATOR=unix:...); it carries their calls over one
// connection, batching heartbeats and membership updates, with TLS towards
// the coordinator where --tls-* says so. If concord-run dies its workers
// die with it.
//
// Timelines: with --trace FILE each worker writes its own trace file
// (CONCORD_TRACE_FILE, in a directory next to FILE) and concord-run merges
// them into FILE when the workers are done, a killed worker's included
// (Note [Trace files] in worker/trace/recorder.h). With --history DIR each
// worker appends its history to DIR/<worker id>.history (Note [History
// files] in worker/trace/history.h) and a --standalone coordinator its own
// to DIR/coordinator.history, for tests/history.py.
//
// Exit status: 0 when the last run of every local worker exits 0; otherwise
// the first failing worker's status (128+signal for a signal), after its
// stderr is shown. Usage errors: exit 2.

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "agent/node_agent.h"
#include "common/auth.h"
#include "common/logging.h"
#include "common/tls.h"
#include "coordinator/server.h"
#include "worker/trace/merge.h"

namespace {

struct Options {
  bool standalone = false;
  bool agent = true;  // serve the workers as their node agent
  std::string coordinator;
  int nproc = 0;
  int min_workers = 0;  // 0: nproc
  int max_workers = 0;  // 0: nproc
  int max_restarts = 0;
  int64_t settle_ms = 0;  // 0: the coordinator's default
  std::string job_id;
  int64_t heartbeat_interval_ms = 1000;
  int64_t heartbeat_timeout_ms = 10000;
  int64_t rendezvous_timeout_ms = 300000;
  int64_t collective_timeout_ms = 300000;
  std::string comm_host = "127.0.0.1";
  std::string node_id;  // empty: the workers use the hostname
  std::string token_file;
  concord::TlsFiles tls;    // towards --coordinator; passed on to the workers
  std::string trace;        // --trace FILE
  std::string trace_parts;  // the workers' trace files go here
  std::string history;      // --history DIR
  std::vector<std::string> program;
};

struct Worker {
  int index = 0;
  int restarts = 0;  // how many runs of this local worker came before
  pid_t pid = -1;
  int stderr_fd = -1;
  std::string partial;             // stderr bytes after the last newline
  std::deque<std::string> tail;    // last lines of stderr
  std::optional<int> exit_status;  // once reaped
};

constexpr size_t kTailLines = 40;

[[noreturn]] void UsageError(const std::string& message) {
  std::cerr << "concord-run: " << message << "\n";
  std::exit(2);
}

Options ParseArgs(int argc, char** argv) {
  // Everything after the first "--" is the program and its arguments.
  int split = argc;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--") == 0) {
      split = i;
      break;
    }
  }
  Options o;
  CLI::App app{
      "Starts N workers of a training program and, with --standalone, a "
      "coordinator for them.\nUsage: concord-run [OPTIONS] -- PROGRAM "
      "[ARGS...]"};
  app.add_flag("--standalone", o.standalone,
               "Run an embedded coordinator on a free loopback port");
  app.add_flag("--agent,!--no-agent", o.agent,
               "Carry the workers' calls to the coordinator as their node "
               "agent: one connection, batched heartbeats and membership "
               "updates (default); --no-agent: each worker connects itself");
  app.add_option("--coordinator", o.coordinator,
                 "Coordinator HOST:PORT to join, or HOST:PORT,HOST:PORT,... "
                 "for replicas (without --standalone)");
  app.add_option("--nproc", o.nproc, "Number of worker processes")
      ->required()
      ->check(CLI::Range(1, 4096));
  app.add_option("--min-workers", o.min_workers,
                 "Fewest members the job trains with (default: --nproc)")
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--max-workers", o.max_workers,
                 "Most members the job admits (default: --nproc)")
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--max-restarts", o.max_restarts,
                 "Restart a failed local worker up to this many times")
      ->check(CLI::Range(0, 1 << 20));
  app.add_option("--settle-ms", o.settle_ms,
                 "With fewer than --max-workers waiting, form a generation "
                 "once none arrived for this long")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  app.add_option("--job-id", o.job_id, "Job id (default: generated)");
  app.add_option("--heartbeat-interval-ms", o.heartbeat_interval_ms)
      ->check(CLI::PositiveNumber);
  app.add_option("--heartbeat-timeout-ms", o.heartbeat_timeout_ms)
      ->check(CLI::PositiveNumber);
  app.add_option("--rendezvous-timeout-ms", o.rendezvous_timeout_ms)
      ->check(CLI::PositiveNumber);
  app.add_option("--collective-timeout-ms", o.collective_timeout_ms)
      ->check(CLI::PositiveNumber);
  app.add_option("--comm-host", o.comm_host,
                 "Address the workers' communicators listen on");
  app.add_option("--node-id", o.node_id,
                 "The node the workers run on, for SlowMo's --nprocs-per-node "
                 "(CONCORD_NODE_ID; default: the hostname)")
      ->check([](const std::string& v) {
        return v.empty() ? std::string("must not be empty") : std::string();
      });
  app.add_option("--token-file", o.token_file,
                 "File holding the worker token (with --coordinator; default "
                 "$CONCORD_TOKEN_FILE)");
  app.add_option("--tls-ca", o.tls.ca,
                 "PEM CA that signed the coordinator's certificate (TLS)");
  app.add_option("--tls-cert", o.tls.cert,
                 "PEM client certificate for mTLS (with --tls-key)");
  app.add_option("--tls-key", o.tls.key, "PEM private key of --tls-cert");
  app.add_option("--trace", o.trace,
                 "merge the workers' timelines (Chrome trace-event JSON, one "
                 "track per rank; open in Perfetto) into this file");
  app.add_option("--history", o.history,
                 "each worker appends its history (generations, restores, "
                 "commits with a parameter digest; JSON lines) to "
                 "DIR/<worker id>.history (CONCORD_HISTORY_FILE); with "
                 "--standalone the coordinator's goes to "
                 "DIR/coordinator.history")
      ->check(CLI::ExistingDirectory);
  try {
    app.parse(split, argv);
  } catch (const CLI::CallForHelp& e) {
    std::exit(app.exit(e));
  } catch (const CLI::ParseError& e) {
    UsageError(e.what());
  }
  for (int i = split + 1; i < argc; ++i) o.program.emplace_back(argv[i]);
  if (o.program.empty()) UsageError("no program given after '--'");
  if (o.standalone == !o.coordinator.empty()) {
    UsageError("give exactly one of --standalone and --coordinator HOST:PORT");
  }
  if (o.job_id.empty()) o.job_id = absl::StrCat("job-", getpid());
  if (!o.standalone) {
    if (o.token_file.empty()) {
      const char* env = std::getenv("CONCORD_TOKEN_FILE");
      if (env != nullptr) o.token_file = env;
    }
    if (o.token_file.empty()) {
      UsageError("--coordinator needs --token-file F (or CONCORD_TOKEN_FILE)");
    }
    auto token = concord::ReadTokenFile(o.token_file);
    if (!token.ok()) UsageError(std::string(token.status().message()));
    // Checked here so that a bad file is one line, not N workers failing.
    auto tls =
        concord::LoadClientTls(o.tls, {"--tls-ca", "--tls-cert", "--tls-key"});
    if (!tls.ok()) UsageError(std::string(tls.status().message()));
  } else if (!o.token_file.empty()) {
    UsageError("--token-file is for --coordinator; --standalone makes its own");
  } else if (!o.tls.ca.empty() || !o.tls.cert.empty() || !o.tls.key.empty()) {
    UsageError(
        "--tls-ca/--tls-cert/--tls-key are for --coordinator; --standalone "
        "serves plaintext on loopback");
  }
  if (o.min_workers == 0) o.min_workers = o.nproc;
  if (o.max_workers == 0) o.max_workers = std::max(o.nproc, o.min_workers);
  if (o.min_workers > o.max_workers) {
    UsageError("--min-workers must not exceed --max-workers");
  }
  if (o.settle_ms >= o.rendezvous_timeout_ms) {
    UsageError("--settle-ms must be below --rendezvous-timeout-ms");
  }
  if (o.heartbeat_timeout_ms <= o.heartbeat_interval_ms) {
    UsageError("--heartbeat-timeout-ms must exceed --heartbeat-interval-ms");
  }
  return o;
}

std::string Hostname() {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  return host;
}

std::vector<std::string> WorkerEnv(const Options& o,
                                   const std::string& coordinator, int index,
                                   int restarts) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    // The job's settings are concord-run's to give; test hooks, the
    // device and the backend (Note [Worker device]), the shared-memory
    // switch (Note [Shared-memory allreduce]) and the library's log level
    // (Note [Library logging]) pass.
    if ((std::strncmp(*e, "CONCORD_", 8) != 0 ||
         std::strncmp(*e, "CONCORD_TEST_", 13) == 0 ||
         std::strncmp(*e, "CONCORD_DEVICE=", 15) == 0 ||
         std::strncmp(*e, "CONCORD_BACKEND=", 16) == 0 ||
         std::strncmp(*e, "CONCORD_SHM=", 12) == 0 ||
         std::strncmp(*e, "CONCORD_LOG_LEVEL=", 18) == 0) &&
        std::strncmp(*e, "LOCAL_RANK=", 11) != 0 &&
        std::strncmp(*e, "LOCAL_WORLD_SIZE=", 17) != 0) {
      env.emplace_back(*e);
    }
  }
  env.push_back("CONCORD_COORDINATOR=" + coordinator);
  env.push_back("CONCORD_TOKEN_FILE=" + o.token_file);
  // Through the agent, TLS is the agent's business.
  for (auto [name, path] : {std::pair{"CONCORD_TLS_CA=", &o.tls.ca},
                            std::pair{"CONCORD_TLS_CERT=", &o.tls.cert},
                            std::pair{"CONCORD_TLS_KEY=", &o.tls.key}}) {
    if (!path->empty() && !o.agent) env.push_back(name + *path);
  }
  env.push_back("CONCORD_JOB_ID=" + o.job_id);
  env.push_back(absl::StrCat("CONCORD_MIN_WORKERS=", o.min_workers));
  env.push_back(absl::StrCat("CONCORD_MAX_WORKERS=", o.max_workers));
  if (o.settle_ms > 0) {
    env.push_back(absl::StrCat("CONCORD_SETTLE_MS=", o.settle_ms));
  }
  // The worker's index on this node: a CUDA worker's device is
  // cuda:<local rank> (Note [Worker device] in worker/device.h). torchrun's
  // names too, for programs written against them.
  env.push_back(absl::StrCat("CONCORD_LOCAL_RANK=", index));
  env.push_back(absl::StrCat("LOCAL_RANK=", index));
  env.push_back(absl::StrCat("LOCAL_WORLD_SIZE=", o.nproc));
  env.push_back(absl::StrCat("CONCORD_RESTART_COUNT=", restarts));
  // Unique in the job across machines and launchers: the host, this
  // launcher's pid, the local index; a restarted worker is a new member (a
  // new process, a new secret), with an id of its own.
  const std::string worker_id =
      absl::StrCat(o.job_id, "-", Hostname(), "-", getpid(), "-w", index,
                   restarts > 0 ? absl::StrCat("-r", restarts) : "");
  env.push_back("CONCORD_WORKER_ID=" + worker_id);
  env.push_back("CONCORD_COMM_HOST=" + o.comm_host);
  if (!o.node_id.empty()) env.push_back("CONCORD_NODE_ID=" + o.node_id);
  env.push_back(
      absl::StrCat("CONCORD_HEARTBEAT_INTERVAL_MS=", o.heartbeat_interval_ms));
  env.push_back(
      absl::StrCat("CONCORD_HEARTBEAT_TIMEOUT_MS=", o.heartbeat_timeout_ms));
  env.push_back(
      absl::StrCat("CONCORD_RENDEZVOUS_TIMEOUT_MS=", o.rendezvous_timeout_ms));
  env.push_back(
      absl::StrCat("CONCORD_COLLECTIVE_TIMEOUT_MS=", o.collective_timeout_ms));
  if (!o.trace_parts.empty()) {
    env.push_back(absl::StrCat("CONCORD_TRACE_FILE=", o.trace_parts, "/worker-",
                               index, "-run-", restarts, ".json"));
  }
  if (!o.history.empty()) {
    env.push_back(absl::StrCat("CONCORD_HISTORY_FILE=", o.history, "/",
                               worker_id, ".history"));
  }
  return env;
}

// Forks and execs one worker with its stderr on a pipe. Signals blocked in
// the parent are unblocked in the child; the child dies with the parent.
Worker Spawn(const Options& o, const std::string& coordinator, int index,
             int restarts, const sigset_t& parent_mask) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    std::cerr << "concord-run: pipe: " << std::strerror(errno) << "\n";
    std::exit(1);
  }
  std::vector<std::string> env = WorkerEnv(o, coordinator, index, restarts);
  std::vector<char*> envp;
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::vector<std::string> args = o.program;
  std::vector<char*> argvp;
  for (auto& a : args) argvp.push_back(a.data());
  argvp.push_back(nullptr);

  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    std::cerr << "concord-run: fork: " << std::strerror(errno) << "\n";
    std::exit(1);
  }
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(1);
    sigprocmask(SIG_SETMASK, &parent_mask, nullptr);
    dup2(fds[1], STDERR_FILENO);
    execvpe(argvp[0], argvp.data(), envp.data());
    // Only async-signal-safe calls between fork and exec.
    const char* parts[] = {"concord-run: cannot run '", argvp[0],
                           "': ", strerror(errno), "\n"};
    for (const char* part : parts) {
      (void)!write(STDERR_FILENO, part, strlen(part));
    }
    _exit(127);
  }
  close(fds[1]);
  Worker w;
  w.index = index;
  w.restarts = restarts;
  w.pid = pid;
  w.stderr_fd = fds[0];
  return w;
}

// What a forwarded line starts with: on a terminal, back to the line's
// start and erase it, so that a worker's progress bar (drawn in place on
// the shared terminal, see concord-train) does not run into the line; the
// worker draws its bar again on its next update.
const char* LineStart() {
  static const char* start = isatty(STDERR_FILENO) == 1 ? "\r\x1b[K" : "";
  return start;
}

// Forwards complete stderr lines, prefixed with the worker's index, and keeps
// the last ones. Returns false at end of file.
bool PumpStderr(Worker& w) {
  char buf[4096];
  const ssize_t n = read(w.stderr_fd, buf, sizeof(buf));
  if (n <= 0) {
    if (n < 0 && errno == EINTR) return true;
    if (!w.partial.empty()) {
      std::cerr << LineStart() << "[worker " << w.index << "] " << w.partial
                << "\n";
      w.tail.push_back(w.partial);
      w.partial.clear();
    }
    close(w.stderr_fd);
    w.stderr_fd = -1;
    return false;
  }
  w.partial.append(buf, static_cast<size_t>(n));
  size_t start = 0;
  for (size_t nl; (nl = w.partial.find('\n', start)) != std::string::npos;
       start = nl + 1) {
    std::string line = w.partial.substr(start, nl - start);
    std::cerr << LineStart() << "[worker " << w.index << "] " << line << "\n";
    w.tail.push_back(std::move(line));
    if (w.tail.size() > kTailLines) w.tail.pop_front();
  }
  w.partial.erase(0, start);
  return true;
}

int StatusOf(int wait_status) {
  if (WIFEXITED(wait_status)) return WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) return 128 + WTERMSIG(wait_status);
  return 1;
}

int Supervise(const Options& o, const std::string& coordinator,
              const sigset_t& parent_mask, std::vector<Worker>& workers,
              int signal_fd) {
  std::optional<size_t> first_failure;  // index into `workers`
  bool terminating = false;
  absl::Time kill_at = absl::InfiniteFuture();
  auto terminate_all = [&](int sig) {
    for (auto& w : workers) {
      if (!w.exit_status) kill(w.pid, sig);
    }
  };
  for (;;) {
    // Reap; restart what failed while restarts are left.
    const size_t count = workers.size();
    for (size_t i = 0; i < count; ++i) {
      Worker& w = workers[i];
      if (w.exit_status) continue;
      int status = 0;
      if (waitpid(w.pid, &status, WNOHANG) != w.pid) continue;
      w.exit_status = StatusOf(status);
      if (*w.exit_status == 0 || terminating) continue;
      if (w.restarts < o.max_restarts) {
        std::cerr << "concord-run: worker " << w.index << " (pid " << w.pid
                  << ") failed with exit status " << *w.exit_status
                  << "; restarting it (" << w.restarts + 1 << " of "
                  << o.max_restarts << ")\n";
        const int index = w.index, restarts = w.restarts + 1;
        workers.push_back(Spawn(o, coordinator, index, restarts, parent_mask));
      } else if (!first_failure) {
        first_failure = i;
      }
    }
    bool all_done = true;
    bool finished = false;  // a worker is done training: so is the job
    int alive = 0;          // local workers still running
    for (auto& w : workers) {
      all_done = all_done && w.exit_status && w.stderr_fd < 0;
      if (!w.exit_status) ++alive;
      if (w.exit_status && *w.exit_status == 0) finished = true;
    }
    if (all_done) break;
    // A worker that failed for good: the others go on while the job can
    // still have min_workers members (with more workers elsewhere, the
    // coordinator decides; its rendezvous timeout ends the job).
    if (first_failure && !terminating && !finished && alive > 0 &&
        alive < o.min_workers && o.standalone) {
      std::cerr << "concord-run: " << alive << " worker(s) left, fewer than "
                << "--min-workers " << o.min_workers << "; stopping them\n";
      terminating = true;
      terminate_all(SIGTERM);
      kill_at = absl::Now() + absl::Seconds(5);
    }
    if (terminating && absl::Now() > kill_at) {
      terminate_all(SIGKILL);
      kill_at = absl::InfiniteFuture();
    }
    std::vector<pollfd> fds;
    std::vector<Worker*> owners;
    for (auto& w : workers) {
      if (w.stderr_fd >= 0) {
        fds.push_back({w.stderr_fd, POLLIN, 0});
        owners.push_back(&w);
      }
    }
    fds.push_back({signal_fd, POLLIN, 0});
    poll(fds.data(), fds.size(), 100);
    for (size_t i = 0; i < owners.size(); ++i) {
      if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) PumpStderr(*owners[i]);
    }
    if (fds.back().revents & POLLIN) {
      signalfd_siginfo info;
      if (read(signal_fd, &info, sizeof(info)) == sizeof(info) &&
          info.ssi_signo != SIGCHLD) {
        std::cerr << "concord-run: got signal " << info.ssi_signo
                  << "; stopping workers\n";
        terminate_all(static_cast<int>(info.ssi_signo));
        if (!terminating) {
          terminating = true;
          kill_at = absl::Now() + absl::Seconds(10);
        }
      }
    }
  }
  if (!first_failure) {
    // The last run of every local worker decides.
    std::vector<const Worker*> last(static_cast<size_t>(o.nproc), nullptr);
    for (const auto& w : workers) last[static_cast<size_t>(w.index)] = &w;
    for (const Worker* w : last) {
      if (w != nullptr && *w->exit_status != 0) return *w->exit_status;
    }
    return 0;
  }
  const Worker& failed = workers[*first_failure];
  std::cerr << "concord-run: worker " << failed.index << " (pid " << failed.pid
            << ") failed with exit status " << *failed.exit_status
            << "; the last lines of its stderr:\n";
  for (const auto& line : failed.tail) std::cerr << "  " << line << "\n";
  return *failed.exit_status;
}

}  // namespace

// --trace FILE: checks that FILE can be written. Exits 2 otherwise.
void CheckTrace(const Options& o) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_directory(o.trace, ec)) {
    UsageError("--trace " + o.trace + ": is a directory");
  }
  const int fd = open(o.trace.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    UsageError("--trace " + o.trace + ": " + std::strerror(errno));
  }
  close(fd);
}

// Makes the directory for the workers' trace files next to --trace FILE.
bool MakeTraceParts(Options& o) {
  std::string dir = o.trace + ".parts-XXXXXX";
  if (mkdtemp(dir.data()) == nullptr) {
    std::cerr << "concord-run: --trace " << o.trace << ": cannot make " << dir
              << ": " << std::strerror(errno) << "\n";
    return false;
  }
  o.trace_parts = dir;
  return true;
}

// Merges the workers' trace files into --trace FILE and removes them.
// Returns false when FILE could not be written.
bool MergeTrace(const Options& o) {
  namespace fs = std::filesystem;
  std::vector<std::string> parts;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(o.trace_parts, ec)) {
    parts.push_back(entry.path().string());
  }
  std::sort(parts.begin(), parts.end());
  auto merged = concord::trace::MergeTraceFiles(parts, o.trace);
  if (merged.ok()) {
    std::cerr << "concord-run: wrote the timeline of " << merged->files
              << " worker run(s), " << merged->events << " events, to "
              << o.trace;
    if (merged->skipped_lines > 0) {
      std::cerr << " (" << merged->skipped_lines
                << " cut-off line(s) of killed workers left out)";
    }
    std::cerr << "\n";
  } else {
    std::cerr << "concord-run: " << merged.status().message() << "\n";
  }
  fs::remove_all(o.trace_parts, ec);
  return merged.ok();
}

int main(int argc, char** argv) {
  Options options = ParseArgs(argc, argv);
  concord::InitLogging("concord-run", "warn");
  if (!options.trace.empty()) CheckTrace(options);

  sigset_t mask, old_mask;
  sigemptyset(&mask);
  sigaddset(&mask, SIGINT);
  sigaddset(&mask, SIGTERM);
  sigaddset(&mask, SIGCHLD);
  sigprocmask(SIG_BLOCK, &mask, &old_mask);
  const int signal_fd = signalfd(-1, &mask, SFD_CLOEXEC);

  std::unique_ptr<concord::coordinator::Server> server;
  std::string coordinator = options.coordinator;
  std::string token_dir;
  std::string worker_token;
  if (options.standalone) {
    concord::coordinator::ServerOptions server_options;
    server_options.listen_address = "127.0.0.1:0";
    server_options.worker_token = worker_token = concord::GenerateToken();
    server_options.operator_token = concord::GenerateToken();
    if (!options.history.empty()) {
      server_options.history_file = options.history + "/coordinator.history";
    }
    // The workers read their token from a file only this user can read.
    std::string dir_template = "/tmp/concord-run-XXXXXX";
    if (mkdtemp(dir_template.data()) == nullptr) {
      std::cerr << "concord-run: mkdtemp: " << std::strerror(errno) << "\n";
      return 1;
    }
    token_dir = dir_template;
    options.token_file = token_dir + "/worker-token";
    const absl::Status written = concord::WriteTokenFile(
        options.token_file, server_options.worker_token);
    if (!written.ok()) {
      std::cerr << "concord-run: " << written.message() << "\n";
      return 1;
    }
    auto started = concord::coordinator::Server::Start(server_options);
    if (!started.ok()) {
      std::cerr << "concord-run: cannot start the coordinator: "
                << started.status() << "\n";
      return 1;
    }
    server = std::move(*started);
    coordinator = server->address();
  } else {
    worker_token = *concord::ReadTokenFile(options.token_file);  // checked
  }

  std::unique_ptr<concord::agent::NodeAgent> agent;
  std::string agent_dir;
  if (options.agent) {
    std::string dir_template = "/tmp/concord-agent-XXXXXX";
    if (mkdtemp(dir_template.data()) == nullptr) {
      std::cerr << "concord-run: mkdtemp: " << std::strerror(errno) << "\n";
      return 1;
    }
    agent_dir = dir_template;
    concord::agent::NodeAgentOptions agent_options;
    agent_options.coordinator = coordinator;
    agent_options.token = worker_token;
    agent_options.tls = *concord::LoadClientTls(  // checked
        options.tls, {"--tls-ca", "--tls-cert", "--tls-key"});
    agent_options.listen = "unix:" + agent_dir + "/agent.sock";
    // Note [Heartbeat batching] in agent/heartbeat_batcher.h.
    const absl::Duration interval =
        absl::Milliseconds(options.heartbeat_interval_ms);
    agent_options.batch.interval = interval;
    agent_options.batch.max_delay = interval / 4;
    agent_options.batch.expect_within =
        absl::Milliseconds(options.heartbeat_timeout_ms);
    auto started = concord::agent::NodeAgent::Start(agent_options);
    if (!started.ok()) {
      std::cerr << "concord-run: cannot start the node agent: "
                << started.status() << "\n";
      rmdir(agent_dir.c_str());
      return 1;
    }
    agent = std::move(*started);
    coordinator = agent->address();
  }

  int status = 1;
  if (options.trace.empty() || MakeTraceParts(options)) {
    std::vector<Worker> workers;
    for (int i = 0; i < options.nproc; ++i) {
      workers.push_back(Spawn(options, coordinator, i, 0, old_mask));
    }
    status = Supervise(options, coordinator, old_mask, workers, signal_fd);
    if (!options.trace_parts.empty() && !MergeTrace(options) && status == 0) {
      status = 1;
    }
  }
  if (agent) {
    agent->Shutdown();
    agent.reset();
    unlink((agent_dir + "/agent.sock").c_str());
    rmdir(agent_dir.c_str());
  }
  if (server) server->Shutdown();
  if (!token_dir.empty()) {
    unlink(options.token_file.c_str());
    rmdir(token_dir.c_str());
  }
  return status;
}
