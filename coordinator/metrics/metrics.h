#pragma once
// Prometheus metrics of the coordinator (prometheus-cpp). Always recorded;
// served over HTTP only when the server has a metrics address.
//
//   concord_rpc_total{method,code}          counter
//   concord_rpc_duration_seconds{method}    histogram (server-side latency)
//   concord_store_errors_total              counter
//   concord_node_messages_total{kind}       counter: node agents' messages
//                                           on Node streams (kind "joins",
//                                           "heartbeats", "watch", "exits":
//                                           what they carried)
//   concord_node_items_total{kind}          counter: the joins, heartbeats,
//                                           watch changes and exit reports
//                                           they carried
//
// The per-job series (concord_jobs, concord_job_*) are read from the core at
// scrape time: jobs_collector.h.
//
// Thread-safe.

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <memory>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace concord::coordinator {

class Metrics {
 public:
  Metrics();
  void RecordRpc(const char* method, absl::StatusCode code,
                 absl::Duration latency);
  void RecordStoreError() { store_errors_.Increment(); }
  // One Node stream message of a node agent carrying `items` of `kind`
  // ("joins", "heartbeats", "watch").
  void RecordNodeMessage(const char* kind, int items) {
    node_messages_.Add({{"kind", kind}}).Increment();
    node_items_.Add({{"kind", kind}}).Increment(items);
  }
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>& rpcs_;
  prometheus::Family<prometheus::Histogram>& latency_;
  prometheus::Counter& store_errors_;
  prometheus::Family<prometheus::Counter>& node_messages_;
  prometheus::Family<prometheus::Counter>& node_items_;
};

// Records one RPC when it goes out of scope with the status it was given.
class RpcScope {
 public:
  RpcScope(Metrics* metrics, const char* method)
      : metrics_(metrics), method_(method), start_(absl::Now()) {}
  ~RpcScope() {
    if (metrics_ != nullptr) {
      metrics_->RecordRpc(method_, code_, absl::Now() - start_);
    }
  }
  RpcScope(const RpcScope&) = delete;
  RpcScope& operator=(const RpcScope&) = delete;
  // Returns `status` after noting its code.
  template <typename S>
  S Done(S status) {
    code_ = static_cast<absl::StatusCode>(status.error_code());
    return status;
  }

 private:
  Metrics* metrics_;
  const char* method_;
  absl::Time start_;
  absl::StatusCode code_ = absl::StatusCode::kUnknown;
};

}  // namespace concord::coordinator
