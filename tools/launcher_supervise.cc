// concord-run's workers: their environment, starting, reaping, restarting
// and reporting them, and concord-run's exit status (see Note [Exit status] in
// launcher.h).

#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "agent/node_agent.h"
#include "common/environment.h"
#include "common/host.h"
#include "tools/launcher.h"

namespace concord::launcher {
namespace {

// The last lines of a dead run's stderr in its death report.
constexpr size_t kReportLines = 20;
// How long concord-run waits for the answers to its exit reports at the end
// (they carry the job's state).
constexpr absl::Duration kExitAnswers = absl::Seconds(2);

// Unique in the job across machines and launchers: the host, this
// launcher's pid, the local index; a restarted worker is a new member (a
// new process, a new secret), with an id of its own.
std::string WorkerId(const Options& o, int index, int restarts) {
  return absl::StrCat(o.job_id, "-", HostName(), "-", getpid(), "-w", index,
                      restarts > 0 ? absl::StrCat("-r", restarts) : "");
}

std::vector<std::string> WorkerEnv(const Options& o,
                                   const std::string& coordinator,
                                   const Worker& w) {
  std::vector<std::string> out;
  for (char** e = environ; *e != nullptr; ++e) {
    // The job's settings are concord-run's to give; what the table
    // (common/environment.h) says is the user's or a test's passes: the
    // device and the backend (see Note [Worker device]), the shared-memory
    // switch (see Note [Shared-memory allreduce]), the library's log level
    // (see Note [Library logging]), test hooks. So does everything that is not
    // Concord's, except torchrun's names, which are set below.
    const absl::string_view e_view(*e);
    const bool concord = absl::StartsWith(e_view, "CONCORD_");
    if ((concord && env::PassedOn(e_view)) ||
        (!concord && !absl::StartsWith(e_view, "LOCAL_RANK=") &&
         !absl::StartsWith(e_view, "LOCAL_WORLD_SIZE="))) {
      out.emplace_back(*e);
    }
  }
  out.push_back(env::Assign(env::kCoordinator, coordinator));
  out.push_back(env::Assign(env::kTokenFile, o.token_file));
  // Through the agent, TLS is the agent's business.
  for (auto [variable, path] : {std::pair{&env::kTlsCa, &o.tls.ca},
                                std::pair{&env::kTlsCert, &o.tls.cert},
                                std::pair{&env::kTlsKey, &o.tls.key}}) {
    if (!path->empty() && !o.agent)
      out.push_back(env::Assign(*variable, *path));
  }
  out.push_back(env::Assign(env::kJobId, o.job_id));
  for (std::string& assignment : checkpoint::ToEnvironment(o.checkpoint)) {
    out.push_back(std::move(assignment));
  }
  out.push_back(env::Assign(env::kMinWorkers, absl::StrCat(o.min_workers)));
  out.push_back(env::Assign(env::kMaxWorkers, absl::StrCat(o.max_workers)));
  if (o.settle_ms > 0) {
    out.push_back(env::Assign(env::kSettleMs, absl::StrCat(o.settle_ms)));
  }
  // The worker's index on this node: a CUDA worker's device is
  // cuda:<local rank> (see Note [Worker device] in worker/device.h). torchrun's
  // names too, for programs written against them.
  out.push_back(env::Assign(env::kLocalRank, absl::StrCat(w.index)));
  out.push_back(absl::StrCat("LOCAL_RANK=", w.index));
  out.push_back(absl::StrCat("LOCAL_WORLD_SIZE=", o.nproc));
  out.push_back(env::Assign(env::kRestartCount, absl::StrCat(w.restarts)));
  // The agent reports the worker's exit under this id (see Note [Exited
  // workers] in coordinator/core/core.h).
  out.push_back(env::Assign(env::kWorkerId, w.id));
  out.push_back(env::Assign(env::kCommHost, o.comm_host));
  if (!o.node_id.empty()) out.push_back(env::Assign(env::kNodeId, o.node_id));
  out.push_back(env::Assign(env::kHeartbeatIntervalMs,
                            absl::StrCat(o.heartbeat_interval_ms)));
  out.push_back(env::Assign(env::kHeartbeatTimeoutMs,
                            absl::StrCat(o.heartbeat_timeout_ms)));
  out.push_back(env::Assign(env::kRendezvousTimeoutMs,
                            absl::StrCat(o.rendezvous_timeout_ms)));
  out.push_back(env::Assign(env::kCollectiveTimeoutMs,
                            absl::StrCat(o.collective_timeout_ms)));
  out.push_back(
      env::Assign(env::kHangTimeoutMs, absl::StrCat(o.hang_timeout_ms)));
  out.push_back(env::Assign(env::kStragglers, o.stragglers));
  out.push_back(env::Assign(env::kStragglerCooldownMs,
                            absl::StrCat(o.straggler_cooldown_ms)));
  if (!o.trace_parts.empty()) {
    out.push_back(env::Assign(env::kTraceFile,
                              absl::StrCat(o.trace_parts, "/worker-", w.index,
                                           "-run-", w.restarts, ".json")));
  }
  if (!o.history.empty()) {
    out.push_back(env::Assign(env::kHistoryFile,
                              absl::StrCat(o.history, "/", w.id, ".history")));
  }
  return out;
}

// Forks and execs one run of local worker `index`, its stdout and stderr
// read by concord-run. Signals blocked in the parent are unblocked in the
// child; the child dies with the parent.
std::unique_ptr<Worker> Spawn(const Options& o, const std::string& coordinator,
                              int index, int restarts,
                              const sigset_t& child_mask) {
  auto w = std::make_unique<Worker>();
  w->index = index;
  w->restarts = restarts;
  w->id = WorkerId(o, index, restarts);
  const ChildEnds ends = OpenStreams(o, *w);
  std::vector<std::string> env = WorkerEnv(o, coordinator, *w);
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
    Say(absl::StrCat("fork: ", std::strerror(errno)));
    std::exit(1);
  }
  if (pid == 0) {
    // Only async-signal-safe calls between fork and exec.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(1);
    sigprocmask(SIG_SETMASK, &child_mask, nullptr);
    signal(SIGPIPE, SIG_DFL);  // concord-run ignores it; its workers do not
    dup2(ends.out, STDOUT_FILENO);
    dup2(ends.err, STDERR_FILENO);
    execvpe(argvp[0], argvp.data(), envp.data());
    const char* parts[] = {"concord-run: cannot run '", argvp[0],
                           "': ", strerror(errno), "\n"};
    for (const char* part : parts) {
      (void)!write(STDERR_FILENO, part, strlen(part));
    }
    _exit(127);
  }
  close(ends.out);
  close(ends.err);
  w->pid = pid;
  w->started = absl::Now();
  return w;
}

int StatusOf(int wait_status) {
  if (WIFEXITED(wait_status)) return WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) return 128 + WTERMSIG(wait_status);
  return 1;
}

