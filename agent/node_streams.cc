// The Node streams of the node's jobs at the node agent, the workers' Join
// and WatchMembership calls they carry, and the flusher that sends the
// heartbeats on them (see node_streams.h).

#include "agent/node_streams.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/clock.h"

namespace concord::agent {
namespace {

bool Terminal(v1::JobState state) {
  return state == v1::JOB_STATE_SUCCEEDED || state == v1::JOB_STATE_FAILED ||
         state == v1::JOB_STATE_STOPPED;
}

}  // namespace

// One worker's Join at the agent, sent and answered on its job's node
// stream. Fields are guarded by the streams' mutex.
class NodeStreams::JoinCall final : public grpc::ServerUnaryReactor {
 public:
  JoinCall(NodeStreams* owner, const v1::JoinRequest* request,
           v1::JoinResponse* response)
      : owner_(owner), request_(request), response_(response) {}

  const v1::JoinRequest& request() const { return *request_; }
  uint64_t id() const { return id_; }
  void set_id(uint64_t id) { id_ = id; }
  void set_stream(NodeStream* stream) { stream_ = stream; }

  // With mu_ held: answers once.
  void Answer(const v1::JoinResult& result, Actions* after) {
    if (answered_) return;
    answered_ = true;
    stream_ = nullptr;
    if (result.code() == 0) {
      *response_ = result.response();
      // See Note [Exited workers]: the coordinator bound the worker to this
      // secret; its exit report will carry it.
      owner_->known_[request_->worker_id()] =
          Known{request_->spec().job_id(), request_->worker_secret()};
      owner_->Vouch(request_->spec().job_id(), request_->worker_id(),
                    request_->worker_secret(), /*pid=*/0);
    }
    after->Add(
        [this, s = grpc::Status(static_cast<grpc::StatusCode>(result.code()),
                                result.message())] { Finish(s); });
  }
  void Answer(const grpc::Status& status, Actions* after) {
    v1::JoinResult result;
    result.set_code(static_cast<int>(status.error_code()));
    result.set_message(status.error_message());
    Answer(result, after);
  }

  void OnCancel() override;
  void OnDone() override { delete this; }

 private:
  NodeStreams* owner_;
  const v1::JoinRequest* request_;
  v1::JoinResponse* response_;
  uint64_t id_ = 0;
  NodeStream* stream_ = nullptr;
  bool answered_ = false;
};

// One worker's WatchMembership at the agent, fed by its job's node stream.
// Fields are guarded by the streams' mutex.
class NodeStreams::WatchCall final
    : public grpc::ServerWriteReactor<v1::MembershipUpdate> {
 public:
  WatchCall(NodeStreams* owner, const v1::WatchMembershipRequest* request)
      : owner_(owner), request_(request) {}

  const v1::WatchMembershipRequest& request() const { return *request_; }

  // With mu_ held: the node stream delivers this worker's view.
  void Deliver(const v1::WorkerView& view, Actions* after) {
    if (ended_) return;
    if (view.code() != 0) {
      stream_ = nullptr;  // the coordinator dropped it
      End(grpc::Status(static_cast<grpc::StatusCode>(view.code()),
                       view.message()),
          after);
      return;
    }
    if (Terminal(view.update().state())) {
      stream_ = nullptr;  // its last view
      terminal_ = true;
    }
    if (writing_) {
      pending_ = view.update();
    } else {
      Write(view.update(), after);
    }
  }
  // With mu_ held: the node stream ended with `status`.
  void StreamEnded(const grpc::Status& status, Actions* after) {
    stream_ = nullptr;
    End(status.ok() ? grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                   "the coordinator closed the node stream")
                    : status,
        after);
  }
  // With mu_ held, once: registers with the job's node stream.
  void Attach(NodeStream* stream, Actions* after);

