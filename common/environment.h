#pragma once
// The CONCORD_* environment variables, in one table: each one's name, type,
// default, meaning and who sets it. The worker library reads them only
// through it (WorkerOptions::FromEnvironment, checkpoint::FromEnvironment,
// concord-train's test hooks), concord-run writes its workers' environment
// through it, and `concord-run --env` prints it: docs/cli.md is generated
// from that output and ctest's cli_reference test fails when they differ.
//
// Under concord-run a job reaches its workers in these variables; without
// CONCORD_COORDINATOR a program runs alone (world size 1, an in-process
// store), which is what a plain `concord-train ...` does.

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/job_defaults.h"

namespace concord::env {

enum class SetBy {
  kLauncher,  // concord-run sets it for each worker (its own value is not
              // passed on)
  kUser,      // the user's: concord-run passes it on to its workers
  kTest,      // a test hook, passed on like kUser
  kDirect,    // for a program run without concord-run: not passed on
};

struct Variable {
  absl::string_view name;
  absl::string_view type;  // as the table prints it
  // An integer variable (the others are text): its default and range.
  bool integer = false;
  int64_t int_default = 0;
  int64_t int_min = 0;
  int64_t int_max = 0;
  // A text variable's default, or how a default that is not a constant is
  // made ("the hostname"); empty: none.
  absl::string_view default_text;
  absl::string_view meaning;
  SetBy set_by = SetBy::kLauncher;
};

inline constexpr int64_t kNoMax = std::numeric_limits<int64_t>::max();

constexpr Variable Text(absl::string_view name, absl::string_view type,
                        absl::string_view default_text,
                        absl::string_view meaning, SetBy set_by) {
  return Variable{name, type, false, 0, 0, 0, default_text, meaning, set_by};
}

constexpr Variable Int(absl::string_view name, absl::string_view type,
                       int64_t int_default, int64_t min, int64_t max,
                       absl::string_view meaning, SetBy set_by,
                       absl::string_view default_text = "") {
  return Variable{name, type,         true,    int_default, min,
                  max,  default_text, meaning, set_by};
}

// The job.
inline constexpr Variable kCoordinator =
    Text("CONCORD_COORDINATOR", "HOST:PORT", "none: run alone",
         "the coordinator (or node agent: unix:PATH) the worker joins through",
         SetBy::kLauncher);
inline constexpr Variable kJobId = Text("CONCORD_JOB_ID", "text", "default",
                                        "the job's name", SetBy::kLauncher);
inline constexpr Variable kMinWorkers =
    Int("CONCORD_MIN_WORKERS", "count", 1, 1, kNoMax,
        "fewest members the job trains with", SetBy::kLauncher);
inline constexpr Variable kMaxWorkers =
    Int("CONCORD_MAX_WORKERS", "count", 0, 1, kNoMax,
        "most members the job admits (at least CONCORD_MIN_WORKERS)",
        SetBy::kLauncher, "CONCORD_MIN_WORKERS");
inline constexpr Variable kSettleMs =
    Int("CONCORD_SETTLE_MS", "milliseconds", 0, 0, kNoMax,
        "with fewer than the most waiting, form a generation once none arrived "
        "for this long (0: the coordinator's default)",
        SetBy::kLauncher);
inline constexpr Variable kHeartbeatIntervalMs = Int(
    "CONCORD_HEARTBEAT_INTERVAL_MS", "milliseconds",
    kDefaultHeartbeatIntervalMs, 1, kNoMax,
    "how often the worker tells the coordinator it is alive", SetBy::kLauncher);
inline constexpr Variable kHeartbeatTimeoutMs =
    Int("CONCORD_HEARTBEAT_TIMEOUT_MS", "milliseconds",
        kDefaultHeartbeatTimeoutMs, 1, kNoMax,
        "a worker silent this long is dropped (must exceed the interval)",
        SetBy::kLauncher);
inline constexpr Variable kHangTimeoutMs =
    Int("CONCORD_HANG_TIMEOUT_MS", "milliseconds", 0, -1, kNoMax,
        "a member that holds the others up while making no progress of its "
        "own is taken out after this long (0: derived from the job's step "
        "times; -1: never)",
        SetBy::kLauncher);
inline constexpr Variable kStragglers =
    Text("CONCORD_STRAGGLERS", "report|evict", "report",
         "what is done with a straggler: named only, or also taken out while "
         "the job is faster without it",
         SetBy::kLauncher);
inline constexpr Variable kStragglerCooldownMs =
    Int("CONCORD_STRAGGLER_COOLDOWN_MS", "milliseconds",
        kDefaultStragglerCooldownMs, 1, kNoMax,
        "an evicted straggler may join again after this long (doubled at "
        "each later eviction)",
        SetBy::kLauncher);
inline constexpr Variable kRendezvousTimeoutMs =
    Int("CONCORD_RENDEZVOUS_TIMEOUT_MS", "milliseconds",
        kDefaultRendezvousTimeoutMs, 1, kNoMax,
        "how long a join waits for its generation to form", SetBy::kLauncher);
inline constexpr Variable kCollectiveTimeoutMs =
    Int("CONCORD_COLLECTIVE_TIMEOUT_MS", "milliseconds",
        kDefaultCollectiveTimeoutMs, 1, kNoMax,
        "how long a collective may take before the peers are given up on",
        SetBy::kLauncher);

// This worker.
inline constexpr Variable kWorkerId =
    Text("CONCORD_WORKER_ID", "text", "HOSTNAME-PID",
         "this worker's name, unique in the job", SetBy::kLauncher);
inline constexpr Variable kNodeId =
    Text("CONCORD_NODE_ID", "text", "the hostname",
         "the node the worker runs on (SlowMo's nodes, the node's checkpoint "
         "memory)",
         SetBy::kLauncher);
inline constexpr Variable kLocalRank =
    Int("CONCORD_LOCAL_RANK", "index", -1, 0, kNoMax,
        "the worker's index on its node: a CUDA worker's device is cuda:<local "
        "rank>; concord-run also sets LOCAL_RANK and LOCAL_WORLD_SIZE "
        "(torchrun's names)",
        SetBy::kLauncher, "LOCAL_RANK, else none");
inline constexpr Variable kRestartCount =
    Int("CONCORD_RESTART_COUNT", "count", 0, 0, kNoMax,
        "how often concord-run restarted this local worker (test hooks fire in "
        "the first run only)",
        SetBy::kLauncher);
inline constexpr Variable kCommHost =
    Text("CONCORD_COMM_HOST", "address", "127.0.0.1",
         "the address the worker's communicators listen on", SetBy::kLauncher);
inline constexpr Variable kTokenFile =
    Text("CONCORD_TOKEN_FILE", "path", "",
         "the file holding the worker token (concordctl: the operator token)",
         SetBy::kLauncher);
inline constexpr Variable kToken =
    Text("CONCORD_TOKEN", "text", "",
         "the worker token itself, when CONCORD_TOKEN_FILE is not set",
         SetBy::kDirect);
inline constexpr Variable kTlsCa = Text(
    "CONCORD_TLS_CA", "path", "",
    "PEM CA that signed the coordinator's certificate (TLS)", SetBy::kLauncher);
inline constexpr Variable kTlsCert =
    Text("CONCORD_TLS_CERT", "path", "", "PEM client certificate for mTLS",
         SetBy::kLauncher);
inline constexpr Variable kTlsKey =
    Text("CONCORD_TLS_KEY", "path", "", "PEM private key of CONCORD_TLS_CERT",
         SetBy::kLauncher);
inline constexpr Variable kTraceFile =
    Text("CONCORD_TRACE_FILE", "path", "",
         "write this worker's timeline (Chrome trace-event JSON) to this file",
         SetBy::kLauncher);
inline constexpr Variable kHistoryFile =
    Text("CONCORD_HISTORY_FILE", "path", "",
         "append this worker's history (generations, restores, commits) to "
         "this file",
         SetBy::kLauncher);
inline constexpr Variable kDevice =
    Text("CONCORD_DEVICE", "cpu|cuda|cuda:N", "cpu",
         "the worker's device (cuda: cuda:<local rank>)", SetBy::kUser);
inline constexpr Variable kBackend =
    Text("CONCORD_BACKEND", "gloo|nccl", "by the device",
         "the communicator's backend (nccl on CUDA where built with it)",
         SetBy::kUser);
inline constexpr Variable kSharedMemory =
    Int("CONCORD_SHM", "0|1", 1, 0, 1,
        "allreduce through shared memory among the ranks of one node",
        SetBy::kUser);
inline constexpr Variable kLogLevel = Text(
    "CONCORD_LOG_LEVEL", "level", "info",
    "the library's log level: trace, debug, info, warn, error, critical or off",
    SetBy::kUser);

// Checkpoints (concord-run --checkpoint-*).
inline constexpr Variable kCheckpointDir =
    Text("CONCORD_CHECKPOINT_DIR", "path", "",
         "write checkpoints to DIR/<job id>/step-<N>/ and resume from them",
         SetBy::kLauncher);
inline constexpr Variable kCheckpointEvery =
    Int("CONCORD_CHECKPOINT_EVERY", "steps", 0, 0, kNoMax,
        "a checkpoint at the commit of every step that is a multiple of this "
        "(required with a dir)",
        SetBy::kLauncher);
inline constexpr Variable kCheckpointKeep =
    Int("CONCORD_CHECKPOINT_KEEP", "count", kDefaultCheckpointKeep, 1, kNoMax,
        "complete checkpoints kept on disk", SetBy::kLauncher);
inline constexpr Variable kCheckpointResume = Int(
    "CONCORD_CHECKPOINT_RESUME", "0|1", 1, 0, 1,
    "resume from the newest checkpoint when no member holds the job's state",
    SetBy::kLauncher);
inline constexpr Variable kCheckpointOverlap = Int(
    "CONCORD_CHECKPOINT_OVERLAP", "0|1", 0, 0, 1,
    "copy parameters and optimizer state into the snapshot while the next "
    "step's forward runs (the program writes them only in an optimizer step "
    "after a backward)",
    SetBy::kUser);
inline constexpr Variable kCheckpointMemory =
    Text("CONCORD_CHECKPOINT_MEMORY", "path", "",
         "the node agent's shared-memory file for this node's snapshot",
         SetBy::kLauncher);

// Test hooks.
inline constexpr Variable kTestFault =
    Text("CONCORD_TEST_FAULT", "LOCAL:STEP:POINT:MODULE:N,...", "",
         "programs on the public API kill themselves at a point of a step "
         "(worker/test_fault.h)",
         SetBy::kTest);
inline constexpr Variable kTestCheckpointFault = Text(
    "CONCORD_TEST_CHECKPOINT_FAULT", "STAGE:N", "",
    "concord-run dies at a stage of its N-th checkpoint write", SetBy::kTest);
inline constexpr Variable kTestKill = Text(
    "CONCORD_TEST_KILL", "LOCAL:STEP:PHASE,...", "",
    "concord-train kills itself in a phase of a step (tools/fault_injection.h)",
    SetBy::kTest);
inline constexpr Variable kTestBusy = Text(
    "CONCORD_TEST_BUSY", "LOCAL:STEP:SECONDS", "",
    "concord-train computes for SECONDS before step STEP, outside the step "
    "(tools/fault_injection.h)",
    SetBy::kTest);
inline constexpr Variable kTestAgentLingerMs =
    Int("CONCORD_TEST_AGENT_LINGER_MS", "milliseconds", 0, 0, 10000,
        "concord-run's node agent lingers on gRPC's thread as each node stream "
        "ends, and concord-run waits twice as long before it exits",
        SetBy::kTest);
inline constexpr Variable kTestShardsAsBytes =
    Int("CONCORD_TEST_SHARDS_AS_BYTES", "0|1", 0, 0, 1,
        "a sharded optimizer's checkpoint sends every shard to its node's "
        "snapshot writer (save_checkpoint's: rank 0) as bytes, none copied "
        "or written in place (a benchmark's other side)",
        SetBy::kTest);
inline constexpr Variable kTestCheckpointHoles =
    Int("CONCORD_TEST_CHECKPOINT_HOLES", "0|1|2", 0, 0, 2,
        "save_checkpoint's ranks but 0, with a sharded optimizer: 1 take "
        "rank 0's files as on a filesystem they do not share and send it "
        "their shards' bytes; 2 fail to write their shards into them",
        SetBy::kTest);
inline constexpr Variable kTestMinStepMs =
    Int("CONCORD_TEST_MIN_STEP_MS", "milliseconds", 0, 0, kNoMax,
        "concord-train's steps take at least this long", SetBy::kTest);

// Every variable, in the order the table prints them.
const std::vector<const Variable*>& All();
// The variable called `name`, or null.
const Variable* Find(absl::string_view name);

// The value of `v`, or `fallback` when it is unset (a text variable's
// documented default is the caller's to pass: some are not constants).
std::string Get(const Variable& v, const std::string& fallback = "");
// Whether `v` is set (possibly to the empty string).
bool IsSet(const Variable& v);
// An integer variable into `*out`: its table default when unset or empty,
// INVALID_ARGUMENT naming it when not an integer in its range.
absl::Status GetInt(const Variable& v, int64_t* out);
// The same with a default that is not a constant (CONCORD_MAX_WORKERS's is
// CONCORD_MIN_WORKERS's value) and a least value above the table's.
absl::Status GetInt(const Variable& v, int64_t fallback, int64_t min,
                    int64_t* out);
// CONCORD_LOCAL_RANK into `*out`, else torchrun's LOCAL_RANK, else -1.
absl::Status GetLocalRank(int64_t* out);
// "NAME=value", for an environment block.
std::string Assign(const Variable& v, absl::string_view value);
// Whether concord-run passes a variable of its own environment, "NAME=...",
// on to its workers: those the table says are the user's or a test's.
bool PassedOn(absl::string_view assignment);
// The table as `concord-run --env` prints it.
std::string Table();

}  // namespace concord::env
