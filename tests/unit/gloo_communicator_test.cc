#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <tuple>

#include "rank_threads.h"
#include "worker/comm/coalesced.h"

namespace concord::comm {
namespace {

using concord::testing::RunRanks;

class GlooAllreduceTest
    : public ::testing::TestWithParam<std::tuple<int, int64_t>> {};

TEST_P(GlooAllreduceTest, SumsOverRanks) {
  const auto [world, numel] = GetParam();
  RunRanks(world, [&, world = world, numel = numel](
                      int rank, std::shared_ptr<Communicator> comm) {
    for (auto dtype : {at::kFloat, at::kDouble, at::kLong}) {
      // Element i on rank r holds r * 1000 + i (exact in every dtype).
      at::Tensor t = (at::arange(numel, at::kDouble) + rank * 1000.0).to(dtype);
      ASSERT_TRUE(comm->AllreduceSum(t, {})->Wait().ok());
      const double rank_sum = 1000.0 * world * (world - 1) / 2;
      at::Tensor expected =
          (at::arange(numel, at::kDouble) * world + rank_sum).to(dtype);
      EXPECT_TRUE(at::equal(t, expected)) << "dtype " << dtype;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(
    WorldsAndSizes, GlooAllreduceTest,
    ::testing::Combine(::testing::Values(1, 2, 3, 4, 5),
                       ::testing::Values<int64_t>(0, 1, 7, 262147)));

TEST(GlooCommunicatorTest, BroadcastFromEveryRoot) {
  const int world = 3;
  RunRanks(world, [&](int rank, std::shared_ptr<Communicator> comm) {
    for (int root = 0; root < world; ++root) {
      at::Tensor t = at::full({1001}, static_cast<float>(rank + 10));
      ASSERT_TRUE(comm->Broadcast(t, root, {})->Wait().ok());
      EXPECT_TRUE(at::equal(t, at::full({1001}, float(root + 10))));
    }
  });
}

TEST(GlooCommunicatorTest, ManyAsyncCollectivesCompleteInIssueOrder) {
  RunRanks(2, [&](int rank, std::shared_ptr<Communicator> comm) {
    std::vector<at::Tensor> tensors;
    std::vector<std::shared_ptr<Work>> works;
    for (int i = 0; i < 20; ++i) {
      tensors.push_back(at::full({i * 100 + 1}, float(i + rank)));
      works.push_back(comm->AllreduceSum(tensors.back(), {}));
    }
    for (int i = 0; i < 20; ++i) {
      ASSERT_TRUE(works[i]->Wait().ok());
      EXPECT_TRUE(
          at::equal(tensors[i], at::full({i * 100 + 1}, float(2 * i + 1))));
    }
  });
}

TEST(GlooCommunicatorTest, BroadcastCoalescedMixedDtypes) {
  RunRanks(3, [&](int rank, std::shared_ptr<Communicator> comm) {
    std::vector<at::Tensor> tensors = {
        at::full({3, 4}, float(rank)), at::full({5}, int64_t(rank + 7)),
        at::full({2, 2, 2}, double(rank) / 3), at::empty({0})};
    ASSERT_TRUE(BroadcastCoalesced(*comm, tensors, /*root=*/1, {}).ok());
    EXPECT_TRUE(at::equal(tensors[0], at::full({3, 4}, 1.0f)));
    EXPECT_TRUE(at::equal(tensors[1], at::full({5}, int64_t(8))));
    EXPECT_TRUE(at::equal(tensors[2], at::full({2, 2, 2}, 1.0 / 3)));
  });
}

TEST(GlooCommunicatorTest, MissingPeerFailsWithinTimeoutInsteadOfHanging) {
  RunRanks(2, [&](int rank, std::shared_ptr<Communicator> comm) {
    if (rank == 1) return;  // never takes part
    CollectiveOptions options;
    options.timeout = absl::Milliseconds(300);
    at::Tensor t = at::ones({16});
    const absl::Time start = absl::Now();
    absl::Status s = comm->AllreduceSum(t, options)->Wait();
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  });
}

TEST(GlooCommunicatorTest, BadArgumentsAreErrorsNotCrashes) {
  RunRanks(2, [&](int rank, std::shared_ptr<Communicator> comm) {
    at::Tensor strided = at::ones({4, 4}).t();
    EXPECT_EQ(comm->AllreduceSum(strided, {})->Wait().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(comm->Broadcast(at::ones({2}), 5, {})->Wait().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(comm->AllreduceSum(at::ones({2}, at::kBool), {})->Wait().code(),
              absl::StatusCode::kInvalidArgument);
  });
}

TEST(GlooCommunicatorTest, AllgatherPlacesEachRankInItsSlot) {
  for (int world : {1, 2, 3, 5}) {
    RunRanks(world, [&](int rank, std::shared_ptr<Communicator> comm) {
      for (int64_t n : {0, 1, 7, 100003}) {
        for (auto dtype : {at::kFloat, at::kDouble, at::kHalf}) {
          at::Tensor in =
              (at::arange(n, at::kDouble).fmod(97) + rank * 100.0).to(dtype);
          at::Tensor out = at::full({world * n}, -1.0, dtype);
          ASSERT_TRUE(comm->Allgather(out, in, {})->Wait().ok());
          for (int r = 0; r < world; ++r) {
            at::Tensor expected =
                (at::arange(n, at::kDouble).fmod(97) + r * 100.0).to(dtype);
            EXPECT_TRUE(at::equal(out.narrow(0, r * n, n), expected))
                << "world " << world << " n " << n << " slot " << r;
          }
        }
      }
      EXPECT_EQ(
          comm->Allgather(at::ones({3}), at::ones({2}), {})->Wait().code(),
          absl::StatusCode::kInvalidArgument);
    });
  }
}

TEST(GlooCommunicatorTest, CreateRejectsBadRank) {
  InMemoryStore store;
  GlooOptions options;
  options.rank = 3;
  options.size = 2;
  EXPECT_EQ(GlooCommunicator::Create(options, &store).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(GlooCommunicatorTest, ReduceSumReachesTheRootOnly) {
  const int world = 3;
  RunRanks(world, [&](int rank, std::shared_ptr<Communicator> comm) {
    for (int root = 0; root < world; ++root) {
      at::Tensor t = at::arange(5, at::kFloat) + 10.0 * rank;
      ASSERT_TRUE(comm->ReduceSum(t, root, {})->Wait().ok());
      if (rank == root) {
        EXPECT_TRUE(at::equal(t, at::arange(5, at::kFloat) * world + 30.0));
      }
    }
    const absl::Status bad = comm->ReduceSum(at::ones({2}), world, {})->Wait();
    EXPECT_TRUE(absl::IsInvalidArgument(bad)) << bad;
  });
}

TEST(GlooCommunicatorTest, ExchangeDeliversEachMessageToItsPeer) {
  const int world = 4;
  RunRanks(world, [&](int rank, std::shared_ptr<Communicator> comm) {
    // Rank r sends to r+1 and r+2 and receives from r-1 and r-2; rank 3
    // sends nothing and rank 0 receives only from 2 on a second round.
    at::Tensor send = at::full({1000}, static_cast<double>(rank), at::kDouble);
    std::vector<int> to = {(rank + 1) % world, (rank + 2) % world};
    std::vector<int> from = {(rank + world - 1) % world,
                             (rank + world - 2) % world};
    std::vector<at::Tensor> recv = {at::empty_like(send), at::empty_like(send)};
    ASSERT_TRUE(comm->Exchange(send, to, recv, from, {})->Wait().ok());
    for (size_t i = 0; i < from.size(); ++i) {
      EXPECT_TRUE(at::equal(
          recv[i],
          at::full({1000}, static_cast<double>(from[i]), at::kDouble)));
    }
    // Uneven: only 3 -> 0; the others take part with empty lists.
    std::vector<int> to2, from2;
    std::vector<at::Tensor> recv2;
    if (rank == 3) to2 = {0};
    if (rank == 0) {
      from2 = {3};
      recv2 = {at::empty_like(send)};
    }
    ASSERT_TRUE(comm->Exchange(send, to2, recv2, from2, {})->Wait().ok());
    if (rank == 0) {
      EXPECT_TRUE(at::equal(recv2[0], at::full({1000}, 3.0, at::kDouble)));
    }
    // A collective afterwards still matches up.
    at::Tensor one = at::ones({3}, at::kFloat);
    ASSERT_TRUE(comm->AllreduceSum(one, {})->Wait().ok());
    EXPECT_TRUE(at::equal(one, at::full({3}, 4.0f)));
    const absl::Status self = comm->Exchange(send, {rank}, {}, {}, {})->Wait();
    EXPECT_TRUE(absl::IsInvalidArgument(self)) << self;
  });
}

}  // namespace
}  // namespace concord::comm
