#pragma once
// The coordinator as the node agent calls it (see Note [Node agents] in
// node_agent.h): a channel and stubs per replica of a replicated coordinator,
// the one in use, and the agent's token and deadline on each call. The
// agent's server (node_agent_impl.h) passes calls on through it and its
// Node streams (node_streams.h) open on it. Thread-safe. Not installed; not
// for use elsewhere.

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "common/tls.h"
#include "concord/v1/agent.grpc.pb.h"
#include "concord/v1/worker.grpc.pb.h"

namespace concord::agent {

class CoordinatorReplicas {
 public:
  struct Replica {
    std::shared_ptr<v1::WorkerService::Stub> worker;
    std::shared_ptr<v1::AgentService::Stub> agent;
    std::shared_ptr<grpc::GenericStub> generic;
    absl::Time created;
  };

  // `coordinator`: as CONCORD_COORDINATOR (common/coordinator_channel.h);
  // `token`: what each call presents.
  CoordinatorReplicas(const std::string& coordinator, const TlsMaterial& tls,
                      std::string token);
  CoordinatorReplicas(const CoordinatorReplicas&) = delete;
  CoordinatorReplicas& operator=(const CoordinatorReplicas&) = delete;

  // The replica in use and its index.
  std::pair<Replica, size_t> Current();
  // A call on replica `used` ended with `status`: after UNAVAILABLE, a fresh
  // channel for it if its channel is older than kRefreshChannelAfterMs (see
  // Note [Fresh channels] in common/coordinator_channel.h), and the next
  // replica from now on. The old one is retired, not dropped here (see Note
  // [Where gRPC objects end] in node_agent_impl.h).
  void Note(const grpc::Status& status, size_t used);
  // The replicas retired so far, for the caller to drop on one of the
  // agent's own threads (see Note [Where gRPC objects end]).
  std::vector<Replica> TakeRetired();

  // Sets `deadline` and the agent's token on a call to the coordinator.
  void Prepare(grpc::ClientContext* context,
               std::chrono::system_clock::time_point deadline) const;

 private:
  Replica Make(const std::string& address) const;

  const TlsMaterial tls_;
  const std::string token_;
  const std::vector<std::string> addresses_;
  std::mutex mu_;
  std::vector<Replica> replicas_;  // guarded by mu_
  size_t current_ = 0;             // guarded by mu_
  std::vector<Replica> retired_;   // guarded by mu_
};

}  // namespace concord::agent
