#pragma once
// The gRPC face of the coordinator for workers: checks the caller's token,
// converts protos and waits; every decision is the Core's.
//
// gRPC's callback API: no call holds a thread while it waits. Join, KvGet
// and WatchMembership are waiters of the CoreHost (see Note [Asynchronous
// waits] in host.h); the other methods answer in the handler.
//
// Thread-safety: every method may be called from any thread; the CoreHost
// serialises access to the Core. Every method first checks the worker token
// (Authorizer: UNAUTHENTICATED, PERMISSION_DENIED) and then validates the
// request (INVALID_ARGUMENT, nothing changed).

#include <grpcpp/grpcpp.h>

#include <optional>

#include "concord/v1/worker.grpc.pb.h"
#include "coordinator/host/host.h"
#include "coordinator/metrics/metrics.h"
#include "coordinator/rpc/authorizer.h"

namespace concord::coordinator {

// With the host's mutex held: the answer to a registered Join once there is
// one (its generation formed: OK with `response` filled; it was placed in
// a generation that ended since: ABORTED; or the core's error), nullopt
// while the worker waits.
std::optional<absl::Status> JoinAnswer(Core& core,
                                       const v1::JoinRequest& request,
                                       v1::JoinResponse* response);

class WorkerServiceImpl final : public v1::WorkerService::CallbackService {
 public:
  // All must outlive the service; `metrics` may be null.
  WorkerServiceImpl(CoreHost* host, const Authorizer* auth, Metrics* metrics)
      : host_(host), auth_(auth), metrics_(metrics) {}

  // Registers the worker, then waits until its generation forms, for at most
  // wait_timeout_ms (default 300 s when 0) and the call's deadline. Errors:
  // those of Core::Join, DEADLINE_EXCEEDED, CANCELLED, ABORTED (the generation
  // it was placed in ended before the call saw it: join again), UNAVAILABLE
  // (shutting down). A call cancelled while it waits (its client went away)
  // frees its waiter and withdraws its worker unless the worker joined again
  // since (Core::CancelJoin): no generation forms with a process that will
  // never hear of it.
  grpc::ServerUnaryReactor* Join(grpc::CallbackServerContext* context,
                                 const v1::JoinRequest* request,
                                 v1::JoinResponse* response) override;
  // Errors as Core::Heartbeat.
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* context,
                                      const v1::HeartbeatRequest* request,
                                      v1::HeartbeatResponse* response) override;
  // Errors as Core::Leave.
  grpc::ServerUnaryReactor* Leave(grpc::CallbackServerContext* context,
                                  const v1::LeaveRequest* request,
                                  v1::LeaveResponse* response) override;
  // Errors as Core::WorkerCheckpointReported.
  grpc::ServerUnaryReactor* ReportCheckpoint(
      grpc::CallbackServerContext* context,
      const v1::ReportCheckpointRequest* request,
      v1::ReportCheckpointResponse* response) override;
  // Errors as Core::KvSet.
  grpc::ServerUnaryReactor* KvSet(grpc::CallbackServerContext* context,
                                  const v1::KvSetRequest* request,
                                  v1::KvSetResponse* response) override;
  // Waits until every key is set, for at most wait_timeout_ms (default
  // 300 s when 0) and the call's deadline. Errors as Core::KvGet, plus
  // DEADLINE_EXCEEDED, CANCELLED, UNAVAILABLE (shutting down).
  grpc::ServerUnaryReactor* KvGet(grpc::CallbackServerContext* context,
                                  const v1::KvGetRequest* request,
                                  v1::KvGetResponse* response) override;
  // Streams Core::Membership: once at once, then after every change that
  // alters it. Ends OK after sending a terminal state (succeeded, failed,
  // stopped); UNAVAILABLE on shutdown; CANCELLED when the client goes away.
  // Errors as Core::Membership.
  grpc::ServerWriteReactor<v1::MembershipUpdate>* WatchMembership(
      grpc::CallbackServerContext* context,
      const v1::WatchMembershipRequest* request) override;

 private:
  CoreHost* host_;
  const Authorizer* auth_;
  Metrics* metrics_;
};

}  // namespace concord::coordinator
