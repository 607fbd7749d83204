// Load generator for the coordinator: many simulated workers over loopback,
// and the anchor, torchrun's c10d rendezvous on LibTorch's TCPStore.
//
//   build/bin/concord-bench-coordinator [--workers N] [--job-size N]
//       [--per-agent K] [--rendezvous-workers N] [--duration-s 10] [--rate-hz
//       1]
//       [--connections 1000] [--client-threads 2] [--state-dir DIR]
//       [--json] [--no-tcpstore] [--tcpstore-threads 16]
//       [--tcpstore-timeout-s 60]
//
// Without --workers it runs N = 1,000, 10,000 and 100,000 in turn; job size
// and rendezvous size default to N. The workers are simulated the way
// concord-run runs them: through node agents of --per-agent K workers
// (default 8, so 100,000 workers are 12,500 agents; see Note [Node agents] in
// agent/node_agent.h), each agent one connection of --connections and one
// Node stream carrying its workers' joins and membership watches;
// --per-agent 0 makes every worker talk to the coordinator itself (async
// Joins, no watches). For each N it starts `concord-coordinator`'s Server
// in a child process (so that its CPU time and memory are its own, read
// from /proc), then
//  1. rendezvous: --rendezvous-workers workers join one job (max = N) at
//     once; prints the time from the first join sent to the last answer
//     (every worker placed in generation 1); then one of them dies (leaves
//     with an error) and the others join again at once: prints the re-form
//     time, from the death to the last new rank;
//  2. joins the rest of --workers in jobs of --job-size the same way;
//  3. heartbeats: every worker heartbeats once per 1/--rate-hz seconds,
//     spread evenly over the period, for --duration-s: an agent sends its
//     K workers' heartbeats in one Heartbeats call, as concord-run does
//     once its workers are in phase (without agents, a Heartbeat call
//     each); prints p50/p99/max latency of those calls, errors, achieved
//     rate, the coordinator's CPU (cores used over the phase), threads and
//     resident memory; then the same again with every heartbeat carrying a
//     WorkerProgress (the hang rule's reports) and, through agents, the
//     agent's ProcessView of the worker, and the two side by side;
//  4. the anchor (concord-bench-tcpstore, tcpstore_rendezvous.cc): the same
//     nodes rendezvous through one c10d::TCPStore, as torchrun's agents do
//     (one participant a node of --per-agent workers; with --per-agent 0,
//     one a worker), as far as it gets within --tcpstore-timeout-s.
// With --json, one JSON object a line per N: workers, agents, rendezvous_s,
// reform_s, heartbeat_p50_ms, heartbeat_p99_ms, coordinator_cores,
// progress_heartbeat_p50_ms, progress_heartbeat_p99_ms,
// progress_coordinator_cores, coordinator_rss_mb, tcpstore_nodes,
// tcpstore_rendezvous_s (null where it did not run).
// Simulated workers share --connections gRPC channels (each its own TCP
// connection) driven by --client-threads completion-queue threads. Bounded
// in time; loopback only. Not a test: it prints figures.

#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/coordinator_agents.h"
#include "common/auth.h"
#include "common/grpc_auth.h"
#include "common/http_get.h"
#include "common/logging.h"
#include "concord/v1/agent.grpc.pb.h"
#include "concord/v1/worker.grpc.pb.h"
#include "coordinator/server.h"
#include "descriptors.h"

