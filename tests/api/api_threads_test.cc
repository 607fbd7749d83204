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

using ApiThreadsTest = concord::testing::JobThreadsTest;

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

// The same arrival with ElasticStateOptions().admit_workers(false) (ranks
// that own fixed shards): the two train alone to the end, in one
// generation, and the late worker never gets a rank.
TEST_F(ApiThreadsTest, AWorkerThatJoinsLateIsNotAdmittedWhenTheStateSaysSo) {
  constexpr size_t kSamples = 400;
  std::mutex mu;
  std::vector<int> worlds;
  std::vector<int64_t> reforms;
  std::atomic<bool> started{false};
  std::atomic<bool> late_joined{false};
  std::atomic<int> late_code{0};
  std::thread late([&] {
    while (!started) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    try {
      concord::Job job(
          concord::testing::WorkerOptions(address(), "closed", 2, 3, 2)
              .timeouts(concord::Timeouts().rendezvous(
                  std::chrono::milliseconds(8000))));
      late_joined = true;
      job.finish();
    } catch (const concord::Error& e) {
      late_code = static_cast<int>(e.code());
    }
  });
  RunJobThreads(
      address(), "closed", 2,
      [&](int, concord::Job& job) {
        torch::manual_seed(7);
        Net net;
        concord::DistributedDataParallel ddp(net, job);
        torch::optim::SGD opt(ddp->parameters(), 0.01);
        concord::ElasticSampler sampler(kSamples, job);
        concord::ElasticState state(
            ddp, opt, sampler,
            concord::ElasticStateOptions().admit_workers(false));
        concord::run_elastic(state, [&] {
          for (; state.epoch() < 2; state.next_epoch()) {
            while (auto batch = sampler.next(2)) {
              started = true;
              opt.zero_grad();
              ddp->forward(Features(*batch, kSamples)).pow(2).sum().backward();
              opt.step();
              state.commit();
              std::this_thread::sleep_for(std::chrono::milliseconds(5));
            }
          }
        });
        std::lock_guard<std::mutex> lock(mu);
        worlds.push_back(job.world_size());
        reforms.push_back(state.reforms());
        job.finish();
      },
      /*min=*/2, /*max=*/3);
  late.join();
  EXPECT_EQ(worlds, (std::vector<int>{2, 2}));
  EXPECT_EQ(reforms, (std::vector<int64_t>{0, 0}));
  EXPECT_FALSE(late_joined) << "the late worker was admitted";
  // The job succeeded while it waited (or its wait ran out).
  EXPECT_TRUE(
      late_code == static_cast<int>(concord::ErrorCode::kFailedPrecondition) ||
      late_code == static_cast<int>(concord::ErrorCode::kDeadlineExceeded))
      << "code " << late_code;
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
        bool left = false;
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
          left = ddp->join();
        });
        std::lock_guard<std::mutex> lock(mu);
        forwards[rank] = trained;
        // The first two leave while others go on; when the last runs out,
        // training is over.
        EXPECT_EQ(left, rank < 2) << "rank " << rank;
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

// SlowMo through DdpOptions::slowmo, against its arithmetic (fairscale's
// perform_slowmo, see Note [SlowMo step]) computed here on one process: every
// rank takes local SGD steps on its own batches; every localsgd_frequency
// steps the parameters are averaged; every slowmo_frequency steps
//   u <- beta u + (x_old - x) / lr;  x_old <- x_old - alpha lr u;  x <- x_old
// with x the average. The first step's batch is the same on every rank, so
// that x_old, taken from the parameters after it, is too.
struct SlowMoRun {
  std::vector<torch::Tensor> initial;
  std::map<int, std::vector<torch::Tensor>> finals;  // rank -> parameters
};

constexpr double kSlowMoLr = 0.1;

torch::Tensor SlowMoBatch(int rank, int64_t step) {
  const float v = static_cast<float>(step == 0 ? 1 : (rank + 1) * (step + 1));
  return torch::full({2, 4}, v / 10);
}

torch::Tensor SlowMoLoss(const torch::Tensor& out) {
  return (out - 1).pow(2).mean();
}

SlowMoRun RunSlowMoJob(const std::string& address, const std::string& job_id,
                       const concord::SlowMoOptions& options, int64_t steps) {
  SlowMoRun run;
  std::mutex mu;
  RunJobThreads(address, job_id, 3, [&](int, concord::Job& job) {
    const int rank = job.rank();
    Net net;
    concord::DistributedDataParallel ddp(net, job,
                                         concord::DdpOptions().slowmo(options));
    if (rank == 0) {
      std::lock_guard<std::mutex> lock(mu);
      for (const auto& p : net->parameters()) {
        run.initial.push_back(p.detach().clone());
      }
    }
    torch::optim::SGD opt(ddp->parameters(), kSlowMoLr);
    for (int64_t t = 0; t < steps; ++t) {
      opt.zero_grad();
      SlowMoLoss(ddp->forward(SlowMoBatch(rank, t))).backward();
      opt.step();
      ddp->perform_slowmo(opt);
    }
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& p : net->parameters()) {
      run.finals[rank].push_back(p.detach().clone());
    }
    job.finish();
  });
  return run;
}

