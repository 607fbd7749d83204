// The public API with several workers as threads (job_threads.h): a real
// coordinator process, real Gloo, one Job per thread.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "job_threads.h"

namespace {

using concord::testing::CoordinatorProcess;
using concord::testing::RunJobThreads;

struct NetImpl : torch::nn::Module {
  NetImpl() : fc(register_module("fc", torch::nn::Linear(4, 1))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc->forward(x); }
  torch::nn::Linear fc;
};
TORCH_MODULE(Net);

// A batch of the samples `indices`: sample i is four times i / n.
torch::Tensor Features(const std::vector<size_t>& indices, size_t n) {
  std::vector<float> xs;
  for (size_t index : indices) {
    for (int k = 0; k < 4; ++k) xs.push_back(static_cast<float>(index) / n);
  }
  return torch::tensor(xs).view({-1, 4});
}

class ApiThreadsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/concord-api-threads-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    coordinator_ =
        std::make_unique<CoordinatorProcess>(CONCORD_COORDINATOR_BIN, dir_);
    ASSERT_FALSE(coordinator_->address().empty())
        << "the coordinator did not start";
  }
  void TearDown() override {
    coordinator_.reset();
    std::system(("rm -rf " + dir_).c_str());
  }
  const std::string& address() const { return coordinator_->address(); }

  std::string dir_;
  std::unique_ptr<CoordinatorProcess> coordinator_;
};

TEST_F(ApiThreadsTest, ThreeWorkersFormOneGenerationAndDdpMakesThemEqual) {
  std::mutex mu;
  std::set<int> ranks;
  std::vector<double> sums;
  RunJobThreads(address(), "ddp", 3, [&](int i, concord::Job& job) {
    EXPECT_EQ(job.world_size(), 3);
    EXPECT_TRUE(job.elastic());
    torch::manual_seed(100 + i);  // different initial weights
    Net net;
    concord::DistributedDataParallel ddp(net, job);
    torch::optim::SGD opt(ddp->parameters(), 0.1);
    for (int step = 0; step < 5; ++step) {
      auto x = torch::full({2, 4}, static_cast<float>(job.rank() + step));
      opt.zero_grad();
      ddp->forward(x).sum().backward();
      opt.step();
    }
    double sum = 0;
    for (const auto& p : net->parameters()) sum += p.sum().item<double>();
    std::lock_guard<std::mutex> lock(mu);
    ranks.insert(job.rank());
    sums.push_back(sum);
    job.finish();
  });
  EXPECT_EQ(ranks, (std::set<int>{0, 1, 2}));
  ASSERT_EQ(sums.size(), 3u);
  EXPECT_EQ(sums[0], sums[1]);
  EXPECT_EQ(sums[1], sums[2]);
}

// Worker 2 leaves (fails) after a few steps; the others' collective is
// aborted, run_elastic restores, re-forms with two and goes on. Over the
// job's committed steps every sample of every epoch is trained once, and
// the survivors end equal.
TEST_F(ApiThreadsTest, RunElasticGoesOnWithoutAWorkerThatLeaves) {
  constexpr size_t kSamples = 60;
  std::mutex mu;
  std::map<int64_t, std::multiset<size_t>> committed;  // epoch -> samples
  std::vector<double> survivor_sums;
  std::vector<int64_t> survivor_steps;
  RunJobThreads(
      address(), "elastic", 3,
      [&](int i, concord::Job& job) {
        torch::manual_seed(7);
        Net net;
        concord::DistributedDataParallel ddp(net, job);
        torch::optim::SGD opt(ddp->parameters(), 0.01);
        concord::ElasticSampler sampler(kSamples, job);
        concord::ElasticState state(ddp, opt, sampler);
        struct Leave {};
        try {
          concord::run_elastic(state, [&] {
            for (; state.epoch() < 2; state.next_epoch()) {
              while (auto batch = sampler.next(2)) {
                if (i == 2 && state.step() == 4) throw Leave{};
                auto x = Features(*batch, kSamples);
                opt.zero_grad();
                ddp->forward(x).pow(2).sum().backward();
                opt.step();
                const int64_t epoch = state.epoch();
                state.commit();
                std::lock_guard<std::mutex> lock(mu);
                committed[epoch].insert(batch->begin(), batch->end());
              }
            }
          });
        } catch (const Leave&) {
          job.finish(false, "test: worker 2 leaves");
          return;
        }
        double sum = 0;
        for (const auto& p : net->parameters()) sum += p.sum().item<double>();
        std::lock_guard<std::mutex> lock(mu);
        survivor_sums.push_back(sum);
        survivor_steps.push_back(state.step());
        EXPECT_EQ(job.world_size(), 2);
        EXPECT_GE(state.reforms(), 1);
        job.finish();
      },
      /*min=*/2);
  ASSERT_EQ(survivor_sums.size(), 2u);
  EXPECT_EQ(survivor_sums[0], survivor_sums[1]);
  EXPECT_EQ(survivor_steps[0], survivor_steps[1]);
  ASSERT_EQ(committed.size(), 2u);
  for (const auto& [epoch, samples] : committed) {
    EXPECT_EQ(samples.size(), kSamples) << "epoch " << epoch;
    EXPECT_EQ(std::set<size_t>(samples.begin(), samples.end()).size(), kSamples)
        << "epoch " << epoch;
  }
}