namespace {

using concord::bench::AgentTracker;
using concord::bench::FillProgress;
using concord::bench::JoinAllThroughAgents;
using concord::bench::JoinRequestOf;
using concord::bench::Seconds;
using concord::bench::SimAgent;
using concord::bench::SteadyClock;
using concord::bench::StreamHeartbeatStats;
using concord::bench::Worker;
namespace v1 = concord::v1;

struct Flags {
  int workers = 10000;
  int job_size = 1000;
  int per_agent = 8;  // 0: every worker talks to the coordinator itself
  int rendezvous_workers = 1000;
  int duration_s = 10;
  double rate_hz = 1.0;
  int connections = 1000;
  int client_threads = 2;
  std::string state_dir;
  std::string log_level = "warn";
  bool json = false;
  bool tcpstore = true;
  int tcpstore_threads = 16;
  double tcpstore_timeout_s = 60;
};

// One N's figures; negative where the phase did not run or failed.
struct Result {
  int workers = 0;
  int rendezvous_workers = 0;
  double rendezvous_s = -1;
  double reform_s = -1;
  double heartbeat_p50_ms = -1;
  double heartbeat_p99_ms = -1;
  double coordinator_cores = -1;
  // The same heartbeats carrying WorkerProgress (see Note [Hangs]) and,
  // through agents, a ProcessView, in the same run: what the hang rule's
  // reports cost.
  double progress_p50_ms = -1;
  double progress_p99_ms = -1;
  double progress_cores = -1;
  double coordinator_rss_mb = -1;
  // The anchor (concord-bench-tcpstore): seconds, or why not.
  double tcpstore_s = -1;
  long long tcpstore_compare_sets = 0;
  std::string tcpstore_error;
};

// Runs concord-bench-tcpstore (next to this program) for `nodes` nodes.
void RunTcpStore(const Flags& f, int nodes, Result* result) {
  char self[4096];
  const ssize_t len = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (len <= 0) {
    result->tcpstore_error = "cannot find this program's folder";
    return;
  }
  std::string program(self, static_cast<size_t>(len));
  program =
      program.substr(0, program.rfind('/') + 1) + "concord-bench-tcpstore";
  const std::string command = absl::StrCat(
      "'", program, "' --workers ", nodes, " --threads ", f.tcpstore_threads,
      " --timeout-s ", f.tcpstore_timeout_s, " 2>&1");
  FILE* out = popen(command.c_str(), "r");
  if (out == nullptr) {
    result->tcpstore_error = "cannot run " + program;
    return;
  }
  std::string text;
  char buffer[512];
  while (fgets(buffer, sizeof(buffer), out) != nullptr) text += buffer;
  pclose(out);
  // Its one line, among whatever LibTorch logged.
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    double seconds = 0;
    long long compare_sets = 0;
    if (std::sscanf(line.c_str(), "ok %lf %lld", &seconds, &compare_sets) ==
        2) {
      result->tcpstore_s = seconds;
      result->tcpstore_compare_sets = compare_sets;
      return;
    }
    if (line.rfind("error ", 0) == 0) {
      result->tcpstore_error = line.substr(6);
      return;
    }
  }
  const size_t what = text.find("what():");
  result->tcpstore_error = absl::StrCat(
      "concord-bench-tcpstore ended without a result",
      what == std::string::npos
          ? ""
          : absl::StrCat(": ",
                         text.substr(what, text.find('\n', what) - what)));
}

// utime + stime of a process, in seconds.
double CpuSeconds(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(in)),
                   std::istreambuf_iterator<char>());
  // Fields after the command name (which may hold spaces) start at ')'.
  std::istringstream fields(text.substr(text.rfind(')') + 2));
  std::string f;
  double utime = 0, stime = 0;
  for (int i = 3; i <= 15 && fields >> f; ++i) {
    if (i == 14) utime = std::stod(f);
    if (i == 15) stime = std::stod(f);
  }
  return (utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

int Threads(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
  }
  return -1;
}

constexpr char kChildFlag[] = "--coordinator-child";

// The child: serves a coordinator on 127.0.0.1:0 with the tokens and store
// its environment names, writes "ADDRESS METRICS_PORT" (or an empty line) to
// its standard output and serves until SIGTERM.
int CoordinatorChild(const std::string& log_level) {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  concord::InitLogging("coordinator", log_level);
  concord::coordinator::ServerOptions options;
  const char* worker = std::getenv("CONCORD_BENCH_WORKER_TOKEN");
  const char* op = std::getenv("CONCORD_BENCH_OPERATOR_TOKEN");
  const char* state_dir = std::getenv("CONCORD_BENCH_STATE_DIR");
  options.worker_token = worker != nullptr ? worker : "";
  options.operator_token = op != nullptr ? op : "";
  options.state_dir = state_dir != nullptr ? state_dir : "";
  options.metrics_address = "127.0.0.1:0";
  auto server = concord::coordinator::Server::Start(options);
  const std::string address =
      server.ok() ? absl::StrCat((*server)->address(), " ",
                                 (*server)->metrics_port(), "\n")
                  : std::string("\n");
  (void)!write(STDOUT_FILENO, address.data(), address.size());
  close(STDOUT_FILENO);
  if (!server.ok()) {
    std::fprintf(stderr, "concord-bench-coordinator: %s\n",
                 server.status().ToString().c_str());
    return 2;
  }
  int signal_number = 0;
  sigwait(&signals, &signal_number);
  (*server)->Shutdown();
  return 0;
}

