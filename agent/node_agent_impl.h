#pragma once
// The node agent's insides (see Note [Node agents] in node_agent.h), shared by
// node_agent.cc (the server, the calls passed on, heartbeat intake,
// shutdown) and node_stream.cc (the Node stream of a job and the workers'
// Join and WatchMembership calls on it). Not installed; not for use
// elsewhere.

#include <google/protobuf/descriptor.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "agent/node_agent.h"
#include "agent/process_view.h"
#include "common/auth.h"
#include "common/coordinator_channel.h"
#include "common/grpc_auth.h"
#include "concord/v1/agent.grpc.pb.h"
#include "concord/v1/worker.grpc.pb.h"

namespace concord::agent {

// gRPC operations decided under the agent's mutex run after it is
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

// Note [Passing calls on]
// ~~~~~~~~~~~~~~~~~~~~~~~
// The agent serves WorkerService to its node's workers. Four methods it
// handles itself (HandledHere): Join and WatchMembership ride the job's node
// stream, Heartbeat is batched, Leave is passed on and its answer read for
// the job's news. Every other method is passed on as bytes: the constructor
// marks it generic, so gRPC hands it to the agent's CallbackGenericService
// (PassOn), which checks the worker token and that the path is one of
// WorkerService's unary methods (from the service's descriptor) and calls the
// coordinator replica in use through a GenericStub with the agent's token and
// the caller's deadline. A unary method added to WorkerService is therefore
// passed on without a line here;
// NodeAgentTest.TheAgentServesEveryWorkerServiceMethod calls every method of
// the descriptor through an agent.
class NodeAgent::Impl final : public v1::WorkerService::CallbackService {
 public:
  explicit Impl(NodeAgentOptions options)
      : options_(std::move(options)),
        pass_on_(this),
        batcher_(options_.batch),
        addresses_(SplitCoordinatorAddress(options_.coordinator)),
        processes_(GpuActivity::Open()) {
    for (const std::string& address : addresses_) {
      replicas_.push_back(MakeReplica(address));
    }
    // See Note [Passing calls on].
    const google::protobuf::ServiceDescriptor* service = Descriptor();
    for (int i = 0; i < service->method_count(); ++i) {
      if (!HandledHere(service->method(i)->name())) MarkMethodGeneric(i);
    }
  }

  absl::Status Listen() {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort(options_.listen, grpc::InsecureServerCredentials(),
                             &port);
    builder.RegisterService(this);
    builder.RegisterCallbackGenericService(&pass_on_);
    server_ = builder.BuildAndStart();
    if (server_ == nullptr) {
      return absl::UnavailableError(
          absl::StrCat("cannot listen on '", options_.listen, "'"));
    }
    address_ = options_.listen;
    if (port > 0 && address_.rfind("unix:", 0) != 0) {
      address_ =
          address_.substr(0, address_.rfind(':') + 1) + std::to_string(port);
    }
    flusher_ = std::thread([this] { FlushLoop(); });
    return absl::OkStatus();
  }

  const std::string& address() const { return address_; }

  void Shutdown();

  bool WorkerExited(const std::string& worker_id, const std::string& how);
  void CheckpointReported(const std::string& job_id,
                          const v1::CheckpointReport& report,
                          int64_t writer_pid);
  bool AwaitWrites(absl::Duration timeout);
  bool AwaitExitReports(absl::Duration timeout);
  JobNews job_news(const std::string& job_id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = news_.find(job_id);
    return it == news_.end() ? JobNews{} : it->second;
  }

  Counters counters() const {
    Counters c;
    c.heartbeats = heartbeats_.load();
    c.heartbeat_batches = batches_.load();
    c.node_streams = node_streams_.load();
    c.node_updates = node_updates_.load();
    c.forwarded = forwarded_.load();
    c.exits = exits_.load();
    return c;
  }

  // WorkerService, as the workers see it.
  grpc::ServerUnaryReactor* Join(grpc::CallbackServerContext* context,
                                 const v1::JoinRequest* request,
                                 v1::JoinResponse* response) override;
  grpc::ServerUnaryReactor* Leave(grpc::CallbackServerContext* context,
                                  const v1::LeaveRequest* request,
                                  v1::LeaveResponse* response) override;
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* context,
                                      const v1::HeartbeatRequest* request,
                                      v1::HeartbeatResponse* response) override;
  grpc::ServerWriteReactor<v1::MembershipUpdate>* WatchMembership(
      grpc::CallbackServerContext* context,
      const v1::WatchMembershipRequest* request) override;

 private:
  class ForwardCall;
  class PassOnCall;
  class JoinCall;
  class WatchCall;
  class NodeStream;

  static const google::protobuf::ServiceDescriptor* Descriptor() {
    return google::protobuf::DescriptorPool::generated_pool()
        ->FindServiceByName(v1::WorkerService::service_full_name());
  }
  // The methods of WorkerService the agent does not pass on as bytes (see
  // Note [Passing calls on]).
  static bool HandledHere(const std::string& method) {
    return method == "Join" || method == "Heartbeat" || method == "Leave" ||
           method == "WatchMembership";
  }
  // The generic service of the methods passed on as bytes.
  class PassOn final : public grpc::CallbackGenericService {
   public:
    explicit PassOn(Impl* impl) : impl_(impl) {}
    grpc::ServerGenericBidiReactor* CreateReactor(
        grpc::GenericCallbackServerContext* context) override;

