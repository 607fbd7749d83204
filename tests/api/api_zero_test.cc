// concord::ZeroRedundancyOptimizer in a world of one, through the public
// API: overlap_with_ddp's warm-up against an unsharded LibTorch optimizer,
// and the one-line errors of what it refuses. (Several ranks against
// PyTorch's own: tests/reference/test_zero_reference.py.)
#include <concord/concord.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <vector>

#include "api_test_util.h"

namespace {

using concord::ErrorCode;
using concord_test::CodeOf;
using concord_test::Net;

void CopyParams(torch::nn::Module& from, torch::nn::Module& to) {
  torch::NoGradGuard no_grad;
  auto a = from.parameters();
  auto b = to.parameters();
  for (size_t i = 0; i < a.size(); ++i) b[i].copy_(a[i]);
}

TEST(ZeroRedundancyOptimizerTest, OverlappedItStepsInBackwardFromTheThird) {
  concord::Job job;
  torch::manual_seed(0);
  Net net, plain_net;
  CopyParams(*net, *plain_net);
  concord::DistributedDataParallel ddp(net, job);
  concord::ZeroRedundancyOptimizer zero(
      ddp->parameters(), torch::optim::AdamOptions(0.05), job,
      concord::ZeroOptions().overlap_with_ddp(true));
  ddp->register_comm_hook(
      concord::hook_with_zero_step(concord::allreduce_hook, ddp, zero));
  torch::optim::Adam plain(plain_net->parameters(),
                           torch::optim::AdamOptions(0.05));
  // Before DDP's buckets are known there are no shards.
  EXPECT_EQ(CodeOf([&] { zero.consolidate_state_dict(0); }),
            ErrorCode::kFailedPrecondition);
  EXPECT_EQ(CodeOf([&] { zero.owners(); }), ErrorCode::kFailedPrecondition);
  for (int s = 0; s < 5; ++s) {
    const torch::Tensor x = torch::randn({6, 4}), y = torch::randn({6, 1});
    concord::zero_grad(zero, false);
    torch::mse_loss(ddp->forward(x), y).backward();
    EXPECT_FALSE(zero.step().defined());  // the hook stepped
    concord::zero_grad(plain, false);
    torch::mse_loss(plain_net->forward(x), y).backward();
    // PyTorch's warm-up: the first backward builds DDP's final buckets,
    // the second tells the optimizer what they hold.
    if (s >= 2) plain.step();
    const auto got = net->parameters(), want = plain_net->parameters();
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_TRUE(torch::equal(got[i], want[i]))
          << "step " << s << " parameter " << i;
    }
  }
  EXPECT_EQ(zero.owners(), std::vector<int>(4, 0));
  EXPECT_EQ(zero.local_optimizer().state().size(), 4u);
  zero.consolidate_state_dict(0);
}

TEST(ZeroRedundancyOptimizerTest, OverlapRefusesWhatItCannotDo) {
  concord::Job job;
  Net net;
  concord::DistributedDataParallel ddp(net, job);
  auto params = ddp->parameters();
  const auto overlap = concord::ZeroOptions().overlap_with_ddp(true);
  EXPECT_EQ(CodeOf([&] {
              std::vector<torch::optim::OptimizerParamGroup> groups;
              groups.emplace_back(std::vector<torch::Tensor>{params[0]});
              groups.emplace_back(std::vector<torch::Tensor>{params[1]});
              concord::ZeroRedundancyOptimizer two(
                  groups, torch::optim::SGDOptions(0.1), job, overlap);
            }),
            ErrorCode::kInvalidArgument);
  concord::ZeroRedundancyOptimizer unhooked(params,
                                            torch::optim::SGDOptions(0.1), job);
  EXPECT_EQ(CodeOf([&] {
              concord::hook_with_zero_step(concord::allreduce_hook, ddp,
                                           unhooked);
            }),
            ErrorCode::kInvalidArgument);
  concord::ZeroRedundancyOptimizer zero(params, torch::optim::SGDOptions(0.1),
                                        job, overlap);
  concord::CommHook hook = concord::hook_with_zero_step_interleaved(
      concord::allreduce_hook, ddp, zero);
  EXPECT_EQ(CodeOf([&] {
              concord::hook_with_zero_step(concord::allreduce_hook, ddp, zero);
            }),
            ErrorCode::kAlreadyExists);
  EXPECT_EQ(CodeOf([&] {
              zero.add_param_group(torch::optim::OptimizerParamGroup(
                  {torch::zeros({2}, torch::requires_grad())}));
            }),
            ErrorCode::kFailedPrecondition);
}

