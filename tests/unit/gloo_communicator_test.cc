#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <thread>
#include <tuple>
#include <vector>

#include "counting_store.h"
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

// See Note [Shared-memory allreduce]: the same bits as Gloo's ring allreduce,
// for any world size (where the order of the additions matters), across
// windows and Gloo's segments, with dtypes Gloo sums itself mixed in.
class ShmAllreduceTest
    : public ::testing::TestWithParam<std::tuple<int, int64_t>> {};

TEST_P(ShmAllreduceTest, SumsBitForBitAsGloosRing) {
  const auto [world, numel] = GetParam();
  // Magnitudes spread over many binades, so that any other order of the
  // additions rounds differently.
  const auto input = [numel = numel](int rank, at::ScalarType dtype) {
    at::Generator gen = at::detail::createCPUGenerator(1000 + rank);
    at::Tensor x = at::randn({numel}, gen, at::kDouble) *
                   at::exp(at::randn({numel}, gen, at::kDouble) * 8);
    if (dtype == at::kLong) return (x * 1e3).to(at::kLong);
    if (dtype == at::kHalf) return x.clamp(-1e3, 1e3).to(dtype);  // finite
    return x.to(dtype);
  };
  const std::vector<at::ScalarType> dtypes = {at::kFloat, at::kDouble,
                                              at::kHalf, at::kLong};
  std::vector<std::vector<at::Tensor>> results(2);
  for (bool shm : {false, true}) {
    auto& out = results[shm];
    out.assign(static_cast<size_t>(world) * dtypes.size(), at::Tensor());
    RunRanks(
        world,
        [&, world = world](int rank, std::shared_ptr<Communicator> comm) {
          EXPECT_EQ(static_cast<GlooCommunicator&>(*comm).uses_shared_memory(),
                    shm);
          for (size_t d = 0; d < dtypes.size(); ++d) {
            at::Tensor t = input(rank, dtypes[d]);
            ASSERT_TRUE(comm->AllreduceSum(t, {})->Wait().ok());
            out[static_cast<size_t>(rank) * dtypes.size() + d] = t;
          }
        },
        absl::Seconds(30), shm);
  }
  for (size_t i = 0; i < results[0].size(); ++i) {
    EXPECT_TRUE(at::equal(results[0][i], results[1][i]))
        << "rank " << i / dtypes.size() << " dtype "
        << dtypes[i % dtypes.size()] << ": max difference "
        << (results[0][i].to(at::kDouble) - results[1][i].to(at::kDouble))
               .abs()
               .max()
               .item<double>();
  }
}

INSTANTIATE_TEST_SUITE_P(
    WorldsAndSizes, ShmAllreduceTest,
    ::testing::Combine(::testing::Values(2, 3, 4),
                       // 1300007 floats: several windows and several
                       // Gloo segments per rank.
                       ::testing::Values<int64_t>(1, 7, 100003, 1300007)));

TEST(ShmAllreduceTest, ARankThatLeavesFailsItsPeerAtOnce) {
  RunRanks(
      2,
      [&](int rank, std::shared_ptr<Communicator> comm) {
        ASSERT_TRUE(static_cast<GlooCommunicator&>(*comm).uses_shared_memory());
        if (rank == 1) return;  // never takes part; its communicator goes
        CollectiveOptions options;
        options.timeout = absl::Seconds(60);
        at::Tensor t = at::ones({16});
        const absl::Time start = absl::Now();
        absl::Status s = comm->AllreduceSum(t, options)->Wait();
        EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
        EXPECT_LT(absl::Now() - start, absl::Seconds(10));
      },
      absl::Seconds(30), /*shared_memory=*/true);
}

// See Note [Rank tables]: a generation's rendezvous costs O(N) store messages
// (KvSet/KvGet to the coordinator), not one Get per pair: connectFullMesh
// alone read N - 1 keys per rank twice over, 2N(N - 1) Gets in all.
TEST(GlooRendezvousTest, StoreMessagesGrowLinearlyWithTheWorld) {
  for (int world : {4, 8, 16}) {
    concord::testing::CountingStore store;
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r) {
      threads.emplace_back([&store, r, world] {
        GlooOptions options;
        options.rank = r;
        options.size = world;
        options.connect_timeout = absl::Seconds(60);
        options.shared_memory = true;
        auto comm = GlooCommunicator::Create(options, &store);
        ASSERT_TRUE(comm.ok()) << comm.status();
        at::Tensor t = at::ones({3});
        ASSERT_TRUE((*comm)->AllreduceSum(t, {})->Wait().ok());
        EXPECT_TRUE(at::equal(t, at::full({3}, static_cast<float>(world))));
      });
    }
    for (auto& t : threads) t.join();
    const int messages = store.sets + store.gets;
    // Gloo: 2 Sets and 2 Gets a rank; the shared-memory group's setup
    // (see Note [Shared-memory allreduce]) 7 more a rank: 11 a rank whatever
    // the world (Gloo alone was 2(N - 1) Gets a rank: 30 at 16).
    EXPECT_LE(messages, 12 * world) << "world " << world << ": " << store.sets
                                    << " sets, " << store.gets << " gets";
    EXPECT_GE(store.gets, 2 * world) << "world " << world;
  }
}

