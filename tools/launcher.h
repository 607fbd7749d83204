#pragma once
// concord-run's insides (tools/concord_run.cc parses the command line and
// starts the coordinator and the node agent): the workers' output
// (launcher_output.cc) and their supervision, restarts and exit status
// (launcher_supervise.cc).
//
// Each worker's death is reported when concord-run reaps it (SIGCHLD), not
// at the end: one message with the run's pid and worker id, how it ended,
// after how long, whether it is restarted, and the last lines of its
// stderr (read to the end of what the dead process wrote first); one that
// concord-run was stopping gets one line without its stderr. Through
// the agent the coordinator is told at once (see Note [Exited workers] in
// coordinator/core/core.h), so that the survivors re-form without waiting
// for the dead worker's heartbeat timeout.

#include <signal.h>
#include <sys/types.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/job_defaults.h"
#include "common/tls.h"
#include "concord/v1/worker.pb.h"
#include "worker/checkpoint/config.h"

namespace concord::agent {
class NodeAgent;
}

namespace concord::launcher {

// Which of the workers' streams the console shows (--console).
enum ConsoleStreams : int {
  kConsoleNone = 0,
  kConsoleStdout = 1,
  kConsoleStderr = 2,
  kConsoleAll = 3,
};

struct Options {
  bool standalone = false;
  bool agent = true;  // serve the workers as their node agent
  // CONCORD_TEST_AGENT_LINGER_MS (a test hook; see agent::NodeAgentOptions).
  int64_t test_agent_linger_ms = 0;
  std::string coordinator;
  int nproc = 0;
  // --nnodes N or MIN:MAX: the job's size in nodes of `nproc` workers
  // (sets min/max_workers); empty: this node alone.
  std::string nnodes;
  int min_workers = 0;  // 0: nproc (x the nodes of --nnodes)
  int max_workers = 0;  // 0: nproc (x the nodes of --nnodes)
  int max_restarts = 0;
  int64_t settle_ms = 0;  // 0: the coordinator's default
  std::string job_id;
  int64_t heartbeat_interval_ms = kDefaultHeartbeatIntervalMs;
  int64_t heartbeat_timeout_ms = kDefaultHeartbeatTimeoutMs;
  int64_t rendezvous_timeout_ms = kDefaultRendezvousTimeoutMs;
  int64_t collective_timeout_ms = kDefaultCollectiveTimeoutMs;
  int64_t hang_timeout_ms = 0;        // 0: derived; -1: off
  std::string stragglers = "report";  // or "evict"
  int64_t straggler_cooldown_ms = kDefaultStragglerCooldownMs;
  std::string comm_host = "127.0.0.1";
  std::string node_id;  // empty: the workers use the hostname
  std::string token_file;
  TlsFiles tls;  // towards --coordinator; passed on to the workers
  // What --token-file and --tls-* hold, read once by ParseArgs (with
  // --coordinator; empty with --standalone).
  ClientCredentials credentials;
  std::string trace;        // --trace FILE
  std::string trace_parts;  // the workers' trace files go here
  std::string history;      // --history DIR
  std::string log_dir;      // --log-dir DIR (see Note [Worker output])
  int console = kConsoleAll;
  // --checkpoint-* (see Note [Checkpoints] in
  // worker/checkpoint/checkpointer.h); `memory` is the node's snapshot region
  // concord-run made.
  checkpoint::Config checkpoint;
  std::vector<std::string> program;
};

// Prints "concord-run: MESSAGE" and exits 2.
[[noreturn]] void UsageError(const std::string& message);

// --log-dir: makes DIR and its worker-I folders; a usage error when DIR
// cannot be written or already holds logs (see Note [Worker output]).
void PrepareLogDir(const Options& o);

// concord-run's own message: "concord-run: " + `message` on stderr, in one
// write, starting a line of its own on a terminal.
void Say(absl::string_view message);

// Note [Worker output]
// ~~~~~~~~~~~~~~~~~~~~
// concord-run reads both standard streams of every worker run and passes each
// complete line on, prefixed "[worker I] " (I the local index; a restarted
// worker keeps its index), to its own stdout or stderr as the worker wrote it;
// a line goes out in one write(2), so lines of different workers (and
// concord-run's own messages) never mix within a line. A line still open when a
// run ends is passed on then; one longer than 64 KiB is passed on in pieces.
// With --log-dir DIR each run's bytes go as they are, unprefixed and at
// once, to
//   DIR/worker-I/run-R/stdout.log and stderr.log
// (R = 0 for the first run of local worker I, 1 for its first restart, ...;
// as torchrun keeps each attempt apart). DIR is made if missing; a DIR
// that already holds a worker-I folder (an earlier run's logs) or cannot
// be written is a usage error, before anything starts. --console picks what
// the terminal still gets (all, stdout, stderr or none, like torchrun's
// --tee); hiding a stream needs --log-dir, so output is never lost. On a
// terminal every line starts by going back to the line's start and erasing
// it, and a worker whose stdout concord-run shows on a terminal gets a
// pseudo-terminal as stdout: a progress bar it redraws in place ('\r') is
// redrawn in place behind its prefix, and its stdio stays line-buffered,
// as it would be on the terminal itself. A console that goes away (a
// closed pipe) stops being written to; the workers and the log files go
// on. The last 20 lines of each run's stderr are kept for its death report.

// One of a worker run's standard streams as concord-run reads it.
struct Stream {
  int fd = -1;            // read end (pipe or pseudo-terminal); -1 at its end
  bool terminal = false;  // a pseudo-terminal: '\r' redraws in place
  int console = -1;       // 1 or 2: shown there; -1: not shown
  int file = -1;          // its log file, or -1
  std::string path;       // of the log file
  std::string partial;    // bytes after the last newline
  bool keep_tail = false;
  std::deque<std::string> tail;  // its last lines (stderr)
};

// One run of a local worker.
struct Worker {
  int index = 0;
  int restarts = 0;  // how many runs of this local worker came before
  pid_t pid = -1;
  std::string id;  // CONCORD_WORKER_ID
  Stream out, err;
  absl::Time started;
  absl::Time ended;
  std::optional<int> wait_status;  // once reaped
  bool restarted = false;          // a next run of it was started
};

// The streams of a run about to be forked: the child's ends, dup'ed onto
// its fd 1 and 2, closed in concord-run once it forked.
struct ChildEnds {
  int out = -1;
  int err = -1;
};

// Makes the run's streams (pipes, or a pseudo-terminal for a stdout shown
// on a terminal) and, with --log-dir, its folder and log files; `w`'s
// index and restarts are set. Exits 1 when a pipe cannot be made.
ChildEnds OpenStreams(const Options& o, Worker& w);
// Reads what is there (non-blocking) and passes it on (see Note [Worker
// output]); at the stream's end, its last partial line too, and closes it.
void Pump(const Worker& w, Stream& s);
// Everything a dead run wrote first (its pipes' contents): Pump until
// nothing is left to read now.
void Drain(Worker& w);
// The run's last lines of stderr, its open partial line included.
std::vector<std::string> StderrTail(const Worker& w, size_t lines);

// Note [Exit status]
// ~~~~~~~~~~~~~~~~~~
// concord-run exits 0 when the job completed, and non-zero when it did not;
// "completed" is the job's state, not the local exit codes. It asks, once its
// last local worker is done:
//  - the embedded coordinator with --standalone;
//  - through the node agent (the default), what the coordinator's answers
//    to its workers said: the state in heartbeat, Leave and exit-report
//    answers and in membership views (agent::NodeAgent::JobNews), and
//    whether a local worker's Leave(COMPLETED) was accepted (its training
//    finished with the rest of the job's, even if the job's last members
//    have not left yet). concord-run waits up to 2 s for the answers to its
//    exit reports, which carry the job's state after each death.
// Then:
//  1. the job SUCCEEDED, or a local worker completed: exit 0, with a summary
//     line naming the local worker runs lost on the way (failed, restarted
//     or not), if any;
//  2. concord-run was stopped by a signal S: 128+S;
//  3. the job FAILED or was STOPPED: the status of the first local worker
//     that failed for good (128+N for signal N), else 1, after a line saying
//     why;
//  4. otherwise (the job goes on elsewhere, this node lost its workers; or
//     no word: --no-agent with --coordinator, a program that never joined):
//     0 when the last run of every local worker exited 0 (say the node's
//     workers ran out of data and left), else the status of the first local
//     worker that failed for good; with --standalone below --min-workers
//     (concord-run stopped the others) that worker's status too.
// Last, with checkpoints: when this node's concord-run writes them and the
// newest snapshot's write failed (none written since; a full or read-only
// disk), it says which step was not written and where, and a status of 0
// becomes 1: a job that completed without its last checkpoint is no success.
// So a node whose workers all died while other nodes finish the job exits
// non-zero (its part was lost: an orchestrator may start it again, and its
// new workers join the running job), and one that lost a worker but whose
// other workers finished training with the job exits 0. Usage errors exit
// 2 before any worker starts.

// What concord-run knows of the job's state (see Note [Exit status]).
struct JobWord {
  std::optional<v1::JobState> state;
  std::string failure;
  bool completed = false;  // a local worker's Leave(COMPLETED) was accepted
};

struct Supervisor {
  const Options& options;
  std::string coordinator;  // what the workers dial
  sigset_t child_mask;      // the signal mask the workers start with
  int signal_fd = -1;       // SIGINT, SIGTERM, SIGCHLD
  agent::NodeAgent* agent;  // null with --no-agent
  std::function<JobWord()> job_word;

  // Starts the workers and supervises them until all are done; returns
  // concord-run's exit status (see Note [Exit status]).
  int Run();
};

}  // namespace concord::launcher
