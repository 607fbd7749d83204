#include "coordinator/metrics/jobs_collector.h"

#include <prometheus/client_metric.h>

#include <limits>
#include <map>
#include <optional>
#include <string>
#include <utility>

namespace concord::coordinator {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

MetricFamily Family(const char* name, const char* help, MetricType type) {
  return MetricFamily{name, help, type, {}};
}

ClientMetric& Add(MetricFamily& family, const std::string& label,
                  const std::string& value) {
  ClientMetric& m = family.metric.emplace_back();
  m.label.push_back({label, value});
  return m;
}

// One per-job series: its name, help and type, and its value for a job
// (nullopt: no sample for that job yet). The reform histogram has no
// `value`: ReformHistogram fills it.
struct JobSeries {
  const char* name;
  const char* help;
  MetricType type;
  std::optional<double> (*value)(const JobMetricsSample&);
};

double D(int64_t v) { return static_cast<double>(v); }

// The order of the exposition. See Note [Checkpoints] in
// worker/checkpoint/checkpointer.h for the checkpoint series.
constexpr JobSeries kJobSeries[] = {
    {"concord_job_generation", "Current generation of each job",
     MetricType::Gauge,
     [](const JobMetricsSample& j) -> std::optional<double> {
       return D(j.generation);
     }},
    {"concord_job_members", "Members of each job's current generation",
     MetricType::Gauge,
     [](const JobMetricsSample& j) -> std::optional<double> {
       return j.members;
     }},
    {"concord_job_waiting", "Workers waiting for each job's next generation",
     MetricType::Gauge,
     [](const JobMetricsSample& j) -> std::optional<double> {
       return j.waiting;
     }},
    {"concord_job_running", "1 while a generation of the job runs, else 0",
     MetricType::Gauge,
     [](const JobMetricsSample& j) -> std::optional<double> {
       return j.state == v1::JOB_STATE_RUNNING ? 1 : 0;
     }},
    {"concord_job_step", "Highest committed step of the members",
     MetricType::Gauge,
     [](const JobMetricsSample& j) -> std::optional<double> {
       return D(j.step);
     }},
    {"concord_job_steps_per_second",
     "Committed steps per second over the last 10 s (0 between generations)",
     MetricType::Gauge,
     [](const JobMetricsSample& j) -> std::optional<double> {
       return j.steps_per_second;
     }},
    {"concord_job_samples_per_second",
     "Training throughput summed over the members (0 between generations)",
     MetricType::Gauge,
     [](const JobMetricsSample& j) -> std::optional<double> {
       return j.samples_per_second;
     }},
    {"concord_job_loss",
     "Mean of the training losses the members reported last", MetricType::Gauge,
     [](const JobMetricsSample& j) { return j.loss; }},
    {"concord_job_failures_total",
     "Workers declared failed (missed heartbeats, broken connections)",
     MetricType::Counter,
     [](const JobMetricsSample& j) -> std::optional<double> {
       return D(j.failures);
     }},
    {"concord_job_reform_seconds",
     "Time from a generation's end to the next one's formation",
     MetricType::Histogram, nullptr},
    {"concord_job_last_reform_seconds", "Duration of the job's latest re-form",
     MetricType::Gauge,
     [](const JobMetricsSample& j) { return j.last_reform_seconds; }},
    {"concord_job_checkpoints_written_total",
     "Checkpoints the node agents wrote to disk", MetricType::Counter,
     [](const JobMetricsSample& j) -> std::optional<double> {
       return D(j.checkpoint_totals.written());
     }},
    {"concord_job_checkpoints_skipped_total",
     "Checkpoints that fell due while the previous one was being written",
     MetricType::Counter,
     [](const JobMetricsSample& j) -> std::optional<double> {
       return D(j.checkpoint_totals.skipped());
     }},
    {"concord_job_checkpoint_failures_total",
     "Checkpoint writes that failed (the last complete one stays)",
     MetricType::Counter,
     [](const JobMetricsSample& j) -> std::optional<double> {
       return D(j.checkpoint_totals.failed());
     }},
    {"concord_job_checkpoint_failing",
     "1 while the job's last checkpoint write failed, else 0",
     MetricType::Gauge,
     [](const JobMetricsSample& j) -> std::optional<double> {
       return j.checkpoint_totals.has_failing() ? 1 : 0;
     }},
    {"concord_job_checkpoint_step", "Step of the newest complete checkpoint",
     MetricType::Gauge,
     [](const JobMetricsSample& j) -> std::optional<double> {
       if (j.last_checkpoint.step() <= 0) return std::nullopt;
       return D(j.last_checkpoint.step());
     }},
    {"concord_job_checkpoint_bytes", "Size of the newest complete checkpoint",
     MetricType::Gauge,
     [](const JobMetricsSample& j) -> std::optional<double> {
       if (j.last_checkpoint.step() <= 0) return std::nullopt;
       return D(j.last_checkpoint.bytes());
     }},
    {"concord_job_checkpoint_write_seconds",
     "Background write of the newest complete checkpoint, snapshot to rename",
     MetricType::Gauge,
     [](const JobMetricsSample& j) -> std::optional<double> {
       if (j.last_checkpoint.step() <= 0) return std::nullopt;
       return j.last_checkpoint.write_seconds();
     }},
    {"concord_job_checkpoint_stall_seconds",
     "Training step's stall for the newest complete checkpoint (its copy into "
     "the node's memory)",
     MetricType::Gauge,
     [](const JobMetricsSample& j) -> std::optional<double> {
       if (j.last_checkpoint.step() <= 0) return std::nullopt;
       return j.last_checkpoint.stall_seconds();
     }},
};

void ReformHistogram(MetricFamily& family, const JobMetricsSample& job) {
  ClientMetric& h = Add(family, "job", job.job_id);
  h.histogram.sample_count = job.reform_count;
  h.histogram.sample_sum = job.reform_seconds_sum;
  uint64_t cumulative = 0;
  for (size_t i = 0; i < job.reform_buckets.size(); ++i) {
    cumulative += job.reform_buckets[i];
    ClientMetric::Bucket& b = h.histogram.bucket.emplace_back();
    b.upper_bound = i < JobHistory::kReformBuckets.size()
                        ? JobHistory::kReformBuckets[i]
                        : std::numeric_limits<double>::infinity();
    b.cumulative_count = cumulative;
  }
}

// concord_jobs{state}: every state but UNSPECIFIED, 0 when no job has it.
MetricFamily JobsByState(const std::vector<JobMetricsSample>& jobs) {
  std::map<std::string, int> by_state;
  for (int s = v1::JobState_MIN; s <= v1::JobState_MAX; ++s) {
    if (s != v1::JOB_STATE_UNSPECIFIED) {
      by_state[v1::JobState_Name(static_cast<v1::JobState>(s))] = 0;
    }
  }
  for (const JobMetricsSample& job : jobs) {
    ++by_state[v1::JobState_Name(job.state)];
  }
  MetricFamily states =
      Family("concord_jobs", "Jobs by state", MetricType::Gauge);
  for (const auto& [state, n] : by_state) {
    Add(states, "state", state).gauge.value = n;
  }
  return states;
}

// See Note [Stragglers] in coordinator/core/hang_rule.h: per worker of a
// running generation, its step time and how it splits, and whether it is named
// a straggler.
std::vector<MetricFamily> WorkerSeries(
    const std::vector<JobMetricsSample>& jobs) {
  struct Series {
    const char* name;
    const char* help;
    double (*value)(const JobMetricsSample::Worker&);
  };
  static constexpr Series kSeries[] = {
      {"concord_worker_step_seconds",
       "Median time between a member's last committed steps",
       [](const JobMetricsSample::Worker& w) { return w.step_ms / 1e3; }},
      {"concord_worker_own_seconds",
       "The part of it the member spent on its own work (not waiting in "
       "collectives)",
       [](const JobMetricsSample::Worker& w) { return w.own_ms / 1e3; }},
      {"concord_worker_wait_seconds",
       "The part of it the member spent waiting in collectives",
       [](const JobMetricsSample::Worker& w) { return w.wait_ms / 1e3; }},
      {"concord_worker_straggler",
       "1 while the coordinator names the member a straggler, else 0",
       [](const JobMetricsSample::Worker& w) {
         return w.straggler ? 1.0 : 0.0;
       }},
  };
  std::vector<MetricFamily> out;
  for (const Series& series : kSeries) {
    MetricFamily family = Family(series.name, series.help, MetricType::Gauge);
    for (const JobMetricsSample& job : jobs) {
      for (const JobMetricsSample::Worker& w : job.workers) {
        ClientMetric& m = Add(family, "job", job.job_id);
        m.label.push_back({"worker", w.worker_id});
        m.gauge.value = series.value(w);
      }
    }
    out.push_back(std::move(family));
  }
  return out;
}

}  // namespace

std::vector<MetricFamily> JobsCollector::Collect() const {
  const std::vector<JobMetricsSample> jobs = host_->Read(
      [](const Core& core) { return core.MetricsSamples(kEndedRetention); });
  std::vector<MetricFamily> out = {JobsByState(jobs)};
  for (const JobSeries& series : kJobSeries) {
    MetricFamily family = Family(series.name, series.help, series.type);
    for (const JobMetricsSample& job : jobs) {
      if (series.value == nullptr) {
        ReformHistogram(family, job);
        continue;
      }
      const std::optional<double> v = series.value(job);
      if (!v.has_value()) continue;
      ClientMetric& m = Add(family, "job", job.job_id);
      (series.type == MetricType::Counter ? m.counter.value : m.gauge.value) =
          *v;
    }
    out.push_back(std::move(family));
  }
  for (MetricFamily& family : WorkerSeries(jobs)) {
    out.push_back(std::move(family));
  }
  return out;
}

}  // namespace concord::coordinator
