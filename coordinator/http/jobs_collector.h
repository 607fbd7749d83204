#pragma once
// Per-job Prometheus series, read from the core at scrape time (so a job's
// series appear and disappear with the job; Core::MetricsSamples leaves out
// jobs that ended more than kEndedRetention ago). Every series has the
// label job="ID" except concord_jobs:
//
//   concord_jobs{state}                       gauge    jobs by state
//   concord_job_generation{job}               gauge    current generation
//   concord_job_members{job}                  gauge    members of it
//   concord_job_waiting{job}                  gauge    workers waiting
//   concord_job_running{job}                  gauge    1 while a generation
//   runs concord_job_step{job}                     gauge    highest committed
//   step concord_job_steps_per_second{job}         gauge    over the last 10 s
//   concord_job_samples_per_second{job}       gauge    summed over members
//   concord_job_loss{job}                     gauge    mean reported loss
//   concord_job_failures_total{job}           counter  workers declared failed
//   concord_job_reform_seconds{job}           histogram  generation end to
//                                                        the next formation
//   concord_job_last_reform_seconds{job}      gauge    the latest re-form
//
// concord_job_loss and concord_job_last_reform_seconds are absent until
// there is a value. Thread-safe (the core is read under CoreHost's mutex).

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