  void OnWriteDone(bool ok) override {
    Actions after;
    std::lock_guard<std::mutex> lock(owner_->mu_);
    writing_ = false;
    if (ended_) {
      after.Add([this, s = status_] { Finish(s); });
      return;
    }
    if (!ok) {
      Detach(&after);
      End(grpc::Status(grpc::StatusCode::CANCELLED, "the stream was closed"),
          &after);
      return;
    }
    if (pending_.has_value()) {
      v1::MembershipUpdate next = *std::move(pending_);
      pending_.reset();
      Write(std::move(next), &after);
      return;
    }
    if (terminal_) End(grpc::Status::OK, &after);
  }
  void OnCancel() override {
    Actions after;
    std::lock_guard<std::mutex> lock(owner_->mu_);
    if (ended_) return;
    Detach(&after);
    owner_->batcher_.Forget(request_->worker_id());
    End(grpc::Status(grpc::StatusCode::CANCELLED, "the call was cancelled"),
        &after);
  }
  void OnDone() override { delete this; }

  // With mu_ held: ends the call (after the write in flight).
  void End(const grpc::Status& status, Actions* after) {
    if (ended_) return;
    ended_ = true;
    status_ = status;
    pending_.reset();
    if (!writing_) after->Add([this, s = status_] { Finish(s); });
  }

 private:
  void Write(v1::MembershipUpdate update, Actions* after) {
    current_ = std::move(update);
    writing_ = true;
    after->Add([this] { StartWrite(&current_); });
  }
  // With mu_ held: no longer fed by the node stream.
  void Detach(Actions* after);

  NodeStreams* owner_;
  const v1::WatchMembershipRequest* request_;
  NodeStream* stream_ = nullptr;
  bool writing_ = false;
  bool terminal_ = false;  // the last view (written or pending) is terminal
  bool ended_ = false;
  v1::MembershipUpdate current_;
  std::optional<v1::MembershipUpdate> pending_;
  grpc::Status status_;
};

