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
// Node agent (see Note [Node agents] in agent/node_agent.h): unless --no-agent,
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
// (see Note [Trace files] in worker/trace/recorder.h). With --history DIR each
// worker appends its history to DIR/<worker id>.history (see Note [History
// files] in worker/trace/history.h) and a --standalone coordinator its own
// to DIR/coordinator.history, for tests/history.py.
//
// Output (see Note [Worker output] in tools/launcher.h): every line of a
// worker's stdout and stderr goes to concord-run's stdout and stderr
// prefixed "[worker I] " (I its local index), whole lines only; with
// --log-dir DIR each run's streams also go, as written, to
// DIR/worker-I/run-R/stdout.log and stderr.log (R: 0 for the first run, 1
// for the first restart, ...), and --console all|stdout|stderr|none says
// what the terminal still gets. A worker's death is reported when it
// happens, with the last lines of its stderr and whether it is restarted;
// through the node agent the coordinator hears of it at once (see Note [Exited
// workers] in coordinator/core/core.h), so that the others re-form without
// waiting for its heartbeat timeout.
//
// Exit status (see Note [Exit status] in tools/launcher.h): 0 when the job
// completed, judged from the job's state (the embedded coordinator's with
// --standalone; through the agent, what the coordinator answered its
// workers), with a summary line naming the worker runs lost on the way;
// otherwise non-zero: the job failed or was stopped, this node's workers
// failed for good while the job goes on elsewhere, or it fell below
// --min-workers (the first worker that failed for good's status, 128+N for
// signal N, else 1); 128+S when concord-run was stopped by signal S.
// Without any word of the job's state (--no-agent with --coordinator, a
// program that never joined) the local exit codes decide: 0 when the last
// run of every local worker exited 0. Usage errors: exit 2, before any
// worker starts.

#include <fcntl.h>
#include <signal.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "agent/node_agent.h"
#include "common/auth.h"
#include "common/crash_trace.h"
#include "common/environment.h"
#include "common/host.h"
#include "common/logging.h"
#include "common/tls.h"
#include "coordinator/server.h"
#include "tools/launcher.h"
#include "worker/checkpoint/persister.h"
#include "worker/checkpoint/region.h"
#include "worker/trace/merge.h"

