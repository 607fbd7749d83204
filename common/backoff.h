#pragma once
// Exponential backoff with full jitter, for retrying UNAVAILABLE calls.

#include <algorithm>
#include <random>

#include "absl/time/time.h"

namespace concord {

class Backoff {
 public:
  Backoff(absl::Duration initial, absl::Duration max, uint64_t seed = 0)
      : initial_(initial), max_(max), next_(initial), rng_(seed) {}

  // The delay before the next attempt; grows by 2x up to `max`.
  absl::Duration Next() {
    const absl::Duration cap = next_;
    next_ = std::min(max_, next_ * 2);
    std::uniform_real_distribution<double> jitter(0.5, 1.0);
    return cap * jitter(rng_);
  }
  void Reset() { next_ = initial_; }

 private:
  absl::Duration initial_;
  absl::Duration max_;
  absl::Duration next_;
  std::mt19937_64 rng_;
};

}  // namespace concord