// Starts this program again as a coordinator (CoordinatorChild): a fresh
// process for each N, its CPU time and memory its own. Exec, not just fork:
// gRPC's threads in this process (the previous N's clients) do not survive
// a fork. Returns "ADDRESS METRICS_PORT" ("" on failure) and its pid.
std::string StartCoordinator(const concord::coordinator::ServerOptions& options,
                             const std::string& log_level, pid_t* pid) {
  int fds[2];
  if (pipe(fds) != 0) return "";
  *pid = fork();
  if (*pid == 0) {
    close(fds[0]);
    dup2(fds[1], STDOUT_FILENO);
    close(fds[1]);
    setenv("CONCORD_BENCH_WORKER_TOKEN", options.worker_token.c_str(), 1);
    setenv("CONCORD_BENCH_OPERATOR_TOKEN", options.operator_token.c_str(), 1);
    setenv("CONCORD_BENCH_STATE_DIR", options.state_dir.c_str(), 1);
    execl("/proc/self/exe", "concord-bench-coordinator", kChildFlag,
          log_level.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  close(fds[1]);
  std::string address;
  char c;
  while (read(fds[0], &c, 1) == 1 && c != '\n') address.push_back(c);
  close(fds[0]);
  return address;
}

using concord::HttpGet;

// The coordinator's own view: the upper bound (ms) of the histogram bucket
// of concord_rpc_duration_seconds{method} that holds quantile q.
double ServerQuantileMs(const std::string& metrics, const std::string& method,
                        double q) {
  const std::string prefix = absl::StrCat(
      "concord_rpc_duration_seconds_bucket{method=\"", method, "\",le=\"");
  std::vector<std::pair<double, double>> buckets;  // (le, cumulative count)
  std::istringstream lines(metrics);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.rfind(prefix, 0) != 0) continue;
    const size_t quote = line.find('"', prefix.size());
    const std::string le = line.substr(prefix.size(), quote - prefix.size());
    const double bound =
        le == "+Inf" ? std::numeric_limits<double>::infinity() : std::stod(le);
    buckets.push_back({bound, std::stod(line.substr(line.rfind(' ') + 1))});
  }
  if (buckets.empty() || buckets.back().second <= 0) return -1;
  const double target = q * buckets.back().second;
  for (const auto& [bound, count] : buckets) {
    if (count >= target) return 1e3 * bound;
  }
  return -1;
}

// A unary call in flight on a completion queue.
template <typename Response>
struct Pending {
  grpc::ClientContext context;
  Response response;
  grpc::Status status;
  std::unique_ptr<grpc::ClientAsyncResponseReader<Response>> reader;
  SteadyClock::time_point sent;
  size_t worker = 0;
};

// Joins workers[first, first + n) to their job (of `job_size` workers) at
// once, naming `previous_generation` (0: a fresh join); returns the seconds
// from the first Join sent to the last answer, or -1 when one failed.
double JoinAll(std::vector<Worker>& workers, size_t first, size_t n,
               size_t job_size, int64_t previous_generation,
               const std::string& token) {
  grpc::CompletionQueue cq;
  std::vector<std::unique_ptr<Pending<v1::JoinResponse>>> calls;
  const SteadyClock::time_point start = SteadyClock::now();
  for (size_t i = first; i < first + n; ++i) {
    Worker& w = workers[i];
    const v1::JoinRequest request =
        JoinRequestOf(w, job_size, previous_generation);
    auto call = std::make_unique<Pending<v1::JoinResponse>>();
    call->context.set_deadline(std::chrono::system_clock::now() +
                               std::chrono::minutes(5));
    concord::AddBearerToken(call->context, token);
    call->worker = i;
    call->reader = w.stub->AsyncJoin(&call->context, request, &cq);
    call->reader->Finish(&call->response, &call->status, call.get());
    calls.push_back(std::move(call));
  }
  size_t done = 0, failed = 0;
  void* tag;
  bool ok;
  while (done < n && cq.Next(&tag, &ok)) {
    auto* call = static_cast<Pending<v1::JoinResponse>*>(tag);
    ++done;
    if (!call->status.ok()) {
      if (failed++ == 0) {
        std::fprintf(stderr, "join of %s failed: %s\n",
                     workers[call->worker].id.c_str(),
                     call->status.error_message().c_str());
      }
      continue;
    }
    workers[call->worker].generation = call->response.generation();
  }
  const double seconds = Seconds(SteadyClock::now() - start);
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return failed == 0 ? seconds : -1;
}

// One worker of the job at workers[first] dies (it leaves with an error: the
// coordinator ends the generation at once, as when its watch stream breaks)
// and the other n - 1 join again at once; returns the seconds from the
// death to the last survivor's new rank, or -1. The dead worker is dropped
// from `workers`' job (its generation is left at 0).
double ReformOne(
    std::vector<Worker>& workers, size_t first, size_t n,
    const std::string& token,
    const std::function<double(size_t first, size_t n, size_t job_size,
                               int64_t previous_generation)>& join_all) {
  Worker& dead = workers[first];
  const int64_t generation = dead.generation;
  const SteadyClock::time_point start = SteadyClock::now();
  v1::LeaveRequest leave;
  leave.set_job_id(dead.job);
  leave.set_worker_id(dead.id);
  leave.set_worker_secret(dead.secret);
  leave.set_generation(generation);
  leave.set_reason(v1::LEAVE_REASON_ERROR);
  leave.set_message("killed by the benchmark");
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(30));
  concord::AddBearerToken(context, token);
  v1::LeaveResponse left;
  const grpc::Status s = dead.stub->Leave(&context, leave, &left);
  if (!s.ok()) {
    std::fprintf(stderr, "leave of %s failed: %s\n", dead.id.c_str(),
                 s.error_message().c_str());
    return -1;
  }
  dead.generation = 0;
  dead.dead = true;
  const double rejoin = join_all(first + 1, n - 1, n, generation);
  if (rejoin < 0) return -1;
  return Seconds(SteadyClock::now() - start);
}

// Resident memory of a process, in MiB.
double ResidentMib(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stod(line.substr(6)) / 1024;
  }
  return -1;
}