// The Node stream of one job: joins, cancels, adds and removes go out one
// write at a time (those made meanwhile merged into the next); answers and
// views are handed to the workers' calls. Held (AddHold) until its read fails
// and no write is in flight, so that a write decided under the mutex is always
// started on a live reactor; deleted in OnDone, which ends the workers' calls
// still on it with the stream's status. Fields are guarded by the streams'
// mutex.
class NodeStreams::NodeStream final
    : public grpc::ClientBidiReactor<v1::NodeRequest, v1::NodeUpdate> {
 public:
  NodeStream(NodeStreams* owner, std::string job_id)
      : owner_(owner), job_id_(std::move(job_id)) {}

  // With mu_ held: starts the call.
  void Open(Actions* after) {
    owner_->replicas_->Prepare(&context_,
                               std::chrono::system_clock::time_point::max());
    auto [replica, used] = owner_->replicas_->Current();
    used_ = used;
    replica.agent->async()->Node(&context_, this);
    queued_.set_job_id(job_id_);
    ++owner_->live_streams_;
    ++owner_->node_streams_;
    after->Add([this] {
      AddHold();
      StartRead(&read_);
      StartCall();
    });
  }
  bool broken() const { return broken_; }
  void Cancel() { context_.TryCancel(); }

  // With mu_ held.
  void Add(WatchCall* call, Actions* after) {
    const std::string& id = call->request().worker_id();
    auto it = watches_.find(id);
    if (it != watches_.end() && it->second != call) {
      // A newer watch of the same worker takes its place.
      it->second->StreamEnded(
          grpc::Status(grpc::StatusCode::ABORTED,
                       "another watch of this worker replaced it"),
          after);
    }
    watches_[id] = call;
    v1::WatchedWorker* w = queued_.add_add();
    w->set_worker_id(id);
    w->set_worker_secret(call->request().worker_secret());
    w->set_include_members(call->request().include_members());
    WriteQueued(after);
  }
  // Queues a heartbeat, with what the agent sees of its process; Flush
  // writes what is queued.
  void AddHeartbeat(const PendingHeartbeat& p,
                    std::optional<v1::ProcessView> process) {
    const uint64_t id = ++next_heartbeat_;
    heartbeats_[id] = p;
    v1::NodeHeartbeat* heartbeat = queued_.add_heartbeats();
    heartbeat->set_id(id);
    *heartbeat->mutable_request() = *p.request;
    if (process.has_value()) *heartbeat->mutable_process() = *process;
  }
  // Queues what the agent sees of a worker whose heartbeats are late (see
  // Note [What the agent sees]).
  void AddProcess(const std::string& worker_id, v1::ProcessView process) {
    v1::ProcessReport* report = queued_.add_processes();
    report->set_worker_id(worker_id);
    *report->mutable_process() = std::move(process);
  }
  void Flush(Actions* after) { WriteQueued(after); }
  void AddJoin(JoinCall* call, Actions* after) {
    call->set_id(++owner_->next_join_);
    call->set_stream(this);
    joins_[call->id()] = call;
    v1::NodeJoin* join = queued_.add_joins();
    join->set_id(call->id());
    *join->mutable_request() = call->request();
    WriteQueued(after);
  }
  // The worker's call ended first: the coordinator withdraws the join.
  void CancelJoin(JoinCall* call, Actions* after) {
    if (joins_.erase(call->id()) == 0) return;
    queued_.add_cancel_joins(call->id());
    WriteQueued(after);
  }
  // See Note [Exited workers]: reports a worker's exit.
  void AddExit(const std::string& worker_id, const Known& known,
               const std::string& how, Actions* after) {
    const uint64_t id = ++owner_->next_exit_;
    exits_[id] = worker_id;
    ++owner_->exits_pending_;
    v1::ExitedWorker* exited = queued_.add_exited();
    exited->set_id(id);
    exited->set_worker_id(worker_id);
    exited->set_worker_secret(known.secret);
    exited->set_how(how);
    WriteQueued(after);
  }
  // See Note [Checkpoints]: a checkpoint this node's concord-run wrote.
  void AddCheckpoint(v1::NodeCheckpoint report, Actions* after) {
    *queued_.add_reports() = std::move(report);
    WriteQueued(after);
  }
  void Remove(WatchCall* call, Actions* after) {
    const std::string& id = call->request().worker_id();
    auto it = watches_.find(id);
    if (it == watches_.end() || it->second != call) return;
    watches_.erase(it);
    queued_.add_remove(id);
    WriteQueued(after);
  }

  void OnReadDone(bool ok) override {
    Actions after;
    std::lock_guard<std::mutex> lock(owner_->mu_);
    if (!ok) {
      Break(&after);
      return;
    }
    ++owner_->node_updates_;
    for (v1::HeartbeatResult& result : *read_.mutable_heartbeats()) {
      auto it = heartbeats_.find(result.id());
      if (it == heartbeats_.end()) continue;
      const PendingHeartbeat p = it->second;
      heartbeats_.erase(it);
      if (result.code() == 0) {
        owner_->Heard(job_id_, result.response().state());
        *p.response = std::move(*result.mutable_response());
      }
      after.Add(
          [p, s = grpc::Status(static_cast<grpc::StatusCode>(result.code()),
                               result.message())] { p.reactor->Finish(s); });
    }
    for (const v1::JoinResult& result : read_.joins()) {
      auto it = joins_.find(result.id());
      if (it == joins_.end()) continue;  // cancelled meanwhile
      it->second->Answer(result, &after);
      joins_.erase(it);
    }
    for (const v1::ExitResult& result : read_.exited()) {
      auto it = exits_.find(result.id());
      if (it == exits_.end()) continue;
      if (result.code() != 0) {
        spdlog::warn(
            "node agent: the coordinator refused the exit report of worker "
            "{}: {}",
            it->second, result.message());
      }
      owner_->Heard(job_id_, result.state(), result.failure());
      exits_.erase(it);
      owner_->ExitAnswered();
    }
    for (const v1::WorkerView& view : read_.views()) {
      if (view.code() == 0) {
        owner_->Heard(job_id_, view.update().state(), view.update().failure());
      }
      auto it = watches_.find(view.worker_id());
      if (it == watches_.end()) continue;
      WatchCall* call = it->second;
      if (view.code() != 0 || Terminal(view.update().state())) {
        watches_.erase(it);  // the coordinator no longer watches it
      }
      call->Deliver(view, &after);
    }
    after.Add([this] { StartRead(&read_); });
  }
  void OnWriteDone(bool ok) override {
    Actions after;
    std::lock_guard<std::mutex> lock(owner_->mu_);
    writing_ = false;
    if (!ok || broken_) {
      Break(&after);  // (the read fails too)
    } else {
      WriteQueued(&after);
    }
  }
  // Not deleted here: see Note [Where gRPC objects end].
  void OnDone(const grpc::Status& status) override {
    // `this` may be deleted once mu_ is free.
    NodeStreams* const owner = owner_;
    const absl::Duration linger = owner->test_linger_;
    if (linger > absl::ZeroDuration()) absl::SleepFor(linger);  // test hook
    Actions after;
    {
      std::lock_guard<std::mutex> lock(owner->mu_);
      Break(&after);
      owner_->replicas_->Note(status, used_);
      for (auto& [id, call] : watches_) call->StreamEnded(status, &after);
      watches_.clear();
      for (auto& [id, call] : joins_) {
        call->Answer(status.ok() ? grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                                "the coordinator closed the "
                                                "node stream")
                                 : status,
                     &after);
      }
      joins_.clear();
      for (auto& [id, p] : heartbeats_) {
        after.Add([reactor = p.reactor,
                   s = status.ok() ? grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                                  "the coordinator closed the "
                                                  "node stream")
                                   : status] { reactor->Finish(s); });
      }
      heartbeats_.clear();
      // Reports not answered are lost with the stream: the coordinator's
      // other rules (a lost watch, heartbeat_timeout) take those workers
      // out.
      for (size_t i = 0; i < exits_.size(); ++i) owner_->ExitAnswered();
      exits_.clear();
      if (Unref()) {
        owner_->ended_streams_.push_back(this);
        owner_->cv_.notify_all();  // the flusher deletes it
      }
    }
    // The workers' calls end (Finish) before the stream stops counting as
    // live, so that Shutdown's wait covers them too.
    after.Run();
    {
      std::lock_guard<std::mutex> lock(owner->mu_);
      --owner->live_streams_;
      owner->drained_.notify_all();
    }
    // The streams may be gone by now; the hook's duration was read before.
    if (linger > absl::ZeroDuration()) absl::SleepFor(linger);
  }

  // With mu_ held: keeps the stream from being deleted by OnDone until the
  // matching Unref (Shutdown cancels streams outside the mutex).
  void Ref() { ++refs_; }
  // With mu_ held: true when the caller is to delete the stream.
  bool Unref() { return --refs_ == 0; }
  // With mu_ held: nothing queued or being written (or it broke).
  bool Idle() const {
    return broken_ || (!writing_ && queued_.ByteSizeLong() == 0);
  }

 private:
  // With mu_ held: starts writing what is queued, unless a write is in
  // flight or the stream broke.
  void WriteQueued(Actions* after) {
    if (writing_ || broken_) return;
    if (queued_.add_size() == 0 && queued_.remove_size() == 0 &&
        queued_.joins_size() == 0 && queued_.cancel_joins_size() == 0 &&
        queued_.heartbeats_size() == 0 && queued_.exited_size() == 0 &&
        queued_.checkpoints_size() == 0 && queued_.job_id().empty()) {
      return;
    }
    current_ = std::move(queued_);
    queued_.Clear();
    writing_ = true;
    after->Add([this] { StartWrite(&current_); });
  }
  // With mu_ held: no new work on this stream; the agent opens another.
  void Break(Actions* after) {
    if (!broken_) {
      broken_ = true;
      auto it = owner_->streams_.find(job_id_);
      if (it != owner_->streams_.end() && it->second == this) {
        owner_->streams_.erase(it);
      }
    }
    if (!writing_ && !released_) {
      released_ = true;
      after->Add([this] { RemoveHold(); });
    }
  }

  NodeStreams* owner_;
  const std::string job_id_;
  grpc::ClientContext context_;
  size_t used_ = 0;  // the replica
  std::map<std::string, WatchCall*> watches_;
  std::map<uint64_t, JoinCall*> joins_;              // sent, not yet answered
  std::map<uint64_t, PendingHeartbeat> heartbeats_;  // likewise
  std::map<uint64_t, std::string> exits_;            // likewise: worker ids
  uint64_t next_heartbeat_ = 0;
  v1::NodeRequest queued_;   // not yet written
  v1::NodeRequest current_;  // the write in flight
  v1::NodeUpdate read_;
  bool writing_ = false;
  bool broken_ = false;    // its read or a write failed
  bool released_ = false;  // RemoveHold was called
  int refs_ = 1;           // gRPC's until OnDone, and Shutdown's
};