namespace {

using concord::launcher::Options;
using concord::launcher::Say;
using concord::launcher::UsageError;

// The footer of --help (docs/cli.md is made of it): where the workers'
// output goes and what the exit status says.
constexpr char kFooter[] =
    R"(Output: each line of a worker's stdout and stderr goes to concord-run's
stdout and stderr as "[worker I] LINE" (I: the local index), whole lines
only. With --log-dir DIR each run's output also goes, as written, to
DIR/worker-I/run-R/stdout.log and stderr.log (R: 0 for the first run of local
worker I, 1 for its first restart, ...); DIR is made if missing and must not
hold a worker-I folder yet. A worker's death is reported when it happens,
with the last lines of its stderr and whether it is restarted; the node agent
tells the coordinator at once, so that the others re-form without waiting
for its heartbeat timeout.

Exit status: 0 when the job completed (its state at the coordinator: the
embedded one with --standalone, else what the coordinator answered this
node's workers through the agent; or a local worker's training finished with
the job's), with a line naming the worker runs lost on the way. Otherwise
non-zero: the job failed or was stopped, or this node's workers failed for
good while it goes on elsewhere, or it fell below --min-workers: the status
of the first local worker that failed for good (128+N for signal N), else 1.
128+S when concord-run got signal S. With no word of the job's state
(--no-agent with --coordinator, a program that never joined) the local exit
codes decide: 0 when the last run of every local worker exited 0. 2: a usage
error, before any worker starts.)";

// Where the workers run and how the job forms: the coordinator, the
// members, the timeouts.
void AddJobFlags(CLI::App& app, Options& o) {
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
  app.add_option("--nnodes", o.nnodes,
                 "The job's size in nodes, N or MIN:MAX, as torchrun's: "
                 "every node runs --nproc workers, and the job trains with "
                 "MIN x --nproc to MAX x --nproc of them (sets the "
                 "defaults of --min-workers and --max-workers; start every "
                 "node with the same value)");
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
  app.add_option("--hang-timeout-ms", o.hang_timeout_ms,
                 "Take out a worker that holds the others up while making "
                 "no progress of its own after this long (0: derived from "
                 "the job's step times; -1: never)")
      ->check(CLI::Range(int64_t{-1}, int64_t{1} << 40));
  app.add_option("--stragglers", o.stragglers,
                 "What is done with a worker persistently slower than the "
                 "others: report (name it in the log, status and metrics) "
                 "or evict (also take it out while the job is faster "
                 "without it and keeps --min-workers, for a cool-down)")
      ->check(CLI::IsMember({"report", "evict"}))
      ->capture_default_str();
  app.add_option("--straggler-cooldown-ms", o.straggler_cooldown_ms,
                 "An evicted straggler may join again after this long, "
                 "twice as long after each later eviction")
      ->check(CLI::Range(int64_t{1}, int64_t{24} * 3600 * 1000))
      ->capture_default_str();
  app.add_option("--comm-host", o.comm_host,
                 "Address the workers' communicators listen on");
  app.add_option("--node-id", o.node_id,
                 "The node the workers run on, for SlowMo's --nprocs-per-node "
                 "(CONCORD_NODE_ID; default: the hostname)")
      ->check([](const std::string& v) {
        return v.empty() ? std::string("must not be empty") : std::string();
      });
}

// --coordinator's credentials.
void AddCredentialFlags(CLI::App& app, Options& o) {
  app.add_option("--token-file", o.token_file,
                 "File holding the worker token (with --coordinator; default "
                 "$CONCORD_TOKEN_FILE)");
  app.add_option("--tls-ca", o.tls.ca,
                 "PEM CA that signed the coordinator's certificate (TLS)");
  app.add_option("--tls-cert", o.tls.cert,
                 "PEM client certificate for mTLS (with --tls-key)");
  app.add_option("--tls-key", o.tls.key, "PEM private key of --tls-cert");
}

// Timelines, histories, the workers' output.
void AddOutputFlags(CLI::App& app, Options& o, std::string& console) {
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
  app.add_option("--log-dir", o.log_dir,
                 "also write each worker run's stdout and stderr, as written, "
                 "to DIR/worker-I/run-R/stdout.log and stderr.log (made if "
                 "missing; must not hold worker-I folders yet)");
  app.add_option("--console", console,
                 "which of the workers' streams concord-run's own stdout and "
                 "stderr show, prefixed \"[worker I] \"; hiding one needs "
                 "--log-dir")
      ->check(CLI::IsMember({"all", "stdout", "stderr", "none"}))
      ->capture_default_str();
}

void AddCheckpointFlags(CLI::App& app, Options& o, bool& no_resume) {
  auto* checkpoints = app.add_option_group(
      "Checkpoints",
      "durable state (docs/checkpoints.md): the workers copy it into this "
      "node's memory, concord-run writes it to disk");
  checkpoints->add_option(
      "--checkpoint-dir", o.checkpoint.dir,
      "write checkpoints of the job's committed state to "
      "DIR/<job id>/step-<N>/ (CONCORD_CHECKPOINT_DIR); a job whose workers "
      "hold no committed step (all died, or it was started again with the "
      "same --job-id) resumes from the newest one; needs --job-id");
  checkpoints
      ->add_option("--checkpoint-every", o.checkpoint.every,
                   "a checkpoint at the commit of every step that is a "
                   "multiple of STEPS")
      ->check(CLI::PositiveNumber);
  checkpoints
      ->add_option("--checkpoint-keep", o.checkpoint.keep,
                   "complete checkpoints kept on disk")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  checkpoints->add_flag("--no-resume", no_resume,
                        "this run starts afresh: it resumes only from its "
                        "own checkpoints");
  // Not a checkpoint flag: last in --help.
  app.add_flag_callback(
      "--env",
      [] {
        std::fputs(concord::env::Table().c_str(), stdout);
        std::exit(0);
      },
      "print the CONCORD_* environment variables a worker reads (name, "
      "type, default, who sets it, meaning) and exit");
}

// --coordinator's token and TLS files are read here, so that a bad file is
// one line, not N workers failing; --standalone takes neither.
void CheckCredentials(Options& o) {
  if (o.standalone) {
    if (!o.token_file.empty()) {
      UsageError(
          "--token-file is for --coordinator; --standalone makes its own");
    }
    if (!o.tls.ca.empty() || !o.tls.cert.empty() || !o.tls.key.empty()) {
      UsageError(
          "--tls-ca/--tls-cert/--tls-key are for --coordinator; --standalone "
          "serves plaintext on loopback");
    }
    return;
  }
  auto loaded = concord::LoadClientCredentials(&o.token_file, o.tls);
  if (!loaded.ok()) {
    UsageError(absl::StrCat("--coordinator: ", loaded.status().message()));
  }
  o.credentials = *std::move(loaded);
}

// --nnodes: "N" or "MIN:MAX", 1 <= MIN <= MAX <= 65536; "" when good.
std::string ParseNodes(const std::string& text, int* min, int* max) {
  const size_t colon = text.find(':');
  const std::string low = text.substr(0, colon);
  const std::string high =
      colon == std::string::npos ? low : text.substr(colon + 1);
  int a = 0;
  int b = 0;
  if (!absl::SimpleAtoi(low, &a) || !absl::SimpleAtoi(high, &b) ||
      low.empty() || high.empty() || !std::isdigit(low[0]) ||
      !std::isdigit(high[0])) {
    return absl::StrCat("'", text, "' is not N or MIN:MAX");
  }
  if (a < 1 || b > 65536 || a > b) {
    return absl::StrCat("'", text, "': need 1 <= MIN <= MAX <= 65536 nodes");
  }
  *min = a;
  *max = b;
  return "";
}

// The members' bounds (defaults from --nproc) and the timeouts.
void CheckMembership(Options& o) {
  int min_nodes = 1;
  int max_nodes = 1;
  if (!o.nnodes.empty()) {
    const std::string problem = ParseNodes(o.nnodes, &min_nodes, &max_nodes);
    if (!problem.empty()) UsageError(absl::StrCat("--nnodes: ", problem));
    if (o.standalone && max_nodes > 1) {
      UsageError(
          "--nnodes above 1 needs --coordinator: --standalone's coordinator "
          "serves this node alone");
    }
  }
  if (o.min_workers == 0) o.min_workers = min_nodes * o.nproc;
  if (o.max_workers == 0) {
    o.max_workers = std::max(max_nodes * o.nproc, o.min_workers);
  }
  if (o.min_workers > o.max_workers) {
    UsageError("--min-workers must not exceed --max-workers");
  }
  if (o.settle_ms >= o.rendezvous_timeout_ms) {
    UsageError("--settle-ms must be below --rendezvous-timeout-ms");
  }
  if (const std::string problem = concord::HeartbeatTimeoutProblem(
          o.heartbeat_interval_ms, o.heartbeat_timeout_ms,
          "--heartbeat-interval-ms", "--heartbeat-timeout-ms");
      !problem.empty()) {
    UsageError(problem);
  }
}

void CheckCheckpoints(Options& o, bool no_resume) {
  o.checkpoint.resume = !no_resume;
  o.checkpoint.dir = concord::checkpoint::NormalDir(o.checkpoint.dir);
  if (auto st = concord::checkpoint::Validate(o.checkpoint, "--checkpoint-");
      !st.ok()) {
    UsageError(std::string(st.message()));
  }
  if (o.checkpoint.enabled() && o.job_id.empty()) {
    UsageError(
        "--checkpoint-dir needs --job-id: checkpoints are kept per job, and "
        "a job started again resumes from its own");
  }
}

void SetConsole(Options& o, const std::string& console) {
  o.console = console == "all"      ? concord::launcher::kConsoleAll
              : console == "stdout" ? concord::launcher::kConsoleStdout
              : console == "stderr" ? concord::launcher::kConsoleStderr
                                    : concord::launcher::kConsoleNone;
  if (o.console != concord::launcher::kConsoleAll && o.log_dir.empty()) {
    UsageError("--console " + console +
               " hides the workers' output: give --log-dir too");
  }
}

// Usage errors exit 2 with one line, before any worker starts.
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
  std::string console = "all";
  bool no_resume = false;
  CLI::App app{
      "Starts N workers of a training program and, with --standalone, a "
      "coordinator for them.\nUsage: concord-run [OPTIONS] -- PROGRAM "
      "[ARGS...]"};
  AddJobFlags(app, o);
  AddCredentialFlags(app, o);
  AddOutputFlags(app, o, console);
  AddCheckpointFlags(app, o, no_resume);
  app.footer(kFooter);
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
  CheckCheckpoints(o, no_resume);
  if (o.job_id.empty()) o.job_id = absl::StrCat("job-", getpid());
  CheckCredentials(o);
  if (absl::Status st = concord::env::GetInt(concord::env::kTestAgentLingerMs,
                                             &o.test_agent_linger_ms);
      !st.ok()) {
    UsageError(std::string(st.message()));
  }
  CheckMembership(o);
  SetConsole(o, console);
  return o;
}

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
    Say(absl::StrCat("--trace ", o.trace, ": cannot make ", dir, ": ",
                     std::strerror(errno)));
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
    Say(absl::StrCat("wrote the timeline of ", merged->files,
                     " worker run(s), ", merged->events, " events, to ",
                     o.trace,
                     merged->skipped_lines > 0
                         ? absl::StrCat(" (", merged->skipped_lines,
                                        " cut-off line(s) of killed workers "
                                        "left out)")
                         : ""));
  } else {
    Say(merged.status().message());
  }
  fs::remove_all(o.trace_parts, ec);
  return merged.ok();
}

