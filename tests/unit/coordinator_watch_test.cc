// Re-forming with lost watch streams (see Note [Re-forming] in
// coordinator/core/core.h): an expected survivor whose WatchMembership stream
// was lost is dropped after a grace, one that comes back is kept.

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "coordinator/core/core.h"
#include "coordinator_core_fixture.h"
#include "coordinator_requests.h"

namespace concord::coordinator {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

using testing::CoordinatorReformTest;
using testing::HeartbeatReq;
using testing::JoinReq;
using testing::kJob;
using testing::LeaveReq;
using testing::RejoinReq;
using testing::SameRecord;
using testing::Secret;
using testing::Spec;
using testing::Worker;

// ---- Lost watch streams (see Note [Re-forming]) ---------------------------

class CoordinatorWatchTest : public CoordinatorReformTest {
 protected:
  // Every member of `gen` watches and heartbeats (at step 4).
  void WatchAndHeartbeat(int n, int64_t gen) {
    for (int i = 0; i < n; ++i) {
      core_.WatchOpened(kJob, Worker(i));
      ASSERT_TRUE(core_.Heartbeat(HeartbeatReq(Worker(i), gen, 4)).ok());
    }
  }
};

TEST_F(CoordinatorWatchTest, ADeadSurvivorsLostWatchDropsItAfterTheGrace) {
  const int64_t gen = FormSettled(3, 3);  // interval 1 s: grace 1 s
  const v1::JobSpec spec = Spec(3);
  WatchAndHeartbeat(3, gen);
  clock_.Advance(absl::Milliseconds(300));
  // w2 is killed: its connection closes, and its communicator fails the
  // others, which join again at once.
  core_.WatchClosed(kJob, Worker(2), /*lost=*/true);
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);  // not for a member
  clock_.Advance(absl::Milliseconds(10));
  ASSERT_TRUE(
      core_.Join(RejoinReq(spec, Worker(0), gen, 4, "peer w2 gone")).ok());
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(1), gen, 4)).ok());
  EXPECT_THAT(Expected(), ElementsAre(Worker(2)));
  clock_.Advance(absl::Milliseconds(989));  // lost 999 ms ago
  core_.Tick();
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  EXPECT_TRUE(EventsOf("failure").empty());
  const JobEpochs epochs = core_.Epochs(kJob);
  (void)core_.TakeDirtyJobs();
  clock_.Advance(absl::Milliseconds(1));
  core_.Tick();
  // 1.3 s after w2's last heartbeat, far from the 10 s timeout.
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(core_.CurrentGeneration(kJob), gen + 1);
  EXPECT_THAT(Ranks(), ElementsAre(Worker(0), Worker(1)));
  // Joins and watchers waiting on the job are re-asked.
  EXPECT_GT(core_.Epochs(kJob).placement, epochs.placement);
  EXPECT_GT(core_.Epochs(kJob).view, epochs.view);
  EXPECT_THAT(core_.TakeDirtyJobs(), ElementsAre(kJob));
  const std::vector<Event> failures = EventsOf("failure");
  ASSERT_EQ(failures.size(), 1u);
  EXPECT_EQ(failures[0].worker_id, Worker(2));
  EXPECT_EQ(failures[0].message,
            "did not join again after generation 1 ended: its connection to "
            "the coordinator broke (watch stream lost for 1s, grace 1s)");
  // Its binding is released: a restarted w2 (new secret) joins and waits.
  v1::JoinRequest restarted = JoinReq(spec, Worker(2));
  restarted.set_worker_secret(Secret("w2-restarted"));
  ASSERT_TRUE(core_.Join(restarted).ok());
  EXPECT_THAT(Waiting(), ElementsAre(Worker(2)));
}

