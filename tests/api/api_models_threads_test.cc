// Real programs on the public API, workers as threads (job_threads.h): a
// GAN-like step with two models and two optimizers in one ElasticState
// through a re-form, an optimizer that steps before a later collective of
// its step put back after a failure, a step that keeps failing ending the
// loop, a DataLoader with workers over an ElasticSampler across a re-form,
// and the library's log on standard error.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "job_threads.h"

namespace {

using concord::testing::RunJobThreads;
using ModelsThreadsTest = concord::testing::JobThreadsTest;

struct GeneratorImpl : torch::nn::Module {
  GeneratorImpl()
      : fc1(register_module("fc1", torch::nn::Linear(2, 4))),
        bn(register_module("bn", torch::nn::BatchNorm1d(4))),
        fc2(register_module("fc2", torch::nn::Linear(4, 3))) {}
  torch::Tensor forward(const torch::Tensor& z) {
    return torch::tanh(fc2->forward(torch::relu(bn->forward(fc1->forward(z)))));
  }
  torch::nn::Linear fc1;
  torch::nn::BatchNorm1d bn;
  torch::nn::Linear fc2;
};
TORCH_MODULE(Generator);

// A plain module, no TORCH_MODULE holder: DDP takes a std::shared_ptr.
struct Discriminator : torch::nn::Module {
  Discriminator()
      : fc1(register_module("fc1", torch::nn::Linear(3, 4))),
        bn(register_module("bn", torch::nn::BatchNorm1d(4))),
        fc2(register_module("fc2", torch::nn::Linear(4, 1))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return torch::sigmoid(fc2->forward(torch::leaky_relu(
                              bn->forward(fc1->forward(x)), 0.2)))
        .view({-1});
  }
  torch::nn::Linear fc1;
  torch::nn::BatchNorm1d bn;
  torch::nn::Linear fc2;
};

// Sample i's real point and noise: functions of i only, so that a step
// taken again after a re-form is the same computation.
torch::Tensor Real(const std::vector<size_t>& indices, size_t n) {
  std::vector<float> v;
  for (size_t i : indices) {
    v.push_back(static_cast<float>(i) / n);
    v.push_back(static_cast<float>(i % 7) / 7);
    v.push_back(static_cast<float>(i % 3) / 3 - 0.5f);
  }
  return torch::tensor(v).view({-1, 3});
}
torch::Tensor Noise(const std::vector<size_t>& indices) {
  std::vector<float> v;
  for (size_t i : indices) {
    v.push_back(std::sin(static_cast<float>(i)));
    v.push_back(std::cos(static_cast<float>(i) * 0.7f));
  }
  return torch::tensor(v).view({-1, 2});
}

// Every parameter of `m`, flattened, in order.
torch::Tensor ParamsOf(const torch::nn::Module& m) {
  std::vector<torch::Tensor> parts;
  for (const auto& p : m.parameters()) parts.push_back(p.detach().flatten());
  return torch::cat(parts);
}

// Where worker 2 leaves the job in step kLeaveStep.
enum class LeaveAt { kNever, kStepStart, kAfterDiscriminatorStep };
constexpr int64_t kLeaveStep = 5;
constexpr size_t kSamples = 60;

struct GanResult {
  // By final rank: the parameters of G, D and the critic (equal on every
  // rank). (Not the BatchNorm statistics: DDP leaves each rank's own last
  // forward in them, after a broadcast from the authoritative rank, which
  // the coordinator picks among equals by who joined first.)
  std::map<int, torch::Tensor> params;
  std::map<int64_t, std::multiset<size_t>> committed;  // epoch -> samples
  std::vector<int64_t> reforms;
  // Per survivor: the critic's comm hook's calls after the re-form, and
  // the steps taken after it.
  std::vector<std::pair<int64_t, int64_t>> hook_calls_after_reform;
};

// DCGAN's step on a 2-D toy (the discriminator's real and fake backwards,
// its optimizer, then the generator's step through it), plus a critic that
// is a third DistributedDataParallel the state is never told about by
// name, with a comm hook of the program's (PyTorch's allreduce_hook).
// Three workers, two epochs; worker 2 leaves as `leave` says.
GanResult TrainGan(const std::string& address, const std::string& job_id,
                   LeaveAt leave) {
  GanResult result;
  std::mutex mu;
  RunJobThreads(
      address, job_id, 3,
      [&](int i, concord::Job& job) {
        // The same weights on every worker and in every run (the global
        // generator under a lock), whichever worker becomes rank 0.
        std::unique_lock<std::mutex> init(mu);
        torch::manual_seed(11);
        Generator g;
        auto d = std::make_shared<Discriminator>();
        torch::nn::Linear c(3, 1);
        init.unlock();
        concord::DistributedDataParallel generator(g, job);
        concord::DistributedDataParallel discriminator(d, job);
        concord::DistributedDataParallel critic(c, job);
        torch::optim::SGD g_opt(generator->parameters(),
                                torch::optim::SGDOptions(0.05).momentum(0.9));
        torch::optim::SGD d_opt(discriminator->parameters(),
                                torch::optim::SGDOptions(0.05).momentum(0.9));
        torch::optim::SGD c_opt(critic->parameters(), 0.01);
        struct HookCalls {
          bool reformed = false;
          int64_t after_reform = 0;
        };
        auto calls = std::make_shared<HookCalls>();
        critic->register_comm_hook(
            calls, [](HookCalls& h, concord::GradBucket& bucket) {
              if (h.reformed) ++h.after_reform;
              concord::ProcessGroup& group = bucket.process_group();
              return group.allreduce(bucket.buffer().div_(group.size()));
            });
        concord::ElasticSampler sampler(
            kSamples, job, concord::ElasticSamplerOptions().shuffle(false));
        concord::ElasticState state(job);
        state.add("generator", generator)
            .add("discriminator", discriminator)
            .add("generator_optimizer", g_opt)
            .add("discriminator_optimizer", d_opt)
            .add("critic_optimizer", c_opt)
            .add(sampler);
        int64_t reformed_at = -1;
        state.on_reset([&](const concord::ResetInfo& info) {
          calls->reformed = true;
          reformed_at = info.step;
        });
        struct Leave {};
        auto leaves = [&](LeaveAt where) {
          return i == 2 && leave == where && state.step() + 1 == kLeaveStep;
        };
        try {
          concord::run_elastic(state, [&] {
            for (; state.epoch() < 2; state.next_epoch()) {
              while (auto batch = sampler.next(2)) {
                if (leaves(LeaveAt::kStepStart)) throw Leave{};
                const auto n = static_cast<int64_t>(batch->size());
                d_opt.zero_grad();
                torch::binary_cross_entropy(
                    discriminator->forward(Real(*batch, kSamples)),
                    torch::full({n}, 0.9))
                    .backward();
                auto fake = generator->forward(Noise(*batch));
                torch::binary_cross_entropy(
                    discriminator->forward(fake.detach()), torch::zeros({n}))
                    .backward();
                d_opt.step();
                if (leaves(LeaveAt::kAfterDiscriminatorStep)) throw Leave{};
                g_opt.zero_grad();
                torch::binary_cross_entropy(discriminator->forward(fake),
                                            torch::ones({n}))
                    .backward();
                g_opt.step();
                c_opt.zero_grad();
                critic->forward(fake.detach()).pow(2).mean().backward();
                c_opt.step();
                const int64_t epoch = state.epoch();
                state.commit();
                std::lock_guard<std::mutex> lock(mu);
                result.committed[epoch].insert(batch->begin(), batch->end());
              }
            }
          });
        } catch (const Leave&) {
          job.finish(false, "test: worker 2 leaves");
          return;
        }
        std::lock_guard<std::mutex> lock(mu);
        result.params[job.rank()] =
            torch::cat({ParamsOf(*g), ParamsOf(*d), ParamsOf(*c)});
        result.reforms.push_back(state.reforms());
        result.hook_calls_after_reform.emplace_back(calls->after_reform,
                                                    state.step() - reformed_at);
        job.finish();
      },
      /*min=*/2);
  return result;
}

void ExpectEveryEpochOnce(const GanResult& r) {
  ASSERT_EQ(r.committed.size(), 2u);
  for (const auto& [epoch, samples] : r.committed) {
    EXPECT_EQ(samples.size(), kSamples) << "epoch " << epoch;
    EXPECT_EQ(std::set<size_t>(samples.begin(), samples.end()).size(), kSamples)
        << "epoch " << epoch;
  }
}

// Worker 2 leaves at the start of a step: the survivors' step agreement
// fails, every module (the unnamed critic too, with its comm hook) is
// rebound and all three optimizers follow the authoritative rank; they end
// equal, having trained every sample once per epoch.
TEST_F(ModelsThreadsTest, TwoModelsAndTheirOptimizersGoOnAfterAWorkerLeaves) {
  GanResult r = TrainGan(address(), "gan-leave", LeaveAt::kStepStart);
  ASSERT_EQ(r.params.size(), 2u);
  EXPECT_TRUE(r.params[0].equal(r.params[1]));
  EXPECT_EQ(r.reforms, (std::vector<int64_t>{1, 1}));
  ExpectEveryEpochOnce(r);
  // The program's hook was kept: called once a step on the new group.
  for (const auto& [calls, steps] : r.hook_calls_after_reform) {
    EXPECT_GT(steps, 10);
    EXPECT_EQ(calls, steps);
  }
}

// See Note [Early optimizer steps]: worker 2 leaves after the discriminator's
// optimizer stepped, before the generator's collectives; the survivors'
// step fails there, the discriminator and its momentum are put back, and
// the step is taken again in the 2-worker generation. The result is bit
// for bit that of a leave before the step began: the discriminator's
// update of that step was applied once.
TEST_F(ModelsThreadsTest, AnOptimizerThatSteppedBeforeAFailureIsPutBack) {
  GanResult early = TrainGan(address(), "gan-start", LeaveAt::kStepStart);
  GanResult late =
      TrainGan(address(), "gan-after-d", LeaveAt::kAfterDiscriminatorStep);
  ASSERT_EQ(early.params.size(), 2u);
  ASSERT_EQ(late.params.size(), 2u);
  EXPECT_TRUE(late.params[0].equal(late.params[1]));
  EXPECT_EQ(late.reforms, (std::vector<int64_t>{1, 1}));
  for (int rank : {0, 1}) {
    EXPECT_TRUE(late.params[rank].equal(early.params[rank]))
        << "rank " << rank << ": max difference "
        << (late.params[rank] - early.params[rank]).abs().max().item<float>();
  }
  ExpectEveryEpochOnce(late);
}

// See Note [Re-form loops]: a step whose retryable error comes back after every
// re-form (nobody left, nothing committed) ends run_elastic after
// max_repeated_failures re-forms with one line naming the step and the
// error, and the job's status shows it.
TEST_F(ModelsThreadsTest, AStepThatKeepsFailingEndsTheLoopWithOneLine) {
  std::mutex mu;
  std::vector<std::string> errors;
  std::vector<int64_t> reforms;
  const auto start = std::chrono::steady_clock::now();
  RunJobThreads(address(), "loop", 2, [&](int, concord::Job& job) {
    torch::manual_seed(3);
    torch::nn::Linear net(4, 1);
    concord::DistributedDataParallel ddp(net, job);
    torch::optim::SGD opt(ddp->parameters(), 0.1);
    concord::ElasticState state(
        ddp, opt, concord::ElasticStateOptions().max_repeated_failures(2));
    try {
      concord::run_elastic(state, [&] {
        for (;;) {
          opt.zero_grad();
          ddp->forward(torch::ones({2, 4})).sum().backward();
          if (state.step() == 2) {
            throw concord::Error(concord::ErrorCode::kUnavailable,
                                 "test: the data service is down");
          }
          opt.step();
          state.commit();
        }
      });
    } catch (const concord::Error& e) {
      std::lock_guard<std::mutex> lock(mu);
      errors.push_back(std::string(e.what()) + " [code " +
                       std::to_string(static_cast<int>(e.code())) + "]");
      reforms.push_back(state.reforms());
    }
  });
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  ASSERT_EQ(errors.size(), 2u);
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("FAILED_PRECONDITION"), std::string::npos) << e;
    EXPECT_NE(e.find("step 3 failed 3 times"), std::string::npos) << e;
    EXPECT_NE(e.find("test: the data service is down"), std::string::npos) << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
  EXPECT_EQ(reforms, (std::vector<int64_t>{2, 2}));
  EXPECT_LT(seconds, 60) << "bounded: two re-forms and 0.2 s of back-off";
  // The job's status: each worker's leave names the error.
  const std::string command = std::string(CONCORD_CONCORDCTL_BIN) +
                              " --endpoint " + address() + " --token-file " +
                              dir_ + "/operator.token -o json status loop";
  FILE* pipe = popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string status;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof(buf), pipe)) status.append(buf, n);
  EXPECT_EQ(pclose(pipe), 0) << status;
  EXPECT_NE(status.find("step 3 failed 3 times"), std::string::npos) << status;
}

