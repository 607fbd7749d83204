#include "coordinator/metrics/metrics.h"

#include <string>

#include "absl/time/clock.h"

namespace concord::coordinator {

Metrics::Metrics()
    : registry_(std::make_shared<prometheus::Registry>()),
      rpcs_(prometheus::BuildCounter()
                .Name("concord_rpc_total")
                .Help("RPCs served, by method and status code")
                .Register(*registry_)),
      latency_(prometheus::BuildHistogram()
                   .Name("concord_rpc_duration_seconds")
                   .Help("Server-side RPC latency (blocking calls included)")
                   .Register(*registry_)),
      store_errors_(prometheus::BuildCounter()
                        .Name("concord_store_errors_total")
                        .Help("Failed writes of job records to the store")
                        .Register(*registry_)
                        .Add({})),
      node_messages_(prometheus::BuildCounter()
                         .Name("concord_node_messages_total")
                         .Help("Node agents' messages on Node streams, by "
                               "what they carried")
                         .Register(*registry_)),
      node_items_(prometheus::BuildCounter()
                      .Name("concord_node_items_total")
                      .Help("Joins, heartbeats and watch changes that node "
                            "agents' messages carried")
                      .Register(*registry_)) {}

void Metrics::RecordRpc(const char* method, absl::StatusCode code,
                        absl::Duration latency) {
  rpcs_.Add({{"method", method}, {"code", absl::StatusCodeToString(code)}})
      .Increment();
  static const prometheus::Histogram::BucketBoundaries kBuckets = {
      0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
      0.025,  0.05,    0.1,    0.25,  0.5,    1,     5};
  latency_.Add({{"method", method}}, kBuckets)
      .Observe(absl::ToDoubleSeconds(latency));
}

}  // namespace concord::coordinator
