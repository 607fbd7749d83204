// The coordinator core's re-forming decisions (see Note [Re-forming] in
// coordinator/core/core.h), driven by a fake clock: expected survivors, rank
// order, the authoritative rank, end of data during a re-form, export/restore
// of all of it. Lost watch streams: coordinator_watch_test.cc.

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

// ---- Re-forming (see Note [Re-forming]) -------------------------------------

TEST_F(CoordinatorReformTest,
       AReformRequestEndsTheGenerationAndSurvivorsFormAtOnce) {
  const int64_t gen = FormSettled(3, 4);
  ASSERT_EQ(gen, 1);
  const v1::JobSpec spec = Spec(4);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(core_.Heartbeat(HeartbeatReq(Worker(i), gen, 5)).ok());
  }
  // Without naming its generation a member cannot join again.
  EXPECT_EQ(core_.Join(JoinReq(spec, Worker(1), 5)).code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);

  ASSERT_TRUE(core_
                  .Join(RejoinReq(spec, Worker(1), gen, 5,
                                  "allreduce failed: connection reset"))
                  .ok());
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  EXPECT_EQ(core_.CurrentGeneration(kJob), gen);
  const std::vector<Event> ended = EventsOf("generation");
  ASSERT_FALSE(ended.empty());
  EXPECT_EQ(ended.back().message,
            "generation 1 ended: worker w1 asked to re-form: allreduce failed: "
            "connection reset; expecting w0, w1, w2 to join again");
  // The requester waits; the others learn with ABORTED and join again.
  auto w1 = core_.GetAssignment(kJob, Worker(1));
  ASSERT_TRUE(w1.ok());
  EXPECT_FALSE(w1->has_value());
  EXPECT_EQ(core_.GetAssignment(kJob, Worker(0)).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(HeartbeatCode(Worker(0), gen), absl::StatusCode::kAborted);
  EXPECT_THAT(Expected(), ElementsAre(Worker(0), Worker(2)));
  EXPECT_THAT(Waiting(), ElementsAre(Worker(1)));

  // Naming the ended generation (or none) is a plain join; no settle wait
  // once every survivor is back, although max_workers (4) are not there.
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(2), gen, 5)).ok());
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  EXPECT_THAT(Expected(), ElementsAre(Worker(0)));
  ASSERT_TRUE(core_.Join(JoinReq(spec, Worker(0), 5)).ok());
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(core_.CurrentGeneration(kJob), gen + 1);
  EXPECT_THAT(Ranks(), ElementsAre(Worker(0), Worker(1), Worker(2)));
  EXPECT_TRUE(Expected().empty());

  // A member naming an older generation, or a completed member naming its
  // own, is still ALREADY_EXISTS.
  EXPECT_EQ(core_.Join(RejoinReq(spec, Worker(0), gen, 5)).code(),
            absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(
      core_.Leave(LeaveReq(Worker(2), gen + 1, v1::LEAVE_REASON_COMPLETED))
          .ok());
  EXPECT_EQ(core_.Join(RejoinReq(spec, Worker(2), gen + 1, 5)).code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(core_.CurrentGeneration(kJob), gen + 1);
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
}

TEST_F(CoordinatorReformTest, RanksKeepTheLongestLivedOrderAndJoinersGoLast) {
  const int64_t gen = FormSettled(3, 4);
  const v1::JobSpec spec = Spec(4);
  clock_.Advance(absl::Seconds(1));
  ASSERT_TRUE(core_.Join(JoinReq(spec, "newcomer")).ok());
  // The survivors come back in reverse order; the newcomer joined before
  // any of them came back, but after they first joined.
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(2), gen, 3, "admit")).ok());
  clock_.Advance(absl::Milliseconds(100));
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(1), gen, 3)).ok());
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(0), gen, 3)).ok());
  EXPECT_EQ(core_.CurrentGeneration(kJob), gen + 1);
  EXPECT_THAT(Ranks(),
              ElementsAre(Worker(0), Worker(1), Worker(2), "newcomer"));
  EXPECT_EQ(Status().authoritative_rank(), 0);

  // The order holds over a further re-form in which w0 fails: the first-join
  // times are kept across re-joins.
  const int64_t next = gen + 1;
  clock_.Advance(absl::Seconds(3));
  for (const std::string& w : {Worker(1), Worker(2), std::string("newcomer")}) {
    ASSERT_TRUE(core_.Heartbeat(HeartbeatReq(w, next, 9)).ok());
  }
  clock_.Advance(absl::Seconds(7) + absl::Milliseconds(1));
  core_.Tick();
  ASSERT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  ASSERT_TRUE(core_.Join(JoinReq(spec, "late")).ok());
  ASSERT_TRUE(core_.Join(RejoinReq(spec, "newcomer", next, 9)).ok());
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(2), next, 9)).ok());
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(1), next, 9)).ok());
  EXPECT_EQ(core_.CurrentGeneration(kJob), next + 1);
  EXPECT_THAT(Ranks(), ElementsAre(Worker(1), Worker(2), "newcomer", "late"));
}

