#pragma once
// The Node streams of the node's jobs at the node agent (see Note [Node
// agents] in node_agent.h), one a job, and all that rides them: the workers'
// Join and WatchMembership calls, their heartbeats (batched, see Note
// [Heartbeat batching] in heartbeat_batcher.h, and sent by a flusher thread
// of its own with what the agent sees of their processes, see Note [What the
// agent sees] in process_view.h), concord-run's exit and checkpoint reports,
// and what the coordinator's answers say of each job. The agent's server
// (node_agent_impl.h) checks its callers and hands these calls here; the
// streams open on the CoordinatorReplicas it shares. Not installed; not for
// use elsewhere.

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "agent/coordinator_replicas.h"
#include "agent/heartbeat_batcher.h"
#include "agent/node_agent.h"
#include "agent/process_view.h"
#include "concord/v1/agent.grpc.pb.h"
#include "concord/v1/worker.grpc.pb.h"

namespace concord::agent {

// gRPC operations decided under the streams' mutex run after it is
// released: gRPC may run a reaction inline on the thread that starts an
// operation, and reactions take the mutex.
class Actions {
 public:
  Actions() = default;
  Actions(const Actions&) = delete;
  Actions& operator=(const Actions&) = delete;
  ~Actions() { Run(); }
  void Run() {
    std::vector<std::function<void()>> fns = std::move(fns_);
    fns_.clear();
    for (auto& fn : fns) fn();
  }
  void Add(std::function<void()> fn) { fns_.push_back(std::move(fn)); }

 private:
  std::vector<std::function<void()>> fns_;
};

class NodeStreams {
 public:
  // `replicas` must outlive this.
  NodeStreams(const NodeAgentOptions& options, CoordinatorReplicas* replicas);
  NodeStreams(const NodeStreams&) = delete;
  NodeStreams& operator=(const NodeStreams&) = delete;

  // Starts the flusher thread.
  void Start();
  // Shutdown, before the server stops: no new work, pending heartbeats
  // answered UNAVAILABLE, streams cancelled, the flusher joined. False when
  // it was stopped already.
  bool Stop();
  // Shutdown, after the server stopped: cancels the streams opened since,
  // waits for every stream to end, and deletes them (see Note [Where gRPC
  // objects end] in node_agent_impl.h).
  void Drain();

  // The workers' calls, from callers the server checked: `caller` is the
  // outcome of that check (not OK ends the call with it).
  grpc::ServerUnaryReactor* Join(const grpc::Status& caller,
                                 const v1::JoinRequest* request,
                                 v1::JoinResponse* response);
  grpc::ServerWriteReactor<v1::MembershipUpdate>* Watch(
      const grpc::Status& caller, const v1::WatchMembershipRequest* request);
  // A heartbeat with a job, answered through `reactor` once the coordinator
  // answered it on its job's stream.
  void Heartbeat(const v1::HeartbeatRequest* request,
                 v1::HeartbeatResponse* response,
                 grpc::ServerUnaryReactor* reactor);
  // A Leave the server passed on was accepted (the job's news).
  void Left(const v1::LeaveRequest& request, const v1::LeaveResponse& response);

  // As NodeAgent's.
  bool WorkerExited(const std::string& worker_id, const std::string& how);
  void CheckpointReported(const std::string& job_id,
                          const v1::CheckpointReport& report,
                          int64_t writer_pid);
  bool AwaitWrites(absl::Duration timeout);
  bool AwaitExitReports(absl::Duration timeout);
  NodeAgent::JobNews job_news(const std::string& job_id);
  // Its counters; `forwarded` counts the Joins sent.
  NodeAgent::Counters counters() const;

 private:
  class JoinCall;
  class WatchCall;
  class NodeStream;
  struct PendingHeartbeat {
    const v1::HeartbeatRequest* request;
    v1::HeartbeatResponse* response;
    grpc::ServerUnaryReactor* reactor;
  };

  // Cancels every open node stream (Stop, Drain).
  void CancelStreams();
  // With mu_ held: the node stream of `job_id`, opened if there is none.
  NodeStream* StreamFor(const std::string& job_id, Actions* after);

