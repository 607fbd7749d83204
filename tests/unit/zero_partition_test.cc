#include <gtest/gtest.h>

#include <algorithm>

#include "worker/zero/partition.h"

namespace concord::zero {
namespace {

TEST(ZeroPartitionTest, LargestFirstToTheLeastLoadedRank) {
  // Sorted: 100 (i=1), 50 (i=3), 40 (i=0), 10 (i=2). Rank 0 takes 100, rank 1
  // takes 50 and then 40 (90 < 100), rank 1 again 10 (90 < 100).
  const Partition p = PartitionParameters({{40, 100, 10, 50}}, 2);
  EXPECT_EQ(p, (Partition{{{1}}, {{3, 0, 2}}}));
  EXPECT_EQ(OwnerOf(p, {{40, 100, 10, 50}}), (std::vector<int>{1, 0, 1, 1}));
}

TEST(ZeroPartitionTest, TiesKeepTheOrderAndGoToTheLowestRank) {
  // Four equal sizes over three ranks: 0, 1, 2 in order, then rank 0 again.
  EXPECT_EQ(PartitionParameters({{8, 8, 8, 8}}, 3),
            (Partition{{{0, 3}}, {{1}}, {{2}}}));
}

TEST(ZeroPartitionTest, TotalsCarryAcrossGroups) {
  // Group 0 loads rank 0 with 30 and rank 1 with 20; group 1's largest goes
  // to rank 1 (20 < 30), then rank 1 holds 45 and the next goes to rank 0.
  const std::vector<std::vector<int64_t>> numels = {{30, 20}, {25, 5}};
  const Partition p = PartitionParameters(numels, 2);
  EXPECT_EQ(p, (Partition{{{0}, {1}}, {{1}, {0}}}));
  EXPECT_EQ(OwnerOf(p, numels), (std::vector<int>{0, 1, 1, 0}));
}

TEST(ZeroPartitionTest, MoreRanksThanParametersLeavesSomeEmpty) {
  const Partition p = PartitionParameters({{3, 7}}, 4);
  EXPECT_EQ(p, (Partition{{{1}}, {{0}}, {{}}, {{}}}));
}

TEST(ZeroPartitionTest, OneRankTakesEverything) {
  const Partition p = PartitionParameters({{1, 2}, {3}}, 1);
  EXPECT_EQ(p, (Partition{{{1, 0}, {0}}}));
}

TEST(ZeroBucketAssignmentTest, WholeBucketsGoRoundTheRanks) {
  const BucketAssignment a = AssignBuckets({{4, 2}, {8}, {1, 1, 1}}, 2, false);
  ASSERT_EQ(a.runs.size(), 3u);
  EXPECT_EQ(a.runs[2].bucket, 2);
  EXPECT_EQ(a.runs[2].rank, 0);
  EXPECT_EQ(a.runs[2].offset, 0);
  EXPECT_EQ(a.runs[2].length, 3);
  EXPECT_EQ(a.ranks, (std::vector<std::vector<int>>{{0}, {1}, {0}}));
}

TEST(ZeroBucketAssignmentTest, ShardBucketsCutsRunsBelowTheThreshold) {
  // An MLP's three rebuilt buckets (elements per parameter). Total 533507,
  // threshold 177835.7. Smallest bucket first: bucket 2 whole to rank 0;
  // bucket 1's bias to rank 1 (its weight would reach the threshold), its
  // weight to rank 2 (rank 1 holds part already); bucket 0's first three to
  // rank 1 (512 elements so far), its last to rank 0 (6656 < 262144).
  const BucketAssignment a = AssignBuckets(
      {{3, 1536, 512, 262144}, {512, 262144}, {512, 6144}}, 3, true);
  std::vector<std::vector<int>> runs;
  for (const BucketRun& r : a.runs) {
    runs.push_back({r.bucket, r.rank, r.offset, r.length});
  }
  EXPECT_EQ(runs, (std::vector<std::vector<int>>{{2, 0, 0, 2},
                                                 {1, 1, 0, 1},
                                                 {1, 2, 1, 1},
                                                 {0, 1, 0, 3},
                                                 {0, 0, 3, 1}}));
  EXPECT_EQ(a.ranks, (std::vector<std::vector<int>>{{0, 1}, {1, 2}, {0}}));
}

TEST(ZeroBucketAssignmentTest, ARunNeverStartsEmpty) {
  // The first parameter reaches the threshold (50.5) alone: it opens the
  // run rather than closing an empty one; the next closes it.
  const BucketAssignment a = AssignBuckets({{100, 1}}, 2, true);
  ASSERT_EQ(a.runs.size(), 2u);
  EXPECT_EQ(a.runs[0].rank, 0);
  EXPECT_EQ(a.runs[0].length, 1);
  EXPECT_EQ(a.runs[1].rank, 1);
  EXPECT_EQ(a.runs[1].offset, 1);
}

TEST(ZeroBucketAssignmentTest, MoreRunsThanRanksGoToTheLeastLoaded) {
  // 303 elements over 2 ranks (threshold 151.5): runs of 102, 101 and 100;
  // the third, with both ranks holding part of the bucket, goes to rank 1
  // (101 elements against rank 0's 102), where PyTorch asserts.
  const BucketAssignment a = AssignBuckets({{1, 100, 1, 100, 1, 100}}, 2, true);
  ASSERT_EQ(a.runs.size(), 3u);
  EXPECT_EQ(a.runs[0].rank, 0);
  EXPECT_EQ(a.runs[0].length, 3);
  EXPECT_EQ(a.runs[1].rank, 1);
  EXPECT_EQ(a.runs[1].offset, 3);
  EXPECT_EQ(a.runs[1].length, 2);
  EXPECT_EQ(a.runs[2].rank, 1);
  EXPECT_EQ(a.runs[2].offset, 5);
  EXPECT_EQ(a.runs[2].length, 1);
  EXPECT_EQ(a.ranks[0], (std::vector<int>{0, 1}));
}

TEST(ZeroMirrorsTest, OneNodeMirrorsOnTheNextRank) {
  EXPECT_EQ(MirrorsOf({"a", "a", "a"}), (std::vector<int>{1, 2, 0}));
}

TEST(ZeroMirrorsTest, TheMirrorIsOnAnotherNodeWhereThereIsOne) {
  // Two nodes of two ranks each: every rank's mirror is on the other node,
  // one shard each.
  EXPECT_EQ(MirrorsOf({"a", "a", "b", "b"}), (std::vector<int>{2, 3, 0, 1}));
  // An uneven layout: rank 2 (node c) mirrors on 3 (node a).
  EXPECT_EQ(MirrorsOf({"a", "b", "c", "a"}), (std::vector<int>{1, 2, 3, 1}));
}

TEST(ZeroMirrorsTest, EqualShardsMakeARing) {
  EXPECT_EQ(MirrorsOf({"a", "a", "a", "a"}, {5, 5, 5, 5}),
            (std::vector<int>{1, 2, 3, 0}));
  // Empty shards (the overlap's warm-up) too.
  EXPECT_EQ(MirrorsOf({"a", "a", "a"}, {0, 0, 0}), (std::vector<int>{1, 2, 0}));
}

TEST(ZeroMirrorsTest, TheLargestShardsAreMirroredOnTheSmallest) {
  // Two matrices of 1 M elements, one of 0.5 M and small parameters over 4
  // ranks (bench's mlp-large): a ring would give rank 1 its shard and rank
  // 0's, 2.1 M elements; evened out, no rank steps more than 1.57 M.
  const std::vector<int64_t> sizes{1048576, 1048576, 524288, 13322};
  const std::vector<int> mirrors = MirrorsOf({"a", "a", "a", "a"}, sizes);
  EXPECT_EQ(mirrors, (std::vector<int>{3, 2, 0, 1}));
  std::vector<int64_t> load = sizes;
  for (size_t r = 0; r < sizes.size(); ++r) {
    EXPECT_NE(mirrors[r], int(r));
    load[size_t(mirrors[r])] += sizes[r];
  }
  EXPECT_EQ(*std::max_element(load.begin(), load.end()), 1048576 + 524288);
  // Over 6 ranks every large shard is mirrored by a rank of small ones.
  const std::vector<int> six =
      MirrorsOf(std::vector<std::string>(6, "a"),
                {1048576, 1048576, 524288, 4, 4, 13314});
  EXPECT_EQ(six, (std::vector<int>{3, 4, 5, 5, 2, 2}));
  // Equal shards among unequal ones: the first after the shard on a tie.
  EXPECT_EQ(MirrorsOf({"a", "a", "a"}, {1048576, 1048576, 537610}),
            (std::vector<int>{2, 0, 1}));
}

TEST(ZeroMirrorsTest, AnotherNodeComesBeforeALighterRank) {
  // Rank 0's large shard: rank 1 shares its node and holds nothing, but
  // the mirror goes to node b.
  EXPECT_EQ(MirrorsOf({"a", "a", "b", "b"}, {100, 0, 60, 50}),
            (std::vector<int>{3, 2, 1, 1}));
}

TEST(ZeroMirrorsTest, ShardSizesCountEveryGroup) {
  // Two groups: rank 0 holds group 0's parameter 1 and group 1's 0.
  const Partition p{{{1}, {0}}, {{0, 2}, {}}};
  EXPECT_EQ(ShardSizes(p, {{3, 10, 4}, {7}}), (std::vector<int64_t>{17, 7}));
}

TEST(ZeroMirrorsTest, AloneHasNoMirror) {
  EXPECT_EQ(MirrorsOf({"a"}), (std::vector<int>{-1}));
  EXPECT_TRUE(MirrorsOf({}).empty());
}

TEST(ZeroMirrorsTest, OneRankOrTwoMirroringEachOtherStepEverything) {
  EXPECT_TRUE(EveryRankStepsAll(MirrorsOf({"a"}), {10}));
  EXPECT_TRUE(EveryRankStepsAll(MirrorsOf({"a", "a"}), {10, 7}));
  EXPECT_TRUE(EveryRankStepsAll(MirrorsOf({"a", "b"}), {}));
  // An empty shard needs no mirror.
  EXPECT_TRUE(EveryRankStepsAll({1, -1}, {10, 0}));
  EXPECT_FALSE(EveryRankStepsAll({1, -1}, {10, 3}));
  // From three ranks on, each shard is on two of them only.
  EXPECT_FALSE(EveryRankStepsAll(MirrorsOf({"a", "a", "a"}), {5, 5, 5}));
  EXPECT_FALSE(EveryRankStepsAll(MirrorsOf({"a", "a", "b", "b"}), {}));
  // One non-empty shard over three ranks is still on two of them only.
  EXPECT_FALSE(EveryRankStepsAll({1, 2, 0}, {9, 0, 0}));
  EXPECT_TRUE(EveryRankStepsAll({}, {}));
}

TEST(ZeroOfferTest, TheLiveShardsOfTheJobsStep) {
  // The step after commit 4 ran its update and someone committed it (the
  // job goes on from 5), or nobody stepped and the job is at 4.
  EXPECT_EQ(OfferAt(4, /*stepped=*/true, /*copied=*/true, 5), Offer::kLive);
  EXPECT_EQ(OfferAt(4, /*stepped=*/false, /*copied=*/true, 4), Offer::kLive);
  // Whether the step's start was copied does not matter then.
  EXPECT_EQ(OfferAt(4, /*stepped=*/true, /*copied=*/false, 5), Offer::kLive);
}

TEST(ZeroOfferTest, TheCopyWhenTheJobWentBackToTheStepsStart) {
  // This rank's update ran, the broadcast failed, nobody committed.
  EXPECT_EQ(OfferAt(4, /*stepped=*/true, /*copied=*/true, 4), Offer::kCopy);
}

TEST(ZeroOfferTest, NothingOfAnotherStep) {
  // A newcomer (its shards are of step 0), a worker two steps behind, an
  // update without a copy of the step's start.
  EXPECT_EQ(OfferAt(0, false, false, 7), Offer::kNone);
  EXPECT_EQ(OfferAt(2, true, true, 4), Offer::kNone);
  EXPECT_EQ(OfferAt(4, true, /*copied=*/false, 4), Offer::kNone);
}

TEST(ZeroSourcesTest, EachParameterFromTheLowestRankOfferingIt) {
  // Ranks 0 and 2 hold parameter 1 (its owner and its mirror): rank 0
  // sends it; rank 1 (a newcomer) offers nothing.
  const Sources s = SourcesOf({{1, 2}, {}, {0, 1}, {3}}, 4);
  EXPECT_EQ(s.rank, (std::vector<int>{2, 0, 0, 3}));
  EXPECT_TRUE(s.missing.empty());
}

TEST(ZeroSourcesTest, AParameterNobodyHoldsIsMissing) {
  const Sources s = SourcesOf({{0, 7, -1}, {2}}, 4);
  EXPECT_EQ(s.rank, (std::vector<int>{0, -1, 1, -1}));
  EXPECT_EQ(s.missing, (std::vector<int64_t>{1, 3}));
}

}  // namespace
}  // namespace concord::zero