// What workers get instead of the member table (worker.proto's RankChange):
// which ranks of the generation before are gone and whether the survivors
// kept their order, enough to derive a communicator.
TEST_F(CoordinatorReformTest, RankChangeSaysWhichOldRanksWentAndIfOrderHeld) {
  const int64_t gen = FormSettled(3, 4);
  const v1::JobSpec spec = Spec(4);
  auto change_of = [&](const std::string& w) {
    auto a = core_.GetAssignment(kJob, w);
    EXPECT_TRUE(a.ok() && a->has_value()) << w;
    return a.ok() && a->has_value() ? (*a)->rank_change
                                    : std::optional<v1::RankChange>();
  };
  EXPECT_FALSE(change_of(Worker(0)).has_value());  // the first generation

  // w1 fails; w2 and w0 come back: old rank 1 is gone, the order holds.
  ASSERT_TRUE(
      core_.Leave(LeaveReq(Worker(1), gen, v1::LEAVE_REASON_ERROR)).ok());
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(2), gen)).ok());
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(0), gen)).ok());
  clock_.Advance(absl::Seconds(2));
  core_.Tick();
  ASSERT_EQ(core_.CurrentGeneration(kJob), gen + 1);
  ASSERT_THAT(Ranks(), ElementsAre(Worker(0), Worker(2)));
  for (const std::string& w : {Worker(0), Worker(2)}) {
    const std::optional<v1::RankChange> change = change_of(w);
    ASSERT_TRUE(change.has_value());
    EXPECT_EQ(change->previous_generation(), gen);
    EXPECT_EQ(change->previous_world_size(), 3);
    EXPECT_THAT(change->departed(), ElementsAre(1));
    EXPECT_TRUE(change->order_kept());
  }

  // A newcomer joins and w0 asks to re-form to admit it: nobody departed,
  // the newcomer goes last.
  ASSERT_TRUE(core_.Join(JoinReq(spec, "newcomer")).ok());
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(0), gen + 1, 0, "admit")).ok());
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(2), gen + 1)).ok());
  ASSERT_EQ(core_.CurrentGeneration(kJob), gen + 2);
  ASSERT_THAT(Ranks(), ElementsAre(Worker(0), Worker(2), "newcomer"));
  const std::optional<v1::RankChange> grown = change_of("newcomer");
  ASSERT_TRUE(grown.has_value());
  EXPECT_EQ(grown->previous_generation(), gen + 1);
  EXPECT_EQ(grown->previous_world_size(), 2);
  EXPECT_THAT(grown->departed(), ElementsAre());
  EXPECT_TRUE(grown->order_kept());
}

TEST_F(CoordinatorReformTest, AuthoritativeRankIsTheHighestCommittedStep) {
  const int64_t gen = FormSettled(4, 4);
  const v1::JobSpec spec = Spec(4);
  // Committed steps come from the re-joins: w2 and w3 are ahead, and w2 is
  // the longer-lived of the two.
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(3), gen, 11, "r")).ok());
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(0), gen, 10)).ok());
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(1), gen, 10)).ok());
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(2), gen, 11)).ok());
  ASSERT_EQ(core_.CurrentGeneration(kJob), gen + 1);
  EXPECT_EQ(Status().authoritative_rank(), 2);
  auto a = core_.GetAssignment(kJob, Worker(3));
  ASSERT_TRUE(a.ok() && a->has_value());
  EXPECT_EQ((*a)->rank, 3);
  EXPECT_EQ((*a)->authoritative_rank, 2);
  EXPECT_EQ((*(*a)->members)[3].committed_step(), 11);
  EXPECT_THAT(core_.Events(kJob).back().message,
              HasSubstr("authoritative rank 2"));
}

