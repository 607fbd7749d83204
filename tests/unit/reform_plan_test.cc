// See Note [Re-forming NCCL]: the next communicator's derivation, decided on
// CPU.

#include "worker/comm/reform_plan.h"

#include <gtest/gtest.h>

namespace concord::comm {
namespace {

using How = ReformPlan::How;

constexpr int kNccl228 = 22809;  // the image's NCCL: has ncclCommShrink
constexpr int kNccl222 = 22203;  // Debian 13's: split or a new init

GenerationChange Change(int nccl, std::vector<std::string> previous,
                        std::vector<std::string> next) {
  GenerationChange c;
  c.backend = Backend::kNccl;
  c.nccl_version = nccl;
  c.parent_usable = true;
  c.previous = std::move(previous);
  c.next = std::move(next);
  return c;
}

TEST(ReformPlanTest, GlooConnectsAnewEveryGeneration) {
  GenerationChange c = Change(kNccl228, {"a", "b", "c"}, {"a", "c"});
  c.backend = Backend::kGloo;
  c.departed_cleanly = true;
  EXPECT_EQ(PlanNextCommunicator(c).how, How::kNewInit);
}

TEST(ReformPlanTest, CleanLeaveShrinksInDefaultMode) {
  GenerationChange c = Change(kNccl228, {"a", "b", "c", "d"}, {"a", "c"});
  c.departed_cleanly = true;
  const ReformPlan p = PlanNextCommunicator(c);
  EXPECT_EQ(p.how, How::kShrink);
  EXPECT_FALSE(p.abort_in_flight);
  EXPECT_EQ(p.excluded, (std::vector<int>{1, 3}));
}

TEST(ReformPlanTest, DeathShrinksInAbortMode) {
  GenerationChange died = Change(kNccl228, {"a", "b", "c"}, {"b", "c"});
  const ReformPlan p = PlanNextCommunicator(died);  // departed_cleanly false
  EXPECT_EQ(p.how, How::kShrink);
  EXPECT_TRUE(p.abort_in_flight);
  EXPECT_EQ(p.excluded, (std::vector<int>{0}));
  // A failed collective means abort mode even when the leavers said goodbye.
  GenerationChange failed = Change(kNccl228, {"a", "b", "c"}, {"b", "c"});
  failed.departed_cleanly = true;
  failed.parent_failed = true;
  EXPECT_TRUE(PlanNextCommunicator(failed).abort_in_flight);
}

TEST(ReformPlanTest, OlderNcclSplitsOnlyWhenEveryMemberCanCall) {
  // The same members, nothing failed: every one of them calls the split.
  GenerationChange same = Change(kNccl222, {"a", "b", "c"}, {"a", "b", "c"});
  EXPECT_EQ(PlanNextCommunicator(same).how, How::kSplit);
  // A member that left is outside the new generation: no split without it.
  GenerationChange left = Change(kNccl222, {"a", "b", "c"}, {"a", "b"});
  left.departed_cleanly = true;
  EXPECT_EQ(PlanNextCommunicator(left).how, How::kNewInit);
  GenerationChange died = Change(kNccl222, {"a", "b", "c"}, {"a", "b"});
  EXPECT_EQ(PlanNextCommunicator(died).how, How::kNewInit);
  GenerationChange failed = Change(kNccl222, {"a", "b"}, {"a", "b"});
  failed.parent_failed = true;
  EXPECT_EQ(PlanNextCommunicator(failed).how, How::kNewInit);
}

TEST(ReformPlanTest, TheSameMembersNeverShrink) {
  // ncclCommShrink refuses to leave nobody out (NCCL 2.28, on a GPU): the
  // same members split when nothing failed, and init anew after a failure.
  GenerationChange same = Change(kNccl228, {"a", "b", "c"}, {"a", "b", "c"});
  EXPECT_EQ(PlanNextCommunicator(same).how, How::kSplit);
  GenerationChange again = Change(kNccl228, {"a", "b"}, {"a", "b"});
  again.parent_failed = true;
  const ReformPlan p = PlanNextCommunicator(again);
  EXPECT_EQ(p.how, How::kNewInit);
  EXPECT_TRUE(p.excluded.empty());
}

TEST(ReformPlanTest, JoinersNeedANewInit) {
  GenerationChange c = Change(kNccl228, {"a", "b"}, {"a", "b", "z"});
  c.departed_cleanly = true;
  const ReformPlan p = PlanNextCommunicator(c);
  EXPECT_EQ(p.how, How::kNewInit);
  EXPECT_EQ(p.why, "1 worker joined");
  // One leaves and one joins in the same change: still a new init.
  GenerationChange swap = Change(kNccl228, {"a", "b"}, {"a", "z"});
  swap.departed_cleanly = true;
  EXPECT_EQ(PlanNextCommunicator(swap).how, How::kNewInit);
}

TEST(ReformPlanTest, ReorderedSurvivorsNeedANewInit) {
  // Shrink keeps the old order; the coordinator numbered them otherwise.
  GenerationChange c = Change(kNccl228, {"a", "b", "c"}, {"c", "a"});
  c.departed_cleanly = true;
  EXPECT_EQ(PlanNextCommunicator(c).how, How::kNewInit);
}

TEST(ReformPlanTest, AnAbortedParentNeedsANewInit) {
  GenerationChange c = Change(kNccl228, {"a", "b", "c"}, {"a", "b"});
  c.parent_usable = false;  // the membership watcher aborted it first
  const ReformPlan p = PlanNextCommunicator(c);
  EXPECT_EQ(p.how, How::kNewInit);
  EXPECT_TRUE(p.excluded.empty());
}

TEST(ReformPlanTest, MalformedMembershipNeedsANewInit) {
  EXPECT_EQ(
      PlanNextCommunicator(Change(kNccl228, {"a", "a", "b"}, {"a", "b"})).how,
      How::kNewInit);
  EXPECT_EQ(PlanNextCommunicator(Change(kNccl228, {"a", "b"}, {})).how,
            How::kNewInit);
}

// The coordinator's RankChange instead of the member table.
TEST(NextRankLabelsTest, SurvivorsKeepTheirLabelsAndNewcomersGetNewOnes) {
  const std::vector<std::string> first = NextRankLabels({}, 0, 1, 4, {});
  EXPECT_EQ(first, (std::vector<std::string>{"g1r0", "g1r1", "g1r2", "g1r3"}));
  RankChange change;
  change.previous_generation = 1;
  change.previous_world_size = 4;
  change.departed = {1};
  change.order_kept = true;
  const std::vector<std::string> second =
      NextRankLabels(first, 1, 2, 4, change);
  EXPECT_EQ(second, (std::vector<std::string>{"g1r0", "g1r2", "g1r3", "g2r3"}));
  // Rank 1 died, one worker joined: no derivation can add a rank.
  EXPECT_EQ(PlanNextCommunicator(Change(kNccl228, first, second)).how,
            How::kNewInit);
  // Rank 1 died, nobody joined: shrink excluding old rank 1.
  const std::vector<std::string> shrunk =
      NextRankLabels(first, 1, 2, 3, change);
  const ReformPlan plan = PlanNextCommunicator(Change(kNccl228, first, shrunk));
  EXPECT_EQ(plan.how, How::kShrink);
  EXPECT_EQ(plan.excluded, std::vector<int>{1});
}

TEST(NextRankLabelsTest, AnythingUnknownMeansEveryLabelIsNew) {
  const std::vector<std::string> first = NextRankLabels({}, 0, 1, 3, {});
  RankChange change;
  change.previous_generation = 1;
  change.previous_world_size = 3;
  change.departed = {2};
  change.order_kept = true;
  const std::vector<std::string> fresh = {"g3r0", "g3r1"};
  // No RankChange (a coordinator that restarted).
  EXPECT_EQ(NextRankLabels(first, 1, 3, 2, {}), fresh);
  // From another generation than the one this worker knows.
  EXPECT_EQ(NextRankLabels(first, 2, 3, 2, change), fresh);
  // Another size than the one this worker knows.
  EXPECT_EQ(NextRankLabels({"a", "b"}, 1, 3, 2, change), fresh);
  // The survivors' order changed.
  change.order_kept = false;
  EXPECT_EQ(NextRankLabels(first, 1, 3, 2, change), fresh);
  for (const std::vector<std::string>& next :
       {NextRankLabels(first, 1, 3, 2, {}),
        NextRankLabels(first, 1, 3, 2, change)}) {
    EXPECT_EQ(PlanNextCommunicator(Change(kNccl228, first, next)).how,
              How::kNewInit);
  }
}

}  // namespace
}  // namespace concord::comm
