#include "agent/node_agent.h"

#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "agent/node_agent_impl.h"
#include "common/auth.h"

namespace concord::agent {

// A unary call passed on as it is. Deleted in OnDone, after Finish, which
// the forwarded call's completion calls.
class NodeAgent::Impl::ForwardCall final : public grpc::ServerUnaryReactor {
 public:
  void OnCancel() override { client_.TryCancel(); }
  void OnDone() override { delete this; }
  grpc::ClientContext client_;
};

template <typename StartFn>
grpc::ServerUnaryReactor* NodeAgent::Impl::Forward(
    grpc::CallbackServerContext* context, StartFn&& start) {
  auto* call = new ForwardCall();
  if (grpc::Status auth = Authorize(*context); !auth.ok()) {
    call->Finish(auth);
    return call;
  }
  ++forwarded_;
  Prepare(&call->client_, context->deadline());
  auto [replica, used] = Current();
  start(replica.worker.get(), &call->client_,
        [this, call, used = used](grpc::Status status) {
          Note(status, used);
          call->Finish(status);
        });
  return call;
}

grpc::ServerUnaryReactor* NodeAgent::Impl::Leave(
    grpc::CallbackServerContext* context, const v1::LeaveRequest* request,
    v1::LeaveResponse* response) {
  return Forward(context, [=](v1::WorkerService::Stub* stub,
                              grpc::ClientContext* c, auto done) {
    stub->async()->Leave(
        c, request, response, [=, done = std::move(done)](grpc::Status s) {
          if (s.ok()) {  // the job's news (JobNews)
            std::lock_guard<std::mutex> lock(mu_);
            Heard(request->job_id(), response->state());
            if (request->reason() == v1::LEAVE_REASON_COMPLETED) {
              news_[request->job_id()].completed = true;
            }
          }
          done(std::move(s));
        });
  });
}

// A unary WorkerService call passed on as bytes (see Note [Passing calls
// on] in node_agent_impl.h): one request read, one call to the coordinator,
// its answer written with the status. Deleted in OnDone.
class NodeAgent::Impl::PassOnCall final
    : public grpc::ServerGenericBidiReactor {
 public:
  PassOnCall(Impl* impl, grpc::GenericCallbackServerContext* context)
      : impl_(impl), context_(context) {
    const std::string prefix =
        absl::StrCat("/", v1::WorkerService::service_full_name(), "/");
    const std::string& path = context->method();
    const google::protobuf::MethodDescriptor* method =
        path.rfind(prefix, 0) == 0
            ? Descriptor()->FindMethodByName(path.substr(prefix.size()))
            : nullptr;
    if (method == nullptr || method->client_streaming() ||
        method->server_streaming() || HandledHere(method->name())) {
      Finish(grpc::Status(
          grpc::StatusCode::UNIMPLEMENTED,
          absl::StrCat("the node agent passes on WorkerService's unary "
                       "methods only, not '",
                       path, "'")));
      return;
    }
    if (grpc::Status auth = impl_->Authorize(*context); !auth.ok()) {
      Finish(auth);
      return;
    }
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "the call ended before its request"));
      return;
    }
    ++impl_->forwarded_;
    impl_->Prepare(&client_, context_->deadline());
    auto [replica, used] = impl_->Current();
    replica.generic->UnaryCall(
        &client_, context_->method(), grpc::StubOptions(), &request_,
        &response_, [this, used = used](grpc::Status status) {
          impl_->Note(status, used);
          if (status.ok()) {
            StartWriteAndFinish(&response_, grpc::WriteOptions(), status);
          } else {
            Finish(status);
          }
        });
  }
  void OnCancel() override { client_.TryCancel(); }
  void OnDone() override { delete this; }

 private:
  Impl* const impl_;
  grpc::GenericCallbackServerContext* const context_;
  grpc::ClientContext client_;
  grpc::ByteBuffer request_, response_;
};

grpc::ServerGenericBidiReactor* NodeAgent::Impl::PassOn::CreateReactor(
    grpc::GenericCallbackServerContext* context) {
  return new PassOnCall(impl_, context);
}

grpc::ServerUnaryReactor* NodeAgent::Impl::Heartbeat(
    grpc::CallbackServerContext* context, const v1::HeartbeatRequest* request,
    v1::HeartbeatResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (grpc::Status auth = Authorize(*context); !auth.ok()) {
    reactor->Finish(auth);
    return reactor;
  }
  if (request->job_id().empty()) {
    reactor->Finish(
        grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "job_id is empty"));
    return reactor;
  }
  std::unique_lock<std::mutex> lock(mu_);
  if (stopping_) {
    lock.unlock();
    reactor->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                 "the node agent is shutting down"));
    return reactor;
  }
  batcher_.Add(request->worker_id(),
               PendingHeartbeat{request, response, reactor}, absl::Now());
  cv_.notify_one();
  return reactor;
}

void NodeAgent::Impl::Shutdown() {
  std::vector<std::pair<std::string, PendingHeartbeat>> unsent;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
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
  if (server_ != nullptr) {
    server_->Shutdown(std::chrono::system_clock::now());
  }
  CancelStreams();
  std::unique_lock<std::mutex> lock(mu_);
  drained_.wait(lock, [&] { return live_streams_ == 0; });
  ReleaseEnded(lock);  // see Note [Where gRPC objects end]
}

NodeAgent::NodeAgent(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

NodeAgent::~NodeAgent() { Shutdown(); }

absl::StatusOr<std::unique_ptr<NodeAgent>> NodeAgent::Start(
    NodeAgentOptions options) {
  if (options.coordinator.empty()) {
    return absl::InvalidArgumentError("the node agent needs a coordinator");
  }
  if (absl::Status token = ValidateToken(options.token); !token.ok()) {
    return token;
  }
  if (options.listen.empty()) {
    return absl::InvalidArgumentError("the node agent needs an address");
  }
  auto impl = std::make_unique<Impl>(std::move(options));
  if (absl::Status s = impl->Listen(); !s.ok()) return s;
  return std::unique_ptr<NodeAgent>(new NodeAgent(std::move(impl)));
}

const std::string& NodeAgent::address() const { return impl_->address(); }

void NodeAgent::Shutdown() { impl_->Shutdown(); }

NodeAgent::Counters NodeAgent::counters() const { return impl_->counters(); }

bool NodeAgent::WorkerExited(const std::string& worker_id,
                             const std::string& how) {
  return impl_->WorkerExited(worker_id, how);
}

void NodeAgent::CheckpointReported(const std::string& job_id,
                                   const v1::CheckpointReport& report,
                                   int64_t writer_pid) {
  impl_->CheckpointReported(job_id, report, writer_pid);
}

bool NodeAgent::AwaitWrites(absl::Duration timeout) {
  return impl_->AwaitWrites(timeout);
}

bool NodeAgent::AwaitExitReports(absl::Duration timeout) {
  return impl_->AwaitExitReports(timeout);
}

NodeAgent::JobNews NodeAgent::job_news(const std::string& job_id) const {
  return impl_->job_news(job_id);
}

}  // namespace concord::agent