TEST_F(CoordinatorReformTest,
       ADeadSurvivorIsDroppedAfterTheHeartbeatTimeoutAndTheRestForm) {
  const int64_t gen = FormSettled(3, 3);  // heartbeat timeout: 10 s
  const v1::JobSpec spec = Spec(3);
  // w2 dies after one heartbeat; its communicator fails the others 2 s
  // later.
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(core_.Heartbeat(HeartbeatReq(Worker(i), gen, 4)).ok());
  }
  clock_.Advance(absl::Seconds(2));
  ASSERT_TRUE(
      core_.Join(RejoinReq(spec, Worker(0), gen, 4, "peer w2 gone")).ok());
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(1), gen, 4)).ok());
  EXPECT_THAT(Expected(), ElementsAre(Worker(2)));
  clock_.Advance(absl::Seconds(8));  // w2 silent for exactly 10 s
  core_.Tick();
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  clock_.Advance(absl::Milliseconds(1));
  core_.Tick();
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(core_.CurrentGeneration(kJob), gen + 1);
  EXPECT_THAT(Ranks(), ElementsAre(Worker(0), Worker(1)));
  const std::vector<Event> failures = EventsOf("failure");
  ASSERT_EQ(failures.size(), 1u);
  EXPECT_EQ(failures[0].worker_id, Worker(2));
  EXPECT_EQ(failures[0].message,
            "did not join again after generation 1 ended: no heartbeat for "
            "10.001s (timeout 10s)");
  // Its binding is released: a restarted w2 (new secret) joins and waits.
  v1::JoinRequest restarted = JoinReq(spec, Worker(2));
  restarted.set_worker_secret(Secret("w2-restarted"));
  ASSERT_TRUE(core_.Join(restarted).ok());
  auto hb = core_.Heartbeat(HeartbeatReq(Worker(0), gen + 1));
  ASSERT_TRUE(hb.ok());
  EXPECT_EQ(hb->waiting_workers(), 1);
}

TEST_F(CoordinatorReformTest, AStaleHeartbeatKeepsASlowSurvivorExpected) {
  const int64_t gen = FormSettled(3, 3);
  const v1::JobSpec spec = Spec(3);
  clock_.Advance(absl::Seconds(2));
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(0), gen, 4, "slow")).ok());
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(1), gen, 4)).ok());
  clock_.Advance(absl::Seconds(6));
  // w2 still heartbeats its ended generation: refused, but alive.
  v1::HeartbeatRequest forged = HeartbeatReq(Worker(2), gen);
  forged.set_worker_secret(Secret("impostor"));
  EXPECT_EQ(core_.Heartbeat(forged).status().code(),
            absl::StatusCode::kPermissionDenied);
  const JobEpochs epochs = core_.Epochs(kJob);
  EXPECT_EQ(HeartbeatCode(Worker(2), gen), absl::StatusCode::kAborted);
  // Not persisted, and no waiter's concern.
  EXPECT_EQ(core_.Epochs(kJob).view, epochs.view);
  EXPECT_EQ(core_.Epochs(kJob).placement, epochs.placement);
  EXPECT_EQ(HeartbeatCode(Worker(2), gen + 1), absl::StatusCode::kAborted);
  clock_.Advance(absl::Seconds(9));  // 17 s after its last member heartbeat
  core_.Tick();
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  ASSERT_EQ(Status().expected_size(), 1);
  EXPECT_EQ(Status().expected(0).worker_id(), Worker(2));
  EXPECT_EQ(Status().expected(0).rank(), -1);
  EXPECT_EQ(Status().expected(0).last_heartbeat_age_ms(), 9000);
  EXPECT_TRUE(EventsOf("failure").empty());
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(2), gen, 4)).ok());
  EXPECT_EQ(core_.CurrentGeneration(kJob), gen + 1);
  EXPECT_THAT(Ranks(), ElementsAre(Worker(0), Worker(1), Worker(2)));
}