TEST(ZeroRedundancyOptimizerTest, OverlappedUnderRunElasticFromTheThirdStep) {
  concord::Job job;
  torch::manual_seed(1);
  Net net, plain_net;
  CopyParams(*net, *plain_net);
  concord::DistributedDataParallel ddp(net, job);
  concord::ZeroRedundancyOptimizer zero(
      ddp->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9), job,
      concord::ZeroOptions().overlap_with_ddp(true));
  ddp->register_comm_hook(concord::hook_with_zero_step_interleaved(
      concord::allreduce_hook, ddp, zero));
  torch::optim::SGD plain(plain_net->parameters(),
                          torch::optim::SGDOptions(0.1).momentum(0.9));
  concord::ElasticSampler sampler(12, job);
  concord::ElasticState state(job);
  state.add("ddp", ddp).add("zero", zero).add(sampler);
  const torch::Tensor x = torch::randn({12, 4}), y = torch::randn({12, 1});
  int steps = 0;
  concord::run_elastic(state, [&] {
    while (auto batch = sampler.next(2)) {
      const torch::Tensor idx =
          torch::tensor(std::vector<int64_t>(batch->begin(), batch->end()));
      concord::zero_grad(zero, false);
      torch::mse_loss(ddp->forward(x.index({idx})), y.index({idx})).backward();
      state.commit();
      concord::zero_grad(plain, false);
      torch::mse_loss(plain_net->forward(x.index({idx})), y.index({idx}))
          .backward();
      if (steps >= 2) plain.step();
      ++steps;
      const auto got = net->parameters(), want = plain_net->parameters();
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_TRUE(torch::equal(got[i], want[i]))
            << "step " << steps << " parameter " << i;
      }
    }
  });
  EXPECT_EQ(steps, 6);
  EXPECT_EQ(zero.local_optimizer().state().size(), 4u);
}

// See Note [Elastic ZeRO] in api/zero.cc: a rank alone steps every shard,
// so once the State has seen its update come after the step's last
// collective the step keeps no start, an unsharded optimizer's cost; a
// sharded optimizer stepping before another model's collectives keeps it
// every step, as an unsharded one does (see Note [Early optimizer steps] in
// worker/elastic/state.h).
// Either way the parameters are LibTorch's Adam's, bit for bit.
TEST(ZeroRedundancyOptimizerTest,
     AStepKeepsItsStartOnlyWhereACollectiveFollows) {
  for (bool early : {false, true}) {
    SCOPED_TRACE(early ? "steps before another model's collectives"
                       : "steps after the step's last collective");
    concord::Job job;
    torch::manual_seed(1);
    Net net, plain_net, other;
    CopyParams(*net, *plain_net);
    concord::DistributedDataParallel ddp(net, job);
    concord::DistributedDataParallel second(other, job);
    concord::ZeroRedundancyOptimizer zero(ddp->parameters(),
                                          torch::optim::AdamOptions(0.01), job);
    torch::optim::Adam plain(plain_net->parameters(),
                             torch::optim::AdamOptions(0.01));
    concord::ElasticSampler sampler(12, job);
    torch::optim::SGD second_optimizer(second->parameters(), 0.1);
    concord::ElasticState state(job);
    state.add("ddp", ddp)
        .add("second", second)
        .add("zero", zero)
        .add("second_optimizer", second_optimizer)
        .add(sampler);
    const torch::Tensor x = torch::randn({12, 4}), y = torch::randn({12, 1});
    int64_t live = 0;
    int steps = 0;
    concord::run_elastic(state, [&] {
      while (auto batch = sampler.next(2)) {
        const torch::Tensor idx =
            torch::tensor(std::vector<int64_t>(batch->begin(), batch->end()));
        auto loss = [&](const torch::Tensor& out) {
          return torch::mse_loss(out, y.index({idx}));
        };
        concord::zero_grad(zero, false);
        loss(ddp->forward(x.index({idx}))).backward();
        if (early) zero.step();
        loss(second->forward(x.index({idx}))).backward();
        if (!early) zero.step();
        state.commit();
        plain.zero_grad();
        loss(plain_net->forward(x.index({idx}))).backward();
        plain.step();
        ++steps;
        const auto got = net->parameters(), want = plain_net->parameters();
        for (size_t i = 0; i < got.size(); ++i) {
          EXPECT_TRUE(torch::equal(got[i], want[i]))
              << "step " << steps << " parameter " << i;
        }
        live = 0;
        for (const auto& p : plain_net->parameters()) {
          live += 2 * p.numel() * int64_t(sizeof(float));  // exp_avg(_sq)
        }
      }
    });
    EXPECT_EQ(steps, 6);
    if (early) {
      // The moments' kept buffers and the parameters as they were.
      EXPECT_GT(zero.state_bytes(), live);
    } else {
      EXPECT_EQ(zero.state_bytes(), live);
    }
  }
}

}  // namespace
