#include "coordinator/http/jobs_collector.h"

#include <prometheus/client_metric.h>

#include <limits>
#include <map>
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

void Gauge(MetricFamily& family, const std::string& job, double v) {
  Add(family, "job", job).gauge.value = v;
}

}  // namespace

std::vector<MetricFamily> JobsCollector::Collect() const {
  const std::vector<JobMetricsSample> jobs = host_->Read(
      [](const Core& core) { return core.MetricsSamples(kEndedRetention); });
  MetricFamily states =
      Family("concord_jobs", "Jobs by state", MetricType::Gauge);
  MetricFamily generation =
      Family("concord_job_generation", "Current generation of each job",
             MetricType::Gauge);
  MetricFamily members =
      Family("concord_job_members", "Members of each job's current generation",
             MetricType::Gauge);
  MetricFamily waiting = Family(
      "concord_job_waiting", "Workers waiting for each job's next generation",
      MetricType::Gauge);
  MetricFamily running =
      Family("concord_job_running",
             "1 while a generation of the job runs, else 0", MetricType::Gauge);
  MetricFamily step =
      Family("concord_job_step", "Highest committed step of the members",
             MetricType::Gauge);
  MetricFamily steps_per_second = Family(
      "concord_job_steps_per_second",
      "Committed steps per second over the last 10 s (0 between generations)",
      MetricType::Gauge);
  MetricFamily samples_per_second =
      Family("concord_job_samples_per_second",
             "Training throughput summed over the members (0 between "
             "generations)",
             MetricType::Gauge);
  MetricFamily loss =
      Family("concord_job_loss",
             "Mean of the training losses the members reported last",
             MetricType::Gauge);
  MetricFamily failures =
      Family("concord_job_failures_total",
             "Workers declared failed (missed heartbeats, broken connections)",
             MetricType::Counter);
  MetricFamily reform =
      Family("concord_job_reform_seconds",
             "Time from a generation's end to the next one's formation",
             MetricType::Histogram);
  MetricFamily last_reform =
      Family("concord_job_last_reform_seconds",
             "Duration of the job's latest re-form", MetricType::Gauge);

  // See Note [Checkpoints] in worker/checkpoint/checkpointer.h.
  MetricFamily ckpt_written =
      Family("concord_job_checkpoints_written_total",
             "Checkpoints the node agents wrote to disk", MetricType::Counter);
  MetricFamily ckpt_skipped = Family(
      "concord_job_checkpoints_skipped_total",
      "Checkpoints that fell due while the previous one was being written",
      MetricType::Counter);
  MetricFamily ckpt_failed =
      Family("concord_job_checkpoint_failures_total",
             "Checkpoint writes that failed (the last complete one stays)",
             MetricType::Counter);
  MetricFamily ckpt_failing =
      Family("concord_job_checkpoint_failing",
             "1 while the job's last checkpoint write failed, else 0",
             MetricType::Gauge);
  MetricFamily ckpt_step =
      Family("concord_job_checkpoint_step",
             "Step of the newest complete checkpoint", MetricType::Gauge);
  MetricFamily ckpt_bytes =
      Family("concord_job_checkpoint_bytes",
             "Size of the newest complete checkpoint", MetricType::Gauge);
  MetricFamily ckpt_write = Family(
      "concord_job_checkpoint_write_seconds",
      "Background write of the newest complete checkpoint, snapshot to rename",
      MetricType::Gauge);
  MetricFamily ckpt_stall =
      Family("concord_job_checkpoint_stall_seconds",
             "Training step's stall for the newest complete checkpoint (its "
             "copy into the node's memory)",
             MetricType::Gauge);

  std::map<std::string, int> by_state;
  for (int s = v1::JobState_MIN; s <= v1::JobState_MAX; ++s) {
    if (s != v1::JOB_STATE_UNSPECIFIED) {
      by_state[v1::JobState_Name(static_cast<v1::JobState>(s))] = 0;
    }
  }
  for (const JobMetricsSample& job : jobs) {
    const std::string& id = job.job_id;
    ++by_state[v1::JobState_Name(job.state)];
    Gauge(generation, id, static_cast<double>(job.generation));
    Gauge(members, id, job.members);
    Gauge(waiting, id, job.waiting);
    Gauge(running, id, job.state == v1::JOB_STATE_RUNNING ? 1 : 0);
    Gauge(step, id, static_cast<double>(job.step));
    Gauge(steps_per_second, id, job.steps_per_second);
    Gauge(samples_per_second, id, job.samples_per_second);
    if (job.loss.has_value()) Gauge(loss, id, *job.loss);
    Add(failures, "job", id).counter.value = static_cast<double>(job.failures);
    ClientMetric& h = Add(reform, "job", id);
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
    if (job.last_reform_seconds.has_value()) {
      Gauge(last_reform, id, *job.last_reform_seconds);
    }
    const v1::CheckpointTotals& totals = job.checkpoint_totals;
    Add(ckpt_written, "job", id).counter.value =
        static_cast<double>(totals.written());
    Add(ckpt_skipped, "job", id).counter.value =
        static_cast<double>(totals.skipped());
    Add(ckpt_failed, "job", id).counter.value =
        static_cast<double>(totals.failed());
    Gauge(ckpt_failing, id, totals.has_failing() ? 1 : 0);
    if (job.last_checkpoint.step() > 0) {
      const v1::CheckpointReport& c = job.last_checkpoint;
      Gauge(ckpt_step, id, static_cast<double>(c.step()));
      Gauge(ckpt_bytes, id, static_cast<double>(c.bytes()));
      Gauge(ckpt_write, id, c.write_seconds());
      Gauge(ckpt_stall, id, c.stall_seconds());
    }
  }
  for (const auto& [state, n] : by_state) {
    Add(states, "state", state).gauge.value = n;
  }
  return {states,       generation,   members,          waiting,
          running,      step,         steps_per_second, samples_per_second,
          loss,         failures,     reform,           last_reform,
          ckpt_written, ckpt_skipped, ckpt_failed,      ckpt_failing,
          ckpt_step,    ckpt_bytes,   ckpt_write,       ckpt_stall};
}

}  // namespace concord::coordinator
