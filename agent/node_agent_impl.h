#pragma once
// The node agent's server (see Note [Node agents] in node_agent.h), defined
// in node_agent.cc: it serves WorkerService to the node's workers, checks
// that they hold the worker token, passes their unary calls on to the
// coordinator and hands Join, Heartbeat and WatchMembership to the job's
// Node stream (NodeStreams, node_streams.h). It owns the coordinator's
// replicas (CoordinatorReplicas, coordinator_replicas.h), which both use,
// and the streams, and orders shutdown. Not installed; not for use
// elsewhere.

#include <google/protobuf/descriptor.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "agent/coordinator_replicas.h"
#include "agent/node_agent.h"
#include "agent/node_streams.h"
#include "common/auth.h"
#include "common/grpc_auth.h"
#include "concord/v1/worker.grpc.pb.h"

namespace concord::agent {

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
//    NodeStreams::ended_streams_, and deleted by the flusher thread, or by
//    Shutdown (NodeStreams::Drain) once every stream has ended
//    (live_streams_ counts a stream until it is queued, so Shutdown's wait
//    covers it);
//  - a replica replaced after UNAVAILABLE is retired
//    (CoordinatorReplicas::Note), dropped by the flusher or with the agent;
//  - a passed-on call's ClientContext does end in its server reaction
//    (ForwardCall::OnDone, PassOnCall::OnDone), but the server, which
//    holds the queue too, waits for that reaction before it shuts down.
// The test hook NodeAgentOptions::test_linger (CONCORD_TEST_AGENT_LINGER_MS)
// makes a stream end late and slowly on gRPC's thread, and concord-run
// outlive it: test_elastic.py's join case runs its launchers so, and with
// the old order (the stream deleted in OnDone after the live count
// dropped) both launchers aborted in every run.

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
  explicit Impl(NodeAgentOptions options);

  absl::Status Listen();
  const std::string& address() const { return address_; }
  void Shutdown();

  // The rest of NodeAgent's interface is the streams'.
  NodeStreams& streams() { return streams_; }
  NodeAgent::Counters counters() const {
    NodeAgent::Counters c = streams_.counters();
    c.forwarded += forwarded_.load();
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

  template <typename StartFn>
  grpc::ServerUnaryReactor* Forward(grpc::CallbackServerContext* context,
                                    StartFn&& start);

  const NodeAgentOptions options_;
  PassOn pass_on_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  // See Note [Where gRPC objects end]: the streams end before the replicas
  // their channels came from.
  CoordinatorReplicas replicas_;
  NodeStreams streams_;
  std::atomic<int64_t> forwarded_{0};  // unary calls passed on (not Joins)
};

}  // namespace concord::agent