TEST_F(CoordinatorWatchTest, TheGraceIsTheHeartbeatIntervalWithinBounds) {
  for (const auto& [interval_ms, grace] :
       std::vector<std::pair<int, absl::Duration>>{
           {20, absl::Milliseconds(100)},
           {250, absl::Milliseconds(250)},
           {5000, absl::Seconds(1)}}) {
    SCOPED_TRACE(interval_ms);
    FakeClock clock;
    Core core(&clock);
    v1::JobSpec spec = Spec(2);
    spec.set_heartbeat_interval_ms(interval_ms);
    spec.set_heartbeat_timeout_ms(30000);
    ASSERT_TRUE(core.Join(JoinReq(spec, Worker(0))).ok());
    ASSERT_TRUE(core.Join(JoinReq(spec, Worker(1))).ok());
    const int64_t gen = core.CurrentGeneration(kJob);
    ASSERT_EQ(gen, 1);
    core.WatchOpened(kJob, Worker(1));
    core.WatchClosed(kJob, Worker(1), /*lost=*/true);
    ASSERT_TRUE(core.Join(RejoinReq(spec, Worker(0), gen, 0, "w1 gone")).ok());
    clock.Advance(grace - absl::Milliseconds(1));
    core.Tick();
    EXPECT_EQ(core.State(kJob), v1::JOB_STATE_RENDEZVOUS);
    clock.Advance(absl::Milliseconds(1));
    core.Tick();
    EXPECT_EQ(core.State(kJob), v1::JOB_STATE_RUNNING);
    EXPECT_EQ(core.CurrentGeneration(kJob), gen + 1);
  }
}

TEST_F(CoordinatorWatchTest, ASurvivorLostForLongerThanTheGraceGoesAtOnce) {
  // The watch was lost before the generation ended (say rank 0 was busy
  // checkpointing): the re-form drops w2 right away, and the last survivor
  // back forms the generation without waiting for a tick.
  const int64_t gen = FormSettled(3, 3);
  const v1::JobSpec spec = Spec(3);
  WatchAndHeartbeat(3, gen);
  core_.WatchClosed(kJob, Worker(2), /*lost=*/true);
  clock_.Advance(absl::Seconds(2));
  ASSERT_TRUE(core_.Heartbeat(HeartbeatReq(Worker(0), gen, 4)).ok());
  ASSERT_TRUE(
      core_.Join(RejoinReq(spec, Worker(0), gen, 4, "peer w2 gone")).ok());
  EXPECT_THAT(Expected(), ElementsAre(Worker(1)));
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(1), gen, 4)).ok());
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
  EXPECT_THAT(Ranks(), ElementsAre(Worker(0), Worker(1)));
  const std::vector<Event> failures = EventsOf("failure");
  ASSERT_EQ(failures.size(), 1u);
  EXPECT_THAT(failures[0].message, HasSubstr("watch stream lost for 2s"));
}

TEST_F(CoordinatorWatchTest, ASurvivorThatReconnectsOrHeartbeatsIsKept) {
  const int64_t gen = FormSettled(3, 3);
  const v1::JobSpec spec = Spec(3);
  WatchAndHeartbeat(3, gen);
  // w1's watcher reconnects within the grace; w2's loses its stream but w2
  // heartbeats afterwards (its watcher is still backing off).
  core_.WatchClosed(kJob, Worker(1), /*lost=*/true);
  core_.WatchClosed(kJob, Worker(2), /*lost=*/true);
  clock_.Advance(absl::Milliseconds(500));
  core_.WatchOpened(kJob, Worker(1));
  ASSERT_TRUE(
      core_.Join(RejoinReq(spec, Worker(0), gen, 4, "slow peers")).ok());
  clock_.Advance(absl::Milliseconds(100));
  EXPECT_EQ(HeartbeatCode(Worker(2), gen), absl::StatusCode::kAborted);
  clock_.Advance(absl::Seconds(5));
  core_.Tick();
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  EXPECT_THAT(Expected(), ElementsAre(Worker(1), Worker(2)));
  EXPECT_TRUE(EventsOf("failure").empty());
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(2), gen, 4)).ok());
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(1), gen, 4)).ok());
  EXPECT_EQ(core_.CurrentGeneration(kJob), gen + 1);
  EXPECT_THAT(Ranks(), ElementsAre(Worker(0), Worker(1), Worker(2)));
}