// A DistributedDataParallel made inside run_elastic's loop lives in one
// generation: used after a re-form it is one line naming it, never a
// re-form loop.
TEST_F(ModelsThreadsTest, AModuleMadeInsideTheLoopIsAnErrorAfterAReform) {
  std::mutex mu;
  std::vector<std::string> errors;
  RunJobThreads(
      address(), "inside", 3,
      [&](int i, concord::Job& job) {
        torch::manual_seed(1);
        torch::nn::Linear net(4, 1), late_net(4, 1);
        concord::DistributedDataParallel ddp(net, job);
        torch::optim::SGD opt(ddp->parameters(), 0.1);
        concord::ElasticState state(ddp, opt);
        std::optional<concord::DistributedDataParallel<torch::nn::Linear>> late;
        struct Leave {};
        try {
          concord::run_elastic(state, [&] {
            for (int k = 0; k < 20; ++k) {
              if (i == 2 && state.step() == 3) throw Leave{};
              if (!late) late.emplace(late_net, job);
              opt.zero_grad();
              ddp->forward(torch::ones({2, 4})).sum().backward();
              (*late)->forward(torch::ones({2, 4})).sum().backward();
              opt.step();
              state.commit();
            }
          });
          ADD_FAILURE() << "worker " << i << " trained on";
        } catch (const Leave&) {
          job.finish(false, "test: worker 2 leaves");
        } catch (const concord::Error& e) {
          std::lock_guard<std::mutex> lock(mu);
          errors.push_back(e.what());
        }
      },
      /*min=*/2);
  ASSERT_EQ(errors.size(), 2u);
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("FAILED_PRECONDITION"), std::string::npos) << e;
    EXPECT_NE(e.find("'ddp2'"), std::string::npos) << e;
    EXPECT_NE(e.find("made while run_elastic ran"), std::string::npos) << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
}

