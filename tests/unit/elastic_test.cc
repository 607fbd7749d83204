// Re-forming below the session: a communicator given up mid-collective, and
// DDP moving to the next generation's communicator while a newcomer joins.
// Ranks as threads over real Gloo.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <mutex>
#include <thread>

#include "rank_threads.h"
#include "worker/ddp/engine.h"
#include "worker/elastic/state.h"

namespace concord {
namespace {

using concord::testing::RunRanks;
using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// See Note [Shards copied where they are]: each node's lowest rank writes
// its snapshot; a rank on its writer's shared region copies its shard in
// place, any other (another node, a region of its own) sends it as bytes.
TEST(ShardPlacementTest, InPlaceOnTheWritersSharedRegionBytesElsewhere) {
  // Ranks 0, 2, 3 on node a (rank 3 without an agent: a region of its
  // own), ranks 1 and 4 on node b.
  const std::vector<std::string> nodes = {"a", "b", "a", "a", "b"};
  const std::vector<std::string> regions = {"/dev/shm/a", "/dev/shm/b",
                                            "/dev/shm/a", "", "/dev/shm/b"};
  const elastic::ShardPlacement p =
      elastic::ShardPlacement::Over(nodes, regions);
  EXPECT_EQ(p.writers, (std::vector<int>{0, 1}));
  EXPECT_EQ(p.writer_of, (std::vector<int>{0, 1, 0, 0, 1}));
  EXPECT_EQ(p.in_place, (std::vector<bool>{true, true, true, false, true}));
  EXPECT_TRUE(p.AnyInPlace());
  // Rank 2's shard: in place on node a, bytes to node b.
  EXPECT_FALSE(p.AsBytes(0, 2));
  EXPECT_TRUE(p.AsBytes(1, 2));
  // Rank 3's: bytes to both writers; a writer never sends itself its own.
  EXPECT_TRUE(p.AsBytes(0, 3));
  EXPECT_TRUE(p.AsBytes(1, 3));
  EXPECT_FALSE(p.AsBytes(0, 0));
  EXPECT_TRUE(p.AsBytes(1, 0));
  // A writer alone on its node, or regions of their own: nothing in place.
  EXPECT_FALSE(
      elastic::ShardPlacement::Over({"a", "b"}, {"/s", "/s"}).AnyInPlace());
  EXPECT_FALSE(
      elastic::ShardPlacement::Over({"a", "a"}, {"", ""}).AnyInPlace());
  const elastic::ShardPlacement bytes =
      elastic::ShardPlacement::Over(nodes, regions, /*as_bytes=*/true);
  EXPECT_EQ(bytes.writers, p.writers);
  EXPECT_FALSE(bytes.AnyInPlace());
  EXPECT_TRUE(bytes.AsBytes(0, 2));
  // A plain loop's checkpoint: everything to one root as bytes.
  const elastic::ShardPlacement to = elastic::ShardPlacement::To(2, 3);
  EXPECT_EQ(to.writers, (std::vector<int>{2}));
  EXPECT_TRUE(to.AsBytes(2, 0));
  EXPECT_FALSE(to.AsBytes(2, 2));
}

TEST(GlooAbortTest, AbortFailsTheWorkInFlightAtOnceAndLaterWorkToo) {
  RunRanks(2, [](int rank, std::shared_ptr<comm::Communicator> comm) {
    if (rank == 1) {
      // Alive, but never takes part: rank 0 would wait it out.
      std::this_thread::sleep_for(std::chrono::seconds(1));
      return;
    }
    comm::CollectiveOptions opts;
    opts.timeout = absl::Seconds(3);  // bounds the destructor's wait
    auto work = comm->AllreduceSum(torch::ones({4}), opts);
    std::thread aborter([comm] {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      comm->Abort();
    });
    const auto start = Clock::now();
    const absl::Status s = work->Wait(absl::Seconds(30));
    aborter.join();
    EXPECT_TRUE(absl::IsAborted(s)) << s;
    EXPECT_LT(SecondsSince(start), 2.0);
    const absl::Status later =
        comm->AllreduceSum(torch::ones({4}), opts)->Wait();
    EXPECT_TRUE(absl::IsAborted(later)) << later;
  });
}

TEST(GlooAbortTest, APeerThatAbortsFailsTheOthersCollective) {
  RunRanks(2, [](int rank, std::shared_ptr<comm::Communicator> comm) {
    comm::CollectiveOptions opts;
    opts.timeout = absl::Seconds(60);
    if (rank == 1) {
      // Gives up instead of taking part: its connections close.
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      comm->Abort();
      return;
    }
    const auto start = Clock::now();
    const absl::Status s =
        comm->AllreduceSum(torch::ones({1 << 16}), opts)->Wait();
    EXPECT_FALSE(s.ok());
    EXPECT_TRUE(absl::IsUnavailable(s)) << s;
    // Not the 60 s timeout: the closed connection ends it.
    EXPECT_LT(SecondsSince(start), 10.0);
  });
}

std::mutex& RngMutex() {
  static std::mutex mu;
  return mu;
}

torch::nn::Sequential MakeNet(uint64_t seed) {
  std::lock_guard<std::mutex> lock(RngMutex());
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(6, 16), torch::nn::ReLU(),
                               torch::nn::Linear(16, 8), torch::nn::ReLU(),
                               torch::nn::Linear(8, 3));
}

torch::Tensor Batch(int rank, int step) {
  std::lock_guard<std::mutex> lock(RngMutex());
  torch::manual_seed(1000 * step + rank);
  return torch::randn({4, 6});
}

struct Rank {
  torch::nn::Sequential net{nullptr};
  std::unique_ptr<ddp::Engine> ddp;
};

void Step(Rank& r, int rank, int step) {
  for (auto& p : r.net->parameters()) p.mutable_grad() = torch::Tensor();
  r.ddp->Forward([&] { return r.net->forward(Batch(rank, step)); })
      .pow(2)
      .mean()
      .backward();
}

std::vector<std::vector<size_t>> Layout(const Rank& r) {
  std::vector<std::vector<size_t>> out;
  for (const auto& b : r.ddp->reducer().buckets()) out.push_back(b.params);
  return out;
}

TEST(DdpRebindTest, SurvivorsAndANewcomerAgreeOnModelLayoutAndGradients) {
  std::vector<Rank> ranks(3);
  DdpOptions options;
  options.bucket_cap_mb(512.0 / (1 << 20));  // 512 bytes
  ddp::ReducerInternals internals;
  internals.first_bucket_bytes = 256;  // several buckets after the rebuild
  // Generation 1: ranks 0 and 1 train two iterations (the buckets are
  // rebuilt from the ready order after the first).
  RunRanks(2, [&](int rank, std::shared_ptr<comm::Communicator> comm) {
    Rank& r = ranks[static_cast<size_t>(rank)];
    r.net = MakeNet(rank);
    auto ddp = ddp::Engine::Create(r.net.ptr(), comm, 0, options, internals);
    ASSERT_TRUE(ddp.ok()) << ddp.status();
    r.ddp = *std::move(ddp);
    for (int step = 0; step < 2; ++step) Step(r, rank, step);
    torch::NoGradGuard no_grad;
    for (auto& p : r.net->parameters()) p.sub_(p.grad() * 0.1);
  });
  ASSERT_EQ(ranks[0].ddp->stats().rebuilds, 1);
  const auto rebuilt = Layout(ranks[0]);
  ASSERT_GT(rebuilt.size(), 1u);
  // Rank 1 drifts (as after a half step): the authoritative model wins.
  {
    torch::NoGradGuard no_grad;
    ranks[1].net->parameters()[0].add_(1.0);
  }
  // Generation 2: the two survivors and a newcomer, rank 1 authoritative.
  std::vector<std::vector<torch::Tensor>> grads(3);
  RunRanks(3, [&](int rank, std::shared_ptr<comm::Communicator> comm) {
    Rank& r = ranks[static_cast<size_t>(rank)];
    if (rank < 2) {
      ASSERT_TRUE(r.ddp->Rebind(comm, /*authoritative_rank=*/0).ok());
    } else {
      r.net = MakeNet(7);
      auto ddp = ddp::Engine::Create(r.net.ptr(), comm, 0, options, internals);
      ASSERT_TRUE(ddp.ok()) << ddp.status();
      r.ddp = *std::move(ddp);
    }
    ASSERT_TRUE(r.ddp->SyncReducerLayout().ok());
    Step(r, rank, 5);
    for (auto& p : r.net->parameters()) grads[rank].push_back(p.grad());
  });
  for (int rank = 1; rank < 3; ++rank) {
    EXPECT_EQ(Layout(ranks[rank]), rebuilt) << "rank " << rank;
    auto mine = ranks[rank].net->parameters();
    auto theirs = ranks[0].net->parameters();
    for (size_t i = 0; i < mine.size(); ++i) {
      EXPECT_TRUE(torch::equal(mine[i], theirs[i])) << "rank " << rank;
      EXPECT_TRUE(torch::equal(grads[rank][i], grads[0][i])) << "rank " << rank;
    }
  }
  // The mean over the three ranks' batches of rank 0's model's gradients.
  auto reference = MakeNet(0);
  {
    torch::NoGradGuard no_grad;
    auto src = ranks[0].net->parameters();
    auto dst = reference->parameters();
    for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
  }
  std::vector<torch::Tensor> mean;
  for (int rank = 0; rank < 3; ++rank) {
    for (auto& p : reference->parameters()) p.mutable_grad() = torch::Tensor();
    reference->forward(Batch(rank, 5)).pow(2).mean().backward();
    auto params = reference->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      if (rank == 0) {
        mean.push_back(params[i].grad().clone() / 3);
      } else {
        mean[i] += params[i].grad() / 3;
      }
    }
  }
  for (size_t i = 0; i < mean.size(); ++i) {
    EXPECT_TRUE(torch::allclose(grads[0][i], mean[i], 1e-5, 1e-6));
  }
}

TEST(DdpRebindTest, TheGradientDivisorFollowsJoinSemantics) {
  // World of one standing in for three: PyTorch's join divides by the
  // initial world size while finished ranks shadow with zeros.
  RunRanks(1, [&](int, std::shared_ptr<comm::Communicator> comm) {
    auto net = MakeNet(3);
    auto ddp = ddp::Engine::Create(net.ptr(), comm, 0);
    ASSERT_TRUE(ddp.ok()) << ddp.status();
    auto local = MakeNet(3);
    local->forward(Batch(0, 0)).pow(2).mean().backward();
    (*ddp)->SetGradientDivisor(3);
    (*ddp)
        ->Forward([&] { return net->forward(Batch(0, 0)); })
        .pow(2)
        .mean()
        .backward();
    auto got = net->parameters();
    auto want = local->parameters();
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_TRUE(torch::equal(got[i].grad(), want[i].grad() * (1.0 / 3)));
    }
  });
}

}  // namespace
}  // namespace concord
