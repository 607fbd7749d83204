// The core's per-job history (see Note [Job history]) and the loss field of
// heartbeats, with a fake clock.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "coordinator/core/job_history.h"
#include "coordinator_core_fixture.h"
#include "coordinator_requests.h"

namespace concord::coordinator {
namespace {

using namespace ::concord::coordinator::testing;  // NOLINT

using HistoryTest = CoordinatorDecisionsTest;

TEST_F(HistoryTest, NonFiniteLossIsInvalidAndChangesNothing) {
  const int64_t gen = FormGeneration(2);
  for (double bad : {std::numeric_limits<double>::quiet_NaN(),
                     std::numeric_limits<double>::infinity(),
                     -std::numeric_limits<double>::infinity()}) {
    v1::HeartbeatRequest r = HeartbeatReq(Worker(0), gen, 5);
    r.set_loss(bad);
    EXPECT_EQ(core_.Heartbeat(r).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  EXPECT_TRUE(core_.History(kJob)->points().empty());
  v1::GetJobRequest get;
  get.set_job_id(kJob);
  const v1::JobStatus status = *core_.GetJob(get);
  EXPECT_FALSE(status.members(0).has_loss());
  EXPECT_EQ(status.members(0).committed_step(), 0);
}

TEST_F(HistoryTest, HeartbeatsAggregateOverMembers) {
  const int64_t gen = FormGeneration(2);
  v1::HeartbeatRequest a = HeartbeatReq(Worker(0), gen, 7);
  a.set_samples_per_second(100);
  a.set_loss(1.0);
  ASSERT_TRUE(core_.Heartbeat(a).ok());
  v1::HeartbeatRequest b = HeartbeatReq(Worker(1), gen, 6);
  b.set_samples_per_second(50);
  b.set_loss(3.0);
  ASSERT_TRUE(core_.Heartbeat(b).ok());
  const JobHistory h = *core_.History(kJob);
  ASSERT_FALSE(h.points().empty());
  const ProgressPoint& p = h.points().back();
  EXPECT_EQ(p.step, 7);
  EXPECT_DOUBLE_EQ(p.samples_per_second, 150);
  ASSERT_TRUE(p.loss.has_value());
  EXPECT_DOUBLE_EQ(*p.loss, 2.0);
  EXPECT_EQ(p.members, 2);
  ASSERT_EQ(h.generations().size(), 1u);
  EXPECT_EQ(h.generations()[0].generation, gen);
  EXPECT_FALSE(h.generations()[0].reform.has_value());
  EXPECT_EQ(core_.History("nosuch").status().code(),
            absl::StatusCode::kNotFound);
}

// See Note [Lazy progress]: the core computes the members' aggregates only when
// the history needs them, and must leave the same points as a history fed
// the aggregates after every heartbeat.
TEST_F(HistoryTest, LazyAggregatesLeaveTheSamePointsAsEagerOnes) {
  int64_t gen = FormGeneration(3);
  JobHistory eager;
  int64_t steps[3] = {0, 0, 0};
  double rates[3] = {0, 0, 0};
  double losses[3] = {0, 0, 0};
  bool reported[3] = {false, false, false};
  uint32_t seed = 7;
  auto next = [&] {
    seed = seed * 1103515245u + 12345u;
    return (seed >> 16) % 1000;
  };
  // Long enough (~8 min) for the history to thin its points once.
  for (int i = 0; i < 8000; ++i) {
    clock_.Advance(absl::Milliseconds(1 + next() % 120));
    const int w = static_cast<int>(next() % 3);
    steps[w] += next() % 3;
    rates[w] = 10.0 + 0.37 * next();
    losses[w] = 0.01 * next();
    reported[w] = true;
    v1::HeartbeatRequest r = HeartbeatReq(Worker(w), gen, steps[w]);
    r.set_samples_per_second(rates[w]);
    r.set_loss(losses[w]);
    ASSERT_TRUE(core_.Heartbeat(r).ok());
    double loss_sum = 0;
    int n = 0;
    for (int k = 0; k < 3; ++k) {
      if (!reported[k]) continue;
      loss_sum += losses[k];
      ++n;
    }
    eager.RecordProgress(clock_.Now(), std::max({steps[0], steps[1], steps[2]}),
                         rates[0] + rates[1] + rates[2], loss_sum / n, 3);
    if (i % 500 == 0) {
      // A reader in between changes nothing.
      EXPECT_EQ(core_.History(kJob)->points().size(), eager.points().size());
    }
  }
  const JobHistory lazy = *core_.History(kJob);
  ASSERT_EQ(lazy.points().size(), eager.points().size());
  EXPECT_GT(lazy.spacing(), JobHistory::kInitialSpacing);
  for (size_t i = 0; i < lazy.points().size(); ++i) {
    const ProgressPoint& a = lazy.points()[i];
    const ProgressPoint& b = eager.points()[i];
    EXPECT_EQ(a.time, b.time) << i;
    EXPECT_EQ(a.step, b.step) << i;
    EXPECT_EQ(a.samples_per_second, b.samples_per_second) << i;
    EXPECT_EQ(a.loss, b.loss) << i;
    EXPECT_EQ(a.members, b.members) << i;
  }
}

TEST_F(HistoryTest, PointsStayBoundedAndCoverTheWholeJob) {
  const int64_t gen = FormGeneration(1);
  const absl::Time start = clock_.Now();
  for (int i = 1; i <= 20000; ++i) {
    clock_.Advance(absl::Milliseconds(100));
    ASSERT_TRUE(core_.Heartbeat(HeartbeatReq(Worker(0), gen, i)).ok());
  }
  const JobHistory h = *core_.History(kJob);
  EXPECT_LE(h.points().size(), JobHistory::kMaxPoints);
  EXPECT_GT(h.points().size(), JobHistory::kMaxPoints / 4);
  EXPECT_GT(h.spacing(), JobHistory::kInitialSpacing);
  // The oldest point is near the start, the newest is current.
  EXPECT_LT(h.points().front().time - start, 4 * h.spacing());
  EXPECT_EQ(h.points().back().step, 20000);
  EXPECT_EQ(h.points().back().time, clock_.Now());
  EXPECT_NEAR(h.StepsPerSecond(), 10.0, 0.5);
}

TEST_F(HistoryTest, FailuresAreCountedAndEndedJobsLeaveTheMetrics) {
  FormGeneration(2);
  clock_.Advance(absl::Minutes(1));  // both miss their heartbeats
  core_.Tick();
  EXPECT_GE(core_.History(kJob)->failures(), 1);
  v1::StopJobRequest stop;
  stop.set_job_id(kJob);
  ASSERT_TRUE(core_.StopJob(stop).ok());
  EXPECT_EQ(core_.MetricsSamples(absl::Minutes(10)).size(), 1u);
  clock_.Advance(absl::Minutes(11));
  EXPECT_TRUE(core_.MetricsSamples(absl::Minutes(10)).empty());
  EXPECT_EQ(core_.job_count(), 1u);  // still shown to operators
}

TEST(JobHistoryTest, ReformsAreTimed) {
  JobHistory h;
  const absl::Time t = absl::FromUnixSeconds(1000);
  h.GenerationFormed(t, 1, 2);
  h.GenerationEnded(t + absl::Seconds(5), 1, "worker w1 failed");
  h.GenerationFormed(t + absl::Seconds(6.5), 2, 1);
  ASSERT_EQ(h.generations().size(), 2u);
  EXPECT_EQ(h.generations()[0].end_reason, "worker w1 failed");
  EXPECT_EQ(h.generations()[1].reform, absl::Seconds(1.5));
  EXPECT_EQ(h.last_reform(), absl::Seconds(1.5));
  EXPECT_EQ(h.reform_count(), 1u);
  EXPECT_DOUBLE_EQ(h.reform_seconds_sum(), 1.5);
  // 1.5 s falls in the (1, 2.5] bucket, the fifth.
  EXPECT_EQ(h.reform_buckets()[4], 1u);
}

}  // namespace
}  // namespace concord::coordinator