// CONCORD_SHM=0 on one rank only: no rank waits for a group that will not
// be made; all use Gloo's TCP, and the sums agree.
TEST(ShmAllreduceTest, RanksThatDisagreeAllUseGloo) {
  InMemoryStore store;
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&store, r] {
      GlooOptions options;
      options.rank = r;
      options.size = 3;
      options.connect_timeout = absl::Seconds(30);
      options.shared_memory = r != 1;
      auto comm = GlooCommunicator::Create(options, &store);
      ASSERT_TRUE(comm.ok()) << comm.status();
      EXPECT_FALSE((*comm)->uses_shared_memory());
      at::Tensor t = at::full({5}, static_cast<float>(r + 1));
      ASSERT_TRUE((*comm)->AllreduceSum(t, {})->Wait().ok());
      EXPECT_TRUE(at::equal(t, at::full({5}, 6.0f)));
    });
  }
  for (auto& t : threads) t.join();
}

// A timed-out collective ends the group: the late peer and every later call
// fail at once instead of pairing up the wrong barriers.
TEST(ShmAllreduceTest, AHungPeerFailsTheCollectiveAtItsTimeoutAndEndsTheGroup) {
  RunRanks(
      2,
      [&](int rank, std::shared_ptr<Communicator> comm) {
        CollectiveOptions options;
        options.timeout = absl::Milliseconds(300);
        if (rank == 1) {  // alive, but late past rank 0's timeout
          absl::SleepFor(absl::Seconds(1));
          options.timeout = absl::Seconds(60);
        }
        const absl::Time start = absl::Now();
        absl::Status s = comm->AllreduceSum(at::ones({16}), options)->Wait();
        EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
        EXPECT_LT(absl::Now() - start, absl::Milliseconds(1500));
        if (rank == 0) {
          absl::SleepFor(absl::Seconds(2));  // rank 1 has failed meanwhile
          const absl::Time again = absl::Now();
          s = comm->AllreduceSum(at::ones({16}), options)->Wait();
          EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
          EXPECT_LT(absl::Now() - again, absl::Milliseconds(100));
        }
      },
      absl::Seconds(30), /*shared_memory=*/true);
}

TEST(ShmAllreduceTest, AbortFailsTheCollectiveInFlightHereAndAtThePeer) {
  RunRanks(
      2,
      [&](int rank, std::shared_ptr<Communicator> comm) {
        CollectiveOptions options;
        options.timeout = absl::Seconds(60);
        if (rank == 1) {
          absl::SleepFor(absl::Milliseconds(200));
          comm->Abort();
          EXPECT_EQ(comm->AllreduceSum(at::ones({4}), options)->Wait().code(),
                    absl::StatusCode::kAborted);
          return;
        }
        const absl::Time start = absl::Now();
        absl::Status s = comm->AllreduceSum(at::ones({16}), options)->Wait();
        EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
        EXPECT_LT(absl::Now() - start, absl::Seconds(10));
      },
      absl::Seconds(30), /*shared_memory=*/true);
}

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