// Two workers train; a third joins while they do and is admitted at a step
// boundary (the step agreement re-forms, the loop starts over in the new
// generation). Every sample once per epoch over the committed steps; all
// three end equal.
TEST_F(ApiThreadsTest, AWorkerThatJoinsLateIsAdmittedAtAStepBoundary) {
  constexpr size_t kSamples = 400;
  std::mutex mu;
  std::map<int64_t, std::multiset<size_t>> committed;
  std::vector<double> sums;
  std::vector<int> worlds;
  std::atomic<bool> started{false};
  auto body = [&](int i, concord::Job& job) {
    torch::manual_seed(7);
    Net net;
    concord::DistributedDataParallel ddp(net, job);
    torch::optim::SGD opt(ddp->parameters(), 0.01);
    concord::ElasticSampler sampler(kSamples, job);
    concord::ElasticState state(ddp, opt, sampler);
    concord::run_elastic(state, [&] {
      for (; state.epoch() < 2; state.next_epoch()) {
        while (auto batch = sampler.next(2)) {
          started = true;
          opt.zero_grad();
          ddp->forward(Features(*batch, kSamples)).pow(2).sum().backward();
          opt.step();
          const int64_t epoch = state.epoch();
          state.commit();
          {
            std::lock_guard<std::mutex> lock(mu);
            committed[epoch].insert(batch->begin(), batch->end());
          }
          // Slow enough steps that the late worker arrives mid-epoch.
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
      }
    });
    double sum = 0;
    for (const auto& p : net->parameters()) sum += p.sum().item<double>();
    std::lock_guard<std::mutex> lock(mu);
    sums.push_back(sum);
    worlds.push_back(job.world_size());
    job.finish();
  };
  std::thread late([&] {
    while (!started) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    try {
      concord::Job job(
          concord::testing::WorkerOptions(address(), "late", 2, 3, /*min=*/2));
      body(2, job);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "late worker: " << e.what();
    }
  });
  RunJobThreads(address(), "late", 2, body, /*min=*/2, /*max=*/3);
  late.join();
  ASSERT_EQ(sums.size(), 3u);
  EXPECT_EQ(sums[0], sums[1]);
  EXPECT_EQ(sums[1], sums[2]);
  EXPECT_EQ(worlds, (std::vector<int>{3, 3, 3}));
  ASSERT_EQ(committed.size(), 2u);
  for (const auto& [epoch, samples] : committed) {
    EXPECT_EQ(samples.size(), kSamples) << "epoch " << epoch;
    EXPECT_EQ(std::set<size_t>(samples.begin(), samples.end()).size(), kSamples)
        << "epoch " << epoch;
  }
}

// A model of one BatchNorm, converted: DDP binds it to the job's ranks, and
// run_elastic rebinds it after a worker leaves. Every committed step's
// outputs, over all ranks of its generation, are batch normalisation of all
// their inputs together.
TEST_F(ApiThreadsTest, SyncBatchNormNormalisesOverTheJobBeforeAndAfterAReform) {
  constexpr size_t kSamples = 48;
  struct Seen {
    torch::Tensor x, y, weight, bias;
  };
  std::mutex mu;
  std::map<int64_t, std::map<int, Seen>> steps;  // step -> rank -> seen
  std::map<int64_t, int> worlds;                 // step -> world size
  RunJobThreads(
      address(), "syncbn", 3,
      [&](int i, concord::Job& job) {
        torch::nn::Sequential seq(torch::nn::BatchNorm1d(4));
        seq = concord::convert_sync_batchnorm(seq);
        auto bn = seq[0]->as<concord::SyncBatchNorm>();
        ASSERT_NE(bn, nullptr);
        concord::DistributedDataParallel ddp(seq, job);
        torch::optim::SGD opt(ddp->parameters(), 0.05);
        concord::ElasticSampler sampler(kSamples, job);
        concord::ElasticState state(ddp, opt, sampler);
        struct Leave {};
        try {
          concord::run_elastic(state, [&] {
            while (auto batch = sampler.next(2)) {
              if (i == 2 && state.step() == 3) throw Leave{};
              // Channel k of sample s: (s + k²) / n, varied per channel.
              auto x = Features(*batch, kSamples) +
                       torch::arange(4, torch::kFloat).pow(2) /
                           static_cast<double>(kSamples);
              Seen seen{x,
                        {},
                        bn->weight.detach().clone(),
                        bn->bias.detach().clone()};
              opt.zero_grad();
              auto y = ddp->forward(x);
              (y * torch::arange(1, 5, torch::kFloat)).pow(2).sum().backward();
              // Kept without its graph: a graph holds the generation's
              // communicator, whose end would wait for Gloo's timeout.
              seen.y = y.detach();
              opt.step();
              state.commit();
              std::lock_guard<std::mutex> lock(mu);
              steps[state.step()][job.rank()] = seen;
              worlds[state.step()] = job.world_size();
            }
          });
        } catch (const Leave&) {
          job.finish(false, "test: worker 2 leaves");
          return;
        }
        EXPECT_EQ(job.world_size(), 2);
        EXPECT_GE(state.reforms(), 1);
        job.finish();
      },
      /*min=*/2);
  ASSERT_FALSE(steps.empty());
  bool before = false, after = false;
  for (const auto& [step, ranks] : steps) {
    ASSERT_EQ(static_cast<int>(ranks.size()), worlds[step]) << "step " << step;
    (worlds[step] == 3 ? before : after) = true;
    std::vector<torch::Tensor> xs, ys;
    for (const auto& [rank, seen] : ranks) {
      xs.push_back(seen.x);
      ys.push_back(seen.y);
      EXPECT_TRUE(seen.weight.equal(ranks.begin()->second.weight));
    }
    const Seen& any = ranks.begin()->second;
    auto expected = torch::batch_norm(torch::cat(xs), any.weight, any.bias, {},
                                      {}, /*training=*/true, 0.1, 1e-5, false);
    EXPECT_TRUE(torch::allclose(torch::cat(ys), expected, 1e-4, 1e-5))
        << "step " << step << " of " << worlds[step] << " ranks";
  }
  EXPECT_TRUE(before);
  EXPECT_TRUE(after);
}

// PyTorch's join: rank r has 3 + r batches of its own (no ElasticSampler).
// Each calls ddp->join() when its data is over and leaves; the others go on
// without restarting their loop, and every step's gradient is the sum over
// the ranks with data divided by the initial world size (3), as PyTorch's
// divide_by_initial_world_size. Checked against that arithmetic on one
// process.
TEST_F(ApiThreadsTest, JoinLetsRanksWithUnevenInputsFinishAndTheOthersGoOn) {
  constexpr double kLr = 0.1;
  auto batch = [](int rank, int64_t step) {
    return torch::full({2, 4},
                       static_cast<float>((rank + 1) * (step + 1)) / 10);
  };
  auto loss = [](const torch::Tensor& out) { return (out - 1).pow(2).mean(); };
  std::mutex mu;
  std::map<int, int> forwards;  // rank at the start -> batches trained
  std::map<int, std::vector<torch::Tensor>> finals;
  std::vector<torch::Tensor> initial;
  RunJobThreads(
      address(), "join", 3,
      [&](int, concord::Job& job) {
        const int rank = job.rank();
        const int64_t batches = 3 + rank;
        Net net;
        concord::DistributedDataParallel ddp(net, job);
        if (rank == 0) {  // every rank starts from these: DDP broadcast them
          std::lock_guard<std::mutex> lock(mu);
          for (const auto& p : net->parameters()) {
            initial.push_back(p.detach().clone());
          }
        }
        torch::optim::SGD opt(ddp->parameters(), kLr);
        concord::ElasticState state(ddp, opt);
        int trained = 0;
        concord::run_elastic(state, [&] {
          // The job's steps are every rank's batches in order: the committed
          // step is where this rank's data goes on from.
          for (int64_t t = state.step(); t < batches; t = state.step()) {
            opt.zero_grad();
            loss(ddp->forward(batch(rank, t))).backward();
            opt.step();
            state.commit();
            ++trained;
          }
          ddp->join();
        });
        std::lock_guard<std::mutex> lock(mu);
        forwards[rank] = trained;
        for (const auto& p : net->parameters()) {
          finals[rank].push_back(p.detach().clone());
        }
        job.finish();
      },
      /*min=*/1);
  EXPECT_EQ(forwards, (std::map<int, int>{{0, 3}, {1, 4}, {2, 5}}));

  Net ref;
  {
    torch::NoGradGuard no_grad;
    auto params = ref->parameters();
    ASSERT_EQ(params.size(), initial.size());
    for (size_t k = 0; k < params.size(); ++k) params[k].copy_(initial[k]);
  }
  for (int64_t t = 0; t < 5; ++t) {
    std::vector<torch::Tensor> sum;
    for (int rank = 0; rank < 3; ++rank) {
      if (t >= 3 + rank) continue;  // out of data: contributes nothing
      ref->zero_grad();
      loss(ref->forward(batch(rank, t))).backward();
      auto params = ref->parameters();
      for (size_t k = 0; k < params.size(); ++k) {
        if (sum.size() <= k) sum.push_back(torch::zeros_like(params[k]));
        sum[k] += params[k].grad();
      }
    }
    torch::NoGradGuard no_grad;
    auto params = ref->parameters();
    for (size_t k = 0; k < params.size(); ++k) params[k] -= kLr * sum[k] / 3;
  }
  ASSERT_EQ(finals[2].size(), ref->parameters().size());
  for (size_t k = 0; k < finals[2].size(); ++k) {
    EXPECT_TRUE(torch::allclose(finals[2][k], ref->parameters()[k], 1e-5, 1e-6))
        << finals[2][k] << " vs " << ref->parameters()[k];
  }
}

}  // namespace