TEST_F(CoordinatorReformTest, BelowMinWorkersTheRendezvousTimeoutFailsTheJob) {
  v1::JobSpec spec = Spec(3, 3);
  spec.set_rendezvous_timeout_ms(30000);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(core_.Join(JoinReq(spec, Worker(i))).ok());
  }
  const int64_t gen = core_.CurrentGeneration(kJob);
  ASSERT_EQ(gen, 1);
  ASSERT_TRUE(
      core_.Leave(LeaveReq(Worker(2), gen, v1::LEAVE_REASON_ERROR)).ok());
  EXPECT_THAT(Expected(), ElementsAre(Worker(0), Worker(1)));
  // Every survivor is back, but 2 < min_workers: wait for joiners.
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(0), gen)).ok());
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(1), gen)).ok());
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  clock_.Advance(absl::Seconds(30));
  core_.Tick();
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  clock_.Advance(absl::Milliseconds(1));
  core_.Tick();
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_FAILED);
  EXPECT_EQ(Status().failure(),
            "rendezvous timed out after 30s with 2 worker(s) waiting; "
            "min_workers is 3");
  const absl::Status join = core_.Join(RejoinReq(spec, Worker(0), gen));
  EXPECT_EQ(join.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(join.message(), HasSubstr("rendezvous timed out"));
}

TEST_F(CoordinatorReformTest, TheRendezvousTimeoutNamesMissingSurvivors) {
  // A heartbeat timeout longer than the rendezvous timeout: the rendezvous
  // gives up on a silent survivor first.
  for (const int min : {1, 2}) {
    SCOPED_TRACE(min);
    FakeClock clock;
    Core core(&clock);
    v1::JobSpec spec = Spec(2, min);
    spec.set_heartbeat_timeout_ms(60000);
    spec.set_rendezvous_timeout_ms(30000);
    ASSERT_TRUE(core.Join(JoinReq(spec, Worker(0))).ok());
    ASSERT_TRUE(core.Join(JoinReq(spec, Worker(1))).ok());
    ASSERT_EQ(core.CurrentGeneration(kJob), 1);
    ASSERT_TRUE(core.Join(RejoinReq(spec, Worker(0), 1, 0, "w1 gone")).ok());
    clock.Advance(absl::Seconds(30) + absl::Milliseconds(1));
    core.Tick();
    if (min == 1) {
      // Enough are waiting: the generation forms without w1.
      EXPECT_EQ(core.State(kJob), v1::JOB_STATE_RUNNING);
      EXPECT_EQ(core.CurrentGeneration(kJob), 2);
      auto a = core.GetAssignment(kJob, Worker(0));
      ASSERT_TRUE(a.ok() && a->has_value());
      EXPECT_EQ((*a)->world_size, 1);
      const std::vector<Event> events = core.Events(kJob);
      EXPECT_TRUE(std::any_of(events.begin(), events.end(), [](const Event& e) {
        return e.kind == "failure" && e.worker_id == "w1";
      }));
    } else {
      v1::GetJobRequest get;
      get.set_job_id(kJob);
      auto status = core.GetJob(get);
      ASSERT_TRUE(status.ok());
      EXPECT_EQ(status->state(), v1::JOB_STATE_FAILED);
      EXPECT_EQ(status->failure(),
                "rendezvous timed out after 30s with 1 worker(s) waiting; "
                "min_workers is 2; survivor(s) w1 of generation 1 did not "
                "join again");
      EXPECT_EQ(status->expected_size(), 0);
    }
  }
}

TEST_F(CoordinatorReformTest, EndOfDataLeaveBeforeTheOthersRejoin) {
  const int64_t gen = FormSettled(3, 3);
  const v1::JobSpec spec = Spec(3);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(core_.Heartbeat(HeartbeatReq(Worker(i), gen, 20)).ok());
  }
  auto left =
      core_.Leave(LeaveReq(Worker(2), gen, v1::LEAVE_REASON_END_OF_DATA));
  ASSERT_TRUE(left.ok()) << left.status();
  EXPECT_EQ(left->state(), v1::JOB_STATE_RENDEZVOUS);
  const std::vector<Event> leaves = EventsOf("leave");
  ASSERT_EQ(leaves.size(), 1u);
  EXPECT_EQ(leaves[0].worker_id, Worker(2));
  EXPECT_EQ(leaves[0].message, "ran out of data at step 20");
  EXPECT_THAT(EventsOf("generation").back().message,
              HasSubstr("worker w2 ran out of data at step 20"));
  EXPECT_THAT(Expected(), ElementsAre(Worker(0), Worker(1)));
  // A repeated Leave changes nothing.
  const std::string before = Snapshot();
  const uint64_t version = core_.version();
  auto again =
      core_.Leave(LeaveReq(Worker(2), gen, v1::LEAVE_REASON_END_OF_DATA));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(core_.version(), version);
  EXPECT_EQ(Snapshot(), before);

  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(1), gen, 20)).ok());
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(0), gen, 20)).ok());
  EXPECT_EQ(core_.CurrentGeneration(kJob), gen + 1);
  EXPECT_THAT(Ranks(), ElementsAre(Worker(0), Worker(1)));
  EXPECT_TRUE(
      core_.Leave(LeaveReq(Worker(2), gen, v1::LEAVE_REASON_END_OF_DATA)).ok());
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
  // w2's binding is released.
  v1::JoinRequest restarted = JoinReq(spec, Worker(2));
  restarted.set_worker_secret(Secret("w2-restarted"));
  EXPECT_TRUE(core_.Join(restarted).ok());
}