// See Note [Checkpoints] in worker/checkpoint/checkpointer.h: the node's
// snapshot region, which outlives the workers, and the thread that writes
// it to disk.
struct CheckpointTier {
  std::string path;
  std::unique_ptr<concord::checkpoint::Region> region;
  std::unique_ptr<concord::checkpoint::Persister> persister;

  ~CheckpointTier() { Release(); }
  // Writes what is ready, unmaps and removes the region.
  void Release() {
    persister.reset();
    region.reset();
    if (!path.empty()) unlink(path.c_str());
    path.clear();
  }
};

// /dev/shm/concord-<job>-<pid>; regions of this job that a concord-run
// killed before it could remove them (its pid gone, or this process's own
// pid: no other process has it now) are removed: a node whose agent died
// lost its memory tier, as a rebooted node would. The region is then made
// exclusively (Region::Create): whatever appears at the path meanwhile is
// refused, never used.
std::string RegionPath(const std::string& job) {
  namespace fs = std::filesystem;
  std::string safe = job;
  for (char& c : safe) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_') {
      c = '_';
    }
  }
  const std::string prefix = absl::StrCat("concord-", safe, "-");
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator("/dev/shm", ec)) {
    const std::string name = entry.path().filename().string();
    int pid = 0;
    if (name.rfind(prefix, 0) == 0 &&
        absl::SimpleAtoi(name.substr(prefix.size()), &pid) && pid > 0 &&
        (pid == getpid() || (kill(pid, 0) != 0 && errno == ESRCH))) {
      fs::remove(entry.path(), ec);
    }
  }
  return absl::StrCat("/dev/shm/", prefix, getpid());
}