TEST_F(CoordinatorWatchTest, WithoutALostWatchASurvivorWaitsForTheTimeout) {
  const int64_t gen = FormSettled(3, 3);
  const v1::JobSpec spec = Spec(3);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(core_.Heartbeat(HeartbeatReq(Worker(i), gen, 4)).ok());
  }
  // w1 never watched; w2's stream ended normally (and an unmatched close
  // for w1 is ignored).
  core_.WatchOpened(kJob, Worker(2));
  core_.WatchClosed(kJob, Worker(2), /*lost=*/false);
  core_.WatchClosed(kJob, Worker(1), /*lost=*/true);
  ASSERT_TRUE(
      core_.Join(RejoinReq(spec, Worker(0), gen, 4, "peers gone")).ok());
  clock_.Advance(absl::Seconds(10));
  core_.Tick();
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  EXPECT_THAT(Expected(), ElementsAre(Worker(1), Worker(2)));
  clock_.Advance(absl::Milliseconds(1));
  core_.Tick();
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
  EXPECT_THAT(Ranks(), ElementsAre(Worker(0)));
  for (const Event& e : EventsOf("failure")) {
    EXPECT_THAT(e.message, HasSubstr("no heartbeat for 10.001s"));
  }
  EXPECT_EQ(EventsOf("failure").size(), 2u);
}

TEST_F(CoordinatorWatchTest, ALostWatchOfARunningMemberEndsNothing) {
  const int64_t gen = FormSettled(3, 3);
  WatchAndHeartbeat(3, gen);
  core_.WatchClosed(kJob, Worker(2), /*lost=*/true);
  for (int s = 0; s < 5; ++s) {
    clock_.Advance(absl::Seconds(1));
    for (int i = 0; i < 3; ++i) {
      ASSERT_TRUE(core_.Heartbeat(HeartbeatReq(Worker(i), gen, 4 + s)).ok());
    }
    core_.Tick();
  }
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(core_.CurrentGeneration(kJob), gen);
  EXPECT_TRUE(EventsOf("failure").empty());
  // Heartbeats after the loss keep it an expected survivor once the
  // generation ends.
  ASSERT_TRUE(core_.Join(RejoinReq(Spec(3), Worker(0), gen, 8, "r")).ok());
  clock_.Advance(absl::Seconds(2));
  core_.Tick();
  EXPECT_THAT(Expected(), ElementsAre(Worker(1), Worker(2)));
}

TEST_F(CoordinatorWatchTest, WatchCallsForUnknownIdsChangeNothing) {
  const int64_t gen = FormSettled(2, 2);
  const uint64_t version = core_.version();
  const JobEpochs epochs = core_.Epochs(kJob);
  const std::string before = Snapshot();
  (void)core_.TakeDirtyJobs();
  (void)core_.TakeWokenJobs();
  core_.WatchOpened("no-such-job", Worker(0));
  core_.WatchClosed("no-such-job", Worker(0), /*lost=*/true);
  core_.WatchClosed("no-such-job", Worker(0), /*lost=*/false);
  core_.WatchOpened(kJob, "stranger");
  core_.WatchClosed(kJob, "stranger", /*lost=*/true);
  core_.WatchClosed(kJob, "stranger", /*lost=*/true);
  core_.WatchOpened(kJob, "");
  core_.WatchClosed(kJob, "", /*lost=*/true);
  // Transient: members' streams are not part of the record either.
  core_.WatchOpened(kJob, Worker(0));
  core_.WatchClosed(kJob, Worker(0), /*lost=*/true);
  EXPECT_EQ(core_.job_count(), 1u);
  EXPECT_EQ(core_.version(), version);
  EXPECT_EQ(core_.Epochs(kJob).placement, epochs.placement);
  EXPECT_EQ(core_.Epochs(kJob).view, epochs.view);
  EXPECT_TRUE(core_.TakeWokenJobs().empty());
  EXPECT_EQ(Snapshot(), before);
  EXPECT_TRUE(core_.TakeDirtyJobs().empty());
  clock_.Advance(absl::Seconds(5));
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(core_.Heartbeat(HeartbeatReq(Worker(i), gen)).ok());
  }
  core_.Tick();
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
  EXPECT_TRUE(EventsOf("failure").empty());
}

}  // namespace
}  // namespace concord::coordinator
