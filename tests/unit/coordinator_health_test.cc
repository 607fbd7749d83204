// A member's health and a job's straggler cool-downs alone, on a fake clock
// (coordinator/core/health.h; see Note [Hangs], see Note [Stragglers] and see
// Note [Evicting stragglers] in coordinator/core/hang_rule.h). The rules
// themselves: hang_rule_test.cc; their verdicts applied to a job:
// coordinator_decisions_test.cc.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "absl/time/time.h"
#include "common/clock.h"
#include "coordinator/core/health.h"

namespace concord::coordinator {
namespace {

using ::testing::HasSubstr;

v1::WorkerProgress Progress(int64_t collectives, int64_t cpu_ms) {
  v1::WorkerProgress p;
  p.set_generation(1);
  p.set_collectives(collectives);
  p.set_cpu_ms(cpu_ms);
  return p;
}

// In the collective numbered `seq` for `pending_ms`.
v1::WorkerProgress Waiting(int64_t collectives, int64_t cpu_ms, int64_t seq,
                           int64_t pending_ms) {
  v1::WorkerProgress p = Progress(collectives, cpu_ms);
  p.set_pending_seq(seq);
  p.set_pending_kind("allreduce");
  p.set_pending_ms(pending_ms);
  return p;
}

v1::ProcessView View(int64_t cpu_ms, int64_t age_ms,
                     const std::string& state = "running") {
  v1::ProcessView v;
  v.set_state(state);
  v.set_cpu_ms(cpu_ms);
  v.set_age_ms(age_ms);
  return v;
}

class MemberHealthTest : public ::testing::Test {
 protected:
  FakeClock clock_{absl::FromUnixSeconds(1700000000)};
  MemberHealth health_;
};

TEST_F(MemberHealthTest, NothingReportedIsNoProgressAndNoWait) {
  EXPECT_FALSE(health_.progress().has_value());
  EXPECT_FALSE(health_.process().has_value());
  EXPECT_FALSE(health_.WaitsFor(clock_.Now(), absl::ZeroDuration()));
  const MemberProgress p = health_.ProgressOf("w0", 2, 30);
  EXPECT_EQ(p.worker_id, "w0");
  EXPECT_EQ(p.rank, 2);
  EXPECT_EQ(p.step, 30);
  EXPECT_FALSE(p.progress.has_value());
  EXPECT_FALSE(health_.straggler());
}

// See Note [Hangs]: the mark moves only when a report shows progress of the
// member's own; a report without is kept, the mark stays.
TEST_F(MemberHealthTest, TheMarkMovesWithProgressOnly) {
  const absl::Time start = clock_.Now();
  health_.Reported(Progress(10, 1000), 5, start);
  EXPECT_EQ(health_.ProgressOf("w0", 0, 5).progressed, start);
  // No new collective, no step, no CPU: no progress.
  clock_.Advance(absl::Seconds(10));
  health_.Reported(Progress(10, 1000), 5, clock_.Now());
  MemberProgress p = health_.ProgressOf("w0", 0, 5);
  EXPECT_EQ(p.progressed, start);
  EXPECT_EQ(p.reported, clock_.Now());
  // A collective issued is.
  clock_.Advance(absl::Seconds(10));
  health_.Reported(Progress(11, 1000), 5, clock_.Now());
  EXPECT_EQ(health_.ProgressOf("w0", 0, 5).progressed, clock_.Now());
  EXPECT_EQ(health_.progress()->collectives(), 11);
}

// The cheap first test of the hang rule: in a collective for `least`,
// counting the time since the report.
TEST_F(MemberHealthTest, WaitsForCountsTheTimeSinceTheReport) {
  health_.Reported(Waiting(10, 1000, 11, 2000), 5, clock_.Now());
  EXPECT_TRUE(health_.WaitsFor(clock_.Now(), absl::Seconds(2)));
  EXPECT_FALSE(health_.WaitsFor(clock_.Now(), absl::Seconds(3)));
  EXPECT_TRUE(
      health_.WaitsFor(clock_.Now() + absl::Seconds(1), absl::Seconds(3)));
  health_.Reported(Progress(11, 1100), 5, clock_.Now());
  EXPECT_FALSE(
      health_.WaitsFor(clock_.Now() + absl::Hours(1), absl::Seconds(1)));
}

// A new generation is a fresh start: what was in flight is forgotten, and
// the mark is where the member stands now.
TEST_F(MemberHealthTest, RestartForgetsWhatWasInFlight) {
  health_.Reported(Waiting(10, 1000, 11, 60000), 5, clock_.Now());
  clock_.Advance(absl::Minutes(2));
  health_.Restart(7, clock_.Now());
  ASSERT_TRUE(health_.progress().has_value());
  EXPECT_TRUE(health_.progress()->pending_kind().empty());
  EXPECT_EQ(health_.progress()->pending_ms(), 0);
  EXPECT_EQ(health_.progress()->pending_seq(), 0);
  EXPECT_FALSE(health_.WaitsFor(clock_.Now(), absl::ZeroDuration()));
  EXPECT_EQ(health_.ProgressOf("w0", 0, 7).progressed, clock_.Now());
  MemberHealth fresh;
  fresh.Restart(0, clock_.Now());
  EXPECT_EQ(fresh.ProgressOf("w1", 1, 0).progressed, clock_.Now());
}

// See Note [What the agent sees] in agent/process_view.h: the view is dated
// back by its age (a minute at most); CPU used since the last view is
// progress, a stopped process never is.
TEST_F(MemberHealthTest, TheAgentsViewShowsProgressOrNot) {
  health_.Reported(Progress(10, 1000), 5, clock_.Now());
  const absl::Time reported = clock_.Now();
  clock_.Advance(absl::Seconds(30));
  health_.Seen(View(5000, 500), clock_.Now());
  EXPECT_EQ(health_.process_seen(), clock_.Now() - absl::Milliseconds(500));
  EXPECT_EQ(health_.process()->cpu_ms(), 5000);
  // The first view is only where it stands.
  EXPECT_EQ(health_.ProgressOf("w0", 0, 5).progressed, reported);
  clock_.Advance(absl::Seconds(10));
  health_.Seen(View(8000, 0), clock_.Now());
  EXPECT_EQ(health_.ProgressOf("w0", 0, 5).progressed, clock_.Now());
  clock_.Advance(absl::Seconds(10));
  health_.Seen(View(20000, 0, "stopped"), clock_.Now());
  EXPECT_EQ(health_.ProgressOf("w0", 0, 5).progressed,
            clock_.Now() - absl::Seconds(10));
  EXPECT_EQ(health_.ProgressOf("w0", 0, 5).process->state(), "stopped");
  health_.Seen(View(20000, 3600000), clock_.Now());
  EXPECT_EQ(health_.process_seen(), clock_.Now() - absl::Minutes(1));
}

// See Note [Stragglers]: named after kStragglerIntervals slow intervals, no
// longer once as many fast ones brought the count back to 0.
TEST_F(MemberHealthTest, AStragglerIsNamedAndUnnamedWithHysteresis) {
  for (int i = 1; i < kStragglerIntervals; ++i) {
    EXPECT_FALSE(health_.CountInterval(true));
  }
  EXPECT_TRUE(health_.CountInterval(true));
  EXPECT_TRUE(health_.straggler());
  // The count goes up to twice the intervals, and down from there.
  for (int i = 0; i < 3 * kStragglerIntervals; ++i) {
    EXPECT_FALSE(health_.CountInterval(true));
  }
  for (int i = 1; i < 2 * kStragglerIntervals; ++i) {
    EXPECT_FALSE(health_.CountInterval(false));
  }
  EXPECT_TRUE(health_.straggler());
  EXPECT_TRUE(health_.CountInterval(false));
  EXPECT_FALSE(health_.straggler());
  EXPECT_FALSE(health_.CountInterval(false));
}

// See Note [Evicting stragglers]: each eviction doubles the cool-down; the
// worker is held until it ends; the record keeps them.
TEST(CooldownsTest, EvictionsDoubleTheCooldownAndArePersisted) {
  FakeClock clock(absl::FromUnixSeconds(1700000000));
  const absl::Duration base = absl::Seconds(60);
  Cooldowns cooling;
  EXPECT_TRUE(cooling.empty());
  EXPECT_FALSE(cooling.HeldUntil("w1", clock.Now()).has_value());
  EXPECT_EQ(cooling.Evict("w1", clock.Now(), base).until,
            clock.Now() + absl::Seconds(60));
  EXPECT_EQ(cooling.HeldUntil("w1", clock.Now()),
            clock.Now() + absl::Seconds(60));
  clock.Advance(absl::Seconds(60));
  EXPECT_FALSE(cooling.HeldUntil("w1", clock.Now()).has_value());
  const Cooldowns::Cooling& again = cooling.Evict("w1", clock.Now(), base);
  EXPECT_EQ(again.evictions, 2);
  EXPECT_EQ(again.until, clock.Now() + absl::Seconds(120));
  cooling.Evict("w2", clock.Now(), base);
  EXPECT_EQ(cooling.all().size(), 2u);

  v1::JobRecord record;
  cooling.Export(record);
  ASSERT_EQ(record.cooling_size(), 2);
  Cooldowns restored;
  ASSERT_TRUE(restored.Restore(record, "job").ok());
  ASSERT_EQ(restored.all().size(), 2u);
  EXPECT_EQ(restored.all().at("w1").evictions, 2);
  EXPECT_EQ(restored.all().at("w1").until, clock.Now() + absl::Seconds(120));
  EXPECT_EQ(restored.HeldUntil("w2", clock.Now()),
            clock.Now() + absl::Seconds(60));

  record.mutable_cooling(1)->set_evictions(0);
  Cooldowns bad;
  const absl::Status s = bad.Restore(record, "job");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("job record job: a cooling entry"));
  restored.Clear();
  EXPECT_TRUE(restored.empty());
}

}  // namespace
}  // namespace concord::coordinator
