#pragma once
// A small synchronous client of etcd's v3 gRPC API (proto/etcd/etcd_v3.proto):
// KV Range/Txn and Lease Grant/KeepAlive/Revoke, which is all the etcd store
// (etcd_store.h) needs.
//
// Endpoints are etcd client URLs, "http://HOST:PORT" (plaintext) or
// "https://HOST:PORT" (TLS with the given CA, and a client certificate for
// etcd's --client-cert-auth); "HOST:PORT" means http. A call that finds its
// endpoint unreachable (UNAVAILABLE, or DEADLINE_EXCEEDED) is tried once on
// each of the other endpoints before it fails, and the client sticks to the
// endpoint that answered. etcd's own user/password authentication is not
// supported (use TLS client certificates).
//
// Thread-safety: every method may be called from any thread.

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/tls.h"
#include "etcd/etcd_v3.grpc.pb.h"

namespace concord::coordinator {

class EtcdClient {
 public:
  // Errors: INVALID_ARGUMENT (no endpoint, a malformed one, https without
  // a CA, or TLS material with only http endpoints).
  static absl::StatusOr<std::unique_ptr<EtcdClient>> Create(
      const std::vector<std::string>& endpoints, const TlsMaterial& tls,
      absl::Duration call_timeout);

  // Each returns etcd's answer, or the status of the last endpoint tried:
  // UNAVAILABLE / DEADLINE_EXCEEDED (etcd unreachable), or what etcd said
  // (e.g. NOT_FOUND for an unknown lease).
  absl::StatusOr<etcdserverpb::RangeResponse> Range(
      const etcdserverpb::RangeRequest& request);
  absl::StatusOr<etcdserverpb::TxnResponse> Txn(
      const etcdserverpb::TxnRequest& request);
  // A lease of `ttl_seconds` (etcd may round it up to its minimum).
  absl::StatusOr<etcdserverpb::LeaseGrantResponse> LeaseGrant(
      int64_t ttl_seconds);
  // One keep-alive round trip, given up (DEADLINE_EXCEEDED) at `deadline`
  // even if the call timeout would allow longer; returns the lease's new TTL
  // in seconds, 0 or less when the lease has already expired.
  absl::StatusOr<int64_t> LeaseKeepAlive(
      int64_t lease_id, absl::Time deadline = absl::InfiniteFuture());
  absl::Status LeaseRevoke(int64_t lease_id);

  // The endpoints as given, for messages.
  std::string endpoints() const;

 private:
  struct Stubs {
    std::shared_ptr<etcdserverpb::KV::Stub> kv;
    std::shared_ptr<etcdserverpb::Lease::Stub> lease;
    absl::Time created;
  };
  struct Endpoint {
    std::string url;
    std::string target;  // host:port
    bool https = false;
    Stubs stubs;  // guarded by mu_
  };
  EtcdClient(std::vector<Endpoint> endpoints, TlsMaterial tls,
             absl::Duration call_timeout)
      : endpoints_(std::move(endpoints)),
        tls_(std::move(tls)),
        call_timeout_(call_timeout) {}

  // Stubs on a new channel to `endpoint`.
  Stubs Connect(const Endpoint& endpoint) const;
  // Runs `call(stubs, context)` on the current endpoint, then on the
  // others while the endpoint is unreachable, each try bounded by the call
  // timeout and all of them by `deadline`. An endpoint found unreachable
  // whose channel is older than a second gets a new one (see Note [Fresh
  // channels] in common/coordinator_channel.h).
  absl::Status Call(
      const std::function<grpc::Status(Stubs&, grpc::ClientContext&)>& call,
      absl::Time deadline = absl::InfiniteFuture());

  std::mutex mu_;
  std::vector<Endpoint> endpoints_;
  const TlsMaterial tls_;
  absl::Duration call_timeout_;
  std::atomic<size_t> current_{0};
};

// The end of the key range that holds every key starting with `prefix`
// (etcd's "prefix" range_end: the prefix with its last byte incremented).
std::string EtcdPrefixEnd(const std::string& prefix);

}  // namespace concord::coordinator
