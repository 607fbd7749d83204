#include "coordinator/agent_service.h"

#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"

namespace concord::coordinator {
namespace {

bool Terminal(v1::JobState state) {
  return state == v1::JOB_STATE_SUCCEEDED || state == v1::JOB_STATE_FAILED ||
         state == v1::JOB_STATE_STOPPED;
}

// A WatchNode stream (AgentServiceImpl::WatchNode). Fields are guarded by
// the host's mutex; gRPC is called only through the host's Defer.
class NodeWatchCall final
    : public grpc::ServerBidiReactor<v1::NodeWatchRequest, v1::NodeWatchUpdate>,
      public CoreHost::Waiter {
 public:
  NodeWatchCall(CoreHost* host, Metrics* metrics)
      : host_(host), scope_(std::make_unique<RpcScope>(metrics, "WatchNode")) {}

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
    if (ended_) return;
    Core& core = host_->core();
    if (!ok) {  // the agent closed its side, or went away
      Unregister();
      End(core, /*lost=*/true,
          absl::CancelledError("the agent closed the stream"));
      return;
    }
    if (absl::Status applied = Apply(core); !applied.ok()) {
      Unregister();
      End(core, /*lost=*/false, applied);
      return;
    }
    if (id_ == 0) {
      id_ = host_->Wait(job_id_, CoreHost::WaitKind::kView,
                        absl::InfiniteFuture(), this);
    } else {
      Poll(core);  // the added workers' first views
    }
    if (!ended_) host_->Defer([this] { StartRead(&request_); });
  }

  bool Poll(Core& core) override {
    if (ended_) return true;
    v1::NodeWatchUpdate out;
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
    for (v1::WorkerView& view : *out.mutable_views()) {
      std::string id = view.worker_id();
      pending_[std::move(id)] = std::move(view);
    }
    if (!writing_) WritePending();
    return false;
  }
  void Abandon(absl::Status status) override {
    id_ = 0;
    End(host_->core(), /*lost=*/false, status);
  }

  void OnWriteDone(bool ok) override {
    CoreHost::Lock lock(host_);
    writing_ = false;
    if (ended_) {
      host_->Defer([this, s = status_] { Finish(s); });
      return;
    }
    if (!ok) {
      Unregister();
      End(host_->core(), /*lost=*/true,
          absl::CancelledError("the stream was closed"));
      return;
    }
    WritePending();
  }
  void OnCancel() override {
    CoreHost::Lock lock(host_);
    if (ended_) return;
    Unregister();
    End(host_->core(), /*lost=*/true,
        absl::CancelledError("the call was cancelled"));
  }
  void OnDone() override { delete this; }

 private:
  struct Watched {
    v1::WatchMembershipRequest request;
    bool open = false;  // the core was told of the watch
    bool sent = false;  // a view was written (or is queued)
    std::string last;   // that view, serialised
  };

  // With the host's mutex held: applies one request of the agent.
  absl::Status Apply(Core& core) {
    if (job_id_.empty()) {
      if (request_.job_id().empty()) {
        return absl::InvalidArgumentError(
            "the first NodeWatchRequest must name the job");
      }
      job_id_ = request_.job_id();
    } else if (!request_.job_id().empty() && request_.job_id() != job_id_) {
      return absl::InvalidArgumentError(
          absl::StrCat("this stream watches job '", job_id_, "', not '",
                       request_.job_id(), "'"));
    }
    if (workers_.size() + request_.add_size() >
        static_cast<size_t>(AgentServiceImpl::kMaxBatch)) {
      return absl::InvalidArgumentError(
          absl::StrCat("a node stream watches at most ",
                       AgentServiceImpl::kMaxBatch, " workers"));
    }
    for (const std::string& id : request_.remove()) {
      auto it = workers_.find(id);
      if (it == workers_.end()) continue;
      if (it->second.open) core.WatchClosed(job_id_, id, /*lost=*/true);
      workers_.erase(it);
    }
    for (const v1::WatchedWorker& add : request_.add()) {
      Watched& w = workers_[add.worker_id()];
      w.request.set_job_id(job_id_);
      w.request.set_worker_id(add.worker_id());
      w.request.set_worker_secret(add.worker_secret());
      w.request.set_include_members(add.include_members());
      w.sent = false;  // (again) from its first view
    }
    return absl::OkStatus();
  }

  // With the host's mutex held and no write in flight.
  void WritePending() {
    if (pending_.empty()) return;
    current_.Clear();
    for (auto& [id, view] : pending_) *current_.add_views() = std::move(view);
    pending_.clear();
    writing_ = true;
    host_->Defer([this] { StartWrite(&current_); });
  }

  // With the host's mutex held: no longer re-asked after changes.
  void Unregister() {
    if (id_ != 0) host_->Cancel(id_);
    id_ = 0;
  }

  // With the host's mutex held: ends the stream with `status`; every
  // worker still watched lost its watch when `lost` (unless the
  // coordinator is shutting down).
  void End(Core& core, bool lost, const absl::Status& status) {
    if (ended_) return;
    ended_ = true;
    for (const auto& [id, w] : workers_) {
      if (w.open)
        core.WatchClosed(job_id_, id, lost && !host_->shutting_down());
    }
    workers_.clear();
    pending_.clear();
    status_ = scope_->Done(ToGrpcStatus(status));
    if (!writing_) host_->Defer([this, s = status_] { Finish(s); });
  }

  CoreHost* host_;
  std::unique_ptr<RpcScope> scope_;
  v1::NodeWatchRequest request_;  // the read in flight
  std::string job_id_;
  std::map<std::string, Watched> workers_;
  std::map<std::string, v1::WorkerView> pending_;  // to write next
  v1::NodeWatchUpdate current_;                    // the write in flight
  CoreHost::WaiterId id_ = 0;
  bool writing_ = false;
  bool ended_ = false;
  grpc::Status status_;
};

}  // namespace

grpc::ServerUnaryReactor* AgentServiceImpl::Heartbeats(
    grpc::CallbackServerContext* context,
    const v1::HeartbeatBatchRequest* request,
    v1::HeartbeatBatchResponse* response) {
  RpcScope scope(metrics_, "Heartbeats");
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::Status status = auth_->Check(*context, Role::kWorker, "Heartbeats");
  if (status.ok() && request->heartbeats_size() > kMaxBatch) {
    status = absl::InvalidArgumentError(
        absl::StrCat("a batch of ", request->heartbeats_size(),
                     " heartbeats; at most ", kMaxBatch));
  }
  if (status.ok()) {
    host_->Mutate([&](Core& core) {
      response->mutable_results()->Reserve(request->heartbeats_size());
      for (const v1::HeartbeatRequest& heartbeat : request->heartbeats()) {
        absl::StatusOr<v1::HeartbeatResponse> answer =
            core.Heartbeat(heartbeat);
        v1::HeartbeatResult* result = response->add_results();
        if (answer.ok()) {
          *result->mutable_response() = *std::move(answer);
        } else {
          result->set_code(static_cast<int>(answer.status().code()));
          result->set_message(std::string(answer.status().message()));
        }
      }
    });
  }
  reactor->Finish(scope.Done(ToGrpcStatus(status)));
  return reactor;
}

grpc::ServerBidiReactor<v1::NodeWatchRequest, v1::NodeWatchUpdate>*
AgentServiceImpl::WatchNode(grpc::CallbackServerContext* context) {
  auto* call = new NodeWatchCall(host_, metrics_);
  call->Begin(auth_->Check(*context, Role::kWorker, "WatchNode"));
  return call;
}

}  // namespace concord::coordinator