// What RunSlowMoJob's ranks must end with, by rank.
std::vector<std::vector<torch::Tensor>> SimulateSlowMo(
    const std::vector<torch::Tensor>& initial,
    const concord::SlowMoOptions& options, int64_t steps) {
  std::vector<Net> ranks(3);
  for (Net& net : ranks) {
    torch::NoGradGuard no_grad;
    auto params = net->parameters();
    for (size_t k = 0; k < params.size(); ++k) params[k].copy_(initial[k]);
  }
  std::vector<torch::Tensor> old, u;
  const double beta = options.slowmo_momentum(), alpha = options.slowmo_lr();
  for (int64_t t = 0; t < steps; ++t) {
    for (int r = 0; r < 3; ++r) {
      ranks[r]->zero_grad();
      SlowMoLoss(ranks[r]->forward(SlowMoBatch(r, t))).backward();
      torch::NoGradGuard no_grad;
      for (auto& p : ranks[r]->parameters()) p -= kSlowMoLr * p.grad();
    }
    torch::NoGradGuard no_grad;
    const size_t n = ranks[0]->parameters().size();
    if (t == 0) {
      for (const auto& p : ranks[0]->parameters()) {
        old.push_back(p.clone());
        u.push_back(torch::zeros_like(p));
      }
    }
    const bool slow = (t + 1) % options.slowmo_frequency() == 0 &&
                      (alpha != 1.0 || beta != 0.0);
    if ((t + 1) % options.localsgd_frequency() != 0 && !slow) continue;
    for (size_t k = 0; k < n; ++k) {
      torch::Tensor x = (ranks[0]->parameters()[k] + ranks[1]->parameters()[k] +
                         ranks[2]->parameters()[k]) /
                        3;
      if (slow) {
        u[k] = beta * u[k] + (old[k] - x) / kSlowMoLr;
        old[k] = old[k] - alpha * kSlowMoLr * u[k];
        x = old[k].clone();
      }
      for (Net& net : ranks) net->parameters()[k].copy_(x);
    }
  }
  std::vector<std::vector<torch::Tensor>> out;
  for (Net& net : ranks) out.push_back(net->parameters());
  return out;
}

void ExpectSlowMoArithmetic(const SlowMoRun& run,
                            const concord::SlowMoOptions& options,
                            int64_t steps) {
  ASSERT_EQ(run.finals.size(), 3u);
  const auto expected = SimulateSlowMo(run.initial, options, steps);
  for (const auto& [rank, params] : run.finals) {
    const auto& mine = expected.at(static_cast<size_t>(rank));
    ASSERT_EQ(params.size(), mine.size());
    for (size_t k = 0; k < params.size(); ++k) {
      EXPECT_TRUE(torch::allclose(params[k], mine[k], 1e-5, 1e-6))
          << "rank " << rank << ": " << params[k] << " vs " << mine[k];
    }
  }
}

TEST_F(ApiThreadsTest, SlowMoLocalSgdAveragesEveryFewStepsAsFairscale) {
  const auto options = concord::SlowMoOptions()
                           .localsgd_frequency(2)
                           .slowmo_lr(1.0)
                           .slowmo_momentum(0.0);
  // 5 steps: the last one local, so the ranks end apart.
  const SlowMoRun run = RunSlowMoJob(address(), "localsgd", options, 5);
  ExpectSlowMoArithmetic(run, options, 5);
  ASSERT_EQ(run.finals.size(), 3u);
  EXPECT_FALSE(run.finals.at(0)[0].equal(run.finals.at(1)[0]));
}

TEST_F(ApiThreadsTest, SlowMoTakesSlowMomentumStepsAsFairscale) {
  const auto options = concord::SlowMoOptions()
                           .localsgd_frequency(2)
                           .slowmo_frequency(4)
                           .slowmo_lr(0.8)
                           .slowmo_momentum(0.5);
  const SlowMoRun run = RunSlowMoJob(address(), "slowmo", options, 8);
  ExpectSlowMoArithmetic(run, options, 8);
}

// SlowMo in run_elastic: a worker leaves; the survivors take the SlowMo
// state over (its shards re-made from owners and replicas), go on, and end
// equal after the last average.
TEST_F(ApiThreadsTest, SlowMoGoesOnAfterAWorkerLeaves) {
  std::mutex mu;
  std::vector<std::vector<torch::Tensor>> survivors;
  RunJobThreads(
      address(), "slowmo-elastic", 3,
      [&](int i, concord::Job& job) {
        Net net;
        concord::DistributedDataParallel ddp(
            net, job,
            concord::DdpOptions().slowmo(
                concord::SlowMoOptions().localsgd_frequency(2).slowmo_frequency(
                    4)));
        torch::optim::SGD opt(ddp->parameters(), kSlowMoLr);
        concord::ElasticState state(ddp, opt);
        struct Leave {};
        try {
          concord::run_elastic(state, [&] {
            for (int64_t t = state.step(); t < 12; t = state.step()) {
              if (i == 2 && t == 5) throw Leave{};
              opt.zero_grad();
              SlowMoLoss(ddp->forward(SlowMoBatch(job.rank(), t))).backward();
              opt.step();
              state.commit();
              ddp->perform_slowmo(opt);
            }
          });
        } catch (const Leave&) {
          job.finish(false, "test: worker 2 leaves");
          return;
        }
        EXPECT_EQ(job.world_size(), 2);
        EXPECT_GE(state.reforms(), 1);
        std::lock_guard<std::mutex> lock(mu);
        survivors.emplace_back();
        for (const auto& p : net->parameters()) {
          survivors.back().push_back(p.detach().clone());
        }
        job.finish();
      },
      /*min=*/2);
  ASSERT_EQ(survivors.size(), 2u);
  for (size_t k = 0; k < survivors[0].size(); ++k) {
    EXPECT_TRUE(survivors[0][k].equal(survivors[1][k]));
  }
}

}  // namespace
