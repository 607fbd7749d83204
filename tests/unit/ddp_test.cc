// DDP with C++-frontend modules, ranks as threads over real Gloo.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <mutex>

#include "rank_threads.h"
#include "worker/ddp/engine.h"

namespace concord {
namespace {

using concord::testing::RunRanks;

// The global generator is shared by the rank threads: seed and draw under
// one lock.
std::mutex& RngMutex() {
  static std::mutex mu;
  return mu;
}

torch::nn::Sequential MakeNet(uint64_t seed) {
  std::lock_guard<std::mutex> lock(RngMutex());
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(6, 32),
                               torch::nn::BatchNorm1d(32), torch::nn::ReLU(),
                               torch::nn::Linear(32, 3));
}

torch::Tensor Batch(int rank) {
  std::lock_guard<std::mutex> lock(RngMutex());
  torch::manual_seed(100 + rank);
  return torch::randn({5 + rank, 6});  // uneven batch sizes per rank
}

// What every rank's gradients must be after a synchronised backward: the
// mean over ranks of the local gradients of rank 0's initial model.
std::vector<torch::Tensor> ExpectedGrads(int world) {
  std::vector<torch::Tensor> sum;
  for (int r = 0; r < world; ++r) {
    auto net = MakeNet(0);
    net->train();
    net->forward(Batch(r)).pow(2).mean().backward();
    auto params = net->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      if (r == 0) {
        sum.push_back(params[i].grad().clone());
      } else {
        sum[i] += params[i].grad();
      }
    }
  }
  for (auto& g : sum) g /= world;
  return sum;
}

class DdpTest : public ::testing::TestWithParam<std::tuple<int, int64_t>> {};

TEST_P(DdpTest, GradientsAreTheMeanOverRanksForAnyBucketing) {
  const auto [world, cap] = GetParam();
  const auto expected = ExpectedGrads(world);
  RunRanks(world, [&, world = world, cap = cap](
                      int rank, std::shared_ptr<comm::Communicator> comm) {
    auto net = MakeNet(/*seed=*/rank);  // different init on every rank
    net->train();
    DdpOptions options;
    options.bucket_cap_mb(2.0 * static_cast<double>(cap) / (1 << 20));
    ddp::ReducerInternals internals;
    internals.first_bucket_bytes = cap;
    auto ddp = ddp::Engine::Create(net.ptr(), comm, 0, options, internals);
    ASSERT_TRUE(ddp.ok()) << ddp.status();
    // PyTorch's first iteration: one bucket; the caps apply after the rebuild.
    EXPECT_EQ((*ddp)->reducer().buckets().size(), 1u);
    // Parameters and buffers now equal rank 0's.
    auto reference = MakeNet(0);
    for (size_t i = 0; i < net->parameters().size(); ++i) {
      EXPECT_TRUE(
          torch::equal(net->parameters()[i], reference->parameters()[i]));
    }
    for (int iteration = 0; iteration < 2; ++iteration) {
      for (auto& p : net->parameters()) p.mutable_grad() = torch::Tensor();
      torch::Tensor out =
          (*ddp)->Forward([&] { return net->forward(Batch(rank)); });
      out.pow(2).mean().backward();
      if (iteration == 1) break;  // second pass checks the reset path
    }
    // After the second pass the model is unchanged (no optimizer), so the
    // gradients are those of the first.
    auto params = net->parameters();
    ASSERT_EQ(params.size(), expected.size());
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(torch::allclose(params[i].grad(), expected[i], 1e-5, 1e-7))
          << "rank " << rank << " param " << i;
    }
    EXPECT_EQ((*ddp)->reducer().iterations(), 2);
    if (cap < 1000) {
      EXPECT_GT((*ddp)->reducer().buckets().size(), 2u);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(
    WorldsAndBuckets, DdpTest,
    ::testing::Combine(::testing::Values(1, 2, 3, 4),
                       ::testing::Values<int64_t>(64, 1 << 20)));

TEST(DdpBuffersTest, BuffersFollowTheAuthoritativeRankBeforeEachForward) {
  RunRanks(3, [&](int rank, std::shared_ptr<comm::Communicator> comm) {
    auto net = MakeNet(rank);
    auto ddp = ddp::Engine::Create(net.ptr(), comm,
                                   /*authoritative_rank=*/2);
    ASSERT_TRUE(ddp.ok()) << ddp.status();
    auto bn = net[1]->as<torch::nn::BatchNorm1d>();
    // Each rank's running stats drift apart locally...
    {
      torch::NoGradGuard no_grad;
      bn->running_mean.fill_(rank);
    }
    // ...and the next forward starts from rank 2's.
    ASSERT_TRUE((*ddp)->PrepareForward().ok());
    EXPECT_TRUE(torch::equal(bn->running_mean, torch::full({32}, 2.0f)));
  });
}

TEST(DdpAccumulationTest, ExistingGradientIsPartOfTheReduction) {
  // Without zero_grad, PyTorch's DDP reduces the accumulated .grad.
  RunRanks(2, [&](int rank, std::shared_ptr<comm::Communicator> comm) {
    auto net = torch::nn::Linear(3, 1);
    auto ddp = ddp::Engine::Create(net.ptr(), comm, 0);
    ASSERT_TRUE(ddp.ok());
    for (auto& p : net->parameters()) {
      p.mutable_grad() = torch::full_like(p, 1.0 + rank);  // 1 and 2
    }
    torch::Tensor out = (*ddp)->Forward([&] {
      return net->forward(torch::zeros({1, 3}));
    });
    out.sum().backward();  // bias grad 1 on both ranks, weight grad 0
    // bias: ((1+1) + (2+1)) / 2; weight: (1 + 2) / 2.
    EXPECT_TRUE(torch::allclose(net->bias.grad(), torch::full({1}, 2.5f)));
    EXPECT_TRUE(torch::allclose(net->weight.grad(), torch::full({1, 3}, 1.5f)));
  });
}

TEST(DdpErrorsTest, UnusedParameterIsAClearError) {
  RunRanks(1, [&](int, std::shared_ptr<comm::Communicator> comm) {
    auto net = MakeNet(0);
    auto ddp = ddp::Engine::Create(net.ptr(), comm, 0);
    ASSERT_TRUE(ddp.ok());
    torch::Tensor out = (*ddp)->Forward([&] {
      return net[0]->as<torch::nn::Linear>()->forward(Batch(0));  // skips 3
    });
    try {
      out.sum().backward();
      FAIL() << "expected an error";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("received no gradient"),
                std::string::npos)
          << e.what();
    }
  });
}

TEST(DdpErrorsTest, BadAuthoritativeRankIsRejected) {
  RunRanks(1, [&](int, std::shared_ptr<comm::Communicator> comm) {
    auto net = MakeNet(0);
    EXPECT_EQ(ddp::Engine::Create(net.ptr(), comm, 1).status().code(),
              absl::StatusCode::kInvalidArgument);
  });
}

}  // namespace
}  // namespace concord