void NodeStreams::WatchCall::Attach(NodeStream* stream, Actions* after) {
  stream_ = stream;
  stream->Add(this, after);
}

void NodeStreams::WatchCall::Detach(Actions* after) {
  if (stream_ != nullptr) stream_->Remove(this, after);
  stream_ = nullptr;
}

NodeStreams::NodeStreams(const NodeAgentOptions& options,
                         CoordinatorReplicas* replicas)
    : policy_(options.batch),
      test_linger_(options.test_linger),
      replicas_(replicas),
      batcher_(options.batch),
      processes_(GpuActivity::Open()) {}

void NodeStreams::Start() {
  flusher_ = std::thread([this] { FlushLoop(); });
}

bool NodeStreams::Stop() {
  std::vector<std::pair<std::string, PendingHeartbeat>> unsent;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return false;
    stopping_ = true;
    unsent = batcher_.TakeAll(absl::Now());
    cv_.notify_all();
  }
  CancelStreams();
  if (flusher_.joinable()) flusher_.join();
  {
    std::lock_guard<std::mutex> lock(mu_);
    exits_cv_.notify_all();
  }
  for (auto& [worker, p] : unsent) {
    p.reactor->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                   "the node agent is shutting down"));
  }
  return true;
}

void NodeStreams::Drain() {
  CancelStreams();
  std::unique_lock<std::mutex> lock(mu_);
  drained_.wait(lock, [&] { return live_streams_ == 0; });
  ReleaseEnded(lock);  // see Note [Where gRPC objects end]
}