// A dataset whose example i is i itself: the batches say which samples the
// loop trained on.
struct Indices : torch::data::datasets::Dataset<Indices> {
  explicit Indices(size_t n) : n(n) {}
  torch::data::Example<> get(size_t i) override {
    return {torch::full({4}, static_cast<float>(i)),
            torch::tensor(static_cast<int64_t>(i))};
  }
  torch::optional<size_t> size() const override { return n; }
  size_t n;
};

// See Note [Prefetching loaders]: LibTorch's DataLoader with two workers over
// an ElasticSampler asks for windows ahead of the loop; worker 2 leaves
// mid-epoch, the survivors' loop starts again (with batches in flight) and
// goes on from the commit: every sample of each epoch trained once.
TEST_F(ModelsThreadsTest, ALoaderWithWorkersGoesOnFromTheCommitAfterAReform) {
  constexpr size_t kN = 64;
  std::mutex mu;
  std::map<int64_t, std::multiset<int64_t>> committed;
  std::vector<int64_t> reforms;
  RunJobThreads(
      address(), "loader", 3,
      [&](int i, concord::Job& job) {
        torch::manual_seed(5);
        torch::nn::Linear net(4, 1);
        concord::DistributedDataParallel ddp(net, job);
        torch::optim::SGD opt(ddp->parameters(), 0.001);
        concord::ElasticSampler sampler(kN, job);
        auto loader = torch::data::make_data_loader(
            Indices(kN).map(torch::data::transforms::Stack<>()), sampler,
            torch::data::DataLoaderOptions().batch_size(2).workers(2));
        concord::ElasticState state(ddp, opt, sampler);
        struct Leave {};
        try {
          concord::run_elastic(state, [&] {
            for (; state.epoch() < 2; state.next_epoch()) {
              for (auto& batch : *loader) {
                if (i == 2 && state.step() == 4) throw Leave{};
                opt.zero_grad();
                ddp->forward(batch.data).sum().backward();
                opt.step();
                const int64_t epoch = state.epoch();
                state.commit();
                std::lock_guard<std::mutex> lock(mu);
                for (int64_t k = 0; k < batch.target.numel(); ++k) {
                  committed[epoch].insert(batch.target[k].item<int64_t>());
                }
              }
            }
          });
        } catch (const Leave&) {
          job.finish(false, "test: worker 2 leaves");
          return;
        }
        std::lock_guard<std::mutex> lock(mu);
        reforms.push_back(state.reforms());
        job.finish();
      },
      /*min=*/2);
  EXPECT_EQ(reforms, (std::vector<int64_t>{1, 1}));
  ASSERT_EQ(committed.size(), 2u);
  for (const auto& [epoch, samples] : committed) {
    EXPECT_EQ(samples.size(), kN) << "epoch " << epoch;
    EXPECT_EQ(std::set<int64_t>(samples.begin(), samples.end()).size(), kN)
        << "epoch " << epoch;
  }
}