struct HeartbeatStats {
  std::vector<double> latency_ms;
  int64_t sent = 0;
  int64_t errors = 0;
  std::string first_error;
  double max_send_lag_ms = 0;  // how far behind schedule the client sent
};

// One worker's Heartbeat call in flight.
struct HeartbeatCall {
  grpc::ClientContext context;
  grpc::Status status;
  SteadyClock::time_point sent;
  v1::HeartbeatResponse response;
  std::unique_ptr<grpc::ClientAsyncResponseReader<v1::HeartbeatResponse>>
      reader;
};

// One client thread: the heartbeats of units[t], units[t + T], ... at
// `rate_hz` each, phase-shifted evenly over the period, until `end`. A unit
// is one worker (a Heartbeat call), or with `agents` a simulated node agent
// (one message on its Node stream for its workers, answered into
// `stream_stats`). Latencies of what was sent before `measure_from` are
// not kept.
void HeartbeatThread(
    const std::vector<Worker>& workers, const std::vector<size_t>& units,
    const std::vector<SimAgent*>* agents, StreamHeartbeatStats* stream_stats,
    size_t t, size_t threads, double rate_hz, const std::string& token,
    SteadyClock::time_point start, SteadyClock::time_point measure_from,
    SteadyClock::time_point end, bool progress, HeartbeatStats* stats) {
  grpc::CompletionQueue cq;
  const auto period = std::chrono::duration_cast<SteadyClock::duration>(
      std::chrono::duration<double>(1.0 / rate_hz));
  const size_t n = units.size();
  // Unit i is due at start + i/n * period + k * period.
  std::vector<size_t> mine;
  for (size_t i = t; i < n; i += threads) mine.push_back(i);
  if (mine.empty()) return;  // fewer units than client threads
  size_t cursor = 0;
  int64_t round = 0, in_flight = 0, step = 0;
  auto due = [&](size_t index) {
    return start + round * period +
           (period * static_cast<int64_t>(mine[index])) /
               static_cast<int64_t>(n);
  };
  while (true) {
    const SteadyClock::time_point now = SteadyClock::now();
    // At most kBatch sends between two looks at the completions, so that a
    // client that falls behind does not also delay the answers it measures.
    constexpr int kBatch = 64;
    for (int batch = 0; batch < kBatch && now < end && due(cursor) <= now;
         ++batch) {
      const size_t unit = units[mine[cursor]];
      const SteadyClock::time_point sent = SteadyClock::now();
      stats->max_send_lag_ms =
          std::max(stats->max_send_lag_ms, 1e3 * Seconds(sent - due(cursor)));
      if (agents != nullptr) {
        stats->sent += (*agents)[unit]->Heartbeat(step, measure_from,
                                                  stream_stats, progress);
        if (++cursor == mine.size()) {
          cursor = 0;
          ++round;
          ++step;
        }
        continue;
      }
      const Worker& w = workers[unit];
      v1::HeartbeatRequest request;
      request.set_job_id(w.job);
      request.set_worker_id(w.id);
      request.set_worker_secret(w.secret);
      request.set_generation(w.generation);
      request.set_step(step);
      request.set_samples_per_second(1000.0);
      if (progress) FillProgress(step, request.mutable_progress());
      auto* call = new HeartbeatCall();
      call->context.set_deadline(std::chrono::system_clock::now() +
                                 std::chrono::seconds(10));
      concord::AddBearerToken(call->context, token);
      call->sent = sent;
      call->reader = w.stub->AsyncHeartbeat(&call->context, request, &cq);
      call->reader->Finish(&call->response, &call->status, call);
      ++in_flight;
      if (++cursor == mine.size()) {
        cursor = 0;
        ++round;
        ++step;
      }
    }
    if (now >= end && in_flight == 0) break;
    const SteadyClock::time_point wake =
        now >= end ? now + std::chrono::seconds(1)
                   : std::min(due(cursor), now + std::chrono::milliseconds(5));
    void* tag;
    bool ok;
    while (true) {
      // gRPC takes system_clock deadlines only.
      const auto status = cq.AsyncNext(
          &tag, &ok,
          std::chrono::system_clock::now() +
              std::max(wake - SteadyClock::now(), SteadyClock::duration{0}));
      if (status != grpc::CompletionQueue::GOT_EVENT) break;
      auto* call = static_cast<HeartbeatCall*>(tag);
      const SteadyClock::time_point done = SteadyClock::now();
      --in_flight;
      ++stats->sent;
      if (!call->status.ok()) {
        if (stats->errors++ == 0) {
          stats->first_error = absl::StrCat(call->status.error_code(), ": ",
                                            call->status.error_message());
        }
      } else if (call->sent >= measure_from) {
        stats->latency_ms.push_back(1e3 * Seconds(done - call->sent));
      }
      delete call;
      // Keep sending on time even when answers keep coming.
      if (SteadyClock::now() >= wake) break;
    }
  }
  cq.Shutdown();
  void* tag;
  bool ok;
  while (cq.Next(&tag, &ok)) {
  }
}