void NodeStreams::ReleaseEnded(std::unique_lock<std::mutex>& lock) {
  std::vector<NodeStream*> ended = std::move(ended_streams_);
  ended_streams_.clear();
  lock.unlock();
  std::vector<CoordinatorReplicas::Replica> retired = replicas_->TakeRetired();
  for (NodeStream* stream : ended) delete stream;
  retired.clear();
  lock.lock();
}

void NodeStreams::FlushLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    // See Note [Where gRPC objects end].
    ReleaseEnded(lock);
    if (stopping_) break;
    const absl::Time now = absl::Now();
    auto batch = batcher_.TakeIfDue(now);
    if (!batch.empty()) {
      // One message a job's stream (a node runs one job's workers).
      Actions after;
      std::set<NodeStream*> streams;
      processes_.RefreshGpu(policy_.interval / 2);
      for (auto& [worker, p] : batch) {
        NodeStream* stream = StreamFor(p.request->job_id(), &after);
        stream->AddHeartbeat(p, ViewOf(worker, *p.request, now));
        streams.insert(stream);
      }
      for (NodeStream* stream : streams) stream->Flush(&after);
      heartbeats_ += static_cast<int64_t>(batch.size());
      batches_ += static_cast<int64_t>(streams.size());
      lock.unlock();
      after.Run();
      lock.lock();
      continue;
    }
    if (now >= next_late_check_ && ReportLate(now, lock)) continue;
    // A stream that ended while ReleaseEnded had the mutex free.
    if (!ended_streams_.empty()) continue;
    absl::Time due = batcher_.Due(now);
    if (!heard_.empty()) due = std::min(due, next_late_check_);
    if (due == absl::InfiniteFuture()) {
      cv_.wait(lock);
    } else {
      cv_.wait_until(lock, absl::ToChronoTime(due));
    }
  }
}

void NodeStreams::JoinCall::OnCancel() {
  Actions after;
  std::lock_guard<std::mutex> lock(owner_->mu_);
  if (answered_) return;
  if (stream_ != nullptr) stream_->CancelJoin(this, &after);
  Answer(grpc::Status(grpc::StatusCode::CANCELLED, "the call was cancelled"),
         &after);
}

grpc::ServerUnaryReactor* NodeStreams::Join(const grpc::Status& caller,
                                            const v1::JoinRequest* request,
                                            v1::JoinResponse* response) {
  auto* call = new JoinCall(this, request, response);
  Actions after;
  std::lock_guard<std::mutex> lock(mu_);
  if (!caller.ok()) {
    call->Answer(caller, &after);
  } else if (stopping_) {
    call->Answer(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                              "the node agent is shutting down"),
                 &after);
  } else if (request->spec().job_id().empty()) {
    call->Answer(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                              "spec.job_id is empty"),
                 &after);
  } else {
    ++joins_;
    StreamFor(request->spec().job_id(), &after)->AddJoin(call, &after);
  }
  return call;
}

