#pragma once
// The gRPC face of the coordinator for node agents (agent.proto, see Note [Node
// agents] in agent/node_agent.h): a node's workers' joins, heartbeats and
// membership views on one stream. Each worker's
// request inside is checked and answered by the Core exactly as
// WorkerServiceImpl would check and answer it alone.
//
// Thread-safety: as WorkerServiceImpl. Every call first checks the worker
// token (UNAUTHENTICATED, PERMISSION_DENIED).

#include <grpcpp/grpcpp.h>

#include "concord/v1/agent.grpc.pb.h"
#include "coordinator/host/host.h"
#include "coordinator/metrics/metrics.h"
#include "coordinator/rpc/authorizer.h"

namespace concord::coordinator {

class AgentServiceImpl final : public v1::AgentService::CallbackService {
 public:
  // The most workers one Node stream may watch, and the most joins,
  // heartbeats or exit reports one of its messages may carry.
  static constexpr int kMaxWorkers = 4096;

  // All must outlive the service; `metrics` may be null.
  AgentServiceImpl(CoreHost* host, const Authorizer* auth, Metrics* metrics)
      : host_(host), auth_(auth), metrics_(metrics) {}

  // A view and placement waiter for all the stream's joins and workers:
  // each join goes through Core::Join as it arrives and its answer goes
  // out as soon as it has one (JoinAnswer); each heartbeat goes through
  // Core::Heartbeat as it arrives (a message's under one hold of the
  // core's mutex) and its answer goes out at once; after every change of the
  // job the views that changed go out, all in one message (one write in flight;
  // what is due meanwhile waits, the newest view a worker kept). Each worker
  // added is reported to the core as a watch opened once its first view was
  // computed, and as closed (lost) when the agent removes it or the stream
  // breaks; not when the coordinator shuts down. A join the agent cancels, or
  // still pending when the stream ends, is withdrawn (Core::CancelJoin).
  // An exit report (see Note [Exited workers] in core.h) goes through
  // Core::WorkerExited and is answered at once with the job's state; it may
  // name only a worker whose calls this stream carried (an accepted join or
  // heartbeat, or a watch added): any other is PERMISSION_DENIED, a
  // malformed id INVALID_ARGUMENT, each refused alone, changing nothing.
  // What the agent saw of a worker's process (a heartbeat's, or a late
  // worker's ProcessReport) goes through Core::ProcessSeen, for a worker
  // whose calls this stream carried only; no answer.
  grpc::ServerBidiReactor<v1::NodeRequest, v1::NodeUpdate>* Node(
      grpc::CallbackServerContext* context) override;

 private:
  CoreHost* host_;
  const Authorizer* auth_;
  Metrics* metrics_;
};

}  // namespace concord::coordinator