// See Note [Shared-memory broadcast]: the root's bytes on every rank, over
// several windows (4 MiB each) and in any dtype, interleaved with sums that
// share the segment's two sets of slots, as Gloo's TCP broadcast has them.
TEST(ShmBroadcastTest, EveryRootsBytesOverWindowsAndBetweenSums) {
  const int world = 3;
  for (bool shm : {false, true}) {
    RunRanks(
        world,
        [&](int rank, std::shared_ptr<Communicator> comm) {
          EXPECT_EQ(static_cast<GlooCommunicator&>(*comm).uses_shared_memory(),
                    shm);
          const std::vector<std::pair<at::ScalarType, int64_t>> cases = {
              {at::kFloat, 1},
              {at::kHalf, 3001},
              {at::kDouble, 1300001},
              {at::kByte, 9 << 20}};
          for (int root = 0; root < world; ++root) {
            for (const auto& [dtype, numel] : cases) {
              at::Generator gen = at::detail::createCPUGenerator(root);
              const at::Tensor want =
                  dtype == at::kByte
                      ? at::randint(256, {numel}, gen, at::kByte)
                      : at::randn({numel}, gen, at::kDouble).to(dtype);
              at::Tensor t = rank == root ? want.clone() : at::zeros_like(want);
              ASSERT_TRUE(comm->Broadcast(t, root, {})->Wait().ok());
              EXPECT_TRUE(at::equal(t, want)) << "root " << root << " dtype "
                                              << dtype << " numel " << numel;
              // A sum right after, in the other set of slots.
              at::Tensor one = at::ones({5}, at::kFloat);
              ASSERT_TRUE(comm->AllreduceSum(one, {})->Wait().ok());
              EXPECT_TRUE(at::equal(one, at::full({5}, float(world))));
            }
          }
          // A view into a larger tensor: only its bytes change.
          at::Tensor base = at::full({4, 6}, float(rank));
          at::Tensor row = base.select(0, 2);
          ASSERT_TRUE(comm->Broadcast(row, 1, {})->Wait().ok());
          EXPECT_TRUE(at::equal(row, at::full({6}, 1.0f)));
          EXPECT_TRUE(at::equal(base.select(0, 3), at::full({6}, float(rank))));
        },
        absl::Seconds(30), shm);
  }
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

TEST(GlooCommunicatorTest, GatherStringsReachesOnlyTheRoots) {
  const int world = 4;
  RunRanks(world, [&](int rank, std::shared_ptr<Communicator> comm) {
    // Lengths differ (rank 2's is empty); ranks 1 and 3 gather, the others
    // get nothing.
    const std::string mine =
        rank == 2 ? std::string() : std::string(100 * (rank + 1), 'a' + rank);
    auto got = GatherStrings(*comm, mine, {3, 1}, {});
    ASSERT_TRUE(got.ok()) << got.status();
    if (rank == 1 || rank == 3) {
      ASSERT_EQ(got->size(), 4u);
      for (int r = 0; r < world; ++r) {
        const std::string expected =
            r == 2 ? std::string() : std::string(100 * (r + 1), 'a' + r);
        EXPECT_EQ((*got)[static_cast<size_t>(r)], expected) << "from " << r;
      }
    } else {
      EXPECT_TRUE(got->empty());
    }
    // Nothing to send anywhere: still a collective that matches up.
    auto none = GatherStrings(*comm, std::string(), {0}, {});
    ASSERT_TRUE(none.ok()) << none.status();
    EXPECT_EQ(none->size(), rank == 0 ? 4u : 0u);
    at::Tensor one = at::ones({3}, at::kFloat);
    ASSERT_TRUE(comm->AllreduceSum(one, {})->Wait().ok());
    EXPECT_TRUE(at::equal(one, at::full({3}, 4.0f)));
    auto bad = GatherStrings(*comm, mine, {world}, {});
    EXPECT_TRUE(absl::IsInvalidArgument(bad.status())) << bad.status();
  });
}

// With `skip`, a root gets nothing from the ranks it skips (an empty
// string), every other value whole; ranks that send nowhere still match up.
TEST(GlooCommunicatorTest, GatherStringsSkipsWhatARootDoesNotTake) {
  const int world = 4;
  RunRanks(world, [&](int rank, std::shared_ptr<Communicator> comm) {
    const auto skip = [](int root, int r) {
      return (root == 1 && r == 2) || (root == 3 && (r == 0 || r == 2));
    };
    const std::string mine(50 * (rank + 1), 'a' + rank);
    auto got = GatherStrings(*comm, mine, {1, 3}, {}, skip);
    ASSERT_TRUE(got.ok()) << got.status();
    if (rank == 1 || rank == 3) {
      ASSERT_EQ(got->size(), 4u);
      for (int r = 0; r < world; ++r) {
        const std::string expected = r != rank && skip(rank, r)
                                         ? std::string()
                                         : std::string(50 * (r + 1), 'a' + r);
        EXPECT_EQ((*got)[static_cast<size_t>(r)], expected) << "from " << r;
      }
    } else {
      EXPECT_TRUE(got->empty());
    }
    at::Tensor one = at::ones({3}, at::kFloat);
    ASSERT_TRUE(comm->AllreduceSum(one, {})->Wait().ok());
    EXPECT_TRUE(at::equal(one, at::full({3}, 4.0f)));
  });
}

}  // namespace
}  // namespace concord::comm