void NodeStreams::Heartbeat(const v1::HeartbeatRequest* request,
                            v1::HeartbeatResponse* response,
                            grpc::ServerUnaryReactor* reactor) {
  std::unique_lock<std::mutex> lock(mu_);
  if (stopping_) {
    lock.unlock();
    reactor->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                 "the node agent is shutting down"));
    return;
  }
  batcher_.Add(request->worker_id(),
               PendingHeartbeat{request, response, reactor}, absl::Now());
  cv_.notify_one();
}

NodeStreams::NodeStream* NodeStreams::StreamFor(const std::string& job_id,
                                                Actions* after) {
  auto it = streams_.find(job_id);
  if (it != streams_.end()) return it->second;
  auto* stream = new NodeStream(this, job_id);
  streams_[job_id] = stream;
  stream->Open(after);
  return stream;
}

grpc::ServerWriteReactor<v1::MembershipUpdate>* NodeStreams::Watch(
    const grpc::Status& caller, const v1::WatchMembershipRequest* request) {
  auto* call = new WatchCall(this, request);
  Actions after;
  std::lock_guard<std::mutex> lock(mu_);
  if (!caller.ok()) {
    call->End(caller, &after);
  } else if (stopping_) {
    call->End(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                           "the node agent is shutting down"),
              &after);
  } else if (request->job_id().empty()) {
    call->End(
        grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "job_id is empty"),
        &after);
  } else {
    call->Attach(StreamFor(request->job_id(), &after), &after);
  }
  return call;
}

void NodeStreams::Left(const v1::LeaveRequest& request,
                       const v1::LeaveResponse& response) {
  std::lock_guard<std::mutex> lock(mu_);
  Heard(request.job_id(), response.state());
  if (request.reason() == v1::LEAVE_REASON_COMPLETED) {
    news_[request.job_id()].completed = true;
  }
}

NodeAgent::JobNews NodeStreams::job_news(const std::string& job_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = news_.find(job_id);
  return it == news_.end() ? NodeAgent::JobNews{} : it->second;
}

NodeAgent::Counters NodeStreams::counters() const {
  NodeAgent::Counters c;
  c.heartbeats = heartbeats_.load();
  c.heartbeat_batches = batches_.load();
  c.node_streams = node_streams_.load();
  c.node_updates = node_updates_.load();
  c.forwarded = joins_.load();
  c.exits = exits_.load();
  return c;
}

void NodeStreams::Heard(const std::string& job_id, v1::JobState state,
                        const std::string& failure) {
  if (state == v1::JOB_STATE_UNSPECIFIED) return;
  NodeAgent::JobNews& news = news_[job_id];
  if (Terminal(news.state)) return;
  news.state = state;
  news.failure = failure;
}

std::optional<v1::ProcessView> NodeStreams::ViewOf(
    const std::string& worker_id, const v1::HeartbeatRequest& request,
    absl::Time now) {
  const int64_t pid = request.progress().pid();
  if (pid <= 0) return std::nullopt;
  Beating& h = heard_[worker_id];
  if (h.pid != pid) {
    if (h.pid > 0) processes_.Forget(h.pid);
    h.pid = pid;
  }
  h.job_id = request.job_id();
  h.at = now;
  Vouch(request.job_id(), worker_id, request.worker_secret(), pid);
  return processes_.View(pid);
}

void NodeStreams::Vouch(const std::string& job_id, const std::string& worker_id,
                        const std::string& secret, int64_t pid) {
  std::vector<Voucher>& vouchers = vouchers_[job_id];
  auto it =
      std::find_if(vouchers.begin(), vouchers.end(),
                   [&](const Voucher& v) { return v.worker_id == worker_id; });
  Voucher v{worker_id, secret, pid};
  if (it != vouchers.end()) {
    // Every heartbeat comes here: the same worker again changes nothing.
    if (it->secret == secret && (pid == 0 || it->pid == pid)) return;
    if (pid == 0 && it->secret == secret) v.pid = it->pid;
    vouchers.erase(it);
  }
  vouchers.push_back(std::move(v));
  if (vouchers.size() > kMaxVouchers) vouchers.erase(vouchers.begin());
}