double Percentile(std::vector<double>& v, double p) {
  if (v.empty()) return 0;
  const size_t k = std::min(v.size() - 1, static_cast<size_t>(p * v.size()));
  std::nth_element(v.begin(), v.begin() + static_cast<ptrdiff_t>(k), v.end());
  return v[k];
}

// Prints unless --json.
template <typename... Args>
void Say(const Flags& f, const char* format, Args... args) {
  if (!f.json) std::printf(format, args...);
}

// The workers and their jobs, the rendezvous job first, then jobs of
// --job-size; each job as [first, count) of `workers`. An agent's workers
// (--per-agent) share its connection.
std::vector<std::pair<size_t, size_t>> PlaceWorkers(
    const Flags& f,
    const std::vector<std::unique_ptr<v1::WorkerService::Stub>>& stubs,
    const std::vector<std::unique_ptr<v1::AgentService::Stub>>& agent_stubs,
    std::vector<Worker>* workers) {
  std::vector<std::pair<size_t, size_t>> jobs;
  const int total = std::max(f.workers, f.rendezvous_workers);
  for (int placed = 0; placed < total;) {
    const int size = jobs.empty() ? f.rendezvous_workers
                                  : std::min(f.job_size, total - placed);
    jobs.push_back({static_cast<size_t>(placed), static_cast<size_t>(size)});
    for (int k = 0; k < size; ++k, ++placed) {
      Worker w;
      w.job = absl::StrCat("bench-", jobs.size() - 1);
      w.id = absl::StrCat("w", placed);
      w.secret = absl::StrCat("secret-", placed, "-0123456789abcdef");
      const size_t connection =
          static_cast<size_t>(f.per_agent > 0 ? placed / f.per_agent : placed) %
          stubs.size();
      w.stub = stubs[connection].get();
      w.agent = agent_stubs[connection].get();
      workers->push_back(std::move(w));
    }
  }
  return jobs;
}

