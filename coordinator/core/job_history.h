#pragma once
// What the coordinator remembers of a job's progress, for the per-job
// Prometheus metrics (server.cc's collector) and the status page
// (status_http.h). Part of the core: no gRPC, no threads, no clock of its
// own (every call is given the time).
//
// Note [Job history]
// ~~~~~~~~~~~~~~~~~~
// Every accepted heartbeat adds or updates one progress point (time, the
// highest committed step of the members, their summed samples/s, the mean of
// the losses they reported, the member count). Points are `spacing` apart: the
// newest point follows every heartbeat (time and values) until it is a spacing
// past the point before it; then the next heartbeat starts a new one. So the
// newest point is always current. At most kMaxPoints are kept: when one more is
// needed, every second point is dropped and the spacing doubles, so the history
// always covers the whole job at a resolution that halves as the job doubles in
// length (0.5 s for the first ~4 min, 1 s up to ~8 min, ...). Generations are
// remembered with when they formed and ended and why (the last
// kMaxGenerations), and a re-form (a generation ending until the next one
// forming) is timed into a fixed-bucket histogram. Transient: nothing of it is
// persisted, so a restarted (or failed-over) coordinator starts an empty
// history and counters from zero (Prometheus' rate() handles the reset).

#include <array>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <string>

#include "absl/time/time.h"

namespace concord::coordinator {

struct ProgressPoint {
  absl::Time time;
  int64_t step = 0;               // highest committed step of the members
  double samples_per_second = 0;  // summed over the members
  std::optional<double> loss;     // mean of the members that reported one
  int32_t members = 0;
};

struct GenerationRecord {
  int64_t generation = 0;
  absl::Time formed;
  int32_t members = 0;
  std::optional<absl::Time> ended;
  std::string end_reason;  // empty while it runs
  // From the previous generation's end to this one's formation.
  std::optional<absl::Duration> reform;
};

class JobHistory {
 public:
  static constexpr size_t kMaxPoints = 512;
  static constexpr size_t kMaxGenerations = 256;
  static constexpr absl::Duration kInitialSpacing = absl::Milliseconds(500);
  // Upper bounds (seconds) of the re-form histogram's buckets; +Inf is
  // implicit.
  static constexpr std::array<double, 10> kReformBuckets = {
      0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300};

  // See Note [Job history]: `step`, `samples_per_second`, `loss` are the job's
  // aggregates after a heartbeat.
  void RecordProgress(absl::Time now, int64_t step, double samples_per_second,
                      std::optional<double> loss, int32_t members);
  // Whether RecordProgress at `now` would start a new point rather than
  // move the newest.
  bool Appends(absl::Time now) const {
    return points_.size() < 2 ||
           now - points_[points_.size() - 2].time >= spacing_;
  }
  void GenerationFormed(absl::Time now, int64_t generation, int32_t members);
  void GenerationEnded(absl::Time now, int64_t generation,
                       const std::string& why);
  // A worker was declared failed (a "failure" event).
  void RecordFailure() { ++failures_; }

  const std::deque<ProgressPoint>& points() const { return points_; }
  const std::deque<GenerationRecord>& generations() const {
    return generations_;
  }
  absl::Duration spacing() const { return spacing_; }
  int64_t failures() const { return failures_; }
  // Re-forms timed so far: per bucket (not cumulative; the last is +Inf),
  // their count and their sum in seconds.
  const std::array<uint64_t, kReformBuckets.size() + 1>& reform_buckets()
      const {
    return reform_buckets_;
  }
  uint64_t reform_count() const { return reform_count_; }
  double reform_seconds_sum() const { return reform_seconds_sum_; }
  std::optional<absl::Duration> last_reform() const { return last_reform_; }
  // Steps per second over the points of the last `window` before the newest
  // point (at least two points apart); 0 without two such points.
  double StepsPerSecond(absl::Duration window = absl::Seconds(10)) const;

 private:
  std::deque<ProgressPoint> points_;
  absl::Duration spacing_ = kInitialSpacing;
  std::deque<GenerationRecord> generations_;
  int64_t failures_ = 0;
  std::optional<absl::Time> last_end_;  // until the next generation forms
  std::array<uint64_t, kReformBuckets.size() + 1> reform_buckets_{};
  uint64_t reform_count_ = 0;
  double reform_seconds_sum_ = 0;
  std::optional<absl::Duration> last_reform_;
};

}  // namespace concord::coordinator
