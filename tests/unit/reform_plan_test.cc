// Note [Re-forming NCCL]: the next communicator's derivation, decided on CPU.

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

}  // namespace
}  // namespace concord::comm
