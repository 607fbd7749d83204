// See Note [Hangs] in coordinator/core/hang_rule.h: the rule alone (a pure
// function of what the members reported), then through the core with a fake
// clock. False alarms are tested as hard as the faults: a member that
// evaluates, checkpoints, restores or warms up is busy, not hung.

#include "coordinator/core/hang_rule.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "coordinator/core/core.h"
#include "coordinator_core_fixture.h"
#include "coordinator_requests.h"

namespace concord::coordinator {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

const absl::Time kT0 = absl::FromUnixSeconds(1000000);

// What a member's heartbeat says (WorkerProgress), briefly.
struct Said {
  int64_t generation = 1;
  int64_t collectives = 0;
  int64_t pending_seq = 0;
  std::string pending_kind;
  int64_t pending_ms = 0;
  int64_t cpu_ms = 0;
  std::string activity;
  double step_ms = 20;

  v1::WorkerProgress Proto() const {
    v1::WorkerProgress p;
    p.set_generation(generation);
    p.set_collectives(collectives);
    p.set_pending_seq(pending_seq);
    p.set_pending_kind(pending_kind);
    p.set_pending_ms(pending_ms);
    p.set_cpu_ms(cpu_ms);
    p.set_activity(activity);
    p.set_step_ms(step_ms);
    p.set_last_kind("allreduce");
    return p;
  }
};

// A member waiting in collective `seq` for `waited`, as of `now`.
MemberProgress Waiting(int rank, int64_t seq, absl::Duration waited,
                       absl::Time now) {
  MemberProgress m;
  m.worker_id = "w" + std::to_string(rank);
  m.rank = rank;
  m.step = 7;
  Said said;
  said.collectives = seq;
  said.pending_seq = seq;
  said.pending_kind = "broadcast";
  said.pending_ms = absl::ToInt64Milliseconds(waited);
  m.progress = said.Proto();
  m.reported = now;
  m.progressed = now - waited;
  return m;
}

// A member that issued `issued` collectives and showed progress last at
// `progressed`, reporting at `now`.
MemberProgress Quiet(int rank, int64_t issued, absl::Time progressed,
                     absl::Time now, Said said = {}) {
  MemberProgress m;
  m.worker_id = "w" + std::to_string(rank);
  m.rank = rank;
  m.step = 7;
  said.collectives = issued;
  m.progress = said.Proto();
  m.reported = now;
  m.progressed = progressed;
  return m;
}

TEST(HangTimeoutTest, DerivedFromStepTimesWithAFloorAndAStartUpAllowance) {
  EXPECT_EQ(HangTimeout(0, 20), kHangFloor);           // MNIST-size steps
  EXPECT_EQ(HangTimeout(0, 3000), absl::Seconds(15));  // 5 x 3 s
  EXPECT_EQ(HangTimeout(0, 0), kStartupAllowance);     // no step time yet
  EXPECT_EQ(HangTimeout(2500, 0), absl::Milliseconds(2500));  // as set
  EXPECT_EQ(HangTimeout(2500, 9000), absl::Milliseconds(2500));
  EXPECT_EQ(HangTimeout(-1, 20), absl::ZeroDuration());  // off
}

TEST(ShowsProgressTest, StepsCollectivesCpuAndActivityAreProgress) {
  Said before;
  before.collectives = 10;
  before.cpu_ms = 5000;
  const ProgressMark mark = MarkOf(before.Proto(), 7, kT0);
  const absl::Time beat = kT0 + absl::Seconds(1);
  Said same = before;
  same.cpu_ms = 5000 + 20;  // a heartbeat thread's crumbs: idle
  EXPECT_FALSE(ShowsProgress(mark, same.Proto(), 7, beat));
  EXPECT_TRUE(ShowsProgress(mark, same.Proto(), 8, beat));
  Said issued = same;
  issued.collectives = 11;
  EXPECT_TRUE(ShowsProgress(mark, issued.Proto(), 7, beat));
  Said computing = before;
  computing.cpu_ms = 5000 + 950;  // a core, evaluating
  EXPECT_TRUE(ShowsProgress(mark, computing.Proto(), 7, beat));
  Said busy = same;
  busy.activity = "checkpoint";
  EXPECT_TRUE(ShowsProgress(mark, busy.Proto(), 7, beat));
  Said next_generation = same;
  next_generation.generation = 2;
  EXPECT_TRUE(ShowsProgress(mark, next_generation.Proto(), 7, beat));
  // The CPU counts from the mark: crumbs that come early (two heartbeats a
  // millisecond apart) are not progress, nor are many beats of crumbs.
  EXPECT_FALSE(ShowsProgress(mark, same.Proto(), 7, kT0 + absl::Seconds(10)));
  Said crumbs = before;
  crumbs.cpu_ms = 5000 + 60;
  EXPECT_FALSE(ShowsProgress(mark, crumbs.Proto(), 7, kT0 + absl::Seconds(6)));
  EXPECT_TRUE(
      ShowsProgress(mark, crumbs.Proto(), 7, kT0 + absl::Milliseconds(500)));
}

TEST(JudgeHangTest, AWorkerStalledBeforeAForwardIsHung) {
  const absl::Time now = kT0;
  // Ranks 0 and 2 broadcast the buffers (#11); rank 1 stopped after the
  // step's agreement (#10) and has done nothing for 6 s.
  const std::vector<MemberProgress> members = {
      Waiting(0, 11, absl::Seconds(6), now),
      Quiet(1, 10, now - absl::Seconds(6), now),
      Waiting(2, 11, absl::Seconds(6), now)};
  const HangVerdict v = JudgeHang(members, now, 0);
  ASSERT_EQ(v.kind, HangVerdict::Kind::kHung);
  EXPECT_THAT(v.hung, ElementsAre("w1"));
  ASSERT_EQ(v.details.size(), 1u);
  EXPECT_THAT(v.details[0], HasSubstr("hung at step 7 (rank 1)"));
  EXPECT_THAT(v.details[0], HasSubstr("it issued 10 collective(s)"));
  EXPECT_THAT(v.details[0], HasSubstr("rank(s) 0 in #11 (broadcast)"));
  EXPECT_THAT(v.why, HasSubstr("worker(s) w1 hung"));
}

TEST(JudgeHangTest, TheHungWorkersLastCollectivesAreInItsEvent) {
  const absl::Time now = kT0;
  MemberProgress quiet = Quiet(1, 10, now - absl::Seconds(6), now);
  for (int64_t seq : {9, 10}) {
    v1::FlightRecord& r = *quiet.progress->add_recent();
    r.set_generation(1);
    r.set_seq(seq);
    r.set_kind("allreduce");
    r.set_bytes(64);
    r.set_issued_ago_ms(6100 - 10 * seq);
    r.set_ended_ago_ms(6000 - 10 * seq);
  }
  EXPECT_EQ(RecentCollectives(*quiet.progress, 1),
            "#10 allreduce ended 5.9 s ago");
  const HangVerdict v =
      JudgeHang({Waiting(0, 11, absl::Seconds(6), now), quiet}, now, 0);
  ASSERT_EQ(v.kind, HangVerdict::Kind::kHung);
  EXPECT_THAT(v.details[0],
              HasSubstr("its last collectives: #9 allreduce ended 5.9 s ago, "
                        "#10 allreduce ended 5.9 s ago"));
  v1::WorkerProgress in_flight;
  v1::FlightRecord& r = *in_flight.add_recent();
  r.set_kind("broadcast");
  r.set_issued_ago_ms(2500);
  r.set_ended_ago_ms(-1);
  EXPECT_EQ(RecentCollectives(in_flight, 4),
            "a group's broadcast in flight 2.5 s");
}

TEST(JudgeHangTest, AWorkerStalledBetweenTwoBucketsIsHung) {
  const absl::Time now = kT0;
  // Each backward launches two buckets: #12 and #13. Rank 2 launched the
  // first and stopped before the second; its #12 ended (everyone was in it).
  std::vector<MemberProgress> members = {
      Waiting(0, 13, absl::Seconds(7), now),
      Waiting(1, 13, absl::Seconds(7), now),
      Quiet(2, 12, now - absl::Seconds(7), now)};
  members[0].progress->set_pending_seq(13);
  const HangVerdict v = JudgeHang(members, now, 0);
  ASSERT_EQ(v.kind, HangVerdict::Kind::kHung);
  EXPECT_THAT(v.hung, ElementsAre("w2"));
}

TEST(JudgeHangTest, NotBeforeTheTimeout) {
  const absl::Time now = kT0;
  const std::vector<MemberProgress> members = {
      Waiting(0, 11, absl::Seconds(4), now),
      Quiet(1, 10, now - absl::Seconds(4), now)};
  EXPECT_EQ(JudgeHang(members, now, 0).kind, HangVerdict::Kind::kNone);
  // Waiting long enough, but the quiet one moved recently.
  const std::vector<MemberProgress> moved = {
      Waiting(0, 11, absl::Seconds(9), now),
      Quiet(1, 10, now - absl::Seconds(3), now)};
  EXPECT_EQ(JudgeHang(moved, now, 0).kind, HangVerdict::Kind::kNone);
}

TEST(JudgeHangTest, FalseAlarmRankZeroEvaluatingBetweenEpochs) {
  // pytorch/examples' MNIST: rank 0 tests the model after each epoch while
  // the others wait in the next step's agreement. Its CPU keeps moving: its
  // `progressed` is a heartbeat ago, for as long as it evaluates.
  const absl::Time now = kT0 + absl::Seconds(60);
  const std::vector<MemberProgress> members = {
      Quiet(0, 40, now - absl::Seconds(1), now),
      Waiting(1, 41, absl::Seconds(60), now),
      Waiting(2, 41, absl::Seconds(60), now)};
  const HangVerdict v = JudgeHang(members, now, 0);
  EXPECT_EQ(v.kind, HangVerdict::Kind::kNone);
  EXPECT_THAT(v.hung, IsEmpty());
  EXPECT_EQ(HealthOf(members[1], now, kHangFloor), "waiting");
  EXPECT_EQ(HealthOf(members[0], now, kHangFloor), "");
}

TEST(JudgeHangTest, FalseAlarmACheckpointOrARestoreIsBusy) {
  const absl::Time now = kT0;
  for (const char* activity : {"checkpoint", "restore"}) {
    Said said;
    said.activity = activity;
    // Reading from a slow disk: no CPU, no collective, for a minute.
    const std::vector<MemberProgress> members = {
        Quiet(0, 10, now - absl::Seconds(60), now, said),
        Waiting(1, 11, absl::Seconds(60), now)};
    EXPECT_EQ(JudgeHang(members, now, 0).kind, HangVerdict::Kind::kNone)
        << activity;
    EXPECT_EQ(HealthOf(members[0], now, kHangFloor), "busy");
  }
}

TEST(JudgeHangTest, FalseAlarmASlowFirstStepHasTheStartUpAllowance) {
  const absl::Time now = kT0;
  // A newcomer (no step time of its own yet) whose first batch loads
  // slowly with little CPU: the others, warmed up, wait in #3.
  Said cold;
  cold.step_ms = 0;
  std::vector<MemberProgress> members = {
      Waiting(0, 3, absl::Seconds(30), now),
      Quiet(1, 2, now - absl::Seconds(30), now, cold)};
  EXPECT_EQ(JudgeHang(members, now, 0).kind, HangVerdict::Kind::kNone);
  // Past the allowance, it is hung after all.
  const absl::Time later = now + kStartupAllowance;
  members = {Waiting(0, 3, kStartupAllowance + absl::Seconds(30), later),
             Quiet(1, 2, now - absl::Seconds(30), later, cold)};
  const HangVerdict v = JudgeHang(members, later, 0);
  EXPECT_EQ(v.kind, HangVerdict::Kind::kHung);
  // A timeout set by the user is the user's: no allowance.
  members = {Waiting(0, 3, absl::Seconds(30), now),
             Quiet(1, 2, now - absl::Seconds(30), now, cold)};
  EXPECT_EQ(JudgeHang(members, now, 10000).kind, HangVerdict::Kind::kHung);
}

TEST(JudgeHangTest, OnlyWhoHoldsTheWaitersUpIsHung) {
  const absl::Time now = kT0;
  // Rank 1 is quiet but already issued #11, the one rank 0 waits in: it is
  // not what holds rank 0 up (rank 2, computing, is).
  const std::vector<MemberProgress> members = {
      Waiting(0, 11, absl::Seconds(8), now),
      Quiet(1, 11, now - absl::Seconds(8), now),
      Quiet(2, 10, now - absl::Seconds(1), now)};
  EXPECT_EQ(JudgeHang(members, now, 0).kind, HangVerdict::Kind::kNone);
  // A member still on the last generation's communicator issued nothing in
  // the waited one.
  Said old;
  old.generation = 0;
  const std::vector<MemberProgress> behind = {
      Waiting(0, 2, absl::Seconds(8), now),
      Quiet(1, 40, now - absl::Seconds(8), now, old)};
  const HangVerdict v = JudgeHang(behind, now, 0);
  EXPECT_EQ(v.kind, HangVerdict::Kind::kHung);
  EXPECT_THAT(v.hung, ElementsAre("w1"));
}

TEST(JudgeHangTest, AStoppedProcessThatStopsReportingIsHung) {
  const absl::Time now = kT0;
  // SIGSTOP: no heartbeat since its last report 6 s ago.
  const std::vector<MemberProgress> members = {
      Waiting(0, 11, absl::Seconds(6), now),
      Quiet(1, 10, now - absl::Seconds(6), now - absl::Seconds(6))};
  const HangVerdict v = JudgeHang(members, now, 0);
  ASSERT_EQ(v.kind, HangVerdict::Kind::kHung);
  EXPECT_THAT(v.details[0], HasSubstr("last heartbeat 6.0 s ago"));
}

v1::ProcessView View(const std::string& state, int64_t cpu_ms,
                     std::optional<int> gpu = std::nullopt) {
  v1::ProcessView v;
  v.set_state(state);
  v.set_cpu_ms(cpu_ms);
  if (gpu.has_value()) v.set_gpu_percent(*gpu);
  return v;
}

// See Note [What the agent sees] in agent/process_view.h.
TEST(ProcessShowsProgressTest, CpuAndAGpuOutsideCollectivesAreProgress) {
  const ProcessMark mark{5000, kT0};
  const absl::Time beat = kT0 + absl::Seconds(1);
  EXPECT_FALSE(ProcessShowsProgress(mark, View("sleeping", 5020), false, beat));
  EXPECT_TRUE(ProcessShowsProgress(mark, View("running", 5950), false, beat));
  // Its kernels keep the GPU busy while its host thread sleeps in a
  // synchronize: progress, unless it waits in a collective (whose own kernel
  // keeps a waiter's GPU busy).
  EXPECT_TRUE(
      ProcessShowsProgress(mark, View("sleeping", 5001, 90), false, beat));
  EXPECT_FALSE(
      ProcessShowsProgress(mark, View("sleeping", 5001, 90), true, beat));
  EXPECT_FALSE(
      ProcessShowsProgress(mark, View("sleeping", 5001, 0), false, beat));
  // A stopped or exited process never progresses, whatever its numbers say.
  EXPECT_FALSE(
      ProcessShowsProgress(mark, View("stopped", 9000, 90), false, beat));
  EXPECT_FALSE(ProcessShowsProgress(mark, View("zombie", 9000), false, beat));
  // Nothing over no time.
  EXPECT_FALSE(ProcessShowsProgress(mark, View("running", 5100), false, kT0));
}

TEST(JudgeHangTest, WhatTheAgentSawOfAHungProcessIsInItsEvent) {
  const absl::Time now = kT0;
  std::vector<MemberProgress> members = {
      Waiting(0, 11, absl::Seconds(6), now),
      Quiet(1, 10, now - absl::Seconds(6), now - absl::Seconds(6))};
  members[1].process = View("stopped", 100);
  members[1].process_seen = now - absl::Milliseconds(400);
  const HangVerdict v = JudgeHang(members, now, 0);
  ASSERT_EQ(v.kind, HangVerdict::Kind::kHung);
  EXPECT_THAT(v.details[0], HasSubstr("its node agent saw its process stopped "
                                      "(SIGSTOP or a debugger) 0.4 s ago"));
  EXPECT_EQ(HealthOf(members[1], now, absl::Seconds(5)), "stopped");
  members[1].process = View("disk", 100, 0);
  EXPECT_THAT(JudgeHang(members, now, 0).details[0],
              HasSubstr("in uninterruptible sleep (disk or network filesystem "
                        "I/O) 0.4 s ago, its GPU 0% busy"));
  EXPECT_EQ(HealthOf(members[1], now, absl::Seconds(5)), "idle");
}

// A member SIGSTOPped inside the very collective the others wait in: its
// last heartbeat says it waits there too, but its agent sees it stopped. It
// is the one hung, not everyone stuck together.
TEST(JudgeHangTest, AMemberStoppedInsideTheWaitedCollectiveIsHung) {
  const absl::Time now = kT0;
  std::vector<MemberProgress> members = {Waiting(0, 11, absl::Seconds(6), now),
                                         Waiting(1, 11, absl::Seconds(6), now),
                                         Waiting(2, 11, absl::Seconds(6), now)};
  for (MemberProgress& m : members) m.progressed = now - absl::Seconds(6);
  ASSERT_EQ(JudgeHang(members, now, 0).kind, HangVerdict::Kind::kStuckTogether);
  members[1].process = View("stopped", 100);
  members[1].process_seen = now - absl::Milliseconds(200);
  const HangVerdict v = JudgeHang(members, now, 0);
  ASSERT_EQ(v.kind, HangVerdict::Kind::kHung);
  EXPECT_THAT(v.hung, ElementsAre(members[1].worker_id));
  EXPECT_THAT(v.details[0],
              HasSubstr("its node agent saw its process stopped"));
  // Continued (its agent sees it sleeping in the collective): a waiter again.
  members[1].process = View("sleeping", 100);
  EXPECT_EQ(JudgeHang(members, now, 0).kind, HangVerdict::Kind::kStuckTogether);
}

TEST(JudgeHangTest, EveryoneWaitingAndNoneMovingIsStuckTogether) {
  const absl::Time now = kT0;
  std::vector<MemberProgress> members = {Waiting(0, 11, absl::Seconds(6), now),
                                         Waiting(1, 11, absl::Seconds(6), now)};
  const HangVerdict v = JudgeHang(members, now, 0);
  EXPECT_EQ(v.kind, HangVerdict::Kind::kStuckTogether);
  EXPECT_THAT(v.why, HasSubstr("every member waits"));
  // One of them still computing (its collective in flight meanwhile): none.
  members[1].progressed = now - absl::Seconds(1);
  EXPECT_EQ(JudgeHang(members, now, 0).kind, HangVerdict::Kind::kNone);
}

TEST(JudgeHangTest, OlderWorkersAndTheRuleOffAreLeftToTheHeartbeats) {
  const absl::Time now = kT0;
  MemberProgress older;
  older.worker_id = "w1";
  older.rank = 1;
  older.progressed = now - absl::Hours(1);
  older.reported = now;
  EXPECT_EQ(
      JudgeHang({Waiting(0, 11, absl::Seconds(60), now), older}, now, 0).kind,
      HangVerdict::Kind::kNone);
  const std::vector<MemberProgress> members = {
      Waiting(0, 11, absl::Seconds(60), now),
      Quiet(1, 10, now - absl::Seconds(60), now)};
  EXPECT_EQ(JudgeHang(members, now, -1).kind, HangVerdict::Kind::kNone);
  EXPECT_EQ(HealthOf(members[1], now, absl::ZeroDuration()), "");
}

// A member whose steps split into `own` and `wait` milliseconds.
MemberProgress Timed(int rank, double own, double wait) {
  MemberProgress m;
  m.worker_id = "w" + std::to_string(rank);
  m.rank = rank;
  Said said;
  said.step_ms = own + wait;
  m.progress = said.Proto();
  m.progress->set_own_ms(own);
  m.progress->set_wait_ms(wait);
  return m;
}

TEST(SlowMembersTest, TheOneThatWorksLongestAndWaitsLeast) {
  // A rank at a fifth of the speed: everyone's step is its, the others wait.
  EXPECT_THAT(
      SlowMembers({Timed(0, 20, 80), Timed(1, 100, 1), Timed(2, 21, 79)}),
      ElementsAre(false, true, false));
  EXPECT_DOUBLE_EQ(
      OthersOwnMs({Timed(0, 20, 80), Timed(1, 100, 1), Timed(2, 21, 79)}, 1),
      21);
  // Two members: each against the other.
  EXPECT_THAT(SlowMembers({Timed(0, 10, 30), Timed(1, 40, 1)}),
              ElementsAre(false, true));
  // Noise is not slowness: 1.5x but under the margin, or under 1.5x.
  EXPECT_THAT(SlowMembers({Timed(0, 1, 1), Timed(1, 2.5, 0), Timed(2, 1, 1)}),
              ElementsAre(false, false, false));
  EXPECT_THAT(SlowMembers({Timed(0, 20, 5), Timed(1, 28, 0), Timed(2, 20, 5)}),
              ElementsAre(false, false, false));
  // Nothing to compare: one member, or no own times.
  EXPECT_THAT(SlowMembers({Timed(0, 50, 0)}), ElementsAre(false));
  MemberProgress none;
  EXPECT_THAT(SlowMembers({none, Timed(1, 50, 0)}), ElementsAre(false, false));
  // Many members: the others' median without the one judged.
  std::vector<MemberProgress> many;
  for (int r = 0; r < 40; ++r) many.push_back(Timed(r, 10 + r % 3, 50));
  many[17] = Timed(17, 60, 1);
  const std::vector<bool> slow = SlowMembers(many);
  for (int r = 0; r < 40; ++r) EXPECT_EQ(slow[r], r == 17) << r;
}

TEST(JudgeEvictionTest, EvictedWhenTheJobIsFasterWithoutIt) {
  // A fifth of the speed in a job of 3: 3 / 101 ms with it, 2 / 22 ms
  // without (the others' own 21 ms plus its 1 ms wait): 3.1x.
  const std::vector<MemberProgress> fifth = {Timed(0, 20, 80), Timed(1, 100, 1),
                                             Timed(2, 21, 79)};
  EvictionEstimate e = JudgeEviction(fifth, 1, /*min_workers=*/1);
  EXPECT_TRUE(e.evict);
  EXPECT_NEAR(e.with, 3000.0 / 101, 1e-9);
  EXPECT_NEAR(e.without, 2000.0 / 22, 1e-9);
  // Not below min_workers: 2 left of a job that needs 3.
  EXPECT_FALSE(JudgeEviction(fifth, 1, /*min_workers=*/3).evict);
  EXPECT_TRUE(JudgeEviction(fifth, 1, /*min_workers=*/2).evict);
  // 1.5x slower in a job of 3 (named, but the job is not faster without it:
  // 3 / 31 ms against 2 / 21 ms).
  const std::vector<MemberProgress> half = {Timed(0, 20, 11), Timed(1, 30, 1),
                                            Timed(2, 20, 11)};
  EXPECT_FALSE(JudgeEviction(half, 1, 1).evict);
  // The same member among 40: 40 / 31 against 39 / 21 ms, 1.44x.
  std::vector<MemberProgress> many;
  for (int r = 0; r < 40; ++r) many.push_back(Timed(r, 20, 11));
  many[17] = Timed(17, 30, 1);
  EXPECT_TRUE(JudgeEviction(many, 17, 1).evict);
  // A throttled CPU is slow inside the collectives too: it waits longer than
  // they take (23 ms here, against the others' 3 ms of own work); the
  // estimate caps them at the others' own work: 2 / 6 ms against 3 / 40 ms.
  const std::vector<MemberProgress> throttled = {
      Timed(0, 2.8, 37), Timed(1, 16.5, 23.5), Timed(2, 3.0, 37)};
  e = JudgeEviction(throttled, 1, 1);
  EXPECT_TRUE(e.evict);
  EXPECT_NEAR(e.without, 2000.0 / 6.0, 1e-9);
  // Nothing known, nothing done: no own time, no others, a bad index.
  MemberProgress none;
  EXPECT_FALSE(JudgeEviction({Timed(0, 20, 80), none}, 1, 1).evict);
  EXPECT_FALSE(JudgeEviction({Timed(0, 100, 1)}, 0, 1).evict);
  EXPECT_FALSE(JudgeEviction(fifth, 3, 1).evict);
}

TEST(JudgeEvictionTest, EachEvictionDoublesTheCooldownUpToACap) {
  const absl::Duration base = absl::Seconds(60);
  EXPECT_EQ(CooldownAfter(1, base), absl::Seconds(60));
  EXPECT_EQ(CooldownAfter(2, base), absl::Seconds(120));
  EXPECT_EQ(CooldownAfter(3, base), absl::Seconds(240));
  EXPECT_EQ(CooldownAfter(kMaxCooldownDoublings + 1, base),
            base * (1 << kMaxCooldownDoublings));
  EXPECT_EQ(CooldownAfter(100, base),
            CooldownAfter(kMaxCooldownDoublings + 1, base));
  EXPECT_EQ(CooldownAfter(0, base), base);
}

// ---- through the core ----------------------------------------------------

using testing::HeartbeatReq;
using testing::JoinReq;
using testing::kJob;
using testing::RejoinReq;
using testing::Spec;
using testing::Worker;

class CoreHangTest : public testing::CoordinatorReformTest {
 protected:
  // Every member's heartbeat at `step`, having issued `issued` collectives:
  // `waiting` ones in #issued for `waited`, the others (per `cpu`) using
  // that much CPU since the last beat.
  void Beat(int64_t gen, int64_t step, int n, int64_t issued,
            const std::vector<bool>& waiting, absl::Duration waited,
            const std::vector<int64_t>& cpu, const std::string& activity = "") {
    for (int i = 0; i < n; ++i) {
      v1::HeartbeatRequest r = HeartbeatReq(Worker(i), gen, step);
      cpu_[i] += cpu[static_cast<size_t>(i)];
      Said said;
      said.generation = gen;
      said.cpu_ms = cpu_[i];
      if (waiting[static_cast<size_t>(i)]) {
        said.collectives = issued;
        said.pending_seq = issued;
        said.pending_kind = "broadcast";
        said.pending_ms = absl::ToInt64Milliseconds(waited);
      } else {
        said.collectives = issued - 1;
        if (i == 0) said.activity = activity;
      }
      *r.mutable_progress() = said.Proto();
      auto response = core_.Heartbeat(r);
      ASSERT_TRUE(response.ok()) << response.status();
    }
  }
  int64_t cpu_[8] = {};
};

TEST_F(CoreHangTest, AHungMemberIsTakenOutAndTheOthersReformWithoutIt) {
  const int64_t gen = FormSettled(3, 3);
  Beat(gen, 7, 3, 10, {false, false, false}, absl::ZeroDuration(),
       {900, 900, 900});
  // w1 stalls; w0 and w2 wait in #10 from now on, one beat a second.
  for (int s = 1; s <= 6; ++s) {
    clock_.Advance(absl::Seconds(1));
    Beat(gen, 7, 3, 10, {true, false, true}, absl::Seconds(s), {5, 5, 5});
    core_.Tick();
    if (core_.CurrentGeneration(kJob) != gen ||
        core_.State(kJob) != v1::JOB_STATE_RUNNING) {
      break;
    }
  }
  ASSERT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  EXPECT_THAT(Expected(), ElementsAre("w0", "w2"));
  const std::vector<Event> failures = EventsOf("failure");
  ASSERT_EQ(failures.size(), 1u);
  EXPECT_EQ(failures[0].worker_id, "w1");
  EXPECT_THAT(failures[0].message, HasSubstr("hung at step 7 (rank 1)"));
  // The others come back and go on at once.
  EXPECT_TRUE(core_.Join(RejoinReq(Spec(3), "w0", gen, 7)).ok());
  EXPECT_TRUE(core_.Join(RejoinReq(Spec(3), "w2", gen, 7)).ok());
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
  EXPECT_THAT(Ranks(), ElementsAre("w0", "w2"));
  // When w1 wakes it is a newcomer: its Join (naming its old generation)
  // waits to be admitted, and the members see it waiting.
  EXPECT_TRUE(core_.Join(RejoinReq(Spec(3), "w1", gen, 7)).ok());
  EXPECT_THAT(Waiting(), ElementsAre("w1"));
  EXPECT_EQ(WaitingWorkersSeenBy("w0"), 1);
}

TEST_F(CoreHangTest, FalseAlarmRankZeroComputingForAMinuteStays) {
  const int64_t gen = FormSettled(3, 3);
  Beat(gen, 7, 3, 10, {false, false, false}, absl::ZeroDuration(),
       {900, 900, 900});
  for (int s = 1; s <= 60; ++s) {
    clock_.Advance(absl::Seconds(1));
    Beat(gen, 7, 3, 10, {false, true, true}, absl::Seconds(s), {950, 3, 3});
    core_.Tick();
  }
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(core_.CurrentGeneration(kJob), gen);
  EXPECT_THAT(EventsOf("failure"), IsEmpty());
  const v1::JobStatus status = Status();
  EXPECT_EQ(status.hang_timeout_ms(), 5000);
  ASSERT_EQ(status.members_size(), 3);
  EXPECT_EQ(status.members(0).health(), "");
  EXPECT_EQ(status.members(1).health(), "waiting");
  EXPECT_EQ(status.members(1).progress().pending_seq(), 10);
}

TEST_F(CoreHangTest, FalseAlarmACheckpointWithoutCpuStays) {
  const int64_t gen = FormSettled(3, 3);
  for (int s = 1; s <= 60; ++s) {
    clock_.Advance(absl::Seconds(1));
    Beat(gen, 7, 3, 10, {false, true, true}, absl::Seconds(s), {2, 2, 2},
         "checkpoint");
    core_.Tick();
  }
  EXPECT_EQ(core_.CurrentGeneration(kJob), gen);
  EXPECT_THAT(EventsOf("failure"), IsEmpty());
  EXPECT_EQ(Status().members(0).health(), "busy");
}

TEST_F(CoreHangTest, EveryoneStuckEndsTheGenerationAndKeepsEveryone) {
  const int64_t gen = FormSettled(2, 2);
  for (int s = 1; s <= 7; ++s) {
    clock_.Advance(absl::Seconds(1));
    Beat(gen, 7, 2, 10, {true, true}, absl::Seconds(s), {1, 1});
    core_.Tick();
    if (core_.State(kJob) != v1::JOB_STATE_RUNNING) break;
  }
  ASSERT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  EXPECT_THAT(Expected(), ElementsAre("w0", "w1"));
  EXPECT_THAT(EventsOf("failure"), IsEmpty());
  const std::vector<Event> generations = EventsOf("generation");
  EXPECT_THAT(generations.back().message, HasSubstr("every member waits"));
  // Back together, they are told to probe each other before connecting (a
  // partition between them would be stuck again): the member table.
  EXPECT_TRUE(core_.Join(RejoinReq(Spec(2), "w0", gen, 7)).ok());
  EXPECT_TRUE(core_.Join(RejoinReq(Spec(2), "w1", gen, 7)).ok());
  auto placed = core_.GetAssignment(kJob, "w0");
  ASSERT_TRUE(placed.ok() && placed->has_value()) << placed.status();
  EXPECT_TRUE((*placed)->probe);
  // Only that generation: the next one formed as usual does not.
  const int64_t next = core_.CurrentGeneration(kJob);
  EXPECT_TRUE(core_.Join(RejoinReq(Spec(2), "w0", next, 7, "boundary")).ok());
  EXPECT_TRUE(core_.Join(RejoinReq(Spec(2), "w1", next, 7)).ok());
  placed = core_.GetAssignment(kJob, "w1");
  ASSERT_TRUE(placed.ok() && placed->has_value()) << placed.status();
  EXPECT_GT((*placed)->generation, next);
  EXPECT_FALSE((*placed)->probe);
}

TEST_F(CoreHangTest, AStragglerIsNamedAfterItsSlowIntervalsAndCleared) {
  const int64_t gen = FormSettled(3, 3);
  auto beat = [&](double slow_own) {
    clock_.Advance(absl::Seconds(1));
    for (int i = 0; i < 3; ++i) {
      v1::HeartbeatRequest r = HeartbeatReq(Worker(i), gen, 7);
      Said said;
      said.collectives = 100;
      said.cpu_ms = cpu_[i] += 900;
      *r.mutable_progress() = said.Proto();
      r.mutable_progress()->set_own_ms(i == 2 ? slow_own : 20);
      r.mutable_progress()->set_wait_ms(i == 2 ? 1 : slow_own - 20);
      ASSERT_TRUE(core_.Heartbeat(r).ok());
    }
    core_.Tick();
  };
  for (int s = 0; s < kStragglerIntervals - 1; ++s) beat(100);
  EXPECT_THAT(EventsOf("straggler"), IsEmpty());
  beat(100);
  std::vector<Event> named = EventsOf("straggler");
  ASSERT_EQ(named.size(), 1u);
  EXPECT_EQ(named[0].worker_id, "w2");
  EXPECT_THAT(named[0].message,
              HasSubstr("own work is 100.0 ms a step against 20.0 ms"));
  EXPECT_EQ(Status().members(2).health(), "slow");
  EXPECT_EQ(Status().members(0).health(), "");
  // Reported only: nobody is taken out.
  EXPECT_EQ(core_.CurrentGeneration(kJob), gen);
  // As many fast intervals as it was slow beyond the mark clear it.
  for (int s = 0; s < kStragglerIntervals; ++s) beat(21);
  named = EventsOf("straggler");
  ASSERT_EQ(named.size(), 2u);
  EXPECT_THAT(named[1].message, HasSubstr("no longer a straggler"));
  EXPECT_EQ(Status().members(2).health(), "");
}

// See Note [Evicting stragglers]: three members, w2 slow (its own work and
// wait a step given), one heartbeat a second.
class CoreEvictionTest : public CoreHangTest {
 protected:
  v1::JobSpec StartJob(const std::string& policy, int min_workers,
                       int64_t rendezvous_timeout_ms = 0) {
    v1::JobSpec spec = Spec(3, min_workers);
    spec.set_stragglers(policy);
    spec.set_straggler_cooldown_ms(30000);
    spec.set_rendezvous_timeout_ms(rendezvous_timeout_ms);
    for (int i = 0; i < 3; ++i) {
      clock_.Advance(absl::Milliseconds(10));
      EXPECT_TRUE(core_.Join(JoinReq(spec, Worker(i))).ok());
    }
    clock_.Advance(absl::Seconds(2));
    core_.Tick();
    EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
    return spec;
  }
  // Up to `intervals` seconds, while the generation runs, w0..w{members-1}
  // beating.
  void RunSlow(double own, double wait, int intervals, int members = 3) {
    const int64_t gen = core_.CurrentGeneration(kJob);
    for (int s = 0; s < intervals; ++s) {
      if (core_.State(kJob) != v1::JOB_STATE_RUNNING) return;
      clock_.Advance(absl::Seconds(1));
      for (int i = 0; i < members; ++i) {
        v1::HeartbeatRequest r = HeartbeatReq(Worker(i), gen, 7);
        Said said;
        said.generation = gen;
        said.collectives = ++collectives_;
        said.cpu_ms = cpu_[i] += 900;
        said.step_ms = own + wait;
        *r.mutable_progress() = said.Proto();
        r.mutable_progress()->set_own_ms(i == 2 ? own : 20);
        r.mutable_progress()->set_wait_ms(i == 2 ? wait : own + wait - 20);
        ASSERT_TRUE(core_.Heartbeat(r).ok());
      }
      core_.Tick();
    }
  }
  // w2 (own work `own` a step, 1 ms waiting) is named a straggler and, for
  // three times the naming window, nobody is taken out.
  void NamedNotEvicted(const std::string& policy, int min_workers, double own) {
    StartJob(policy, min_workers);
    const int64_t gen = core_.CurrentGeneration(kJob);
    RunSlow(own, 1, 3 * kStragglerIntervals);
    EXPECT_EQ(core_.CurrentGeneration(kJob), gen);
    EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
    EXPECT_EQ(EventsOf("straggler").size(), 1u);
    EXPECT_EQ(Status().members(2).health(), "slow");
  }
  int64_t collectives_ = 100;
};

// With "evict" the straggler named is taken out, waits out its cool-down
// (held back, though it joined), is admitted again, and a second eviction
// keeps it out twice as long; a restored record keeps that.
TEST_F(CoreEvictionTest, AnEvictedStragglerCoolsDownAndStaysOutLongerNextTime) {
  const v1::JobSpec spec = StartJob("evict", 1);
  const int64_t gen = core_.CurrentGeneration(kJob);
  RunSlow(100, 1, kStragglerIntervals + 1);
  ASSERT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  std::vector<Event> events = EventsOf("straggler");
  ASSERT_EQ(events.size(), 2u);
  EXPECT_THAT(events[1].message, HasSubstr("evicted as a straggler (rank 2)"));
  EXPECT_THAT(events[1].message, HasSubstr("cool-down of 30s"));
  EXPECT_THAT(Expected(), ElementsAre("w0", "w1"));
  // The others go on; w2 re-joins at once and is held back.
  ASSERT_TRUE(core_.Join(RejoinReq(spec, "w0", gen, 7)).ok());
  ASSERT_TRUE(core_.Join(RejoinReq(spec, "w1", gen, 7)).ok());
  ASSERT_TRUE(core_.Join(RejoinReq(spec, "w2", gen, 7)).ok());
  ASSERT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
  EXPECT_THAT(Ranks(), ElementsAre("w0", "w1"));
  EXPECT_THAT(Waiting(), ElementsAre("w2"));
  EXPECT_EQ(WaitingWorkersSeenBy("w0"), 0);
  EXPECT_THAT(Status().waiting(0).health(), HasSubstr("cooling down (30 s"));
  auto placed = core_.GetAssignment(kJob, "w2");
  ASSERT_TRUE(placed.ok()) << placed.status();
  EXPECT_FALSE(placed->has_value());
  // A coordinator restarted meanwhile keeps it held.
  const std::optional<v1::JobRecord> record = core_.ExportJob(kJob);
  ASSERT_TRUE(record.has_value());
  ASSERT_EQ(record->cooling_size(), 1);
  EXPECT_EQ(record->cooling(0).evictions(), 1);
  Core restored(&clock_);
  ASSERT_TRUE(restored.RestoreJob(*record).ok());
  EXPECT_TRUE(testing::SameRecord(*restored.ExportJob(kJob), *record));
  // After the cool-down the members see it waiting and re-form to admit it.
  RunSlow(20, 0, 29, /*members=*/2);
  EXPECT_EQ(WaitingWorkersSeenBy("w0"), 0);
  RunSlow(20, 0, 1, /*members=*/2);
  EXPECT_EQ(WaitingWorkersSeenBy("w0"), 1);
  EXPECT_EQ(Status().waiting(0).health(), "");
  const int64_t two = core_.CurrentGeneration(kJob);
  ASSERT_TRUE(core_.Join(RejoinReq(spec, "w0", two, 7, "boundary")).ok());
  ASSERT_TRUE(core_.Join(RejoinReq(spec, "w1", two, 7)).ok());
  ASSERT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
  EXPECT_THAT(Ranks(), ElementsAre("w0", "w1", "w2"));
  // Still slow: out again, for twice as long.
  RunSlow(100, 1, 2 * kStragglerIntervals);
  ASSERT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  events = EventsOf("straggler");
  EXPECT_THAT(events.back().message, HasSubstr("cool-down of 60s"));
  EXPECT_THAT(events.back().message, HasSubstr("(eviction 2)"));
}

// A rendezvous that would time out below min_workers lets a held straggler
// in before its cool-down ends.
TEST_F(CoreEvictionTest, AHeldStragglerIsLetInRatherThanTheJobFailing) {
  const v1::JobSpec spec =
      StartJob("evict", 2, /*rendezvous_timeout_ms=*/20000);
  const int64_t gen = core_.CurrentGeneration(kJob);
  RunSlow(100, 1, kStragglerIntervals + 1);
  ASSERT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  // w1 never comes back; w2 re-joins and is held for 30 s.
  ASSERT_TRUE(core_.Join(RejoinReq(spec, "w0", gen, 7)).ok());
  ASSERT_TRUE(core_.Join(RejoinReq(spec, "w2", gen, 7)).ok());
  for (int s = 0; s < 19; ++s) {
    clock_.Advance(absl::Seconds(1));
    core_.Tick();
  }
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  clock_.Advance(absl::Seconds(2));
  core_.Tick();
  ASSERT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
  EXPECT_THAT(Ranks(), ElementsAre("w0", "w2"));
  EXPECT_THAT(EventsOf("join").back().message, HasSubstr("let in before"));
}

// Named in each job, taken out in none: "report" (the default), a job that
// would fall below min_workers, a member only 1.6x slower.
TEST_F(CoreEvictionTest, FalseAlarmReportOnly) { NamedNotEvicted("", 1, 100); }

TEST_F(CoreEvictionTest, FalseAlarmNotBelowMinWorkers) {
  NamedNotEvicted("evict", 3, 100);
}

TEST_F(CoreEvictionTest, FalseAlarmNotWhenTheJobIsNotFasterWithout) {
  NamedNotEvicted("evict", 1, 32);
}

// See Note [What the agent sees]: rank 0 evaluates on its GPU, its host
// thread asleep in a synchronize (no CPU); its agent sees the GPU busy.
TEST_F(CoreHangTest, FalseAlarmRankZeroOnItsGpuWithoutCpuStays) {
  const int64_t gen = FormSettled(3, 3);
  Beat(gen, 7, 3, 10, {false, false, false}, absl::ZeroDuration(),
       {900, 900, 900});
  for (int s = 1; s <= 60; ++s) {
    clock_.Advance(absl::Seconds(1));
    Beat(gen, 7, 3, 10, {false, true, true}, absl::Seconds(s), {3, 3, 3});
    for (int i = 0; i < 3; ++i) {
      // The waiters' GPUs run the collective's kernel: busy too.
      ASSERT_TRUE(
          core_.ProcessSeen(kJob, Worker(i), View("sleeping", cpu_[i], 90))
              .ok());
    }
    core_.Tick();
  }
  EXPECT_EQ(core_.CurrentGeneration(kJob), gen);
  EXPECT_THAT(EventsOf("failure"), IsEmpty());
  const v1::JobStatus status = Status();
  EXPECT_EQ(status.members(0).health(), "");
  EXPECT_EQ(status.members(0).process().gpu_percent(), 90);
  EXPECT_EQ(status.members(1).health(), "waiting");
}

// A GPU busy in a collective is no progress: members stuck together in one
// (NCCL's kernels spinning on every GPU) are still found.
TEST_F(CoreHangTest, BusyGpusOfWaitersDoNotHideAStuckGeneration) {
  const int64_t gen = FormSettled(2, 2);
  for (int s = 1; s <= 7; ++s) {
    clock_.Advance(absl::Seconds(1));
    Beat(gen, 7, 2, 10, {true, true}, absl::Seconds(s), {1, 1});
    for (int i = 0; i < 2; ++i) {
      ASSERT_TRUE(
          core_.ProcessSeen(kJob, Worker(i), View("running", cpu_[i], 100))
              .ok());
    }
    core_.Tick();
    if (core_.State(kJob) != v1::JOB_STATE_RUNNING) break;
  }
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  EXPECT_THAT(EventsOf("generation").back().message,
              HasSubstr("every member waits"));
}

// SIGSTOP: its heartbeats stop; its agent goes on reporting it stopped.
TEST_F(CoreHangTest, AStoppedProcessIsShownStoppedAndNamedSoWhenTakenOut) {
  const int64_t gen = FormSettled(3, 3);
  Beat(gen, 7, 3, 10, {false, false, false}, absl::ZeroDuration(),
       {900, 900, 900});
  ASSERT_TRUE(
      core_.ProcessSeen(kJob, Worker(1), View("running", cpu_[1])).ok());
  bool shown = false;
  for (int s = 1; s <= 8; ++s) {
    clock_.Advance(absl::Seconds(1));
    for (int i : {0, 2}) {
      v1::HeartbeatRequest r = HeartbeatReq(Worker(i), gen, 7);
      Said said;
      said.collectives = 10;
      said.pending_seq = 10;
      said.pending_kind = "broadcast";
      said.pending_ms = s * 1000;
      said.cpu_ms = cpu_[i] + s;
      *r.mutable_progress() = said.Proto();
      ASSERT_TRUE(core_.Heartbeat(r).ok());
    }
    v1::ProcessView stopped = View("stopped", cpu_[1]);
    stopped.set_age_ms(200);
    ASSERT_TRUE(core_.ProcessSeen(kJob, Worker(1), stopped).ok());
    if (core_.State(kJob) == v1::JOB_STATE_RUNNING) {
      const v1::JobStatus status = Status();
      shown = shown || (status.members(1).health() == "stopped" &&
                        status.members(1).process_age_ms() == 200);
    }
    core_.Tick();
    if (core_.State(kJob) != v1::JOB_STATE_RUNNING) break;
  }
  EXPECT_TRUE(shown);
  ASSERT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  const std::vector<Event> failures = EventsOf("failure");
  ASSERT_EQ(failures.size(), 1u);
  EXPECT_EQ(failures[0].worker_id, "w1");
  EXPECT_THAT(failures[0].message,
              HasSubstr("its node agent saw its process stopped (SIGSTOP or a "
                        "debugger) 0.2 s ago"));
}

TEST_F(CoreHangTest, BadProcessViewsAreRefusedAndChangeNothing) {
  const int64_t gen = FormSettled(2, 2);
  Beat(gen, 7, 2, 10, {false, false}, absl::ZeroDuration(), {900, 900});
  for (const v1::ProcessView& bad :
       {View("", 1), View("Z", 1), View("running", -1), View("running", 1, 101),
        View("running", 1, -1), [] {
          v1::ProcessView v = View("running", 1);
          v.set_age_ms(-5);
          return v;
        }()}) {
    EXPECT_EQ(core_.ProcessSeen(kJob, Worker(0), bad).code(),
              absl::StatusCode::kInvalidArgument)
        << bad.ShortDebugString();
  }
  EXPECT_FALSE(Status().members(0).has_process());
  EXPECT_EQ(core_.ProcessSeen("nope", Worker(0), View("running", 1)).code(),
            absl::StatusCode::kNotFound);
  // Of a worker that is no member: nothing to keep.
  EXPECT_TRUE(core_.ProcessSeen(kJob, "w9", View("running", 1)).ok());
  EXPECT_TRUE(core_.ProcessSeen(kJob, Worker(0), View("running", 1)).ok());
  EXPECT_EQ(Status().members(0).process().state(), "running");
}

TEST_F(CoreHangTest, TheRuleCanBeTurnedOffAndBadReportsChangeNothing) {
  v1::JobSpec spec = Spec(2);
  spec.set_hang_timeout_ms(-1);
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(core_.Join(JoinReq(spec, Worker(i))).ok());
  }
  clock_.Advance(absl::Seconds(2));
  core_.Tick();
  const int64_t gen = core_.CurrentGeneration(kJob);
  ASSERT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
  for (int s = 1; s <= 9; ++s) {
    clock_.Advance(absl::Seconds(1));
    Beat(gen, 7, 2, 10, {true, false}, absl::Seconds(s), {1, 1});
    core_.Tick();
  }
  EXPECT_EQ(core_.CurrentGeneration(kJob), gen);
  EXPECT_EQ(Status().hang_timeout_ms(), 0);