   private:
    Impl* const impl_;
  };

  struct Replica {
    std::shared_ptr<v1::WorkerService::Stub> worker;
    std::shared_ptr<v1::AgentService::Stub> agent;
    std::shared_ptr<grpc::GenericStub> generic;
    absl::Time created;
  };
  Replica MakeReplica(const std::string& address) const {
    auto channel = CoordinatorChannel(address, options_.tls);
    return Replica{v1::WorkerService::NewStub(channel),
                   v1::AgentService::NewStub(channel),
                   std::make_shared<grpc::GenericStub>(channel), absl::Now()};
  }
  // The replica in use and its index.
  std::pair<Replica, size_t> Current() {
    std::lock_guard<std::mutex> lock(replica_mu_);
    return {replicas_[current_], current_};
  }
  // Replica `used` was UNAVAILABLE: a fresh channel for it if its channel
  // is older than kRefreshChannelAfterMs (see Note [Fresh channels] in
  // common/coordinator_channel.h), and the next replica from now on. The old
  // one is retired, not dropped here (see Note [Where gRPC objects end]).
  void Unavailable(size_t used) {
    std::lock_guard<std::mutex> lock(replica_mu_);
    if (absl::Now() - replicas_[used].created >
        absl::Milliseconds(kRefreshChannelAfterMs)) {
      retired_.push_back(std::move(replicas_[used]));
      replicas_[used] = MakeReplica(addresses_[used]);
    }
    if (used == current_) current_ = (current_ + 1) % replicas_.size();
  }
  void Note(const grpc::Status& status, size_t used) {
    if (status.error_code() == grpc::StatusCode::UNAVAILABLE) Unavailable(used);
  }

  // Whether the caller holds the worker token.
  grpc::Status Authorize(const grpc::CallbackServerContext& context) const {
    const auto& metadata = context.client_metadata();
    auto it = metadata.find("authorization");
    const std::string token =
        it == metadata.end()
            ? std::string()
            : BearerTokenOf(std::string(it->second.data(), it->second.size()));
    if (token.empty() || !ConstantTimeEquals(token, options_.token)) {
      return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                          "this node agent needs the job's worker token");
    }
    return grpc::Status::OK;
  }
  void Prepare(grpc::ClientContext* context,
               std::chrono::system_clock::time_point deadline) const {
    context->set_deadline(deadline);
    AddBearerToken(*context, options_.token);
  }

  template <typename StartFn>
  grpc::ServerUnaryReactor* Forward(grpc::CallbackServerContext* context,
                                    StartFn&& start);

  // Cancels every open node stream (Shutdown).
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
  struct PendingHeartbeat {
    const v1::HeartbeatRequest* request;
    v1::HeartbeatResponse* response;
    grpc::ServerUnaryReactor* reactor;
  };

  const NodeAgentOptions options_;
  PassOn pass_on_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;

  // Note [Where gRPC objects end]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // gRPC 1.51 on Linux runs the reactions of every callback-API server and
  // channel of a process on one shared completion queue served by threads of
  // its own ("nexting" threads). Each such server and each channel that made a
  // callback call holds a reference to that queue; the last release shuts it
  // down and joins its threads. Released on one of those threads (a channel's
  // last reference dropped in a reaction), the thread joins itself (which
  // fails quietly), the queue is freed, and the thread then polls the freed
  // queue: concord-run aborted with "ref_counted.h:183 assertion failed:
  // prior > 0" in grpc_cq_internal_unref, after the job was done, in about
  // one CI run in two (the agent's server shut down, its channels freed on the
  // main thread, and a node stream ending a moment later on a nexting thread
  // held the last reference to its channel). So the agent's channels end
  // on its own threads only:
  //  - a node stream that ended (OnDone) is not deleted there but queued in
  //    ended_streams_, and deleted by the flusher thread, or by Shutdown once
  //    every stream has ended (live_streams_ counts a stream until it is
  //    queued, so Shutdown's wait covers it);
  //  - a replica replaced after UNAVAILABLE goes to retired_, dropped by the
  //    flusher or with the agent;
  //  - a passed-on call's ClientContext does end in its server reaction
  //    (ForwardCall::OnDone, PassOnCall::OnDone), but the server, which
  //    holds the queue too, waits for that reaction before it shuts down.
  // The test hook NodeAgentOptions::test_linger (CONCORD_TEST_AGENT_LINGER_MS)
  // makes a stream end late and slowly on gRPC's thread, and concord-run
  // outlive it: test_elastic.py's join case runs its launchers so, and with
  // the old order (the stream deleted in OnDone after the live count
  // dropped) both launchers aborted in every run.
  std::mutex replica_mu_;
  HeartbeatBatcher<PendingHeartbeat> batcher_;  // guarded by mu_
  const std::vector<std::string> addresses_;
  std::vector<Replica> replicas_;  // guarded by replica_mu_
  size_t current_ = 0;             // guarded by replica_mu_
  std::vector<Replica> retired_;   // guarded by replica_mu_

  std::mutex mu_;
  std::condition_variable cv_;  // the batcher's due time moved, or stopping
  bool stopping_ = false;
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
  std::map<std::string, JobNews> news_;  // by job
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
      node_updates_{0}, forwarded_{0}, exits_{0};
};

}  // namespace concord::agent