// "exit status 3", "killed by signal 9 (SIGKILL)".
std::string How(int wait_status) {
  if (WIFEXITED(wait_status)) {
    return absl::StrCat("exit status ", WEXITSTATUS(wait_status));
  }
  if (WIFSIGNALED(wait_status)) {
    const int sig = WTERMSIG(wait_status);
    const char* abbrev = sigabbrev_np(sig);
    return absl::StrCat(
        "killed by signal ", sig,
        abbrev == nullptr ? "" : absl::StrCat(" (SIG", abbrev, ")"),
        WCOREDUMP(wait_status) ? ", core dumped" : "");
  }
  return absl::StrCat("wait status ", wait_status);
}

std::string Seconds(absl::Duration d) {
  return absl::StrFormat("%.1f s", absl::ToDoubleSeconds(d));
}

// The death report of a failed run, when it is reaped. `ended`: why the
// job will not have it back (the job failed or was stopped), else empty.
void ReportDeath(const Options& o, const Worker& w, bool restart,
                 const std::string& ended) {
  std::string text = absl::StrFormat(
      "worker %d (pid %d, worker id %s) failed after %s: %s; ", w.index, w.pid,
      w.id, Seconds(w.ended - w.started), How(*w.wait_status));
  if (restart) {
    absl::StrAppend(&text, "restarting it (restart ", w.restarts + 1, " of ",
                    o.max_restarts, ")");
  } else if (!ended.empty()) {
    absl::StrAppend(&text, "not restarting it (", ended, ")");
  } else {
    absl::StrAppend(&text, "not restarting it (--max-restarts ", o.max_restarts,
                    ")");
  }
  const std::vector<std::string> tail = StderrTail(w, kReportLines);
  if (tail.empty()) {
    absl::StrAppend(&text, "; it wrote nothing on stderr");
  } else {
    absl::StrAppend(&text, "; the last ", tail.size(),
                    " line(s) of its stderr:");
    for (const std::string& line : tail) absl::StrAppend(&text, "\n  ", line);
  }
  Say(text);
}

