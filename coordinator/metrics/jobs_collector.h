#pragma once
// Per-job Prometheus series, read from the core at scrape time (so a job's
// series appear and disappear with the job; Core::MetricsSamples leaves out
// jobs that ended more than kEndedRetention ago): concord_jobs{state}, and
// one series per row of kJobSeries in jobs_collector.cc, each with the label
// job="ID" (docs/operators.md lists them). A job's series without a value
// yet (its loss, its last re-form, its newest checkpoint) is absent.
// Thread-safe (the core is read under CoreHost's mutex).

#include <prometheus/collectable.h>
#include <prometheus/metric_family.h>

#include <vector>

#include "absl/time/time.h"
#include "coordinator/host/host.h"

namespace concord::coordinator {

class JobsCollector final : public prometheus::Collectable {
 public:
  static constexpr absl::Duration kEndedRetention = absl::Minutes(10);

  // `host` must outlive this.
  explicit JobsCollector(CoreHost* host) : host_(host) {}
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  CoreHost* host_;
};

}  // namespace concord::coordinator