// `report`: where each checkpoint written goes (the node agent, towards the
// coordinator; empty: nowhere).
bool StartCheckpointTier(
    Options& o, CheckpointTier& tier,
    std::function<void(const concord::checkpoint::PersistReport&)> report) {
  if (!o.checkpoint.enabled()) return true;
  tier.path = RegionPath(o.job_id);
  auto region = concord::checkpoint::Region::Create(tier.path);
  if (!region.ok()) {
    Say(absl::StrCat("checkpoints: ", region.status().message()));
    tier.path.clear();
    return false;
  }
  tier.region = *std::move(region);
  auto crash = concord::checkpoint::TestCrashFromEnvironment();
  if (!crash.ok()) {
    Say(std::string(crash.status().message()));
    return false;
  }
  tier.persister = std::make_unique<concord::checkpoint::Persister>(
      tier.region.get(), o.checkpoint.dir, o.checkpoint.keep, *crash,
      std::move(report));
  o.checkpoint.memory = tier.path;
  return true;
}

// SIGINT, SIGTERM and SIGCHLD, blocked and read from the returned
// signalfd; `old_mask` is what the workers start with.
int BlockSignals(sigset_t* old_mask) {
  sigset_t mask;
  sigemptyset(&mask);
  sigaddset(&mask, SIGINT);
  sigaddset(&mask, SIGTERM);
  sigaddset(&mask, SIGCHLD);
  sigprocmask(SIG_BLOCK, &mask, old_mask);
  return signalfd(-1, &mask, SFD_CLOEXEC);
}

// What concord-run runs besides the workers: the embedded coordinator
// (--standalone) and the node agent (unless --no-agent), started in that
// order and stopped in the reverse one.
class NodeServices {
 public:
  explicit NodeServices(Options& o) : o_(o), coordinator_(o.coordinator) {}

  // Returns false (having said why) when one could not start.
  bool Start() {
    if (o_.standalone) {
      if (!StartCoordinator()) return false;
    } else {
      worker_token_ = o_.credentials.token;
    }
    return !o_.agent || StartAgent();
  }

  // What the workers dial: the agent, else the coordinator.
  const std::string& coordinator() const { return coordinator_; }
  concord::agent::NodeAgent* agent() const { return agent_.get(); }

