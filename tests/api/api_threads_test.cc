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

}  // namespace