bool NodeStreams::ReportLate(absl::Time now,
                             std::unique_lock<std::mutex>& lock) {
  next_late_check_ = now + policy_.interval;
  Actions after;
  std::set<NodeStream*> streams;
  const absl::Duration late = policy_.interval * 3 / 2;
  bool gpu_refreshed = false;
  for (auto it = heard_.begin(); it != heard_.end();) {
    const Beating& h = it->second;
    if (now - h.at < late) {
      ++it;
      continue;
    }
    if (!gpu_refreshed) {
      processes_.RefreshGpu(policy_.interval / 2);
      gpu_refreshed = true;
    }
    std::optional<v1::ProcessView> view;
    if (now - h.at < kReportLateFor) view = processes_.View(h.pid);
    auto stream = streams_.find(h.job_id);
    if (!view.has_value() || stream == streams_.end() ||
        stream->second->broken()) {
      if (!view.has_value()) processes_.Forget(h.pid);
      it = heard_.erase(it);  // gone, or reported long enough
      continue;
    }
    stream->second->AddProcess(it->first, *std::move(view));
    streams.insert(stream->second);
    ++it;
  }
  for (NodeStream* stream : streams) stream->Flush(&after);
  if (streams.empty()) return false;
  lock.unlock();
  after.Run();
  lock.lock();
  return true;
}

bool NodeStreams::WorkerExited(const std::string& worker_id,
                               const std::string& how) {
  Actions after;
  std::lock_guard<std::mutex> lock(mu_);
  batcher_.Forget(worker_id);
  if (auto h = heard_.find(worker_id); h != heard_.end()) {
    processes_.Forget(h->second.pid);
    heard_.erase(h);
  }
  auto it = known_.find(worker_id);
  if (it == known_.end() || stopping_) return false;
  const Known known = std::move(it->second);
  known_.erase(it);
  ++exits_;
  StreamFor(known.job_id, &after)->AddExit(worker_id, known, how, &after);
  return true;
}

void NodeStreams::CheckpointReported(const std::string& job_id,
                                     const v1::CheckpointReport& report,
                                     int64_t writer_pid) {
  Actions after;
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_) return;
  auto job = vouchers_.find(job_id);
  if (job == vouchers_.end() || job->second.empty()) {
    spdlog::warn(
        "checkpoint of step {} of job {} not reported: no worker of the job "
        "called through this node agent",
        report.step(), job_id);
    return;
  }
  const std::vector<Voucher>& vouchers = job->second;
  auto writer = std::find_if(
      vouchers.rbegin(), vouchers.rend(),
      [&](const Voucher& v) { return writer_pid > 0 && v.pid == writer_pid; });
  const Voucher& v = writer != vouchers.rend() ? *writer : vouchers.back();
  v1::NodeCheckpoint c;
  c.set_worker_id(v.worker_id);
  c.set_worker_secret(v.secret);
  *c.mutable_report() = report;
  StreamFor(job_id, &after)->AddCheckpoint(std::move(c), &after);
}

bool NodeStreams::AwaitWrites(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      bool idle = true;
      for (const auto& [job, stream] : streams_) idle = idle && stream->Idle();
      if (idle) return true;
    }
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
}

bool NodeStreams::AwaitExitReports(absl::Duration timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  return exits_cv_.wait_for(lock, absl::ToChronoNanoseconds(timeout),
                            [this] { return exits_pending_ == 0; });
}

void NodeStreams::CancelStreams() {
  // Cancelled outside the mutex (gRPC may run a reaction on this thread),
  // each held meanwhile so that its OnDone does not delete it.
  std::vector<NodeStream*> open;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [job, stream] : streams_) {
      stream->Ref();
      open.push_back(stream);
    }
  }
  for (NodeStream* stream : open) stream->Cancel();
  std::vector<NodeStream*> done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (NodeStream* stream : open) {
      if (stream->Unref()) done.push_back(stream);
    }
  }
  for (NodeStream* stream : done) delete stream;
}

}  // namespace concord::agent