  // See Note [Checkpoints] in worker/checkpoint/checkpointer.h: the
  // coordinator hears of each write, done or failed, and of each snapshot
  // only in memory (see Note [Resume source]), through the agent (which
  // outlives the persister: Stop comes after it), or directly when it is
  // embedded. Empty when there is neither.
  std::function<void(const concord::checkpoint::PersistReport&)>
  CheckpointReporter() const {
    concord::agent::NodeAgent* agent = agent_.get();
    concord::coordinator::Server* embedded = server_.get();
    if (agent == nullptr && embedded == nullptr) return nullptr;
    const std::string node =
        o_.node_id.empty() ? concord::HostName() : o_.node_id;
    return [agent, embedded,
            node](const concord::checkpoint::PersistReport& w) {
      const concord::v1::CheckpointReport r =
          concord::checkpoint::ReportOf(w, node);
      if (agent != nullptr) {
        agent->CheckpointReported(w.job, r, w.writer_pid);
        return;
      }
      embedded->host().Mutate([&](concord::coordinator::Core& core) {
        if (absl::Status s = core.CheckpointReported(w.job, r); !s.ok()) {
          concord::Log()->warn("checkpoint report refused: {}", s.ToString());
        }
      });
    };
  }

  // See Note [Exit status] in tools/launcher.h: the job's state as the
  // embedded coordinator or the agent knows it.
  std::function<concord::launcher::JobWord()> JobWord() const {
    concord::coordinator::Server* embedded = server_.get();
    concord::agent::NodeAgent* agent = agent_.get();
    const std::string job_id = o_.job_id;
    return [embedded, agent, job_id] {
      concord::launcher::JobWord word;
      if (agent != nullptr) {
        const auto news = agent->job_news(job_id);
        if (news.state != concord::v1::JOB_STATE_UNSPECIFIED) {
          word.state = news.state;
          word.failure = news.failure;
        }
        word.completed = news.completed;
      }
      if (embedded != nullptr) {
        embedded->host().Read([&](const concord::coordinator::Core& core) {
          if (auto state = core.State(job_id)) {
            word.state = *state;
            word.failure = core.Failure(job_id);
          }
        });
      }
      return word;
    };
  }

  // The agent first (after the checkpoints' last reports, when there are
  // checkpoints), then the coordinator, then the files they used.
  void Stop() {
    if (agent_) {
      if (o_.checkpoint.enabled()) agent_->AwaitWrites(absl::Seconds(2));
      agent_->Shutdown();
      agent_.reset();
    }
    if (!agent_dir_.empty()) {
      unlink((agent_dir_ + "/agent.sock").c_str());
      rmdir(agent_dir_.c_str());
      agent_dir_.clear();
    }
    if (server_) {
      server_->Shutdown();
      server_.reset();
    }
    if (!token_dir_.empty()) {
      unlink(o_.token_file.c_str());
      rmdir(token_dir_.c_str());
      token_dir_.clear();
    }
  }

 private:
  // A directory only this user can enter, under /tmp; empty (said why) when
  // it could not be made.
  static std::string PrivateDir(const char* name) {
    std::string dir = absl::StrCat("/tmp/", name, "-XXXXXX");
    if (mkdtemp(dir.data()) == nullptr) {
      Say(absl::StrCat("mkdtemp: ", std::strerror(errno)));
      return "";
    }
    return dir;
  }

  // --standalone: a coordinator on a free loopback port with fresh worker
  // and operator tokens; the workers read theirs from a file only this user
  // can read.
  bool StartCoordinator() {
    concord::coordinator::ServerOptions so;
    so.listen_address = "127.0.0.1:0";
    so.worker_token = worker_token_ = concord::GenerateToken();
    so.operator_token = concord::GenerateToken();
    if (!o_.history.empty()) {
      so.history_file = o_.history + "/coordinator.history";
    }
    token_dir_ = PrivateDir("concord-run");
    if (token_dir_.empty()) return false;
    o_.token_file = token_dir_ + "/worker-token";
    if (absl::Status s =
            concord::WriteTokenFile(o_.token_file, so.worker_token);
        !s.ok()) {
      Say(s.message());
      return false;
    }
    auto started = concord::coordinator::Server::Start(so);
    if (!started.ok()) {
      Say(absl::StrCat("cannot start the coordinator: ",
                       started.status().ToString()));
      return false;
    }
    server_ = std::move(*started);
    coordinator_ = server_->address();
    return true;
  }

