// DDP options (PyTorch's and apex's) with ranks as threads over real Gloo.
// Each test states the arithmetic it expects; the PyTorch comparisons are in
// tests/reference.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <mutex>

#include "rank_threads.h"
#include "worker/ddp/engine.h"
#include "worker/ddp/manual_reducer.h"
#include "worker/torch_compat.h"

namespace concord {
namespace {

using concord::testing::RunRanks;

// y = w * x (w: [1], x: scalar per rank) makes the arithmetic visible:
// d(sum y)/dw = x.
struct Scalar : torch::nn::Module {
  Scalar() {
    w = register_parameter("w", torch::ones({1}));
    unused = register_parameter("unused", torch::ones({1}));
  }
  torch::Tensor forward(const torch::Tensor& x) { return w * x; }
  torch::Tensor w, unused;
};

std::unique_ptr<ddp::Engine> Wrap(std::shared_ptr<torch::nn::Module> m,
                                  std::shared_ptr<comm::Communicator> comm,
                                  DdpOptions options = {},
                                  ddp::ReducerInternals internals = {}) {
  auto ddp = ddp::Engine::Create(std::move(m), std::move(comm), 0,
                                 std::move(options), std::move(internals));
  EXPECT_TRUE(ddp.ok()) << ddp.status();
  return ddp.ok() ? std::move(*ddp) : nullptr;
}

// Backward of sum(w * x) on a rank with input x.
void Step(ddp::Engine& ddp, Scalar& m, float x) {
  torch::Tensor out =
      ddp.Forward([&] { return m.forward(torch::full({1}, x)); });
  out.sum().backward();
}

TEST(DdpNoSyncTest, AccumulatedGradientsAreReducedAtTheNextSync) {
  RunRanks(2, [&](int rank, std::shared_ptr<comm::Communicator> comm) {
    auto m = std::make_shared<Scalar>();
    DdpOptions o;
    o.find_unused_parameters(true);
    auto ddp = Wrap(m, comm, o);
    {
      auto guard = ddp->NoSync();
      Step(*ddp, *m, rank + 1.0f);  // local only: 1 and 2
    }
    EXPECT_FLOAT_EQ(m->w.grad().item<float>(), rank + 1.0f);
    Step(*ddp, *m, 10.0f);  // synchronised: ((1+10) + (2+10)) / 2
    EXPECT_FLOAT_EQ(m->w.grad().item<float>(), 11.5f);
  });
}

TEST(DdpUnusedTest, LocallyUnusedParametersTakePartGloballyUnusedAreLeftAlone) {
  RunRanks(2, [&](int rank, std::shared_ptr<comm::Communicator> comm) {
    auto m = std::make_shared<Scalar>();
    DdpOptions o;
    o.find_unused_parameters(true);
    auto ddp = Wrap(m, comm, o);
    // `unused` is used on rank 1 only: its reduced gradient is (0 + 3) / 2.
    torch::Tensor out = ddp->Forward([&] {
      torch::Tensor y = m->forward(torch::full({1}, 2.0f));
      return rank == 1 ? y + 3 * m->unused : y;
    });
    out.sum().backward();
    EXPECT_FLOAT_EQ(m->unused.grad().item<float>(), 1.5f);
    EXPECT_TRUE(ddp->stats().unused_parameters.empty());
    // Next step nobody uses it: its gradient keeps its value.
    Step(*ddp, *m, 2.0f);
    EXPECT_FLOAT_EQ(m->unused.grad().item<float>(), 1.5f);
    EXPECT_EQ(ddp->stats().unused_parameters,
              std::vector<std::string>{"unused"});
  });
}

TEST(DdpUnusedTest, WithoutFindUnusedEveryRankFailsInsteadOfHanging) {
  RunRanks(2, [&](int rank, std::shared_ptr<comm::Communicator> comm) {
    auto m = std::make_shared<Scalar>();
    auto ddp = Wrap(m, comm);
    try {
      Step(*ddp, *m, 1.0f);
      FAIL() << "expected an error";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("find_unused_parameters"),
                std::string::npos)
          << e.what();
    }
  });
}

TEST(DdpStaticGraphTest, UnusedSetIsLearntOnceAndResultsMatch) {
  RunRanks(3, [&](int rank, std::shared_ptr<comm::Communicator> comm) {
    auto m = std::make_shared<Scalar>();
    DdpOptions o;
    o.static_graph(true);
    auto ddp = Wrap(m, comm, o);
    for (int i = 0; i < 3; ++i) {
      m->w.mutable_grad() = torch::Tensor();
      Step(*ddp, *m, rank + 1.0f);
      EXPECT_FLOAT_EQ(m->w.grad().item<float>(), 2.0f);  // (1+2+3)/3
      EXPECT_FALSE(m->unused.grad().defined());
    }
    EXPECT_EQ(ddp->stats().rebuilds, 1);
  });
}

TEST(DdpBucketViewTest, GradientsAreViewsOfTheBuckets) {
  RunRanks(2, [&](int rank, std::shared_ptr<comm::Communicator> comm) {
    torch::manual_seed(0);
    auto net = torch::nn::Linear(4, 3);
    DdpOptions o;
    o.gradient_as_bucket_view(true);
    auto ddp = Wrap(net.ptr(), comm, o);
    for (int i = 0; i < 3; ++i) {
      torch::Tensor out = ddp->Forward([&] {
        return net->forward(torch::full({2, 4}, rank + 1.0f));
      });
      out.sum().backward();
      // d/db sum = batch size 2 on both ranks; accumulated over i+1 steps
      // (never zeroed): the reduced value keeps growing by 2.
      EXPECT_TRUE(
          torch::allclose(net->bias.grad(), torch::full({3}, 2.0f * (i + 1))));
      EXPECT_TRUE(net->bias.grad().is_alias_of(net->weight.grad()))
          << "both live in one bucket";
    }
    torch::optim::SGD sgd(net->parameters(), 0.1);
    // Zeroing detach_()es the gradients: must not throw.
    compat::ZeroGrad(sgd, /*set_to_none=*/false);
    EXPECT_EQ(net->bias.grad().abs().sum().item<float>(), 0.0f);
    // Dropped gradients (LibTorch 2.x's default) come back as bucket views.
    compat::ZeroGrad(sgd, /*set_to_none=*/true);
    EXPECT_FALSE(net->bias.grad().defined());
    torch::Tensor out = ddp->Forward([&] {
      return net->forward(torch::full({2, 4}, rank + 1.0f));
    });
    out.sum().backward();
    EXPECT_TRUE(torch::allclose(net->bias.grad(), torch::full({3}, 2.0f)));
    EXPECT_TRUE(net->bias.grad().is_alias_of(net->weight.grad()));
  });
}

TEST(DdpRebuildTest, BucketsAreRebuiltOnceFromTheReadyOrder) {
  RunRanks(2, [&](int rank, std::shared_ptr<comm::Communicator> comm) {
    torch::manual_seed(0);
    auto net =
        torch::nn::Sequential(torch::nn::Linear(8, 8), torch::nn::Linear(8, 8));
    DdpOptions o;
    o.bucket_cap_mb(1000.0 / (1 << 20));  // 1000 bytes
    ddp::ReducerInternals internals;
    internals.first_bucket_bytes = 1;  // one gradient per bucket at first
    auto ddp = Wrap(net.ptr(), comm, o, internals);
    for (int i = 0; i < 3; ++i) {
      torch::Tensor out = ddp->Forward([&] {
        return net->forward(torch::ones({1, 8}));
      });
      out.sum().backward();
    }
    EXPECT_EQ(ddp->stats().rebuilds, 1);
    const auto buckets = ddp->reducer().buckets();
    ASSERT_EQ(buckets.size(), 2u);
    // Backward produces the last layer's gradients first.
    EXPECT_EQ(buckets[0].params.size(), 1u);
    EXPECT_EQ(buckets[0].params[0], 3u);
    EXPECT_EQ(ddp->stats().bucket_bytes.size(), 2u);
    EXPECT_GT(ddp->stats().backward_comm_us, 0);
  });
}

TEST(DdpVerifyTest, DifferentModelsFailOnEveryRankWithTheDifference) {
  RunRanks(3, [&](int rank, std::shared_ptr<comm::Communicator> comm) {
    auto net = torch::nn::Linear(4, rank == 2 ? 5 : 3);
    auto ddp = ddp::Engine::Create(net.ptr(), comm, 0);
    ASSERT_FALSE(ddp.ok());
    EXPECT_EQ(ddp.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(ddp.status().message().find("1 of 3"), std::string::npos)
        << ddp.status();
    if (rank == 2) {
      EXPECT_NE(ddp.status().message().find("[5, 4]"), std::string::npos)
          << ddp.status();
    }
  });
}

TEST(DdpIgnoreTest, IgnoredParametersAreNeitherBroadcastNorReduced) {
  RunRanks(2, [&](int rank, std::shared_ptr<comm::Communicator> comm) {
    auto m = std::make_shared<Scalar>();
    {
      torch::NoGradGuard no_grad;
      m->unused.fill_(rank + 5.0f);
    }
    DdpOptions o;
    o.params_and_buffers_to_ignore({"unused"});
    auto ddp = Wrap(m, comm, o);
    EXPECT_FLOAT_EQ(m->unused.item<float>(), rank + 5.0f);
    Step(*ddp, *m, rank + 1.0f);  // no error although `unused` gets no grad
    EXPECT_FLOAT_EQ(m->w.grad().item<float>(), 1.5f);
    DdpOptions bad;
    bad.params_and_buffers_to_ignore({"nope"});
    EXPECT_EQ(ddp::Engine::Create(m, comm, 0, bad).status().code(),
              absl::StatusCode::kInvalidArgument);
  });
}

class DdpHookTest : public ::testing::TestWithParam<std::string> {};

TEST_P(DdpHookTest, CompressionFollowsItsDocumentedArithmetic) {
  const std::string name = GetParam();
  // x per rank chosen so that the compressed mean differs from the exact one.
  const float xs[3] = {1.0f / 3, 2.0f / 7, 1.0f / 11};
  RunRanks(3, [&](int rank, std::shared_ptr<comm::Communicator> comm) {
    auto m = std::make_shared<Scalar>();
    DdpOptions o;
    o.params_and_buffers_to_ignore({"unused"});
    auto ddp = Wrap(m, comm, o);
    ASSERT_TRUE(ddp->RegisterCommHook(*ddp::MakeCommHook(name, comm)).ok());
    EXPECT_EQ(ddp->RegisterCommHook(*ddp::MakeCommHook(name, comm)).code(),
              absl::StatusCode::kFailedPrecondition);
    Step(*ddp, *m, xs[rank]);
    // Expected: cast, divide by W, sum (rounded in the wire dtype), cast back.
    const at::ScalarType wire = name == "fp16"   ? at::kHalf
                                : name == "bf16" ? at::kBFloat16
                                                 : at::kFloat;
    std::vector<torch::Tensor> parts;
    for (float x : xs) parts.push_back(torch::full({1}, x).to(wire).div_(3));
    // Gloo's ring adds in some order; every order is within one rounding
    // step of this one for three terms.
    torch::Tensor expected = ((parts[0] + parts[1]) + parts[2]).to(at::kFloat);
    const double ulp = wire == at::kHalf       ? 1e-3
                       : wire == at::kBFloat16 ? 8e-3
                                               : 1e-7;
    EXPECT_NEAR(m->w.grad().item<float>(), expected.item<float>(),
                ulp * std::abs(expected.item<float>()))
        << name;
    if (wire != at::kFloat) {
      const float exact = (xs[0] + xs[1] + xs[2]) / 3;
      EXPECT_NE(m->w.grad().item<float>(), exact) << "no compression happened";
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Hooks, DdpHookTest,
                         ::testing::Values("allreduce", "fp16", "bf16"));

TEST(DdpHookTest, UnknownHookAndHookWithApexScalingAreRejected) {
  RunRanks(1, [&](int, std::shared_ptr<comm::Communicator> comm) {
    EXPECT_EQ(ddp::MakeCommHook("powersgd:x", comm).status().code(),
              absl::StatusCode::kInvalidArgument);
    DdpOptions o;
    o.gradient_predivide_factor(2);
    EXPECT_EQ(ddp::Engine::ValidateOptions(o, true).code(),
              absl::StatusCode::kInvalidArgument);
  });
}

struct ApexCase {
  const char* name;
  DdpOptions options;
  double expected;  // reduced gradient of w for inputs x = 1, 2, 3, 4
};

class DdpApexTest : public ::testing::TestWithParam<ApexCase> {};

TEST_P(DdpApexTest, ArithmeticAsDocumented) {
  const ApexCase c = GetParam();
  RunRanks(4, [&](int rank, std::shared_ptr<comm::Communicator> comm) {
    auto m = std::make_shared<Scalar>();
    DdpOptions o = c.options;
    o.params_and_buffers_to_ignore({"unused"});
    auto ddp = Wrap(m, comm, o);
    Step(*ddp, *m, rank + 1.0f);
    EXPECT_NEAR(m->w.grad().item<float>(), c.expected, 1e-6) << c.name;
  });
}

DdpOptions With(void (*set)(DdpOptions&)) {
  DdpOptions o;
  set(o);
  return o;
}

INSTANTIATE_TEST_SUITE_P(
    Apex, DdpApexTest,
    ::testing::Values(
        // sum = 10 over 4 ranks.
        ApexCase{"default", DdpOptions{}, 2.5},
        // 1/f before, f/W after: (10 / 8) * (8 / 4).
        ApexCase{"predivide",
                 With([](DdpOptions& o) { o.gradient_predivide_factor(8); }),
                 2.5},
        // f == W: no post-scaling at all.
        ApexCase{"predivide_world",
                 With([](DdpOptions& o) { o.gradient_predivide_factor(4); }),
                 2.5},
        ApexCase{"no_average",
                 With([](DdpOptions& o) { o.gradient_average(false); }), 10.0},
        ApexCase{"no_average_predivide", With([](DdpOptions& o) {
                   o.gradient_average(false);
                   o.gradient_predivide_factor(2);
                 }),
                 5.0},
        ApexCase{"always_fp32",
                 With([](DdpOptions& o) { o.allreduce_always_fp32(true); }),
                 2.5},
        ApexCase{"delay_allreduce",
                 With([](DdpOptions& o) { o.delay_allreduce(true); }), 2.5},
        ApexCase{"message_size", With([](DdpOptions& o) { o.message_size(1); }),
                 2.5},
        ApexCase{"trigger",
                 With([](DdpOptions& o) { o.allreduce_trigger_params({"w"}); }),
                 2.5}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(DdpApexFp32Test, HalfGradientsAreReducedInFloat) {
  // fp16 parameters: the fp32 reduction of 1/3-ish values differs from a
  // half-precision one.
  RunRanks(3, [&](int rank, std::shared_ptr<comm::Communicator> comm) {
    auto m = std::make_shared<Scalar>();
    m->to(torch::kHalf);
    DdpOptions o;
    o.params_and_buffers_to_ignore({"unused"});
    o.allreduce_always_fp32(true);
    o.gradient_predivide_factor(3);
    auto ddp = Wrap(m, comm, o);
    const float xs[3] = {1.0f / 3, 2.0f / 7, 1.0f / 11};
    torch::Tensor out = ddp->Forward(
        [&] { return m->forward(torch::full({1}, xs[rank], torch::kHalf)); });
    out.sum().backward();
    // Expected: each half gradient widened to float, / 3, summed in float,
    // (f == W: no post-scale), rounded to half once.
    float sum = 0;
    for (float x : xs) {
      sum += static_cast<float>(c10::Half(x)) / 3.0f;
    }
    EXPECT_EQ(m->w.grad().item<c10::Half>(), c10::Half(sum));
  });
}

}  // namespace
}  // namespace concord

namespace concord::ddp {
namespace {

TEST(ManualReducerTest, AveragesEveryGradientOnDemand) {
  concord::testing::RunRanks(3, [&](int rank,
                                    std::shared_ptr<comm::Communicator> comm) {
    torch::Tensor a = torch::zeros({2, 3}, torch::requires_grad());
    torch::Tensor b =
        torch::zeros({5}, torch::dtype(torch::kDouble).requires_grad(true));
    torch::Tensor none = torch::zeros({1}, torch::requires_grad());
    a.mutable_grad() = torch::full({2, 3}, rank + 1.0f);
    b.mutable_grad() = torch::full({5}, 3.0 * rank, torch::kDouble);
    ManualReducer reducer({a, b, none}, comm);
    // Nothing happens until asked (apex: e.g. every few iterations).
    EXPECT_EQ(a.grad()[0][0].item<float>(), rank + 1.0f);
    ASSERT_TRUE(reducer.Reduce().ok());
    EXPECT_TRUE(torch::equal(a.grad(), torch::full({2, 3}, 2.0f)));
    EXPECT_TRUE(torch::equal(b.grad(), torch::full({5}, 3.0, torch::kDouble)));
    EXPECT_FALSE(none.grad().defined());
  });
}

}  // namespace
}  // namespace concord::ddp