TEST_F(CoordinatorReformTest, EndOfDataLeaveAfterTheOthersRejoin) {
  const int64_t gen = FormSettled(3, 3);
  const v1::JobSpec spec = Spec(3);
  // The members agreed that w2's data ends at step 20; w0 and w1 are
  // quicker to re-form than w2 to leave.
  ASSERT_TRUE(
      core_.Join(RejoinReq(spec, Worker(0), gen, 20, "w2 out of data")).ok());
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(1), gen, 20)).ok());
  EXPECT_THAT(Expected(), ElementsAre(Worker(2)));
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  // A Leave naming another generation than its own is still refused.
  EXPECT_EQ(
      core_.Leave(LeaveReq(Worker(2), gen - 1, v1::LEAVE_REASON_END_OF_DATA))
          .status()
          .code(),
      absl::StatusCode::kAborted);
  auto left =
      core_.Leave(LeaveReq(Worker(2), gen, v1::LEAVE_REASON_END_OF_DATA));
  ASSERT_TRUE(left.ok()) << left.status();
  EXPECT_EQ(left->state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(core_.CurrentGeneration(kJob), gen + 1);
  EXPECT_THAT(Ranks(), ElementsAre(Worker(0), Worker(1)));
  EXPECT_EQ(EventsOf("leave").back().message,
            "ran out of data at step 0, after generation 1 ended");
  EXPECT_TRUE(
      core_.Leave(LeaveReq(Worker(2), gen, v1::LEAVE_REASON_END_OF_DATA)).ok());
}

TEST_F(CoordinatorReformTest, TheJobSucceedsWhenTheLastWorkerRunsOutOfData) {
  // Both run out at the same boundary; the second Leave finds its generation
  // already ended.
  const int64_t gen = FormSettled(2, 2);
  ASSERT_TRUE(
      core_.Leave(LeaveReq(Worker(0), gen, v1::LEAVE_REASON_END_OF_DATA)).ok());
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  auto last =
      core_.Leave(LeaveReq(Worker(1), gen, v1::LEAVE_REASON_END_OF_DATA));
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_EQ(last->state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(core_.Events(kJob).back().message,
            "job succeeded after generation 1: every worker ran out of data "
            "or completed");
  EXPECT_TRUE(
      core_.Leave(LeaveReq(Worker(1), gen, v1::LEAVE_REASON_END_OF_DATA)).ok());
  clock_.Advance(absl::Hours(1));
  core_.Tick();
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_SUCCEEDED);
}

TEST_F(CoordinatorReformTest, TheLastMemberRunningOutOfDataEndsTheJob) {
  const int64_t gen = FormSettled(2, 3);
  const v1::JobSpec spec = Spec(3);
  ASSERT_TRUE(
      core_.Leave(LeaveReq(Worker(0), gen, v1::LEAVE_REASON_END_OF_DATA)).ok());
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(1), gen, 30)).ok());
  ASSERT_EQ(core_.CurrentGeneration(kJob), gen + 1);
  EXPECT_THAT(Ranks(), ElementsAre(Worker(1)));
  // A waiting worker keeps the job going...
  ASSERT_TRUE(core_.Join(JoinReq(spec, "spare")).ok());
  ASSERT_TRUE(
      core_.Leave(LeaveReq(Worker(1), gen + 1, v1::LEAVE_REASON_END_OF_DATA))
          .ok());
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  // ...until it runs out of data too.
  ASSERT_TRUE(
      core_.Leave(LeaveReq("spare", 0, v1::LEAVE_REASON_END_OF_DATA)).ok());
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_SUCCEEDED);
}