  // See Note [Node agents] in agent/node_agent.h: on a unix socket in a
  // private directory, towards coordinator_.
  bool StartAgent() {
    agent_dir_ = PrivateDir("concord-agent");
    if (agent_dir_.empty()) return false;
    concord::agent::NodeAgentOptions ao;
    ao.coordinator = coordinator_;
    ao.token = worker_token_;
    ao.tls = o_.credentials.tls;  // plaintext with --standalone
    ao.listen = "unix:" + agent_dir_ + "/agent.sock";
    // See Note [Heartbeat batching] in agent/heartbeat_batcher.h.
    const absl::Duration interval =
        absl::Milliseconds(o_.heartbeat_interval_ms);
    ao.batch.interval = interval;
    ao.batch.max_delay = interval / 4;
    ao.batch.expect_within = absl::Milliseconds(o_.heartbeat_timeout_ms);
    ao.test_linger = absl::Milliseconds(o_.test_agent_linger_ms);
    auto started = concord::agent::NodeAgent::Start(ao);
    if (!started.ok()) {
      Say(absl::StrCat("cannot start the node agent: ",
                       started.status().ToString()));
      return false;
    }
    agent_ = std::move(*started);
    coordinator_ = agent_->address();
    return true;
  }

  Options& o_;
  std::string coordinator_;
  std::string worker_token_;
  std::string token_dir_;
  std::string agent_dir_;
  std::unique_ptr<concord::coordinator::Server> server_;
  std::unique_ptr<concord::agent::NodeAgent> agent_;
};

// Runs the workers (with the checkpoint tier and the trace parts they
// need) and returns concord-run's exit status.
int Supervise(Options& options, const NodeServices& node, sigset_t old_mask,
              int signal_fd, CheckpointTier& checkpoints) {
  if (!StartCheckpointTier(options, checkpoints, node.CheckpointReporter()) ||
      (!options.trace.empty() && !MakeTraceParts(options))) {
    return 1;
  }
  concord::launcher::Supervisor supervisor{options,      node.coordinator(),
                                           old_mask,     signal_fd,
                                           node.agent(), node.JobWord()};
  int status = supervisor.Run();
  if (!options.trace_parts.empty() && !MergeTrace(options) && status == 0) {
    status = 1;
  }
  return status;
}

// Everything is shut down and written: the process ends without running
// static destructors. concord-run links LibTorch for the checkpoints'
// writer, and the teardown of LibTorch's and gRPC's statics at exit, in an
// order neither controls, tripped gRPC's reference-count assertion (SIGABRT
// after the work was done) in about one run in five. (The same assertion
// came back at the agent's shutdown: see Note [Where gRPC objects end] in
// agent/node_agent_impl.h.)
[[noreturn]] void EndProcess(int status, const Options& options) {
  std::fflush(nullptr);
  // The test hook's second half: the process outlives a lingering reaction.
  absl::SleepFor(absl::Milliseconds(2 * options.test_agent_linger_ms));
  _exit(status);
}

}  // namespace

int main(int argc, char** argv) {
  concord::InstallCrashTraces("concord-run", argv[0]);
  Options options = ParseArgs(argc, argv);
  concord::InitLogging("concord-run", "warn");
  if (!options.trace.empty()) CheckTrace(options);
  if (!options.log_dir.empty()) concord::launcher::PrepareLogDir(options);
  // A console that went away (a closed pipe) is not written to again; the
  // job goes on (see Note [Worker output]).
  signal(SIGPIPE, SIG_IGN);
  sigset_t old_mask;
  const int signal_fd = BlockSignals(&old_mask);

  NodeServices node(options);
  int status = 1;
  CheckpointTier checkpoints;
  if (node.Start()) {
    status = Supervise(options, node, old_mask, signal_fd, checkpoints);
  }
  // The last checkpoint is written (and reported) before the agent stops;
  // see Note [Exit status] in tools/launcher.h: a job that completed without
  // it is no success.
  if (checkpoints.persister != nullptr) {
    checkpoints.persister->Flush();
    const concord::checkpoint::PersisterStats last =
        checkpoints.persister->stats();
    if (last.failing_step >= 0) {
      Say(absl::StrCat("the job's last checkpoint, of step ", last.failing_step,
                       ", was not written to ", options.checkpoint.dir, ": ",
                       last.last_error,
                       last.last_step >= 0
                           ? absl::StrCat("; the newest this run wrote is of "
                                          "step ",
                                          last.last_step)
                           : std::string("; this run wrote none")));
      if (status == 0) status = 1;
    }
  }
  checkpoints.persister.reset();
  node.Stop();
  checkpoints.Release();
  EndProcess(status, options);
}
