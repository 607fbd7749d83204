#include "worker/ddp/bucket_assignment.h"

#include <gtest/gtest.h>

namespace concord::ddp {
namespace {

using Buckets = std::vector<std::vector<size_t>>;
constexpr int64_t kMiB = 1 << 20;

TEST(BucketAssignmentTest, NoGradientsNoBuckets) {
  EXPECT_TRUE(ComputeBucketAssignment({}, kMiB, 25 * kMiB).empty());
}

TEST(BucketAssignmentTest, ReverseOrderSmallFirstBucketThenCap) {
  // Ten gradients of 400 KiB: the first bucket closes at >= 1 MiB (3
  // gradients), later ones at >= 2 MiB (6 gradients), the rest is last.
  std::vector<GradSpec> grads(10, GradSpec{400 * 1024, 0});
  const Buckets buckets = ComputeBucketAssignment(grads, kMiB, 2 * kMiB);
  EXPECT_EQ(buckets, (Buckets{{9, 8, 7}, {6, 5, 4, 3, 2, 1}, {0}}));
}

TEST(BucketAssignmentTest, EveryGradientInExactlyOneBucket) {
  std::vector<GradSpec> grads;
  for (int i = 0; i < 37; ++i) grads.push_back({(i * 7919) % 5000 + 1, i % 3});
  const Buckets buckets = ComputeBucketAssignment(grads, 4000, 9000);
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

TEST(BucketAssignmentTest, DtypesNeverShareABucket) {
  std::vector<GradSpec> grads = {{100, 0}, {100, 1}, {100, 0}, {100, 1}};
  const Buckets buckets = ComputeBucketAssignment(grads, kMiB, kMiB);
  // Launch order: the bucket whose first gradient is visited first (index 3,
  // dtype 1) comes first.
  EXPECT_EQ(buckets, (Buckets{{3, 1}, {2, 0}}));
}

TEST(BucketAssignmentTest, LargeGradientClosesItsBucket) {
  std::vector<GradSpec> grads = {{10, 0}, {100 * kMiB, 0}, {10, 0}};
  const Buckets buckets = ComputeBucketAssignment(grads, kMiB, 25 * kMiB);
  EXPECT_EQ(buckets, (Buckets{{2, 1}, {0}}));
}

}  // namespace
}  // namespace concord::ddp