TEST_F(CoordinatorReformTest, AWaitingWorkerOutlivesMembersOutOfData) {
  const int64_t gen = FormSettled(2, 3);
  ASSERT_TRUE(core_.Join(JoinReq(Spec(3), "spare")).ok());
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(
        core_.Leave(LeaveReq(Worker(i), gen, v1::LEAVE_REASON_END_OF_DATA))
            .ok());
  }
  // Both members ran out of data, but the job goes on with the spare.
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  EXPECT_TRUE(Expected().empty());
  clock_.Advance(absl::Seconds(2));
  core_.Tick();
  ASSERT_EQ(core_.CurrentGeneration(kJob), gen + 1);
  EXPECT_THAT(Ranks(), ElementsAre("spare"));
  ASSERT_TRUE(
      core_.Leave(LeaveReq("spare", gen + 1, v1::LEAVE_REASON_END_OF_DATA))
          .ok());
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_SUCCEEDED);
}

TEST_F(CoordinatorReformTest, AWorkerStillWaitingWhenTheJobSucceedsIsToldSo) {
  const int64_t gen = FormSettled(2, 2);
  // At max_workers: the newcomer waits for a generation that never comes.
  ASSERT_TRUE(core_.Join(JoinReq(Spec(2), "late")).ok());
  ASSERT_TRUE(core_.GetAssignment(kJob, "late").ok());  // waiting: no error yet
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(
        core_.Leave(LeaveReq(Worker(i), gen, v1::LEAVE_REASON_COMPLETED)).ok());
  }
  ASSERT_EQ(core_.State(kJob), v1::JOB_STATE_SUCCEEDED);
  const auto late = core_.GetAssignment(kJob, "late");
  EXPECT_TRUE(absl::IsFailedPrecondition(late.status())) << late.status();
  EXPECT_THAT(std::string(late.status().message()),
              ::testing::HasSubstr("has already succeeded"));
}

TEST_F(CoordinatorReformTest, CompletedMembersAreNotExpected) {
  const int64_t gen = FormSettled(3, 3);
  const v1::JobSpec spec = Spec(3);
  ASSERT_TRUE(
      core_.Leave(LeaveReq(Worker(0), gen, v1::LEAVE_REASON_COMPLETED)).ok());
  ASSERT_TRUE(
      core_.Leave(LeaveReq(Worker(1), gen, v1::LEAVE_REASON_ERROR)).ok());
  EXPECT_THAT(Expected(), ElementsAre(Worker(2)));
  EXPECT_TRUE(
      core_.Leave(LeaveReq(Worker(0), gen, v1::LEAVE_REASON_COMPLETED)).ok());
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(2), gen)).ok());
  EXPECT_EQ(core_.CurrentGeneration(kJob), gen + 1);
  EXPECT_THAT(Ranks(), ElementsAre(Worker(2)));
}