  // A spec with another setting is refused; so are malformed reports.
  v1::JobSpec other = Spec(2);
  other.set_hang_timeout_ms(3000);
  EXPECT_EQ(core_.Join(JoinReq(other, "w9")).code(),
            absl::StatusCode::kFailedPrecondition);
  v1::JobSpec bad = Spec(2);
  bad.set_job_id("other");
  bad.set_hang_timeout_ms(-2);
  EXPECT_EQ(core_.Join(JoinReq(bad, "w9")).code(),
            absl::StatusCode::kInvalidArgument);
  const std::string before = Snapshot();
  for (auto mutate : std::vector<std::function<void(v1::WorkerProgress&)>>{
           [](auto& p) { p.set_cpu_ms(-1); },
           [](auto& p) { p.set_pending_seq(p.collectives() + 1); },
           [](auto& p) { p.set_pending_kind(std::string(65, 'x')); },
           [](auto& p) { p.set_step_ms(-1); },
           [](auto& p) { p.set_activity("\xff"); },
           [](auto& p) { p.add_recent()->set_ended_ago_ms(-2); },
           [](auto& p) {
             for (int i = 0; i < 65; ++i) p.add_recent();
           }}) {
    v1::HeartbeatRequest r = HeartbeatReq(Worker(0), gen, 7);
    v1::WorkerProgress p = Said().Proto();
    p.set_collectives(3);
    mutate(p);
    *r.mutable_progress() = p;
    EXPECT_EQ(core_.Heartbeat(r).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(Snapshot(), before);
}

}  // namespace
}  // namespace concord::coordinator