  // With mu_ held: the coordinator said `state` (and `failure`) of
  // `job_id`; a terminal state already heard is kept.
  void Heard(const std::string& job_id, v1::JobState state,
             const std::string& failure = "");
  // With mu_ held: an exit report was answered, or lost with its stream.
  void ExitAnswered() {
    --exits_pending_;
    exits_cv_.notify_all();
  }

  void FlushLoop();
  // With mu_ held, as the flusher passes on `request` of `worker_id` at
  // `now`: what the agent sees of its process (see Note [What the agent
  // sees]), which is heard from now.
  std::optional<v1::ProcessView> ViewOf(const std::string& worker_id,
                                        const v1::HeartbeatRequest& request,
                                        absl::Time now);
  // With `lock` (on mu_) held, on the flusher: reports the workers whose
  // heartbeats are late on their jobs' streams (see Note [What the agent
  // sees]); whether it sent any (`lock` was released meanwhile). The next
  // check is an interval later.
  bool ReportLate(absl::Time now, std::unique_lock<std::mutex>& lock);
  // How long a worker's heartbeats may be late and the agent still reports
  // its process: past the coordinator's default heartbeat timeout, a worker
  // is out of its generation anyway.
  static constexpr absl::Duration kReportLateFor = absl::Seconds(60);
  // With `lock` (on mu_) held, on one of the agent's own threads: deletes the
  // ended node streams and drops the retired replicas, outside the mutexes
  // (see Note [Where gRPC objects end]); `lock` is held again after.
  void ReleaseEnded(std::unique_lock<std::mutex>& lock);

  const BatchPolicy policy_;
  // Test hook: see NodeAgentOptions::test_linger.
  const absl::Duration test_linger_;
  CoordinatorReplicas* const replicas_;

  std::mutex mu_;
  std::condition_variable cv_;  // the batcher's due time moved, or stopping
  bool stopping_ = false;
  HeartbeatBatcher<PendingHeartbeat> batcher_;
  std::map<std::string, NodeStream*> streams_;  // by job; open ones only
  uint64_t next_join_ = 0;                      // JoinCall ids
  int live_streams_ = 0;                        // not yet ended
  std::vector<NodeStream*> ended_streams_;      // to delete (not on gRPC's)
  std::condition_variable drained_;             // live_streams_ fell
  std::thread flusher_;
  // See Note [Exited workers]: the job and secret of each worker whose Join the
  // coordinator accepted through this agent, until its exit is reported.
  struct Known {
    std::string job_id;
    std::string secret;
  };
  std::map<std::string, Known> known_;
  std::map<std::string, NodeAgent::JobNews> news_;  // by job
  // See Note [What the agent sees]: each worker whose heartbeats carried its
  // pid, its job, and when the flusher last passed one on.
  struct Beating {
    std::string job_id;
    int64_t pid = 0;
    absl::Time at;
  };
  std::map<std::string, Beating> heard_;
  // See Note [One job's checkpoints] in coordinator/core/core.h: the workers
  // of each job whose calls this agent passed on, with their secrets and
  // (once a heartbeat carried it) pids, in the order first seen (or seen
  // with a new secret or pid); kept past their exit (a snapshot's report may
  // come after its writer is gone), at most kMaxVouchers a job. A checkpoint
  // report carries the credential of its snapshot's writer, or the last seen
  // of its job.
  struct Voucher {
    std::string worker_id;
    std::string secret;
    int64_t pid = 0;
  };
  static constexpr size_t kMaxVouchers = 64;
  std::map<std::string, std::vector<Voucher>> vouchers_;  // by job
  // With mu_ held.
  void Vouch(const std::string& job_id, const std::string& worker_id,
             const std::string& secret, int64_t pid);
  ProcessWatch processes_;
  absl::Time next_late_check_ = absl::InfinitePast();
  uint64_t next_exit_ = 0;            // ExitedWorker ids
  int exits_pending_ = 0;             // sent, not yet answered
  std::condition_variable exits_cv_;  // exits_pending_ fell

  std::atomic<int64_t> heartbeats_{0}, batches_{0}, node_streams_{0},
      node_updates_{0}, joins_{0}, exits_{0};
};

}  // namespace concord::agent
