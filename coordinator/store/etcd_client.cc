#include "coordinator/store/etcd_client.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/grpc_status.h"

namespace concord::coordinator {
namespace {

bool Unreachable(const grpc::Status& s) {
  return s.error_code() == grpc::StatusCode::UNAVAILABLE ||
         s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
}

}  // namespace

std::string EtcdPrefixEnd(const std::string& prefix) {
  std::string end = prefix;
  while (!end.empty()) {
    unsigned char last = static_cast<unsigned char>(end.back());
    if (last < 0xff) {
      end.back() = static_cast<char>(last + 1);
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');  // every key
}

absl::StatusOr<std::unique_ptr<EtcdClient>> EtcdClient::Create(
    const std::vector<std::string>& urls, const TlsMaterial& tls,
    absl::Duration call_timeout) {
  if (urls.empty()) {
    return absl::InvalidArgumentError("no etcd endpoint given");
  }
  if (call_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("the etcd call timeout must be positive");
  }
  std::vector<Endpoint> endpoints;
  bool any_https = false;
  for (const std::string& url : urls) {
    std::string target = url;
    bool https = false;
    if (absl::StartsWith(url, "https://")) {
      https = true;
      target = url.substr(8);
    } else if (absl::StartsWith(url, "http://")) {
      target = url.substr(7);
    } else if (absl::StrContains(url, "://")) {
      return absl::InvalidArgumentError(absl::StrCat(
          "etcd endpoint '", url, "': only http:// and https:// are known"));
    }
    while (absl::EndsWith(target, "/")) target.pop_back();
    const size_t colon = target.rfind(':');
    if (target.empty() || colon == std::string::npos || colon == 0 ||
        colon + 1 == target.size() || target.find('/') != std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("etcd endpoint '", url, "' is not http(s)://HOST:PORT"));
    }
    if (https && tls.ca_pem.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("etcd endpoint '", url, "' is https: give --etcd-ca"));
    }
    any_https = any_https || https;
    endpoints.push_back(Endpoint{url, target, https, Stubs{}});
  }
  if (tls.enabled() && !any_https) {
    return absl::InvalidArgumentError(
        "etcd TLS files were given but no endpoint is https://");
  }
  std::unique_ptr<EtcdClient> client(
      new EtcdClient(std::move(endpoints), tls, call_timeout));
  for (Endpoint& e : client->endpoints_) e.stubs = client->Connect(e);
  return client;
}

EtcdClient::Stubs EtcdClient::Connect(const Endpoint& endpoint) const {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  auto channel = grpc::CreateCustomChannel(
      endpoint.target,
      endpoint.https ? ChannelCredentials(tls_)
                     : grpc::InsecureChannelCredentials(),
      args);
  return Stubs{etcdserverpb::KV::NewStub(channel),
               etcdserverpb::Lease::NewStub(channel), absl::Now()};
}

std::string EtcdClient::endpoints() const {
  std::vector<std::string> urls;
  for (const Endpoint& e : endpoints_) urls.push_back(e.url);
  return absl::StrJoin(urls, ",");
}

absl::Status EtcdClient::Call(
    const std::function<grpc::Status(Stubs&, grpc::ClientContext&)>& call,
    absl::Time deadline) {
  const size_t first = current_.load();
  grpc::Status status(grpc::StatusCode::DEADLINE_EXCEEDED,
                      "no time left to call");
  for (size_t i = 0; i < endpoints_.size(); ++i) {
    const absl::Time now = absl::Now();
    if (now >= deadline) break;
    const size_t index = (first + i) % endpoints_.size();
    grpc::ClientContext context;
    context.set_deadline(
        absl::ToChronoTime(std::min(deadline, now + call_timeout_)));
    Stubs stubs;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stubs = endpoints_[index].stubs;
    }
    status = call(stubs, context);
    if (!Unreachable(status)) {
      current_.store(index);
      break;
    }
    std::lock_guard<std::mutex> lock(mu_);
    Endpoint& e = endpoints_[index];
    if (absl::Now() - e.stubs.created > absl::Seconds(1)) {
      e.stubs = Connect(e);
    }
  }
  if (status.ok()) return absl::OkStatus();
  return absl::Status(
      FromGrpcStatus(status).code(),
      absl::StrCat("etcd (", endpoints(), "): ", status.error_message()));
}

absl::StatusOr<etcdserverpb::RangeResponse> EtcdClient::Range(
    const etcdserverpb::RangeRequest& request) {
  etcdserverpb::RangeResponse response;
  absl::Status s = Call([&](Stubs& e, grpc::ClientContext& ctx) {
    return e.kv->Range(&ctx, request, &response);
  });
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<etcdserverpb::TxnResponse> EtcdClient::Txn(
    const etcdserverpb::TxnRequest& request) {
  etcdserverpb::TxnResponse response;
  absl::Status s = Call([&](Stubs& e, grpc::ClientContext& ctx) {
    return e.kv->Txn(&ctx, request, &response);
  });
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<etcdserverpb::LeaseGrantResponse> EtcdClient::LeaseGrant(
    int64_t ttl_seconds) {
  etcdserverpb::LeaseGrantRequest request;
  request.set_ttl(ttl_seconds);
  etcdserverpb::LeaseGrantResponse response;
  absl::Status s = Call([&](Stubs& e, grpc::ClientContext& ctx) {
    return e.lease->LeaseGrant(&ctx, request, &response);
  });
  if (!s.ok()) return s;
  if (!response.error().empty()) {
    return absl::UnavailableError(
        absl::StrCat("etcd refused a lease: ", response.error()));
  }
  return response;
}

absl::StatusOr<int64_t> EtcdClient::LeaseKeepAlive(int64_t lease_id,
                                                   absl::Time deadline) {
  // One short stream per renewal: a stream whose peer went away would
  // otherwise block Read without a deadline.
  etcdserverpb::LeaseKeepAliveRequest request;
  request.set_id(lease_id);
  etcdserverpb::LeaseKeepAliveResponse response;
  bool answered = false;
  absl::Status s = Call(
      [&](Stubs& e, grpc::ClientContext& ctx) {
        auto stream = e.lease->LeaseKeepAlive(&ctx);
        answered = stream->Write(request) && stream->Read(&response);
        stream->WritesDone();
        grpc::Status finished = stream->Finish();
        if (!finished.ok() || answered) return finished;
        return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                            "the keep-alive stream closed without an answer");
      },
      deadline);
  if (!s.ok()) return s;
  return response.ttl();
}

absl::Status EtcdClient::LeaseRevoke(int64_t lease_id) {
  etcdserverpb::LeaseRevokeRequest request;
  request.set_id(lease_id);
  etcdserverpb::LeaseRevokeResponse response;
  return Call([&](Stubs& e, grpc::ClientContext& ctx) {
    return e.lease->LeaseRevoke(&ctx, request, &response);
  });
}

}  // namespace concord::coordinator