TEST_F(CoordinatorReformTest, AnErrorLeaveOrADrainDropsAnExpectedSurvivor) {
  const int64_t gen = FormSettled(4, 4);
  const v1::JobSpec spec = Spec(4);
  // A drained member is not expected.
  v1::DrainWorkerRequest drain;
  drain.set_job_id(kJob);
  drain.set_worker_id(Worker(3));
  ASSERT_TRUE(core_.DrainWorker(drain).ok());
  EXPECT_THAT(Expected(), ElementsAre(Worker(0), Worker(1), Worker(2)));
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(0), gen)).ok());
  // An expected survivor leaving with an error, or drained, is dropped.
  ASSERT_TRUE(
      core_.Leave(LeaveReq(Worker(1), gen, v1::LEAVE_REASON_ERROR)).ok());
  EXPECT_THAT(Expected(), ElementsAre(Worker(2)));
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  drain.set_worker_id(Worker(2));
  auto drained = core_.DrainWorker(drain);
  ASSERT_TRUE(drained.ok());
  EXPECT_EQ(drained->ended_generation(), 0);
  EXPECT_EQ(core_.CurrentGeneration(kJob), gen + 1);
  EXPECT_THAT(Ranks(), ElementsAre(Worker(0)));
  EXPECT_EQ(core_.Join(RejoinReq(spec, Worker(2), gen)).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(CoordinatorReformTest, WaitingWorkersIsWhatTheNextGenerationAdmits) {
  const int64_t gen = FormSettled(2, 3);
  const v1::JobSpec spec = Spec(3);
  auto hb = core_.Heartbeat(HeartbeatReq(Worker(0), gen));
  ASSERT_TRUE(hb.ok());
  EXPECT_EQ(hb->waiting_workers(), 0);
  EXPECT_EQ(WaitingWorkersSeenBy(Worker(0)), 0);

  // A join while running changes what watchers see.
  const JobEpochs epochs = core_.Epochs(kJob);
  ASSERT_TRUE(core_.Join(JoinReq(spec, "x")).ok());
  EXPECT_GT(core_.Epochs(kJob).view, epochs.view);
  // ...and nobody's placement (see Note [Asynchronous waits]).
  EXPECT_EQ(core_.Epochs(kJob).placement, epochs.placement);
  EXPECT_EQ(core_.Heartbeat(HeartbeatReq(Worker(0), gen))->waiting_workers(),
            1);
  EXPECT_EQ(WaitingWorkersSeenBy(Worker(1)), 1);
  EXPECT_EQ(WaitingWorkersSeenBy("x"), 1);
  // Room for one more only.
  ASSERT_TRUE(core_.Join(JoinReq(spec, "y")).ok());
  EXPECT_EQ(core_.Heartbeat(HeartbeatReq(Worker(0), gen))->waiting_workers(),
            1);

  // The members re-form to let x in; during the rendezvous it is 0.
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(0), gen, 0, "admit x")).ok());
  EXPECT_EQ(WaitingWorkersSeenBy(Worker(0)), 0);
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(1), gen)).ok());
  ASSERT_EQ(core_.CurrentGeneration(kJob), gen + 1);
  EXPECT_THAT(Ranks(), ElementsAre(Worker(0), Worker(1), "x"));
  EXPECT_THAT(Waiting(), ElementsAre("y"));
  // At max_workers nobody more can be admitted.
  EXPECT_EQ(
      core_.Heartbeat(HeartbeatReq(Worker(0), gen + 1))->waiting_workers(), 0);
  EXPECT_EQ(WaitingWorkersSeenBy("y"), 0);
}

TEST_F(CoordinatorReformTest, BadReformRequestsAreInvalidAndChangeNothing) {
  const int64_t gen = FormSettled(2, 2);
  const v1::JobSpec spec = Spec(2);
  const uint64_t version = core_.version();
  const std::string before = Snapshot();
  std::vector<std::pair<std::string, absl::Status>> results = {
      {"member, generation ahead",
       core_.Join(RejoinReq(spec, Worker(0), gen + 1))},
      {"newcomer, generation ahead",
       core_.Join(RejoinReq(spec, "new", gen + 5))},
      {"negative previous generation",
       core_.Join(RejoinReq(spec, Worker(0), -1))},
      {"long reason",
       core_.Join(RejoinReq(spec, Worker(0), gen, 0, std::string(4097, 'r')))},
      {"reason not UTF-8",
       core_.Join(RejoinReq(spec, Worker(0), gen, 0, "cut \xe2\x82"))},
  };
  v1::JobSpec other = Spec(2);
  other.set_job_id("unknown");
  results.emplace_back("unknown job, generation ahead",
                       core_.Join(RejoinReq(other, "w", 1)));
  for (const auto& [name, status] : results) {
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_FALSE(status.message().empty()) << name;
  }
  EXPECT_THAT(std::string(results[0].second.message()),
              HasSubstr("previous_generation 2 is ahead"));
  EXPECT_EQ(core_.version(), version);
  EXPECT_EQ(Snapshot(), before);
  EXPECT_EQ(core_.job_count(), 1u);
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
  // The longest reason allowed is fine.
  EXPECT_TRUE(
      core_.Join(RejoinReq(spec, Worker(0), gen, 0, std::string(4096, 'r')))
          .ok());
}

