#pragma once
// A node agent: serves the node's workers the coordinator's WorkerService on
// a local socket and carries their calls to the coordinator over one
// connection (concord-run, unless --no-agent).
//
// The agent that launched its workers (concord-run) also tells the
// coordinator the moment one of them exits (WorkerExited: it reaped the
// process), on the job's Node stream with the secret of the worker's own
// accepted Join, so that the job re-forms without it at once rather than
// after its heartbeat timeout (see Note [Exited workers] in
// coordinator/core/core.h). And it remembers what the coordinator said of
// each job in its answers (JobNews), which is how concord-run knows whether
// the job completed when its workers are done (see Note [Exit status] in
// tools/launcher.h).
//
// Errors reach the worker as the coordinator gave them; a coordinator the
// agent cannot reach is UNAVAILABLE (the worker's client retries, and the
// agent moves to the next replica of a replicated coordinator).

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "agent/heartbeat_batcher.h"
#include "common/tls.h"
#include "concord/v1/worker.pb.h"

namespace concord::agent {

struct NodeAgentOptions {
  // The coordinator, as CONCORD_COORDINATOR (common/coordinator_channel.h).
  std::string coordinator;
  // The worker token: workers must present it, and the agent presents it.
  std::string token;
  // TLS towards the coordinator (workers reach the agent locally).
  TlsMaterial tls;
  // Where the workers connect: a gRPC address, "unix:/path" for a node.
  std::string listen;
  BatchPolicy batch;
  // Test hook (CONCORD_TEST_AGENT_LINGER_MS, through concord-run): each node
  // stream's last reaction (OnDone, on gRPC's thread) starts this much late
  // and stays this long after the stream stops counting as live, as a slow
  // thread would (see Note [Where gRPC objects end] in node_agent_impl.h).
  absl::Duration test_linger = absl::ZeroDuration();
};

// Note [Node agents]
// ~~~~~~~~~~~~~~~~~~
// A job of thousands of processes would otherwise hold a connection, a
// membership stream and a heartbeat call an interval per process at the
// coordinator. With an agent per node, the coordinator's load grows with nodes:
//  - Joins, heartbeats and membership views travel on one Node stream per
//    node and job. Heartbeats are batched (see Note [Heartbeat batching] in
//    heartbeat_batcher.h): one message an interval carries the node's
//    workers' heartbeats; each worker gets its own answer. A worker's Join goes
//    out on it (with the others' that arrive while a write is in flight, in one
//    message) and its answer comes back on it; a Join whose worker's call ends
//    first (the process died, its deadline passed) is cancelled there, so the
//    coordinator withdraws the worker as it does a cancelled Join. The agent
//    adds a worker to the stream when its WatchMembership opens and removes it
//    when that call ends; each view is passed on as WatchMembership would have
//    sent it. When the stream ends (the coordinator restarted or moved), the
//    workers' calls on it end with its status (UNAVAILABLE) and the
//    workers retry and reconnect as they would to the coordinator; the
//    agent opens a fresh stream for them.
//  - Leave, KvSet and KvGet are passed on as they are, with the worker's
//    deadline; a worker's call that is cancelled cancels
//    the call the agent made for it.
// The worker's own identity (worker_id, worker_secret) travels inside each
// request and is checked by the coordinator as before; the agent checks
// that its callers hold the worker token and calls with the same token. An
// agent that dies takes its workers with it (concord-run's children die
// with it): their peers' collectives fail and the job re-forms without
// them; their streams on the node stream count as lost, which drops them
// as expected survivors at once (see Note [Re-forming] in
// coordinator/core/core.h). Workers started without an agent talk to the
// coordinator themselves; both kinds mix in one job.

class NodeAgent {
 public:
  // Listens and serves. Errors: INVALID_ARGUMENT (empty coordinator or
  // token), UNAVAILABLE (cannot listen).
  static absl::StatusOr<std::unique_ptr<NodeAgent>> Start(
      NodeAgentOptions options);
  // Shuts down.
  ~NodeAgent();
  NodeAgent(const NodeAgent&) = delete;
  NodeAgent& operator=(const NodeAgent&) = delete;

  // What workers dial (the listen address, with a bound port for TCP).
  const std::string& address() const;

  // Ends every call (pending heartbeats UNAVAILABLE, streams cancelled) and
  // stops serving. Idempotent.
  void Shutdown();

  // See Note [Exited workers]: the process of worker `worker_id` (a worker of
  // this node's, by the id its launcher gave it in CONCORD_WORKER_ID) has
  // exited, `how` ("killed by signal 9 (SIGKILL)"). If the coordinator
  // accepted a Join of that worker through this agent, the exit goes out at
  // once on its job's Node stream and true is returned; otherwise (it never
  // joined, or the agent is shutting down) nothing goes out. Its answer
  // updates the job's news; a refusal is logged. Thread-safe.
  bool WorkerExited(const std::string& worker_id, const std::string& how);
  // See Note [Checkpoints] in worker/checkpoint/checkpointer.h: concord-run
  // wrote a complete checkpoint of `job_id` (or failed to, or holds a
  // snapshot in memory) of the snapshot process `writer_pid` made; it goes
  // out on the job's Node stream with the credential of that worker, or of
  // the newest of the job's workers whose calls came through this agent
  // (see Note [One job's checkpoints] in coordinator/core/core.h; no
  // answer). Nothing goes out while the agent shuts down, or when no worker
  // of the job ever called through it (logged). Thread-safe.
  void CheckpointReported(const std::string& job_id,
                          const v1::CheckpointReport& report,
                          int64_t writer_pid);
  // Waits until every message queued on a Node stream so far is written
  // (handed to the connection), at most `timeout`; whether all were.
  bool AwaitWrites(absl::Duration timeout);
  // Waits until every exit report sent so far is answered (or its stream
  // ended), at most `timeout`; whether all were.
  bool AwaitExitReports(absl::Duration timeout);

  // What the coordinator said of a job in its answers to this agent's
  // workers: the newest state of a heartbeat answer, a membership view, a
  // Leave answer or an exit report's answer (a terminal state, once heard,
  // is kept), with the failure reason of a view or an exit answer; and
  // whether a worker's Leave(COMPLETED) was accepted (its training finished
  // with the rest of the job's, worker.proto).
  struct JobNews {
    v1::JobState state = v1::JOB_STATE_UNSPECIFIED;  // nothing heard
    std::string failure;
    bool completed = false;
  };
  JobNews job_news(const std::string& job_id) const;

  // What the agent carried so far.
  struct Counters {
    int64_t heartbeats = 0;         // workers' heartbeats carried
    int64_t heartbeat_batches = 0;  // messages that carried them
    int64_t node_streams = 0;       // Node streams opened
    int64_t node_updates = 0;       // NodeUpdates received
    int64_t forwarded = 0;          // calls passed on, Joins included
    int64_t exits = 0;              // exit reports sent
  };
  Counters counters() const;

  class Impl;

 private:
  explicit NodeAgent(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace concord::agent
