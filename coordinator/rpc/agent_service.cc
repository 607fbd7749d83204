#include "coordinator/rpc/agent_service.h"

#include <spdlog/spdlog.h>

#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "coordinator/core/core_validation.h"
#include "coordinator/rpc/core_stream.h"
#include "coordinator/rpc/service.h"

namespace concord::coordinator {
namespace {

// A Node stream (AgentServiceImpl::Node): registered with the host as a
// view waiter and a placement waiter of its job, re-asking its pending
// joins and its workers' views (see Note [Core streams] in core_stream.h).
class NodeCall final
    : public CoreStream<
          grpc::ServerBidiReactor<v1::NodeRequest, v1::NodeUpdate>,
          v1::NodeUpdate> {
 public:
  NodeCall(CoreHost* host, Metrics* metrics)
      : CoreStream(host, std::make_unique<RpcScope>(metrics, "Node")),
        metrics_(metrics) {}

  // Starts reading, or ends at once when `auth` refused the call.
  void Begin(const absl::Status& auth) {
    CoreHost::Lock lock(host_);
    if (!auth.ok()) {
      End(host_->core(), /*lost=*/false, auth);
      return;
    }
    host_->Defer([this] { StartRead(&request_); });
  }

  void OnReadDone(bool ok) override {
    CoreHost::Lock lock(host_);
    if (ended()) return;
    Core& core = host_->core();
    if (!ok) {  // the agent closed its side, or went away
      StopWaiting();
      End(core, /*lost=*/true,
          absl::CancelledError("the agent closed the stream"));
      return;
    }
    if (absl::Status applied = Apply(core); !applied.ok()) {
      StopWaiting();
      End(core, /*lost=*/false, applied);
      return;
    }
    if (view_id_ == 0) {
      view_id_ = host_->Wait(job_id_, CoreHost::WaitKind::kView,
                             absl::InfiniteFuture(), this);
      if (!ended()) {
        placement_id_ = host_->Wait(job_id_, CoreHost::WaitKind::kPlacement,
                                    absl::InfiniteFuture(), this);
      }
    } else if (host_->Answerable(job_id_)) {
      Poll(core);  // the new joins' and the added workers' first answers
    }
    if (!ended()) host_->Defer([this] { StartRead(&request_); });
  }

  bool Poll(Core& core) override {
    if (ended()) return true;
    v1::NodeUpdate out;
    for (auto it = joins_.begin(); it != joins_.end();) {
      v1::JoinResponse response;
      std::optional<absl::Status> answer =
          JoinAnswer(core, it->second.request, &response);
      if (!answer.has_value()) {
        ++it;
        continue;
      }
      v1::JoinResult* result = out.add_joins();
      result->set_id(it->first);
      if (answer->ok()) {
        *result->mutable_response() = std::move(response);
      } else {
        result->set_code(static_cast<int>(answer->code()));
        result->set_message(std::string(answer->message()));
      }
      it = joins_.erase(it);
    }
    for (auto it = workers_.begin(); it != workers_.end();) {
      Watched& w = it->second;
      absl::StatusOr<v1::MembershipUpdate> update = core.Membership(w.request);
      if (!update.ok()) {
        v1::WorkerView* view = out.add_views();
        view->set_worker_id(it->first);
        view->set_code(static_cast<int>(update.status().code()));
        view->set_message(std::string(update.status().message()));
        if (w.open) core.WatchClosed(job_id_, it->first, /*lost=*/false);
        it = workers_.erase(it);
        continue;
      }
      if (!w.open) {
        core.WatchOpened(job_id_, it->first);
        w.open = true;
      }
      std::string bytes = update->SerializeAsString();
      if (w.sent && bytes == w.last) {
        ++it;
        continue;
      }
      w.sent = true;
      w.last = std::move(bytes);
      const bool terminal = Terminal(update->state());
      v1::WorkerView* view = out.add_views();
      view->set_worker_id(it->first);
      *view->mutable_update() = *std::move(update);
      if (terminal) {  // its last view: the worker's watch ends here
        core.WatchClosed(job_id_, it->first, /*lost=*/false);
        it = workers_.erase(it);
      } else {
        ++it;
      }
    }
    Queue(std::move(out));
    return false;
  }
  void Abandon(absl::Status status) override {
    // The host removed one registration; the other goes with the stream.
    StopWaiting();
    End(host_->core(), /*lost=*/false, status);
  }

 private:
  struct Watched {
    v1::WatchMembershipRequest request;
    bool open = false;  // the core was told of the watch
    bool sent = false;  // a view was written (or is queued)
    std::string last;   // that view, serialised
  };
  struct PendingJoin {
    v1::JoinRequest request;
    uint64_t call = 0;  // the Core::Join it made (CancelJoin)
  };

  // With the host's mutex held: applies one request of the agent.
  absl::Status Apply(Core& core) {
    if (metrics_ != nullptr) {
      for (const auto& [kind, items] :
           {std::pair<const char*, int>{
                "joins", request_.joins_size() + request_.cancel_joins_size()},
            {"heartbeats", request_.heartbeats_size()},
            {"watch", request_.add_size() + request_.remove_size()},
            {"exits", request_.exited_size()}}) {
        if (items > 0) metrics_->RecordNodeMessage(kind, items);
      }
    }
    if (job_id_.empty()) {
      if (request_.job_id().empty()) {
        return absl::InvalidArgumentError(
            "the first NodeRequest must name the job");
      }
      job_id_ = request_.job_id();
    } else if (!request_.job_id().empty() && request_.job_id() != job_id_) {
      return absl::InvalidArgumentError(absl::StrCat("this stream is job '",
                                                     job_id_, "'s, not '",
                                                     request_.job_id(), "'"));
    }
    if (workers_.size() + request_.add_size() >
            static_cast<size_t>(AgentServiceImpl::kMaxWorkers) ||
        request_.joins_size() > AgentServiceImpl::kMaxWorkers ||
        request_.heartbeats_size() > AgentServiceImpl::kMaxWorkers ||
        request_.exited_size() > AgentServiceImpl::kMaxWorkers ||
        request_.checkpoints_size() > AgentServiceImpl::kMaxWorkers ||
        request_.processes_size() > AgentServiceImpl::kMaxWorkers) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a node stream carries at most ", AgentServiceImpl::kMaxWorkers,
          " workers (watches, joins, heartbeats, exits or process views at "
          "once)"));
    }
    for (const std::string& id : request_.remove()) {
      auto it = workers_.find(id);
      if (it == workers_.end()) continue;
      if (it->second.open) core.WatchClosed(job_id_, id, /*lost=*/true);
      workers_.erase(it);
    }
    v1::NodeUpdate refused;
    for (const uint64_t id : request_.cancel_joins()) {
      auto it = joins_.find(id);
      if (it == joins_.end()) continue;  // answered meanwhile
      core.CancelJoin(job_id_, it->second.request.worker_id(), it->second.call);
      joins_.erase(it);
    }
    for (v1::NodeJoin& join : *request_.mutable_joins()) {
      absl::Status status;
      PendingJoin pending;
      if (join.request().spec().job_id() != job_id_) {
        status = absl::InvalidArgumentError(
            absl::StrCat("a join for job '", join.request().spec().job_id(),
                         "' on the node stream of job '", job_id_, "'"));
      } else if (joins_.count(join.id()) != 0) {
        status = absl::InvalidArgumentError(
            absl::StrCat("join ", join.id(), " is already pending"));
      } else if (host_->shutting_down()) {
        status = absl::UnavailableError("the coordinator is shutting down");
      } else {
        status = core.Join(join.request(), &pending.call);
        if (status.ok()) {
          Carry(join.request().worker_id());
          Vouch(join.request().worker_id(), join.request().worker_secret());
        }
      }
      if (!status.ok()) {
        v1::JoinResult* result = refused.add_joins();
        result->set_id(join.id());
        result->set_code(static_cast<int>(status.code()));
        result->set_message(std::string(status.message()));
        continue;
      }
      pending.request = std::move(*join.mutable_request());
      joins_.emplace(join.id(), std::move(pending));
    }
    for (const v1::NodeHeartbeat& heartbeat : request_.heartbeats()) {
      v1::HeartbeatResult* result = refused.add_heartbeats();
      result->set_id(heartbeat.id());
      absl::StatusOr<v1::HeartbeatResponse> answer =
          heartbeat.request().job_id() == job_id_
              ? core.Heartbeat(heartbeat.request())
              : absl::InvalidArgumentError(absl::StrCat(
                    "a heartbeat for job '", heartbeat.request().job_id(),
                    "' on the node stream of job '", job_id_, "'"));
      if (answer.ok()) {
        Carry(heartbeat.request().worker_id());
        Vouch(heartbeat.request().worker_id(),
              heartbeat.request().worker_secret());
        *result->mutable_response() = *std::move(answer);
        if (heartbeat.has_process()) {
          Seen(core, heartbeat.request().worker_id(), heartbeat.process());
        }
      } else {
        result->set_code(static_cast<int>(answer.status().code()));
        result->set_message(std::string(answer.status().message()));
      }
    }
    Queue(std::move(refused));
    for (const v1::WatchedWorker& add : request_.add()) {
      Watched& w = workers_[add.worker_id()];
      w.request.set_job_id(job_id_);
      w.request.set_worker_id(add.worker_id());
      w.request.set_worker_secret(add.worker_secret());
      w.request.set_include_members(add.include_members());
      w.sent = false;  // (again) from its first view
      Carry(add.worker_id());
    }
    for (const v1::ExitedWorker& exited : request_.exited()) {
      Exited(core, exited);
    }
    // See Note [What the agent sees]: no answer.
    for (const v1::ProcessReport& report : request_.processes()) {
      if (carried_.count(report.worker_id()) != 0) {
        Seen(core, report.worker_id(), report.process());
      }
    }
    // See Note [One job's checkpoints]: no answer (a refusal is logged).
    if (request_.checkpoints_size() > 0) {
      spdlog::warn(
          "job {}: {} checkpoint report(s) without a worker's credential "
          "refused (an agent older than this coordinator?)",
          job_id_, request_.checkpoints_size());
    }
    for (const v1::NodeCheckpoint& c : request_.reports()) {
      if (absl::Status s = Reported(core, c); !s.ok()) {
        spdlog::warn("job {}: checkpoint report refused: {}", job_id_,
                     s.ToString());
      }
    }
    return absl::OkStatus();
  }

  // With the host's mutex held: see Note [One job's checkpoints] in
  // coordinator/core/core.h.
  absl::Status Reported(Core& core, const v1::NodeCheckpoint& c) {
    CONCORD_RETURN_IF_ERROR(ValidateId("worker_id", c.worker_id()));
    auto vouched = vouched_.find(c.worker_id());
    if (vouched == vouched_.end() || vouched->second != c.worker_secret()) {
      return absl::PermissionDeniedError(absl::StrCat(
          "worker ", c.worker_id(),
          vouched == vouched_.end()
              ? " has no calls on this node stream"
              : " is bound to another secret on this node stream",
          ": an agent reports the checkpoints of its own job's workers only"));
    }
    const std::string& node = c.report().node();
    if (!node_.empty() && node != node_) {
      return absl::PermissionDeniedError(absl::StrCat(
          "a report for node '", absl::CHexEscape(node.substr(0, 128)),
          "' on the node stream of '", node_, "': one agent, one node"));
    }
    CONCORD_RETURN_IF_ERROR(core.CheckpointReported(job_id_, c.report()));
    node_ = node;
    return absl::OkStatus();
  }

  // With the host's mutex held: the core accepted a call of `worker_id` with
  // `secret` on this stream (see Note [One job's checkpoints]). Kept after
  // the worker leaves or exits (its last snapshot's report may come later);
  // bounded by kMaxCarried.
  void Vouch(const std::string& worker_id, const std::string& secret) {
    auto it = vouched_.find(worker_id);
    if (it != vouched_.end()) {
      if (it->second != secret) it->second = secret;
    } else if (vouched_.size() < kMaxCarried) {
      vouched_.emplace(worker_id, secret);
    }
  }

  // With the host's mutex held: see Note [What the agent sees] in
  // agent/process_view.h. A malformed view is refused alone (logged).
  void Seen(Core& core, const std::string& worker_id,
            const v1::ProcessView& process) {
    if (absl::Status s = core.ProcessSeen(job_id_, worker_id, process);
        !s.ok()) {
      spdlog::warn("job {}: the view of worker {}'s process refused: {}",
                   job_id_, worker_id, s.ToString());
    }
  }

  // With the host's mutex held: `worker_id` has calls on this stream, so
  // its agent may report its exit.
  void Carry(const std::string& worker_id) {
    if (carried_.size() < kMaxCarried) carried_.insert(worker_id);
  }

  // With the host's mutex held: see Note [Exited workers] in core.h. Answered
  // at once, with the job's state after it; refused alone when malformed or for
  // a worker this stream never carried.
  void Exited(Core& core, const v1::ExitedWorker& exited) {
    absl::Status status = ValidateId("worker_id", exited.worker_id());
    if (status.ok() && carried_.count(exited.worker_id()) == 0) {
      status = absl::PermissionDeniedError(absl::StrCat(
          "worker ", exited.worker_id(),
          " has no calls on this node stream: an agent reports the exits of "
          "its own workers only"));
    }
    if (status.ok()) {
      status = core.WorkerExited(job_id_, exited.worker_id(),
                                 exited.worker_secret(), exited.how())
                   .status();
    }
    if (status.ok()) carried_.erase(exited.worker_id());
    v1::NodeUpdate out;
    v1::ExitResult* result = out.add_exited();
    result->set_id(exited.id());
    result->set_code(static_cast<int>(status.code()));
    result->set_message(std::string(status.message()));
    if (std::optional<v1::JobState> state = core.State(job_id_)) {
      result->set_state(*state);
      result->set_failure(core.Failure(job_id_));
    }
    Queue(std::move(out));
  }

  // With the host's mutex held: `out` goes with the next write.
  void Queue(v1::NodeUpdate out) {
    for (v1::WorkerView& view : *out.mutable_views()) {
      std::string id = view.worker_id();
      pending_views_[std::move(id)] = std::move(view);
    }
    for (v1::JoinResult& join : *out.mutable_joins()) {
      *pending_joins_.add_joins() = std::move(join);
    }
    for (v1::HeartbeatResult& heartbeat : *out.mutable_heartbeats()) {
      *pending_joins_.add_heartbeats() = std::move(heartbeat);
    }
    for (v1::ExitResult& exited : *out.mutable_exited()) {
      *pending_joins_.add_exited() = std::move(exited);
    }
    if (!writing()) WriteQueued();
  }

  // With the host's mutex held and no write in flight: what is queued, in
  // one NodeUpdate.
  void WriteQueued() override {
    if (pending_views_.empty() && pending_joins_.joins_size() == 0 &&
        pending_joins_.heartbeats_size() == 0 &&
        pending_joins_.exited_size() == 0) {
      return;
    }
    v1::NodeUpdate update = std::move(pending_joins_);
    pending_joins_.Clear();
    for (auto& [id, view] : pending_views_) {
      *update.add_views() = std::move(view);
    }
    pending_views_.clear();
    Write(std::move(update));
  }

  // With the host's mutex held: no longer re-asked after changes.
  void StopWaiting() override {
    for (CoreHost::WaiterId* id : {&view_id_, &placement_id_}) {
      if (*id != 0) host_->Cancel(*id);
      *id = 0;
    }
  }

  // With the host's mutex held (End): its joins not yet answered are
  // withdrawn as cancelled Joins, and every worker still watched lost its
  // watch when `lost` (unless the coordinator is shutting down).
  void Ending(Core& core, bool lost) override {
    for (const auto& [id, join] : joins_) {
      core.CancelJoin(job_id_, join.request.worker_id(), join.call);
    }
    joins_.clear();
    for (const auto& [id, w] : workers_) {
      if (w.open) {
        core.WatchClosed(job_id_, id, lost && !host_->shutting_down());
      }
    }
    workers_.clear();
    pending_views_.clear();
    pending_joins_.Clear();
  }

  Metrics* metrics_;         // may be null
  v1::NodeRequest request_;  // the read in flight
  std::string job_id_;
  std::map<std::string, Watched> workers_;
  std::map<uint64_t, PendingJoin> joins_;  // by the agent's id
  // Workers whose calls this stream carried (Carry), the only ones whose
  // exits its agent may report; bounded by kMaxCarried.
  static constexpr size_t kMaxCarried = 4 * AgentServiceImpl::kMaxWorkers;
  std::set<std::string> carried_;
  // Workers whose join or heartbeat the core accepted on this stream, with
  // their secrets (Vouch); and the node this stream's reports are of (its
  // first accepted report's).
  std::map<std::string, std::string> vouched_;
  std::string node_;
  // To write next: views (newest a worker), join and heartbeat answers.
  std::map<std::string, v1::WorkerView> pending_views_;
  v1::NodeUpdate pending_joins_;  // the answers (joins, heartbeats, exits)
  CoreHost::WaiterId view_id_ = 0, placement_id_ = 0;
};

}  // namespace

grpc::ServerBidiReactor<v1::NodeRequest, v1::NodeUpdate>*
AgentServiceImpl::Node(grpc::CallbackServerContext* context) {
  auto* call = new NodeCall(host_, metrics_);
  call->Begin(auth_->Check(*context, Role::kWorker, "Node"));
  return call;
}

}  // namespace concord::coordinator
