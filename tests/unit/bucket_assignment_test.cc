#include "worker/ddp/bucket_assignment.h"

#include <gtest/gtest.h>

namespace concord::ddp {
namespace {

using Buckets = std::vector<std::vector<size_t>>;
constexpr int64_t kMiB = 1 << 20;

std::vector<size_t> Reverse(size_t n) {
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = n - 1 - i;
  return order;
}

TEST(BucketAssignmentTest, NoGradientsNoBuckets) {
  EXPECT_TRUE(InitialBucketAssignment({}, kMiB, 25 * kMiB).empty());
  EXPECT_TRUE(ComputeBucketAssignment({}, {}, kMiB, 25 * kMiB).empty());
}

TEST(BucketAssignmentTest, InitialLayoutIsPyTorchs) {
  // Ten gradients of 400 KiB, caps 1 MiB then 2 MiB, in forward order:
  // {0,1,2} (first, >= 1 MiB), {3..8} (>= 2 MiB), {9}; sorted by lowest
  // index and reversed, as DistributedDataParallel.__init__ does.
  std::vector<GradSpec> grads(10, GradSpec{400 * 1024, 0});
  EXPECT_EQ(InitialBucketAssignment(grads, kMiB, 2 * kMiB),
            (Buckets{{9}, {3, 4, 5, 6, 7, 8}, {0, 1, 2}}));
}

TEST(BucketAssignmentTest, RebuiltLayoutFollowsTheReadyOrder) {
  // The rebuild: the small first bucket really comes first.
  std::vector<GradSpec> grads(10, GradSpec{400 * 1024, 0});
  EXPECT_EQ(ComputeBucketAssignment(grads, Reverse(10), kMiB, 2 * kMiB),
            (Buckets{{9, 8, 7}, {6, 5, 4, 3, 2, 1}, {0}}));
}

TEST(BucketAssignmentTest, EveryGradientInExactlyOneBucket) {
  std::vector<GradSpec> grads;
  for (int i = 0; i < 37; ++i) {
    grads.push_back({(i * 7919) % 5000 + 1, i % 3, i % 11 == 0});
  }
  for (const Buckets& buckets :
       {InitialBucketAssignment(grads, 4000, 9000),
        ComputeBucketAssignment(grads, Reverse(37), 4000, 9000)}) {
    std::vector<int> seen(grads.size(), 0);
    for (const auto& b : buckets) {
      ASSERT_FALSE(b.empty());
      for (size_t i : b) {
        ++seen[i];
        EXPECT_EQ(grads[i].dtype, grads[b.front()].dtype) << "mixed dtypes";
      }
    }
    for (int count : seen) EXPECT_EQ(count, 1);
  }
}

TEST(BucketAssignmentTest, DtypesNeverShareABucket) {
  std::vector<GradSpec> grads = {{100, 0}, {100, 1}, {100, 0}, {100, 1}};
  EXPECT_EQ(ComputeBucketAssignment(grads, Reverse(4), kMiB, kMiB),
            (Buckets{{2, 0}, {3, 1}}));
}

TEST(BucketAssignmentTest, TriggerClosesTheBucket) {
  std::vector<GradSpec> grads = {{10, 0}, {10, 0, true}, {10, 0}, {10, 0}};
  EXPECT_EQ(ComputeBucketAssignment(grads, Reverse(4), kMiB, kMiB),
            (Buckets{{3, 2, 1}, {0}}));
}

TEST(BucketAssignmentTest, LargeGradientClosesItsBucket) {
  std::vector<GradSpec> grads = {{10, 0}, {100 * kMiB, 0}, {10, 0}};
  EXPECT_EQ(ComputeBucketAssignment(grads, Reverse(3), kMiB, 25 * kMiB),
            (Buckets{{2, 1}, {0}}));
}

}  // namespace
}  // namespace concord::ddp