TEST_F(CoordinatorReformTest, ExportAndRestoreKeepSurvivorsAndFinished) {
  const int64_t gen = FormSettled(3, 3);
  const v1::JobSpec spec = Spec(3);
  ASSERT_TRUE(
      core_.Leave(LeaveReq(Worker(2), gen, v1::LEAVE_REASON_END_OF_DATA)).ok());
  clock_.Advance(absl::Seconds(1));
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(1), gen, 6)).ok());
  auto record = core_.ExportJob(kJob);
  ASSERT_TRUE(record.has_value());
  ASSERT_EQ(record->expected_size(), 2);
  EXPECT_EQ(record->expected(0).worker_id(), Worker(0));
  EXPECT_EQ(record->expected(0).rank(), -1);
  EXPECT_EQ(record->waiting(0).joined_unix_ms(),
            record->expected(1).joined_unix_ms());
  EXPECT_THAT(record->finished(), ElementsAre(Worker(2)));

  FakeClock later(clock_.Now() + absl::Hours(1));
  Core restored(&later);
  ASSERT_TRUE(restored.RestoreJob(*record).ok());
  EXPECT_TRUE(SameRecord(*restored.ExportJob(kJob), *record));
  // The finished worker's Leave is still a no-op.
  EXPECT_TRUE(
      restored.Leave(LeaveReq(Worker(2), gen, v1::LEAVE_REASON_END_OF_DATA))
          .ok());
  // w0's timer restarted from the restore time.
  later.Advance(absl::Seconds(10));
  restored.Tick();
  EXPECT_EQ(restored.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  // A copy restored alongside drops w0 once that timer runs out.
  {
    FakeClock clock(later.Now() - absl::Seconds(10));
    Core copy(&clock);
    ASSERT_TRUE(copy.RestoreJob(*record).ok());
    clock.Advance(absl::Seconds(10) + absl::Milliseconds(1));
    copy.Tick();
    EXPECT_EQ(copy.State(kJob), v1::JOB_STATE_RUNNING);
    EXPECT_EQ(copy.CurrentGeneration(kJob), gen + 1);
  }
  // w0 comes back and keeps its rank ahead of w1 (first-join times), and
  // only with its own secret.
  v1::JoinRequest forged = RejoinReq(spec, Worker(0), gen, 6);
  forged.set_worker_secret(Secret("impostor"));
  EXPECT_EQ(restored.Join(forged).code(), absl::StatusCode::kPermissionDenied);
  ASSERT_TRUE(restored.Join(RejoinReq(spec, Worker(0), gen, 6)).ok());
  EXPECT_EQ(restored.CurrentGeneration(kJob), gen + 1);
  auto a = restored.GetAssignment(kJob, Worker(0));
  ASSERT_TRUE(a.ok() && a->has_value());
  EXPECT_EQ((*a)->rank, 0);
  EXPECT_EQ((*(*a)->members)[1].worker_id(), Worker(1));
}

TEST_F(CoordinatorReformTest, RestoreRefusesInconsistentSurvivors) {
  const int64_t gen = FormSettled(2, 2);
  ASSERT_TRUE(core_.Join(RejoinReq(Spec(2), Worker(0), gen, 1, "r")).ok());
  const v1::JobRecord good = *core_.ExportJob(kJob);
  ASSERT_EQ(good.expected_size(), 2);
  ASSERT_EQ(good.state(), v1::JOB_STATE_RENDEZVOUS);
  const std::vector<std::pair<std::string, std::function<void(v1::JobRecord&)>>>
      cases = {
          {"expected while running",
           [](v1::JobRecord& r) { r.set_state(v1::JOB_STATE_RUNNING); }},
          {"expected with members",
           [&](v1::JobRecord& r) {
             *r.add_members() = r.expected(1);
             r.mutable_members(0)->set_rank(0);
             r.mutable_expected()->RemoveLast();
           }},
          {"expected before any generation",
           [](v1::JobRecord& r) { r.set_generation(0); }},
          {"expected twice",
           [](v1::JobRecord& r) { *r.add_expected() = r.expected(0); }},
          {"expected unbound",
           [](v1::JobRecord& r) { r.mutable_bindings()->erase("w1"); }},
          {"expected drained", [](v1::JobRecord& r) { r.add_drained("w1"); }},
          {"expected finished", [](v1::JobRecord& r) { r.add_finished("w1"); }},
          {"expected bad id",
           [](v1::JobRecord& r) {
             r.mutable_expected(1)->set_worker_id("bad id");
           }},
          {"finished bad id", [](v1::JobRecord& r) { r.add_finished(""); }},
          {"waiting twice",
           [](v1::JobRecord& r) { *r.add_waiting() = r.waiting(0); }},
      };
  for (const auto& [name, mutate] : cases) {
    v1::JobRecord bad = good;
    mutate(bad);
    FakeClock clock;
    Core fresh(&clock);
    EXPECT_EQ(fresh.RestoreJob(bad).code(), absl::StatusCode::kInvalidArgument)
        << name;
    EXPECT_EQ(fresh.job_count(), 0u) << name;
  }
  FakeClock clock;
  Core fresh(&clock);
  EXPECT_TRUE(fresh.RestoreJob(good).ok());
}

}  // namespace
}  // namespace concord::coordinator