bool Terminal(v1::JobState state) {
  return state == v1::JOB_STATE_SUCCEEDED || state == v1::JOB_STATE_FAILED ||
         state == v1::JOB_STATE_STOPPED;
}

// One Supervisor::Run: every run of every local worker, what became of
// them, and concord-run's exit status from that and the job's word.
class Supervision {
 public:
  explicit Supervision(const Supervisor& s) : s_(s), o_(s.options) {}

  int Run() {
    for (int i = 0; i < o_.nproc; ++i) {
      workers_.push_back(Spawn(o_, s_.coordinator, i, 0, s_.child_mask));
    }
    for (;;) {
      const size_t count = workers_.size();  // not the restarts Reap adds
      for (size_t i = 0; i < count; ++i) Reap(i);
      const Tally tally = Count();
      if (tally.all_done) break;
      StopBelowMinWorkers(tally);
      if (terminating_ && absl::Now() > kill_at_) {
        TerminateAll(SIGKILL);
        kill_at_ = absl::InfiniteFuture();
      }
      PollOutputAndSignals();
    }
    return ExitStatus();
  }

 private:
  struct Tally {
    bool all_done = true;   // every run reaped, its output drained
    bool finished = false;  // a worker is done training: so is the job
    int alive = 0;          // local workers still running
  };

  void TerminateAll(int sig) {
    for (auto& w : workers_) {
      if (!w->wait_status) kill(w->pid, sig);
    }
  }

  // Why a failed run is not restarted whatever the restarts left: the job
  // failed or was stopped (a new process would start it again: see Note
  // [Starting again] in coordinator/core/core.h; running the command again
  // does that). Empty otherwise.
  std::string JobEnded() const {
    if (!s_.job_word) return "";
    const JobWord word = s_.job_word();
    if (word.state == v1::JOB_STATE_FAILED) return "the job failed";
    if (word.state == v1::JOB_STATE_STOPPED) return "the job was stopped";
    return "";
  }

  // Reaps workers_[i] if it ended; reports a death; restarts a failed run
  // while restarts are left.
  void Reap(size_t i) {
    Worker& w = *workers_[i];
    if (w.wait_status) return;
    int status = 0;
    if (waitpid(w.pid, &status, WNOHANG) != w.pid) return;
    w.wait_status = status;
    w.ended = absl::Now();
    // First, so that the others re-form at once (see Note [Exited workers]).
    if (s_.agent != nullptr) s_.agent->WorkerExited(w.id, How(status));
    Drain(w);  // what it wrote before it died
    if (StatusOf(status) == 0) return;
    if (terminating_) {  // concord-run was stopping it: one line
      Say(absl::StrFormat(
          "worker %d (pid %d, worker id %s) ended after %s: %s (being "
          "stopped)",
          w.index, w.pid, w.id, Seconds(w.ended - w.started), How(status)));
      return;
    }
    lost_.push_back(&w);
    const std::string ended = JobEnded();
    const bool restart = w.restarts < o_.max_restarts && ended.empty();
    ReportDeath(o_, w, restart, ended);
    if (restart) {
      w.restarted = true;
      workers_.push_back(
          Spawn(o_, s_.coordinator, w.index, w.restarts + 1, s_.child_mask));
    } else if (!first_failure_) {
      first_failure_ = i;
    }
  }

  Tally Count() const {
    Tally t;
    for (const auto& w : workers_) {
      t.all_done =
          t.all_done && w->wait_status && w->out.fd < 0 && w->err.fd < 0;
      if (!w->wait_status) ++t.alive;
      if (w->wait_status && StatusOf(*w->wait_status) == 0) t.finished = true;
    }
    return t;
  }

  // A worker that failed for good: the others go on while the job can still
  // have min_workers members (with more workers elsewhere, the coordinator
  // decides; its rendezvous timeout ends the job).
  void StopBelowMinWorkers(const Tally& t) {
    if (!first_failure_ || terminating_ || t.finished || t.alive == 0 ||
        t.alive >= o_.min_workers || !o_.standalone) {
      return;
    }
    Say(absl::StrCat(t.alive, " worker(s) left, fewer than --min-workers ",
                     o_.min_workers, ": the job cannot go on; stopping them"));
    terminating_ = below_min_ = true;
    TerminateAll(SIGTERM);
    kill_at_ = absl::Now() + absl::Seconds(5);
  }