// Unordered delivery cannot say which windows the loop took: refused when
// the loader is made, with one line.
TEST_F(ModelsThreadsTest, AnUnorderedLoaderWithWorkersIsRefused) {
  RunJobThreads(address(), "unordered", 1, [&](int, concord::Job& job) {
    concord::ElasticSampler sampler(8, job);
    try {
      auto loader = torch::data::make_data_loader(
          Indices(8).map(torch::data::transforms::Stack<>()), sampler,
          torch::data::DataLoaderOptions()
              .batch_size(2)
              .workers(2)
              .enforce_ordering(false));
      ADD_FAILURE() << "made";
    } catch (const concord::Error& e) {
      EXPECT_EQ(e.code(), concord::ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("enforce_ordering"),
                std::string::npos);
    }
    job.finish();
  });
}

// Standard output and error of this process, into files while it lives.
// (gtest's CaptureStdout flushes every FILE, which waits on the
// coordinator's output pipe that another thread reads: by hand instead.)
class Redirected {
 public:
  explicit Redirected(const std::string& dir)
      : out_path_(dir + "/stdout"), err_path_(dir + "/stderr") {
    fflush(stdout);
    fflush(stderr);
    saved_out_ = dup(STDOUT_FILENO);
    saved_err_ = dup(STDERR_FILENO);
    Point(out_path_, STDOUT_FILENO);
    Point(err_path_, STDERR_FILENO);
  }
  // Puts the streams back; what went to each.
  std::pair<std::string, std::string> Finish() {
    fflush(stdout);
    fflush(stderr);
    dup2(saved_out_, STDOUT_FILENO);
    dup2(saved_err_, STDERR_FILENO);
    close(saved_out_);
    close(saved_err_);
    return {Read(out_path_), Read(err_path_)};
  }

 private:
  static void Point(const std::string& path, int fd) {
    const int file = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    dup2(file, fd);
    close(file);
  }
  static std::string Read(const std::string& path) {
    std::ifstream in(path);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  std::string out_path_, err_path_;
  int saved_out_ = -1, saved_err_ = -1;
};

// See Note [Library logging]: what the library says goes to standard error,
// never to the program's standard output.
TEST_F(ModelsThreadsTest, TheLibraryLogsToStandardErrorOnly) {
  Redirected streams(dir_);
  {
    concord::Job job(concord::testing::WorkerOptions(address(), "log", 0, 1)
                         .log_level("info"));
    job.finish();
  }
  const auto [out, err] = streams.Finish();
  EXPECT_EQ(out, "");
  EXPECT_NE(err.find("joined job 'log' generation 1"), std::string::npos)
      << err;
}

}  // namespace
