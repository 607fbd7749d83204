#pragma once
// Channels to the coordinator, for every client of it (workers, node
// agents): how an address names its replicas, and the channel settings.

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <vector>

#include "common/tls.h"

namespace concord {

// The replicas named by a coordinator address: "HOST:PORT" or
// "HOST:PORT,HOST:PORT,..." (coordinator replicas sharing an etcd store, in
// any order: only the leader listens). A gRPC target with a scheme
// ("ipv4:...", "dns:///...", "unix:...") is one target, passed as is.
std::vector<std::string> SplitCoordinatorAddress(const std::string& address);

// The channel to one coordinator replica. gRPC's default reconnect backoff
// grows to two minutes; capped at one second here.
//
// Note [Fresh channels]
// ~~~~~~~~~~~~~~~~~~~~~
// After a coordinator restart or an etcd failover (a standby starts listening a
// lease TTL after the leader died), a gRPC 1.51 channel that has been failing
// to connect can take several seconds (measured: ~4 s) to notice that the
// address now accepts connections, whatever its backoff settings say: longer
// than a short heartbeat timeout, so the new coordinator would declare every
// worker failed. A client whose channel has been failing for
// kRefreshChannelAfter therefore replaces it by a fresh one, which connects at
// its first call.
std::shared_ptr<grpc::Channel> CoordinatorChannel(const std::string& address,
                                                  const TlsMaterial& tls);
inline constexpr int kRefreshChannelAfterMs = 1000;

}  // namespace concord