  // Up to 100 ms: the workers' output passed on; SIGINT or SIGTERM passed
  // to them (SIGKILL 10 s later); SIGCHLD only wakes the loop.
  void PollOutputAndSignals() {
    std::vector<pollfd> fds;
    std::vector<std::pair<Worker*, Stream*>> owners;
    for (auto& w : workers_) {
      for (Stream* s : {&w->out, &w->err}) {
        if (s->fd < 0) continue;
        fds.push_back({s->fd, POLLIN, 0});
        owners.emplace_back(w.get(), s);
      }
    }
    fds.push_back({s_.signal_fd, POLLIN, 0});
    poll(fds.data(), fds.size(), 100);
    for (size_t i = 0; i < owners.size(); ++i) {
      if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) {
        Pump(*owners[i].first, *owners[i].second);
      }
    }
    if (!(fds.back().revents & POLLIN)) return;
    signalfd_siginfo info;
    if (read(s_.signal_fd, &info, sizeof(info)) != sizeof(info) ||
        info.ssi_signo == SIGCHLD) {
      return;
    }
    Say(absl::StrCat("got signal ", info.ssi_signo, "; stopping workers"));
    interrupted_ = static_cast<int>(info.ssi_signo);
    TerminateAll(interrupted_);
    if (!terminating_) {
      terminating_ = true;
      kill_at_ = absl::Now() + absl::Seconds(10);
    }
  }

  // See Note [Exit status].
  int ExitStatus() const {
    if (s_.agent != nullptr) s_.agent->AwaitExitReports(kExitAnswers);
    const JobWord word = s_.job_word ? s_.job_word() : JobWord{};
    const v1::JobState state = word.state.value_or(v1::JOB_STATE_UNSPECIFIED);
    std::vector<std::string> names;
    for (const Worker* w : lost_) {
      names.push_back(absl::StrFormat("worker %d (%s: %s%s)", w->index, w->id,
                                      How(*w->wait_status),
                                      w->restarted ? "; restarted" : ""));
    }
    const std::string lost_text = absl::StrJoin(names, ", ");
    const int failed_status =
        first_failure_ ? StatusOf(*workers_[*first_failure_]->wait_status) : 0;
    const std::string& job = o_.job_id;
    if (state == v1::JOB_STATE_SUCCEEDED || word.completed) {
      if (!lost_.empty()) {
        Say(absl::StrCat(
            "job ", job,
            " completed; worker run(s) lost on the way: ", lost_text));
      }
      return 0;
    }
    if (interrupted_ != 0) return 128 + interrupted_;
    if (state == v1::JOB_STATE_FAILED || state == v1::JOB_STATE_STOPPED) {
      Say(absl::StrCat(
          "job ", job,
          state == v1::JOB_STATE_FAILED ? " failed" : " was stopped",
          word.failure.empty() ? "" : ": ", word.failure,
          lost_.empty() ? "" : "; worker run(s) lost: ", lost_text));
      return failed_status != 0 ? failed_status : 1;
    }
    if (!first_failure_) {
      if (!lost_.empty()) {
        Say(absl::StrCat(
            "every local worker's last run exited 0; worker run(s) lost on "
            "the way: ",
            lost_text));
      }
      return 0;
    }
    const Worker& failed = *workers_[*first_failure_];
    std::vector<std::string> why;
    if (below_min_) why.push_back("below --min-workers");
    if (!Terminal(state) && state != v1::JOB_STATE_UNSPECIFIED) {
      why.push_back(
          absl::StrCat("the coordinator says ", v1::JobState_Name(state)));
    }
    why.push_back(absl::StrCat("worker run(s) lost: ", lost_text));
    Say(absl::StrCat(
        "job ", job, " did not complete here: ", absl::StrJoin(why, "; "),
        "; exit status ", failed_status, " (worker ", failed.index, "'s)"));
    return failed_status;
  }

  const Supervisor& s_;
  const Options& o_;
  std::vector<std::unique_ptr<Worker>> workers_;  // every run, in start order
  std::vector<const Worker*> lost_;               // failed runs, death order
  std::optional<size_t> first_failure_;           // failed for good (index)
  int interrupted_ = 0;                           // the signal that stopped us
  bool terminating_ = false;
  bool below_min_ = false;
  absl::Time kill_at_ = absl::InfiniteFuture();
};

}  // namespace

int Supervisor::Run() { return Supervision(*this).Run(); }

}  // namespace concord::launcher
