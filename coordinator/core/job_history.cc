#include "coordinator/core/job_history.h"

#include <utility>

namespace concord::coordinator {

void JobHistory::RecordProgress(absl::Time now, int64_t step,
                                double samples_per_second,
                                std::optional<double> loss, int32_t members) {
  // The newest point moves with each heartbeat until it is a spacing past
  // the one before it.
  if (!Appends(now)) {
    points_.back() =
        ProgressPoint{now, step, samples_per_second, loss, members};
    return;
  }
  if (points_.size() >= kMaxPoints) {
    // Keep every second point, the newest included; the spacing doubles.
    std::deque<ProgressPoint> kept;
    const size_t n = points_.size();
    for (size_t i = (n - 1) % 2; i < n; i += 2) kept.push_back(points_[i]);
    points_ = std::move(kept);
    spacing_ *= 2;
  }
  points_.push_back(
      ProgressPoint{now, step, samples_per_second, loss, members});
}

void JobHistory::GenerationFormed(absl::Time now, int64_t generation,
                                  int32_t members) {
  GenerationRecord record;
  record.generation = generation;
  record.formed = now;
  record.members = members;
  if (last_end_.has_value()) {
    const absl::Duration reform = now - *last_end_;
    record.reform = reform;
    last_reform_ = reform;
    const double seconds = absl::ToDoubleSeconds(reform);
    size_t bucket = 0;
    while (bucket < kReformBuckets.size() && seconds > kReformBuckets[bucket]) {
      ++bucket;
    }
    ++reform_buckets_[bucket];
    ++reform_count_;
    reform_seconds_sum_ += seconds;
    last_end_.reset();
  }
  if (generations_.size() >= kMaxGenerations) generations_.pop_front();
  generations_.push_back(std::move(record));
}

void JobHistory::GenerationEnded(absl::Time now, int64_t generation,
                                 const std::string& why) {
  last_end_ = now;
  for (auto it = generations_.rbegin(); it != generations_.rend(); ++it) {
    if (it->generation == generation) {
      it->ended = now;
      it->end_reason = why;
      return;
    }
  }
}

double JobHistory::StepsPerSecond(absl::Duration window) const {
  if (points_.size() < 2) return 0;
  const ProgressPoint& last = points_.back();
  // The oldest point within the window, but never the newest itself.
  size_t i = points_.size() - 2;
  while (i > 0 && last.time - points_[i - 1].time <= window) --i;
  const ProgressPoint& first = points_[i];
  const double seconds = absl::ToDoubleSeconds(last.time - first.time);
  if (seconds <= 0 || last.step < first.step) return 0;
  return static_cast<double>(last.step - first.step) / seconds;
}

}  // namespace concord::coordinator
