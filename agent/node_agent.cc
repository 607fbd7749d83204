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

NodeAgent::Impl::Impl(NodeAgentOptions options)
    : options_(std::move(options)),
      pass_on_(this),
      replicas_(options_.coordinator, options_.tls, options_.token),
      streams_(options_, &replicas_) {
  // See Note [Passing calls on].
  const google::protobuf::ServiceDescriptor* service = Descriptor();
  for (int i = 0; i < service->method_count(); ++i) {
    if (!HandledHere(service->method(i)->name())) MarkMethodGeneric(i);
  }
}

absl::Status NodeAgent::Impl::Listen() {
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
  streams_.Start();
  return absl::OkStatus();
}

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
  replicas_.Prepare(&call->client_, context->deadline());
  auto [replica, used] = replicas_.Current();
  start(replica.worker.get(), &call->client_,
        [this, call, used = used](grpc::Status status) {
          replicas_.Note(status, used);
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
          if (s.ok()) streams_.Left(*request, *response);  // the job's news
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
    impl_->replicas_.Prepare(&client_, context_->deadline());
    auto [replica, used] = impl_->replicas_.Current();
    replica.generic->UnaryCall(
        &client_, context_->method(), grpc::StubOptions(), &request_,
        &response_, [this, used = used](grpc::Status status) {
          impl_->replicas_.Note(status, used);
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
  streams_.Heartbeat(request, response, reactor);
  return reactor;
}

grpc::ServerUnaryReactor* NodeAgent::Impl::Join(
    grpc::CallbackServerContext* context, const v1::JoinRequest* request,
    v1::JoinResponse* response) {
  return streams_.Join(Authorize(*context), request, response);
}

grpc::ServerWriteReactor<v1::MembershipUpdate>*
NodeAgent::Impl::WatchMembership(grpc::CallbackServerContext* context,
                                 const v1::WatchMembershipRequest* request) {
  return streams_.Watch(Authorize(*context), request);
}

void NodeAgent::Impl::Shutdown() {
  // No new work, the pending heartbeats answered, the flusher stopped; then
  // the server; then the streams opened meanwhile, drained.
  if (!streams_.Stop()) return;
  if (server_ != nullptr) {
    server_->Shutdown(std::chrono::system_clock::now());
  }
  streams_.Drain();
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
  return impl_->streams().WorkerExited(worker_id, how);
}

void NodeAgent::CheckpointReported(const std::string& job_id,
                                   const v1::CheckpointReport& report,
                                   int64_t writer_pid) {
  impl_->streams().CheckpointReported(job_id, report, writer_pid);
}

bool NodeAgent::AwaitWrites(absl::Duration timeout) {
  return impl_->streams().AwaitWrites(timeout);
}

bool NodeAgent::AwaitExitReports(absl::Duration timeout) {
  return impl_->streams().AwaitExitReports(timeout);
}

NodeAgent::JobNews NodeAgent::job_news(const std::string& job_id) const {
  return impl_->streams().job_news(job_id);
}

}  // namespace concord::agent