// Every job joins (`join_all`), the first one then re-forms after a death:
// the rendezvous and re-form figures. False when a phase failed.
template <typename JoinAllFn>
bool JoinPhase(const Flags& f, pid_t pid, const std::string& token,
               std::vector<Worker>& workers,
               const std::vector<std::pair<size_t, size_t>>& jobs,
               const JoinAllFn& join_all, Result* result) {
  for (size_t j = 0; j < jobs.size(); ++j) {
    const int threads_before = Threads(pid);
    const double cpu_before = CpuSeconds(pid);
    // The coordinator's peak thread count while the Joins wait.
    std::atomic<bool> joining{true};
    std::atomic<int> peak_threads{threads_before};
    std::thread sampler([&] {
      while (joining) {
        peak_threads = std::max(peak_threads.load(), Threads(pid));
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    });
    const double seconds = join_all(jobs[j].first, jobs[j].second,
                                    jobs[j].second, /*previous_generation=*/0);
    joining = false;
    sampler.join();
    if (seconds < 0) return false;
    if (j == 0) {
      result->rendezvous_s = seconds;
      Say(f,
          "rendezvous: %zu workers joined one job in %.3f s "
          "(coordinator CPU %.2f s, threads %d, peak %d, resident %.0f "
          "MiB)\n",
          jobs[j].second, seconds, CpuSeconds(pid) - cpu_before, threads_before,
          peak_threads.load(), ResidentMib(pid));
      if (jobs[j].second > 1) {
        const double cpu = CpuSeconds(pid);
        const double reform =
            ReformOne(workers, jobs[j].first, jobs[j].second, token, join_all);
        if (reform < 0) return false;
        result->reform_s = reform;
        Say(f,
            "re-form: one of %zu workers died, the other %zu had their new "
            "ranks in %.3f s (coordinator CPU %.2f s)\n",
            jobs[j].second, jobs[j].second - 1, reform, CpuSeconds(pid) - cpu);
      }
    } else if (j + 1 == jobs.size()) {
      Say(f, "joined %zu jobs, %zu workers (last job: %.3f s)\n", jobs.size(),
          workers.size(), seconds);
    }
  }
  return true;
}

// Through agents, the heartbeats' answers come back on the Node streams:
// waited for (10 s at most) and counted into `into`.
void TakeStreamAnswers(StreamHeartbeatStats& stream_stats,
                       std::vector<HeartbeatStats>& stats) {
  int64_t sent_total = 0;
  for (auto& st : stats) sent_total += st.sent;
  const SteadyClock::time_point give_up =
      SteadyClock::now() + std::chrono::seconds(10);
  while (SteadyClock::now() < give_up) {
    {
      std::lock_guard<std::mutex> lock(stream_stats.mu);
      if (stream_stats.answered >= sent_total) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::lock_guard<std::mutex> lock(stream_stats.mu);
  HeartbeatStats& into = stats.front();
  into.latency_ms.insert(into.latency_ms.end(), stream_stats.latency_ms.begin(),
                         stream_stats.latency_ms.end());
  into.errors += stream_stats.errors + (sent_total - stream_stats.answered);
  if (into.first_error.empty()) {
    into.first_error = stream_stats.answered < sent_total
                           ? absl::StrCat(sent_total - stream_stats.answered,
                                          " heartbeats not answered")
                           : stream_stats.first_error;
  }
}

// --duration-s of heartbeats at --rate-hz from every live worker (or every
// simulated agent), with or without `progress` (WorkerProgress): latency,
// the coordinator's CPU and memory. False when a heartbeat failed.
bool HeartbeatPhase(const Flags& f, pid_t pid, int metrics_port,
                    const std::string& token, std::vector<Worker>& workers,
                    std::vector<std::unique_ptr<SimAgent>>& agents,
                    bool progress, Result* result) {
  workers.resize(static_cast<size_t>(f.workers));
  // The heartbeat units: each worker (the rendezvous job's dead worker
  // heartbeats no more), or each simulated agent.
  std::vector<size_t> units;
  std::vector<SimAgent*> agent_units;
  if (f.per_agent > 0) {
    for (auto& agent : agents) {
      units.push_back(agent_units.size());
      agent_units.push_back(agent.get());
    }
  } else {
    for (size_t i = 0; i < workers.size(); ++i) {
      if (workers[i].generation > 0) units.push_back(i);
    }
  }
  StreamHeartbeatStats stream_stats;
  const size_t threads = static_cast<size_t>(f.client_threads);
  std::vector<HeartbeatStats> stats(threads);
  const SteadyClock::time_point start = SteadyClock::now();
  const SteadyClock::time_point measure_from = start + std::chrono::seconds(1);
  const SteadyClock::time_point end =
      start + std::chrono::seconds(f.duration_s);
  const double cpu_before = CpuSeconds(pid);
  const rusage self_before = [] {
    rusage r{};
    getrusage(RUSAGE_SELF, &r);
    return r;
  }();
  std::vector<std::thread> pool;
  for (size_t t = 0; t < threads; ++t) {
    pool.emplace_back(HeartbeatThread, std::cref(workers), std::cref(units),
                      f.per_agent > 0 ? &agent_units : nullptr, &stream_stats,
                      t, threads, f.rate_hz, std::cref(token), start,
                      measure_from, end, progress, &stats[t]);
  }
  for (auto& th : pool) th.join();
  if (f.per_agent > 0) TakeStreamAnswers(stream_stats, stats);
  const double wall = Seconds(SteadyClock::now() - start);
  const double cpu = CpuSeconds(pid) - cpu_before;
  rusage self_after{};
  getrusage(RUSAGE_SELF, &self_after);
  auto tv = [](const timeval& v) { return v.tv_sec + v.tv_usec / 1e6; };
  const double client_cpu = tv(self_after.ru_utime) + tv(self_after.ru_stime) -
                            tv(self_before.ru_utime) - tv(self_before.ru_stime);
  std::vector<double> latency;
  int64_t sent = 0, errors = 0;
  double lag = 0;
  std::string first_error;
  for (auto& st : stats) {
    latency.insert(latency.end(), st.latency_ms.begin(), st.latency_ms.end());
    sent += st.sent;
    errors += st.errors;
    lag = std::max(lag, st.max_send_lag_ms);
    if (first_error.empty()) first_error = st.first_error;
  }
  const double p50 = Percentile(latency, 0.50);
  const double p99 = Percentile(latency, 0.99);
  const double max =
      latency.empty() ? 0 : *std::max_element(latency.begin(), latency.end());
  (progress ? result->progress_p50_ms : result->heartbeat_p50_ms) = p50;
  (progress ? result->progress_p99_ms : result->heartbeat_p99_ms) = p99;
  (progress ? result->progress_cores : result->coordinator_cores) = cpu / wall;
  result->coordinator_rss_mb = ResidentMib(pid);
  Say(f,
      "heartbeats%s: %d workers%s at %.2f Hz for %.1f s: %lld sent "
      "(%.0f/s), %lld errors%s%s\n",
      progress ? " with progress" : "", f.workers,
      f.per_agent > 0
          ? absl::StrCat(" through ", units.size(), " agents of ", f.per_agent)
                .c_str()
          : "",
      f.rate_hz, wall, static_cast<long long>(sent),
      static_cast<double>(sent) / wall, static_cast<long long>(errors),
      errors > 0 ? ", first: " : "", first_error.c_str());
  Say(f,
      "heartbeat latency: p50 %.2f ms, p99 %.2f ms, max %.2f ms "
      "(client fell behind schedule by at most %.1f ms)\n",
      p50, p99, max, lag);
  const std::string metrics = HttpGet(metrics_port, "/metrics");
  if (f.per_agent == 0) {
    Say(f,
        "heartbeat handler time in the coordinator (its histogram): p50 <= "
        "%g ms, p99 <= %g ms\n",
        ServerQuantileMs(metrics, "Heartbeat", 0.5),
        ServerQuantileMs(metrics, "Heartbeat", 0.99));
  }
  Say(f,
      "coordinator CPU: %.2f s over %.1f s = %.2f cores; threads %d; "
      "resident %.0f MiB (%.2f KiB a worker); load generator CPU %.2f "
      "cores\n",
      cpu, wall, cpu / wall, Threads(pid), result->coordinator_rss_mb,
      1024 * result->coordinator_rss_mb / std::max(f.workers, 1),
      client_cpu / wall);
  if (errors > 0) {
    if (f.json) {
      std::fprintf(stderr, "heartbeats: %lld errors, first: %s\n",
                   static_cast<long long>(errors), first_error.c_str());
    }
    return false;
  }
  return true;
}

// One run against a fresh coordinator: the rendezvous (and re-form) of
// f.rendezvous_workers, the rest of f.workers in jobs of f.job_size, then
// the heartbeat phase. Prints its lines unless f.json. Returns false when a
// phase failed.
bool RunConcord(const Flags& f, Result* result) {
  concord::coordinator::ServerOptions options;
  options.worker_token = concord::GenerateToken();
  options.operator_token = concord::GenerateToken();
  options.state_dir = f.state_dir;
  options.metrics_address = "127.0.0.1:0";
  pid_t pid = -1;
  const std::string started = StartCoordinator(options, f.log_level, &pid);
  const std::string address = started.substr(0, started.find(' '));
  const int metrics_port = started.find(' ') == std::string::npos
                               ? 0
                               : std::stoi(started.substr(started.find(' ')));
  if (address.empty()) {
    std::fprintf(stderr,
                 "concord-bench-coordinator: coordinator did not start\n");
    if (pid > 0) waitpid(pid, nullptr, 0);
    return false;
  }
  Say(f,
      "coordinator pid %d on %s; %d workers, %d connections, %d "
      "client threads, %d cores here\n",
      pid, address.c_str(), f.workers, f.connections, f.client_threads,
      static_cast<int>(std::thread::hardware_concurrency()));

  std::vector<std::unique_ptr<v1::WorkerService::Stub>> stubs;
  std::vector<std::unique_ptr<v1::AgentService::Stub>> agent_stubs;
  for (int i = 0; i < f.connections; ++i) {
    grpc::ChannelArguments args;
    args.SetInt("concord.bench.connection", i);  // one TCP connection each
    auto channel = grpc::CreateCustomChannel(
        address, grpc::InsecureChannelCredentials(), args);
    stubs.push_back(v1::WorkerService::NewStub(channel));
    agent_stubs.push_back(v1::AgentService::NewStub(channel));
  }
  std::vector<Worker> workers;
  const std::vector<std::pair<size_t, size_t>> jobs =
      PlaceWorkers(f, stubs, agent_stubs, &workers);

  // Through simulated node agents (--per-agent): their Node streams.
  AgentTracker tracker;
  std::vector<std::unique_ptr<SimAgent>> agents;
  const auto join_all = [&](size_t first, size_t n, size_t job_size,
                            int64_t previous_generation) {
    return f.per_agent > 0
               ? JoinAllThroughAgents(workers, agents, &tracker, first, n,
                                      job_size, previous_generation,
                                      static_cast<size_t>(f.per_agent),
                                      options.worker_token)
               : JoinAll(workers, first, n, job_size, previous_generation,
                         options.worker_token);
  };
  const bool ok = JoinPhase(f, pid, options.worker_token, workers, jobs,
                            join_all, result) &&
                  HeartbeatPhase(f, pid, metrics_port, options.worker_token,
                                 workers, agents, /*progress=*/false, result) &&
                  HeartbeatPhase(f, pid, metrics_port, options.worker_token,
                                 workers, agents, /*progress=*/true, result);
  if (ok) {
    Say(f,
        "heartbeat cost, without / with WorkerProgress and ProcessView: p50 "
        "%.2f / %.2f ms, "
        "p99 %.2f / %.2f ms, coordinator %.3f / %.3f cores\n",
        result->heartbeat_p50_ms, result->progress_p50_ms,
        result->heartbeat_p99_ms, result->progress_p99_ms,
        result->coordinator_cores, result->progress_cores);
  }
  if (!agents.empty()) {
    Say(f, "agents: %zu Node streams carried the joins and %lld views\n",
        agents.size(), static_cast<long long>(tracker.views()));
    for (auto& agent : agents) agent->Close();
    tracker.AwaitStreamsDone(static_cast<int64_t>(agents.size()));
  }
  kill(pid, SIGTERM);
  waitpid(pid, nullptr, 0);
  return ok;
}

// A figure for --json: null where it was not measured.
nlohmann::json OrNull(double v) {
  return v < 0 ? nlohmann::json(nullptr) : nlohmann::json(v);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == kChildFlag) {
    return CoordinatorChild(argv[2]);
  }
  Flags f;
  CLI::App app{
      "Load generator for concord-coordinator; without --workers, runs N = "
      "1,000, 10,000 and 100,000",
      "concord-bench-coordinator"};
  app.add_option("--workers", f.workers,
                 "Simulated workers heartbeating (one N)")
      ->check(CLI::Range(1, 100000));
  app.add_option("--job-size", f.job_size, "Workers per job (default: N)")
      ->check(CLI::Range(1, 100000));
  app.add_option("--per-agent", f.per_agent,
                 "Workers per simulated node agent (concord-run's default); "
                 "0: every worker talks to the coordinator itself")
      ->capture_default_str()
      ->check(CLI::Range(0, 4096));
  app.add_option("--rendezvous-workers", f.rendezvous_workers,
                 "Workers of the measured rendezvous, the first job "
                 "(default: N)")
      ->check(CLI::Range(1, 100000));
  app.add_option("--duration-s", f.duration_s, "Heartbeat phase length")
      ->check(CLI::Range(2, 600))
      ->capture_default_str();
  app.add_option("--rate-hz", f.rate_hz, "Heartbeats per worker per second")
      ->check(CLI::Range(0.01, 100.0));
  app.add_option("--connections", f.connections, "gRPC channels (TCP)")
      ->check(CLI::Range(1, 10000));
  app.add_option("--client-threads", f.client_threads, "Client threads")
      ->check(CLI::Range(1, 64));
  app.add_option("--coordinator-log-level", f.log_level,
                 "The coordinator's log level (info logs every join)")
      ->capture_default_str();
  app.add_option("--state-dir", f.state_dir,
                 "Run the coordinator with the embedded store here");
  app.add_flag("--json", f.json,
               "One JSON object a line per N instead of the text");
  app.add_flag("!--no-tcpstore", f.tcpstore,
               "Skip the anchor (the c10d rendezvous on LibTorch's TCPStore)");
  app.add_option("--tcpstore-threads", f.tcpstore_threads,
                 "Threads driving the TCPStore nodes (each call blocks)")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  app.add_option("--tcpstore-timeout-s", f.tcpstore_timeout_s,
                 "Give the TCPStore rendezvous up after this long (null)")
      ->check(CLI::Range(1.0, 3600.0))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  // Every connection is a descriptor on both sides (the coordinator and
  // concord-bench-tcpstore inherit the limit).
  concord::bench::RaiseDescriptorLimit();

  const bool one = app.count("--workers") > 0;
  const std::vector<int> series =
      one ? std::vector<int>{f.workers} : std::vector<int>{1000, 10000, 100000};
  int status = 0;
  for (int n : series) {
    Flags g = f;
    g.workers = n;
    if (app.count("--job-size") == 0) g.job_size = n;
    if (app.count("--rendezvous-workers") == 0) g.rendezvous_workers = n;
    Result r;
    r.workers = n;
    r.rendezvous_workers = g.rendezvous_workers;
    if (!RunConcord(g, &r)) status = 1;
    // The anchor with the participants torchrun would have: one agent a
    // node joins its rendezvous and gives its node's workers their ranks,
    // as concord-run's agents do here (every worker its own without).
    const int nodes =
        g.per_agent > 0 ? (g.rendezvous_workers + g.per_agent - 1) / g.per_agent
                        : g.rendezvous_workers;
    if (g.tcpstore) {
      RunTcpStore(g, nodes, &r);
      if (!g.json) {
        if (r.tcpstore_s >= 0) {
          std::printf(
              "anchor: c10d rendezvous of %d nodes (%d workers) on LibTorch's "
              "TCPStore in %.3f s (%lld compare_sets, %d threads)\n",
              nodes, g.rendezvous_workers, r.tcpstore_s,
              r.tcpstore_compare_sets, g.tcpstore_threads);
        } else {
          std::printf("anchor: c10d rendezvous of %d nodes on TCPStore: %s\n",
                      nodes, r.tcpstore_error.c_str());
        }
      }
    }
    if (g.json) {
      nlohmann::json line = {
          {"workers", r.workers},
          {"agents",
           g.per_agent > 0 ? (r.workers + g.per_agent - 1) / g.per_agent : 0},
          {"rendezvous_workers", r.rendezvous_workers},
          {"rendezvous_s", OrNull(r.rendezvous_s)},
          {"reform_s", OrNull(r.reform_s)},
          {"heartbeat_p50_ms", OrNull(r.heartbeat_p50_ms)},
          {"heartbeat_p99_ms", OrNull(r.heartbeat_p99_ms)},
          {"coordinator_cores", OrNull(r.coordinator_cores)},
          {"progress_heartbeat_p50_ms", OrNull(r.progress_p50_ms)},
          {"progress_heartbeat_p99_ms", OrNull(r.progress_p99_ms)},
          {"progress_coordinator_cores", OrNull(r.progress_cores)},
          {"coordinator_rss_mb", OrNull(r.coordinator_rss_mb)},
          {"tcpstore_nodes", nodes},
          {"tcpstore_rendezvous_s", OrNull(r.tcpstore_s)},
      };
      if (g.tcpstore && r.tcpstore_s < 0) {
        line["tcpstore_error"] = r.tcpstore_error;
      }
      std::printf("%s\n", line.dump().c_str());
    }
    std::fflush(stdout);
  }
  return status;
}
