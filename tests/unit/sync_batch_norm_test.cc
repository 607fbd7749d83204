// SyncBatchNorm over ranks as threads equals torch::nn::BatchNorm on the
// concatenated batch: outputs, input gradients, weight/bias gradients
// (summed over ranks) and running statistics.

#include "worker/syncbn/sync_batch_norm.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <numeric>
#include <vector>

#include "rank_threads.h"

namespace concord {
namespace {

using concord::testing::RunRanks;

struct Case {
  std::vector<int64_t> batch;  // per rank; the world is batch.size()
  std::vector<int64_t> tail;   // (C, spatial...)
  bool channels_last = false;
  c10::optional<double> momentum = 0.1;
  bool affine = true;
};

std::string Describe(const Case& c) {
  std::ostringstream s;
  s << "batch " << c10::IntArrayRef(c.batch) << " tail "
    << c10::IntArrayRef(c.tail) << (c.channels_last ? " channels-last" : "")
    << (c.momentum ? "" : " momentum=None") << (c.affine ? "" : " no-affine");
  return s.str();
}

torch::nn::AnyModule ReferenceBatchNorm(size_t dims,
                                        const torch::nn::BatchNormOptions& o) {
  if (dims == 1 || dims == 2)
    return torch::nn::AnyModule(torch::nn::BatchNorm1d(o));
  if (dims == 3) return torch::nn::AnyModule(torch::nn::BatchNorm2d(o));
  return torch::nn::AnyModule(torch::nn::BatchNorm3d(o));
}

// Channels innermost, logical shape unchanged.
torch::Tensor ToChannelsLast(const torch::Tensor& x) {
  std::vector<int64_t> perm{0};
  for (int64_t d = 2; d < x.dim(); ++d) perm.push_back(d);
  perm.push_back(1);
  std::vector<int64_t> inverse(perm.size());
  for (size_t i = 0; i < perm.size(); ++i) inverse[perm[i]] = int64_t(i);
  return x.permute(perm).contiguous().permute(inverse);
}

void ExpectClose(const torch::Tensor& a, const torch::Tensor& b,
                 const std::string& what) {
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  EXPECT_TRUE(torch::allclose(a, b, 1e-4, 1e-5))
      << what << ": max abs diff " << (a - b).abs().max().item<double>();
}

void RunCase(const Case& c) {
  SCOPED_TRACE(Describe(c));
  torch::manual_seed(7);
  const int world = static_cast<int>(c.batch.size());
  const int64_t total = std::accumulate(c.batch.begin(), c.batch.end(), 0LL);
  const int64_t channels = c.tail[0];
  std::vector<int64_t> full_shape{total};
  full_shape.insert(full_shape.end(), c.tail.begin(), c.tail.end());
  torch::nn::BatchNormOptions options(channels);
  options.momentum(c.momentum).affine(c.affine);

  // Two steps: running statistics accumulate (cumulative when momentum is
  // none).
  constexpr int kSteps = 2;
  std::vector<torch::Tensor> xs, gs;
  for (int s = 0; s < kSteps; ++s) {
    xs.push_back(torch::randn(full_shape) * (s + 1.5) + 3.0);
    gs.push_back(torch::randn(full_shape));
  }
  torch::Tensor w0 = torch::rand({channels}) + 0.5;
  torch::Tensor b0 = torch::randn({channels});

  // Reference: BatchNorm on the concatenated batch.
  auto ref = ReferenceBatchNorm(c.tail.size(), options);
  auto ref_module = ref.ptr();
  if (c.affine) {
    torch::NoGradGuard g;
    ref_module->named_parameters()["weight"].copy_(w0);
    ref_module->named_parameters()["bias"].copy_(b0);
  }
  std::vector<torch::Tensor> ref_y, ref_dx, ref_dw, ref_db;
  for (int s = 0; s < kSteps; ++s) {
    ref_module->zero_grad();
    torch::Tensor x = xs[s].clone().requires_grad_(true);
    torch::Tensor y = ref.forward(x);
    (y * gs[s]).sum().backward();
    ref_y.push_back(y.detach());
    ref_dx.push_back(x.grad());
    if (c.affine) {
      ref_dw.push_back(ref_module->named_parameters()["weight"].grad().clone());
      ref_db.push_back(ref_module->named_parameters()["bias"].grad().clone());
    }
  }
  const torch::Tensor ref_mean = ref_module->named_buffers()["running_mean"];
  const torch::Tensor ref_var = ref_module->named_buffers()["running_var"];

  RunRanks(world, [&](int rank, std::shared_ptr<comm::Communicator> comm) {
    const int64_t offset =
        std::accumulate(c.batch.begin(), c.batch.begin() + rank, 0LL);
    const int64_t n = c.batch[rank];
    auto group = std::make_shared<SyncBnGroup>(comm);
    SyncBatchNorm bn(options, group);
    if (c.affine) {
      torch::NoGradGuard g;
      bn->weight.copy_(w0);
      bn->bias.copy_(b0);
    }
    for (int s = 0; s < kSteps; ++s) {
      bn->zero_grad();
      torch::Tensor x = xs[s].narrow(0, offset, n).clone();
      if (c.channels_last) x = ToChannelsLast(x);
      x.requires_grad_(true);
      torch::Tensor y = bn->forward(x);
      if (c.channels_last && n > 0) {
        EXPECT_EQ(y.strides(), x.strides()) << "output keeps the layout";
      }
      (y * gs[s].narrow(0, offset, n)).sum().backward();
      const std::string step =
          " step " + std::to_string(s) + " rank " + std::to_string(rank);
      ExpectClose(y.detach(), ref_y[s].narrow(0, offset, n), "output" + step);
      ExpectClose(x.grad(), ref_dx[s].narrow(0, offset, n),
                  "input grad" + step);
      if (c.affine) {
        // Each rank holds its contribution; DDP would sum (and average).
        torch::Tensor dw = bn->weight.grad().clone();
        torch::Tensor db = bn->bias.grad().clone();
        ASSERT_TRUE(comm->AllreduceSum(dw, {})->Wait().ok());
        ASSERT_TRUE(comm->AllreduceSum(db, {})->Wait().ok());
        ExpectClose(dw, ref_dw[s], "weight grad" + step);
        ExpectClose(db, ref_db[s], "bias grad" + step);
      }
    }
    ExpectClose(bn->running_mean, ref_mean, "running_mean");
    ExpectClose(bn->running_var, ref_var, "running_var");
    EXPECT_EQ(bn->num_batches_tracked.item<int64_t>(), kSteps);
  });
}

TEST(SyncBatchNormTest, EqualsBatchNormOnConcatenatedBatch2d) {
  RunCase({{4, 4}, {3, 5, 4}});
  RunCase({{2, 5, 3}, {3, 4, 3}});
  RunCase({{3, 1, 2, 4}, {5, 3, 3}});
}

TEST(SyncBatchNormTest, EmptyAndUnevenBatches) {
  RunCase({{0, 3, 5}, {4, 3, 2}});
  RunCase({{6, 0}, {3, 2, 2}});
  RunCase({{1, 0, 7, 2}, {7}});
}

TEST(SyncBatchNormTest, OneAndThreeDimensionalInputs) {
  RunCase({{5, 3}, {6}});           // (N, C)
  RunCase({{2, 3, 4}, {3, 7}});     // (N, C, L)
  RunCase({{2, 1}, {3, 2, 3, 2}});  // (N, C, D, H, W)
}

TEST(SyncBatchNormTest, ChannelsLast) {
  RunCase({{3, 2}, {5, 3, 4}, /*channels_last=*/true});
  RunCase({{2, 0, 3}, {3, 2, 3, 2}, true});
  RunCase({{2, 4}, {7, 5}, true});  // (N, C, L) with channels innermost
}

TEST(SyncBatchNormTest, MomentumNoneAndNoAffine) {
  RunCase({{3, 4}, {3, 4, 2}, false, c10::nullopt});
  RunCase({{3, 2, 2}, {5, 3}, false, 0.3, /*affine=*/false});
}

TEST(SyncBatchNormTest, HalfAndBFloat16InputWithFloatLayer) {
  for (auto dtype : {torch::kHalf, torch::kBFloat16}) {
    torch::manual_seed(3);
    torch::Tensor full = (torch::randn({6, 4, 3, 3}) * 2 + 1).to(dtype);
    torch::nn::BatchNorm2d ref(4);
    torch::Tensor expected = ref->forward(full.to(torch::kFloat));
    RunRanks(2, [&](int rank, std::shared_ptr<comm::Communicator> comm) {
      SyncBatchNorm bn(torch::nn::BatchNormOptions(4),
                       std::make_shared<SyncBnGroup>(comm));
      torch::Tensor x =
          full.narrow(0, rank * 3, 3).clone().requires_grad_(true);
      torch::Tensor y = bn->forward(x);
      EXPECT_EQ(y.scalar_type(), dtype);
      EXPECT_TRUE(torch::allclose(y.to(torch::kFloat),
                                  expected.narrow(0, rank * 3, 3), 2e-2, 2e-2));
      y.to(torch::kFloat).sum().backward();
      EXPECT_EQ(x.grad().scalar_type(), dtype);
      EXPECT_EQ(bn->weight.grad().scalar_type(), torch::kFloat);
      ExpectClose(bn->running_mean, ref->running_mean, "running_mean");
      EXPECT_TRUE(torch::allclose(bn->running_var, ref->running_var, 1e-3));
      bn->eval();
      torch::Tensor eval = bn->forward(x.detach());
      EXPECT_EQ(eval.scalar_type(), dtype);
    });
  }
}

TEST(SyncBatchNormTest, EvalUsesRunningStatsWithoutCommunication) {
  // Only rank 0 runs eval forwards: any collective would time out.
  RunRanks(2, [&](int rank, std::shared_ptr<comm::Communicator> comm) {
    comm::CollectiveOptions quick;
    quick.timeout = absl::Seconds(2);
    SyncBatchNorm bn(torch::nn::BatchNormOptions(3),
                     std::make_shared<SyncBnGroup>(comm, quick));
    torch::nn::BatchNorm1d ref(3);
    torch::NoGradGuard g;
    bn->running_mean.copy_(torch::tensor({1.0, -2.0, 0.5}));
    bn->running_var.copy_(torch::tensor({2.0, 0.5, 1.5}));
    ref->running_mean.copy_(bn->running_mean);
    ref->running_var.copy_(bn->running_var);
    bn->eval();
    ref->eval();
    if (rank == 0) {
      torch::Tensor x = torch::randn({5, 3});
      EXPECT_TRUE(torch::allclose(bn->forward(x), ref->forward(x)));
      // Without running stats: the local batch's statistics (PyTorch).
      SyncBatchNorm stateless(
          torch::nn::BatchNormOptions(3).track_running_stats(false),
          std::make_shared<SyncBnGroup>(comm, quick));
      stateless->eval();
      EXPECT_TRUE(torch::allclose(
          stateless->forward(x),
          torch::batch_norm(x, {}, {}, {}, {}, true, 0.1, 1e-5, false), 1e-4,
          1e-5));
    }
  });
}

TEST(SyncBatchNormTest, OneValuePerChannelOverTheGroupIsAnErrorOnEveryRank) {
  RunRanks(2, [&](int rank, std::shared_ptr<comm::Communicator> comm) {
    SyncBatchNorm bn(torch::nn::BatchNormOptions(3),
                     std::make_shared<SyncBnGroup>(comm));
    torch::Tensor x = torch::randn({rank == 0 ? 1 : 0, 3});
    EXPECT_THROW(bn->forward(x), c10::Error);
  });
}

TEST(SyncBatchNormTest, SetCommunicatorMovesStatisticsToTheNewGroup) {
  torch::manual_seed(5);
  torch::Tensor full = torch::randn({8, 3}) * 3;
  torch::nn::BatchNorm1d local(3), global(3);
  RunRanks(2, [&](int rank, std::shared_ptr<comm::Communicator> comm) {
    auto group = std::make_shared<SyncBnGroup>();  // no group yet: local
    SyncBatchNorm bn(torch::nn::BatchNormOptions(3), group);
    torch::Tensor x = full.narrow(0, rank * 4, 4);
    torch::Tensor y_local = bn->forward(x);
    EXPECT_TRUE(torch::allclose(
        y_local, torch::batch_norm(x, {}, {}, {}, {}, true, 0.1, 1e-5, false),
        1e-4, 1e-5));
    group->SetCommunicator(comm);  // what the elastic loop does
    torch::Tensor y = bn->forward(x);
    torch::Tensor expected =
        torch::batch_norm(full, {}, {}, {}, {}, true, 0.1, 1e-5, false)
            .narrow(0, rank * 4, 4);
    EXPECT_TRUE(torch::allclose(y, expected, 1e-4, 1e-5));
  });
}

struct Net : torch::nn::Module {
  Net() {
    features = register_module(
        "features", torch::nn::Sequential(
                        torch::nn::Conv2d(torch::nn::Conv2dOptions(2, 4, 3)),
                        torch::nn::BatchNorm2d(4), torch::nn::ReLU()));
    heads = register_module("heads", torch::nn::ModuleList());
    heads->push_back(torch::nn::BatchNorm1d(4));
    dict = register_module(
        "dict",
        torch::nn::ModuleDict(
            std::vector<std::pair<std::string, std::shared_ptr<Module>>>{
                {"bn3", std::make_shared<torch::nn::BatchNorm3dImpl>(2)}}));
  }
  torch::Tensor forward(torch::Tensor x) {
    return features->forward(x).mean({2, 3});
  }
  torch::nn::Sequential features{nullptr};
  torch::nn::ModuleList heads{nullptr};
  torch::nn::ModuleDict dict{nullptr};
};

TEST(SyncBatchNormTest, ConvertReplacesEveryBatchNormKeepingState) {
  auto net = std::make_shared<Net>();
  {
    torch::NoGradGuard g;
    for (auto& b : net->named_buffers()) {
      if (b.value().is_floating_point()) b.value().uniform_(0.5, 1.5);
    }
    for (auto& p : net->named_parameters()) p.value().uniform_(-1, 1);
  }
  auto before = net->named_parameters();
  auto buffers_before = net->named_buffers();
  std::vector<std::string> replaced;
  auto converted = ConvertSyncBatchNorm(net, nullptr, &replaced);
  EXPECT_EQ(converted, net);
  EXPECT_EQ(replaced,
            (std::vector<std::string>{"features.1", "heads.0", "dict.bn3"}));
  auto after = net->named_parameters();
  ASSERT_EQ(after.keys(), before.keys());
  for (const auto& p : before) {
    // The same tensors: an optimizer built before conversion still works.
    EXPECT_TRUE(after[p.key()].is_same(p.value())) << p.key();
  }
  auto buffers_after = net->named_buffers();
  ASSERT_EQ(buffers_after.keys(), buffers_before.keys());
  for (const auto& b : buffers_before) {
    EXPECT_TRUE(torch::equal(buffers_after[b.key()], b.value())) << b.key();
  }
  // The Sequential and ModuleList call the new layers.
  EXPECT_NE(net->features->ptr<SyncBatchNormImpl>(1), nullptr);
  EXPECT_NE(std::dynamic_pointer_cast<SyncBatchNormImpl>(net->heads[0]),
            nullptr);
  EXPECT_NE(std::dynamic_pointer_cast<SyncBatchNormImpl>(net->dict["bn3"]),
            nullptr);
  torch::Tensor out = net->forward(torch::randn({5, 2, 6, 6}));
  EXPECT_EQ(out.sizes(), (std::vector<int64_t>{5, 4}));

  // A BatchNorm root becomes a new SyncBatchNorm.
  auto root = ConvertSyncBatchNorm(torch::nn::BatchNorm2d(3).ptr(),
                                   std::make_shared<SyncBnGroup>());
  EXPECT_NE(std::dynamic_pointer_cast<SyncBatchNormImpl>(root), nullptr);
}

}  // namespace
}  // namespace concord
