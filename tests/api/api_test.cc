// The public API through libconcord.so, with nothing but
// <concord/concord.h> and LibTorch: a world of one (no coordinator), the
// errors bad options get, DDP as a module holder around C++-frontend and
// TorchScript modules. (Several ranks: the examples under concord-run,
// tests/integration/test_find_package.py.)
#include <ATen/CPUGeneratorImpl.h>
#include <concord/concord.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "api_test_util.h"

namespace {

using concord_test::CodeOf;
using concord_test::Net;
using concord_test::TwoInputs;

using std::chrono::milliseconds;

TEST(ErrorTest, CarriesItsCodeAndPrintsItsName) {
  const concord::Error e(concord::ErrorCode::kAborted, "peer 3 went away");
  EXPECT_EQ(e.code(), concord::ErrorCode::kAborted);
  EXPECT_EQ(e.message(), "peer 3 went away");
  EXPECT_STREQ(e.what(), "ABORTED: peer 3 went away");
  EXPECT_TRUE(e.retryable());
  EXPECT_FALSE(
      concord::Error(concord::ErrorCode::kInvalidArgument, "x").retryable());
  const std::runtime_error& base = e;  // catchable as std::runtime_error
  EXPECT_STREQ(base.what(), e.what());
}

TEST(JobTest, AloneItIsAWorldOfOneOnTheCpu) {
  concord::Job job;
  EXPECT_EQ(job.rank(), 0);
  EXPECT_EQ(job.world_size(), 1);
  EXPECT_EQ(job.local_rank(), 0);
  EXPECT_EQ(job.authoritative_rank(), 0);
  EXPECT_FALSE(job.elastic());
  EXPECT_EQ(job.device(), c10::Device(c10::kCPU));
  EXPECT_EQ(job.backend(), "gloo");
  // Every timeout is in force with the documented default.
  EXPECT_EQ(job.timeouts().rendezvous(), milliseconds(300000));
  EXPECT_EQ(job.timeouts().collective(), milliseconds(300000));
  EXPECT_EQ(job.timeouts().heartbeat_interval(), milliseconds(1000));
  EXPECT_EQ(job.timeouts().heartbeat_timeout(), milliseconds(10000));
  job.report_progress(3, 12.5, 0.25);
  job.finish();
  job.finish();  // idempotent
}

TEST(JobTest, TimeoutsSetOnceAreTheOnesInForce) {
  concord::Job job(
      concord::JobOptions().timeouts(concord::Timeouts()
                                         .collective(milliseconds(1500))
                                         .rendezvous(milliseconds(2500))));
  EXPECT_EQ(job.timeouts().collective(), milliseconds(1500));
  EXPECT_EQ(job.timeouts().rendezvous(), milliseconds(2500));
  EXPECT_EQ(job.timeouts().heartbeat_interval(), milliseconds(1000));
}

TEST(JobTest, BadOptionsAreOneLineErrors) {
  using concord::ErrorCode;
  using concord::JobOptions;
  auto join = [](JobOptions o) { return [o] { concord::Job job(o); }; };
  EXPECT_EQ(CodeOf(join(JobOptions().device("tpu"))),
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(CodeOf(join(JobOptions().backend("mpi"))),
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(CodeOf(join(JobOptions().min_workers(3).max_workers(2))),
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(CodeOf(join(JobOptions().min_workers(0))),
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(CodeOf(join(JobOptions().stragglers("kick"))),
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(CodeOf(join(JobOptions().straggler_cooldown(milliseconds(0)))),
            ErrorCode::kInvalidArgument);
  EXPECT_NO_THROW(join(JobOptions().stragglers("evict").straggler_cooldown(
      milliseconds(5000)))());
  EXPECT_EQ(CodeOf(join(JobOptions().timeouts(
                concord::Timeouts().collective(milliseconds(0))))),
            ErrorCode::kInvalidArgument);
  // A heartbeat timeout not above the interval in force (the default 1 s).
  EXPECT_EQ(CodeOf(join(JobOptions().timeouts(
                concord::Timeouts().heartbeat_timeout(milliseconds(1000))))),
            ErrorCode::kInvalidArgument);
  // An interval of the environment's that the options' timeout lifts is
  // the pair in force, not refused.
  setenv("CONCORD_HEARTBEAT_INTERVAL_MS", "20000", 1);
  EXPECT_NO_THROW(concord::Job(JobOptions().timeouts(
      concord::Timeouts().heartbeat_timeout(milliseconds(60000)))));
  unsetenv("CONCORD_HEARTBEAT_INTERVAL_MS");
  EXPECT_EQ(CodeOf(join(JobOptions().coordinator("127.0.0.1:1"))),
            ErrorCode::kInvalidArgument);  // no token
  EXPECT_EQ(CodeOf(join(JobOptions().job_id(""))), ErrorCode::kInvalidArgument);
  EXPECT_EQ(CodeOf(join(JobOptions().log_level("loud"))),
            ErrorCode::kInvalidArgument);
  setenv("CONCORD_LOG_LEVEL", "loud", 1);
  EXPECT_EQ(CodeOf(join(JobOptions())), ErrorCode::kInvalidArgument);
  setenv("CONCORD_LOG_LEVEL", "warn", 1);
  EXPECT_NO_THROW(join(JobOptions())());
  unsetenv("CONCORD_LOG_LEVEL");
  using concord::CheckpointOptions;
  EXPECT_EQ(CodeOf(join(JobOptions().checkpoints(
                CheckpointOptions().dir("/tmp/concord-ckpt-test")))),
            ErrorCode::kInvalidArgument);  // no `every`
  EXPECT_EQ(
      CodeOf(join(JobOptions().checkpoints(CheckpointOptions().every(5)))),
      ErrorCode::kInvalidArgument);  // no dir
  EXPECT_EQ(
      CodeOf(join(JobOptions().checkpoints(
          CheckpointOptions().dir("/tmp/concord-ckpt-test").every(5).keep(0)))),
      ErrorCode::kInvalidArgument);
  setenv("CONCORD_CHECKPOINT_EVERY", "often", 1);
  EXPECT_EQ(CodeOf(join(JobOptions())), ErrorCode::kInvalidArgument);
  unsetenv("CONCORD_CHECKPOINT_EVERY");
  if (!torch::cuda::is_available()) {
    EXPECT_EQ(CodeOf(join(JobOptions().device("cuda:0"))),
              ErrorCode::kFailedPrecondition);
  }
}

// The message of the concord::Error `f` throws ("" when it throws none).
std::string MessageOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const concord::Error& e) {
    return e.message();
  }
  return "";
}

TEST(JobPlanTest, ItIsWhatTheJobIsWithoutJoining) {
  const concord::JobPlan plan = concord::plan_job();
  concord::Job job;
  EXPECT_EQ(plan.device, job.device());
  EXPECT_EQ(plan.backend, job.backend());
  EXPECT_TRUE(plan.device_note.empty());
  EXPECT_EQ(plan.elastic, job.elastic());
  EXPECT_EQ(plan.job_id, "default");
  EXPECT_EQ(plan.worker_id, job.worker_id());
  EXPECT_EQ(plan.local_rank, job.local_rank());
  EXPECT_EQ(plan.min_workers, job.min_workers());
  EXPECT_EQ(plan.max_workers, job.max_workers());
  EXPECT_TRUE(plan.trace_file.empty());
  EXPECT_EQ(plan.timeouts.rendezvous(), job.timeouts().rendezvous());
  EXPECT_EQ(plan.timeouts.collective(), job.timeouts().collective());
  EXPECT_EQ(plan.timeouts.hang(), job.timeouts().hang());
  job.finish();
  // The options over the environment; no file is made.
  setenv("CONCORD_MAX_WORKERS", "4", 1);
  setenv("CONCORD_TRACE_FILE", "/nonexistent-concord-dir/t.json", 1);
  const concord::JobPlan set = concord::plan_job(
      concord::JobOptions().min_workers(2).job_id("planned").timeouts(
          concord::Timeouts().collective(milliseconds(1500))));
  unsetenv("CONCORD_MAX_WORKERS");
  unsetenv("CONCORD_TRACE_FILE");
  EXPECT_EQ(set.min_workers, 2);
  EXPECT_EQ(set.max_workers, 4);
  EXPECT_EQ(set.job_id, "planned");
  EXPECT_EQ(set.trace_file, "/nonexistent-concord-dir/t.json");
  EXPECT_EQ(set.timeouts.collective(), milliseconds(1500));
}

TEST(JobPlanTest, ItRefusesWhatTheJobWouldNamingTheSource) {
  using concord::ErrorCode;
  using concord::JobOptions;
  auto plan = [](JobOptions o) { return [o] { concord::plan_job(o); }; };
  auto join = [](JobOptions o) { return [o] { concord::Job job(o); }; };
  EXPECT_EQ(CodeOf(plan(JobOptions().device("tpu"))),
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(MessageOf(plan(JobOptions().device("tpu")))
                .rfind("JobOptions::device: ", 0),
            0u);
  EXPECT_EQ(CodeOf(plan(JobOptions().min_workers(3).max_workers(2))),
            ErrorCode::kInvalidArgument);
  // A device or backend that is not there: where the request came from,
  // then the request; the same from Job's constructor.
  const auto on_cpu = JobOptions().backend("nccl");
  EXPECT_EQ(CodeOf(plan(on_cpu)), ErrorCode::kFailedPrecondition);
  EXPECT_EQ(MessageOf(plan(on_cpu)),
            "JobOptions::backend nccl needs a CUDA device; this worker's is "
            "cpu");
  EXPECT_EQ(MessageOf(join(on_cpu)), MessageOf(plan(on_cpu)));
  setenv("CONCORD_BACKEND", "nccl", 1);
  EXPECT_EQ(MessageOf(plan(JobOptions())),
            "CONCORD_BACKEND: backend nccl needs a CUDA device; this "
            "worker's is cpu");
  unsetenv("CONCORD_BACKEND");
  if (torch::cuda::is_available()) return;
  EXPECT_EQ(CodeOf(plan(JobOptions().device("cuda:1"))),
            ErrorCode::kFailedPrecondition);
  EXPECT_EQ(
      MessageOf(plan(JobOptions().device("cuda:1")))
          .rfind("JobOptions::device cuda:1: no CUDA device is visible", 0),
      0u);
  EXPECT_EQ(MessageOf(join(JobOptions().device("cuda:1"))),
            MessageOf(plan(JobOptions().device("cuda:1"))));
  setenv("CONCORD_DEVICE", "cuda", 1);
  EXPECT_EQ(MessageOf(plan(JobOptions()))
                .rfind("CONCORD_DEVICE: device cuda: no CUDA device", 0),
            0u);
  // `auto` falls back to the CPU, and says so once, naming the source.
  setenv("CONCORD_DEVICE", "auto", 1);
  const concord::JobPlan fallback = concord::plan_job();
  unsetenv("CONCORD_DEVICE");
  EXPECT_EQ(fallback.device, c10::Device(c10::kCPU));
  EXPECT_EQ(fallback.backend, "gloo");
  EXPECT_EQ(fallback.device_note.rfind("CONCORD_DEVICE: device auto: ", 0), 0u)
      << fallback.device_note;
  EXPECT_NE(fallback.device_note.find("training on the CPU"),
            std::string::npos);
  EXPECT_EQ(concord::plan_job(JobOptions().device("auto"))
                .device_note.rfind("JobOptions::device auto: ", 0),
            0u);
}

TEST(ZeroGradTest, ZeroesOrDropsTheGradientsWithEveryLibTorch) {
  Net net;
  torch::optim::SGD optimizer(net->parameters(), 0.1);
  net->forward(torch::ones({2, 4})).sum().backward();
  concord::zero_grad(optimizer, /*set_to_none=*/false);
  for (const auto& p : net->parameters()) {
    ASSERT_TRUE(p.grad().defined());
    EXPECT_EQ(p.grad().abs().sum().item<double>(), 0);
  }
  net->forward(torch::ones({2, 4})).sum().backward();
  concord::zero_grad(optimizer, /*set_to_none=*/true);
  for (const auto& p : net->parameters()) EXPECT_FALSE(p.grad().defined());
}

// A second Net with `net`'s parameters.
Net CopyOf(const Net& net) {
  Net copy;
  torch::NoGradGuard no_grad;
  auto src = net->parameters();
  auto dst = copy->parameters();
  for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
  return copy;
}

// One rank: DDP's allreduce averages over one, so DDP trains exactly as the
// module alone does.
TEST(DistributedDataParallelTest, AloneItTrainsAsTheModuleAlone) {
  concord::Job job;
  torch::manual_seed(7);
  Net plain;
  Net wrapped = CopyOf(plain);
  concord::DistributedDataParallel ddp(wrapped, job,
                                       concord::DdpOptions().bucket_cap_mb(1));
  EXPECT_EQ(ddp->parameters().size(), plain->parameters().size());
  EXPECT_EQ(ddp->named_parameters().size(), 4u);
  EXPECT_TRUE(ddp->named_parameters().contains("module.fc1.weight"));
  torch::optim::SGD opt_plain(plain->parameters(), 0.1);
  torch::optim::SGD opt_ddp(ddp->parameters(), 0.1);
  for (int step = 0; step < 3; ++step) {
    auto x = torch::randn({5, 4});
    auto y = torch::randn({5, 1});
    opt_plain.zero_grad();
    opt_ddp.zero_grad();
    torch::mse_loss(plain->forward(x), y).backward();
    torch::mse_loss(ddp->forward(x), y).backward();
    opt_plain.step();
    opt_ddp.step();
  }
  auto a = plain->parameters();
  auto b = ddp->module()->parameters();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i]));
  // ModuleHolder's call operator is forward.
  EXPECT_EQ(ddp(torch::ones({1, 4})).sizes(), torch::IntArrayRef({1, 1}));
}

TEST(DistributedDataParallelTest, NoSyncAccumulatesAndTheNextBackwardReduces) {
  concord::Job job;
  Net net;
  concord::DistributedDataParallel ddp(net, job);
  auto x = torch::ones({2, 4});
  {
    auto guard = ddp->no_sync();
    ddp->forward(x).sum().backward();
  }
  auto after_one = ddp->parameters()[0].grad().clone();
  ddp->forward(x).sum().backward();
  EXPECT_TRUE(torch::allclose(ddp->parameters()[0].grad(), 2 * after_one));
}

TEST(DistributedDataParallelTest, ForwardTakesTheModulesOwnSignature) {
  concord::Job job;
  TwoInputs m;
  concord::DistributedDataParallel ddp(m, job);
  auto out = ddp->forward(torch::ones({3, 2}), 2.0);
  EXPECT_EQ(out.sizes(), torch::IntArrayRef({3, 1}));
  out.sum().backward();
  EXPECT_TRUE(m->fc->weight.grad().defined());
}

TEST(DistributedDataParallelTest, WrapsTorchScriptModules) {
  // ATen's arithmetic, as PyTorch's (the result is exact either way here).
  concord::disable_torchscript_cpu_fusion();
  concord::Job job;
  torch::jit::Module m("Scale");
  m.register_parameter("w", torch::full({3}, 2.0).requires_grad_(),
                       /*is_buffer=*/false);
  m.define(R"(
def forward(self, x):
    return x * self.w
)");
  concord::DistributedDataParallel ddp(m, job);
  ASSERT_EQ(ddp->parameters().size(), 1u);
  auto out = ddp->forward(torch::ones({3})).toTensor();
  EXPECT_TRUE(torch::equal(out, torch::full({3}, 2.0)));
  out.sum().backward();
  EXPECT_TRUE(torch::equal(ddp->parameters()[0].grad(), torch::ones({3})));
  auto listed = ddp->forward({torch::ones({3})}).toTensor();
  EXPECT_TRUE(torch::equal(listed, out));
}

TEST(DistributedDataParallelTest, BadOptionsAreErrorsBeforeAnyCollective) {
  concord::Job job;
  Net net;
  using concord::DdpOptions;
  using concord::ErrorCode;
  auto wrap = [&](DdpOptions o) {
    return [&, o] { concord::DistributedDataParallel ddp(net, job, o); };
  };
  EXPECT_EQ(CodeOf(wrap(DdpOptions().bucket_cap_mb(-1))),
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(CodeOf(wrap(DdpOptions().comm_hook("zip"))),
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(CodeOf(wrap(DdpOptions().params_and_buffers_to_ignore(
                {"no.such.parameter"}))),
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(
      CodeOf(wrap(DdpOptions().comm_hook("fp16").gradient_average(false))),
      ErrorCode::kInvalidArgument);
  EXPECT_EQ(CodeOf(wrap(DdpOptions().gradient_predivide_factor(0))),
            ErrorCode::kInvalidArgument);
}

TEST(DistributedDataParallelTest, ABuiltInCommHookRuns) {
  concord::Job job;
  torch::manual_seed(3);
  Net net;
  concord::DistributedDataParallel ddp(net, job,
                                       concord::DdpOptions().comm_hook("fp16"));
  ddp->forward(torch::ones({2, 4})).sum().backward();
  for (const auto& p : ddp->parameters()) {
    ASSERT_TRUE(p.grad().defined());
    // fp16 round trip: the gradient is representable in half precision.
    EXPECT_TRUE(
        torch::equal(p.grad(), p.grad().to(torch::kHalf).to(torch::kFloat)));
  }
}

// A plain module, no TORCH_MODULE: PyTorch's DDP takes any module, and so
// does Concord's, through a std::shared_ptr.
struct PlainNet : torch::nn::Module {
  PlainNet() : fc(register_module("fc", torch::nn::Linear(4, 2))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc->forward(x); }
  torch::nn::Linear fc;
};

TEST(DistributedDataParallelTest, WrapsAStdSharedPtrOfAPlainModule) {
  concord::Job job;
  auto net = std::make_shared<PlainNet>();
  concord::DistributedDataParallel ddp(net, job);
  EXPECT_EQ(ddp->parameters().size(), 2u);
  EXPECT_TRUE(ddp->named_parameters().contains("module.fc.weight"));
  ddp->forward(torch::ones({3, 4})).sum().backward();
  EXPECT_TRUE(net->fc->weight.grad().defined());
  EXPECT_EQ(ddp->module().get(), net.get());
  EXPECT_EQ(CodeOf([&] {
              concord::DistributedDataParallel empty(
                  std::shared_ptr<PlainNet>(), job);
            }),
            concord::ErrorCode::kInvalidArgument);
}

// register_comm_hook(state, hook): the hook's future's value becomes the
// gradients; its state is the caller's; a `then` callback runs once even
// when the hook waits for the future before returning it.
TEST(DistributedDataParallelTest, AProgramsCommHookWithStateReduces) {
  concord::Job job;
  torch::manual_seed(5);
  Net plain;
  Net wrapped = CopyOf(plain);
  concord::DistributedDataParallel ddp(wrapped, job);
  struct Calls {
    int buckets = 0;
    int thens = 0;
  };
  auto calls = std::make_shared<Calls>();
  ddp->register_comm_hook(calls, [](Calls& c, concord::GradBucket& bucket) {
    ++c.buckets;
    EXPECT_EQ(bucket.process_group().size(), 1);
    EXPECT_EQ(bucket.gradients().size(), bucket.parameters().size());
    auto future = bucket.process_group()
                      .allreduce(bucket.buffer())
                      .then([&c](torch::Tensor sum) {
                        ++c.thens;
                        return sum * 3;
                      });
    future.wait();
    return future;
  });
  auto x = torch::ones({2, 4});
  plain->forward(x).sum().backward();
  ddp->forward(x).sum().backward();
  EXPECT_EQ(calls->buckets, 1);
  EXPECT_EQ(calls->thens, 1);
  auto a = plain->parameters();
  auto b = ddp->parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(torch::equal(b[i].grad(), a[i].grad() * 3));
  }
  // One hook: a second, or one besides DdpOptions::comm_hook, is refused.
  EXPECT_EQ(CodeOf([&] {
              ddp->register_comm_hook([](concord::GradBucket& bucket) {
                return concord::Future::completed(bucket.buffer());
              });
            }),
            concord::ErrorCode::kAlreadyExists);
  Net other;
  concord::DistributedDataParallel with_builtin(
      other, job, concord::DdpOptions().comm_hook("fp16"));
  EXPECT_EQ(CodeOf([&] {
              with_builtin->register_comm_hook([](concord::GradBucket& b) {
                return concord::Future::completed(b.buffer());
              });
            }),
            concord::ErrorCode::kAlreadyExists);
}

// A hook that throws, or returns a value of another size, fails backward
// with one line (the program's bug is not retried as a lost peer would be).
TEST(DistributedDataParallelTest, ABrokenCommHookFailsBackwardWithOneLine) {
  concord::Job job;
  Net net;
  concord::DistributedDataParallel ddp(net, job);
  ddp->register_comm_hook([](concord::GradBucket&) -> concord::Future {
    throw std::runtime_error("boom");
  });
  try {
    ddp->forward(torch::ones({2, 4})).sum().backward();
    ADD_FAILURE() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("communication hook"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("boom"), std::string::npos);
  }
}

// ElasticState::add: names once each, one state a job, nothing after
// run_elastic started; each misuse is one line.
TEST(ElasticStateTest, AddRefusesWhatCannotBeRestored) {
  concord::Job job;
  Net a_net, b_net;
  concord::DistributedDataParallel a(a_net, job), b(b_net, job);
  torch::optim::SGD a_opt(a->parameters(), 0.1), b_opt(b->parameters(), 0.1);
  concord::ElasticSampler sampler(8, job);
  concord::ElasticState state(job);
  state.add("a", a).add("a_opt", a_opt).add(sampler);
  using concord::ErrorCode;
  EXPECT_EQ(CodeOf([&] { state.add("a", b); }), ErrorCode::kAlreadyExists);
  EXPECT_EQ(CodeOf([&] { state.add("a_opt", b_opt); }),
            ErrorCode::kAlreadyExists);
  EXPECT_EQ(CodeOf([&] { state.add("again", a_opt); }),
            ErrorCode::kAlreadyExists);
  EXPECT_EQ(CodeOf([&] { state.add(sampler); }), ErrorCode::kAlreadyExists);
  EXPECT_EQ(CodeOf([&] { state.add("", b_opt); }), ErrorCode::kInvalidArgument);
  EXPECT_EQ(CodeOf([&] { concord::ElasticState second(job); }),
            ErrorCode::kAlreadyExists);
  EXPECT_EQ(CodeOf([&] {
              concord::ElasticState bad(
                  job, concord::ElasticStateOptions().max_repeated_failures(0));
            }),
            ErrorCode::kInvalidArgument);
  concord::Job other;
  concord::ElasticSampler foreign(8, other);
  EXPECT_EQ(CodeOf([&] { state.add(foreign); }), ErrorCode::kAlreadyExists);
  // A generator of the program's own (see Note [Each rank's randomness]).
  at::Generator noise = at::make_generator<at::CPUGeneratorImpl>(3);
  EXPECT_EQ(CodeOf([&] { state.add("u", at::Generator()); }),
            ErrorCode::kInvalidArgument);
  state.add("noise", noise);
  EXPECT_EQ(CodeOf([&] { state.add("noise2", noise); }),
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(CodeOf([&] {
              state.add("noise", at::make_generator<at::CPUGeneratorImpl>(4));
            }),
            ErrorCode::kInvalidArgument);
  state.add("b", b).add("b_opt", b_opt);
  int steps = 0;
  concord::run_elastic(state, [&] {
    while (auto batch = sampler.next(2)) {
      a->forward(torch::ones({2, 4})).sum().backward();
      b->forward(torch::ones({2, 4})).sum().backward();
      a_opt.step();
      b_opt.step();
      state.commit();
      ++steps;
      EXPECT_EQ(CodeOf([&] { state.add("late", b_opt); }),
                ErrorCode::kFailedPrecondition);
      EXPECT_EQ(CodeOf([&] {
                  state.add("late_noise",
                            at::make_generator<at::CPUGeneratorImpl>(5));
                }),
                ErrorCode::kFailedPrecondition);
    }
  });
  EXPECT_EQ(steps, 4);
  EXPECT_EQ(state.step(), 4);
}

std::vector<std::vector<size_t>> Drain(concord::ElasticSampler& sampler,
                                       size_t batch_size) {
  std::vector<std::vector<size_t>> batches;
  while (auto b = sampler.next(batch_size)) batches.push_back(*b);
  return batches;
}

TEST(ElasticSamplerTest, AloneItHandsOutTheEpochInWindowsOfTheBatch) {
  concord::Job job;
  concord::ElasticSampler sampler(
      10, job, concord::ElasticSamplerOptions().shuffle(false));
  const auto batches = Drain(sampler, 3);
  ASSERT_EQ(batches.size(), 4u);
  EXPECT_EQ(batches[0], (std::vector<size_t>{0, 1, 2}));
  EXPECT_EQ(batches[3], (std::vector<size_t>{9}));
  EXPECT_EQ(sampler.position(), 10u);
  // Without a commit, a new loop over it starts the epoch again.
  sampler.reset();
  EXPECT_EQ(sampler.position(), 0u);
  EXPECT_EQ(Drain(sampler, 3), batches);
}

TEST(ElasticSamplerTest, ShufflesAsDistributedSamplerDoes) {
  concord::Job job;
  concord::ElasticSampler sampler(50, job,
                                  concord::ElasticSamplerOptions().seed(7));
  std::vector<size_t> seen;
  for (const auto& b : Drain(sampler, 8))
    seen.insert(seen.end(), b.begin(), b.end());
  // torch.randperm(50, generator=torch.Generator().manual_seed(7 + epoch 0))
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  auto perm = torch::randperm(50, gen, torch::kLong);
  ASSERT_EQ(seen.size(), 50u);
  for (size_t i = 0; i < seen.size(); ++i) {
    EXPECT_EQ(static_cast<int64_t>(seen[i]),
              perm[static_cast<int64_t>(i)].item<int64_t>());
  }
}

TEST(ElasticSamplerTest, SavesAndLoadsItsPosition) {
  concord::Job job;
  concord::ElasticSampler a(20, job);
  a.next(4);
  a.next(4);
  torch::serialize::OutputArchive out;
  a.save(out);
  std::ostringstream bytes;
  out.save_to(bytes);
  concord::ElasticSampler b(20, job);
  torch::serialize::InputArchive in;
  std::istringstream read(bytes.str());
  in.load_from(read);
  b.load(in);
  EXPECT_EQ(b.position(), 8u);
  EXPECT_EQ(Drain(a, 4), Drain(b, 4));
  concord::ElasticSampler other(21, job);
  std::istringstream again(bytes.str());
  torch::serialize::InputArchive in2;
  in2.load_from(again);
  EXPECT_EQ(CodeOf([&] { other.load(in2); }),
            concord::ErrorCode::kInvalidArgument);
}

// The elastic loop of docs/api.md ("An elastic program"), alone: every sample
// once per epoch, one commit per step, and the state the counters say.
TEST(ElasticStateTest, AloneTheLoopTrainsEverySampleOncePerEpoch) {
  concord::Job job;
  torch::manual_seed(1);
  auto data = torch::arange(0, 30, torch::kFloat).unsqueeze(1).repeat({1, 4});
  auto targets = torch::arange(0, 30, torch::kLong);
  auto dataset = torch::data::datasets::TensorDataset(
      torch::stack({data.select(1, 0), targets.to(torch::kFloat)}, 1));
  Net net;
  concord::DistributedDataParallel ddp(net, job);
  torch::optim::SGD opt(ddp->parameters(), 0.001);
  concord::ElasticSampler sampler(30, job);
  auto loader = torch::data::make_data_loader(
      dataset, sampler, torch::data::DataLoaderOptions().batch_size(4));
  concord::ElasticState state(ddp, opt, sampler);
  std::vector<std::multiset<int64_t>> seen(2);
  concord::run_elastic(state, [&] {
    for (; state.epoch() < 2; state.next_epoch()) {
      for (auto& batch : *loader) {
        std::vector<torch::Tensor> rows;
        for (auto& example : batch) {
          seen[static_cast<size_t>(state.epoch())].insert(
              static_cast<int64_t>(example.data[1].item<float>()));
          rows.push_back(example.data[0].repeat({4}));
        }
        opt.zero_grad();
        ddp->forward(torch::stack(rows)).sum().backward();
        opt.step();
        state.commit();
      }
    }
  });
  EXPECT_EQ(state.epoch(), 2);
  EXPECT_EQ(state.step(), 16);  // 8 batches of 4 (the last 2) per epoch
  for (const auto& epoch : seen) {
    ASSERT_EQ(epoch.size(), 30u);
    EXPECT_EQ(std::set<int64_t>(epoch.begin(), epoch.end()).size(), 30u);
  }
  EXPECT_EQ(state.reforms(), 0);
}

TEST(ElasticStateTest, AloneAFailedCollectiveIsThrownNotRetried) {
  concord::Job job;
  Net net;
  concord::DistributedDataParallel ddp(net, job);
  torch::optim::SGD opt(ddp->parameters(), 0.1);
  concord::ElasticState state(ddp, opt);
  int calls = 0;
  EXPECT_EQ(CodeOf([&] {
              concord::run_elastic(state, [&] {
                ++calls;
                throw concord::Error(concord::ErrorCode::kUnavailable,
                                     "peer gone");
              });
            }),
            concord::ErrorCode::kUnavailable);
  EXPECT_EQ(calls, 1);  // a world of one has nobody to re-form with
  EXPECT_EQ(CodeOf([&] { concord::ElasticState again(ddp, opt); }),
            concord::ErrorCode::kAlreadyExists);
}

TEST(JoinTest, AloneJoinEndsTrainingAndMisuseIsAnError) {
  concord::Job job;
  Net net;
  concord::DistributedDataParallel ddp(net, job);
  torch::optim::SGD opt(ddp->parameters(), 0.1);
  // No ElasticState: nothing to agree with.
  EXPECT_EQ(CodeOf([&] { ddp->join(); }),
            concord::ErrorCode::kFailedPrecondition);
  concord::ElasticState state(ddp, opt);
  int steps = 0;
  concord::run_elastic(state, [&] {
    for (; steps < 3; ++steps) {
      opt.zero_grad();
      ddp->forward(torch::ones({2, 4})).sum().backward();
      opt.step();
      if (steps == 2) {
        // A step begun (forward ran) and not committed.
        EXPECT_EQ(CodeOf([&] { ddp->join(); }),
                  concord::ErrorCode::kFailedPrecondition);
      }
      state.commit();
    }
    // The only rank is out of data: training is over (nobody goes on).
    EXPECT_FALSE(ddp->join());
  });
  EXPECT_EQ(state.step(), 3);
  EXPECT_EQ(CodeOf([&] {
              ddp->forward(torch::ones({2, 4}));
            }),
            concord::ErrorCode::kFailedPrecondition);
}

TEST(DdpOptionsTest, ValidateRefusesWhatTheConstructorWouldBeforeJoining) {
  concord::DdpOptions().validate();  // the defaults are fine
  concord::DdpOptions().comm_hook("powersgd:2").bucket_cap_mb(4).validate();
  EXPECT_EQ(CodeOf([] { concord::DdpOptions().comm_hook("nope").validate(); }),
            concord::ErrorCode::kInvalidArgument);
  EXPECT_EQ(CodeOf([] {
              concord::DdpOptions()
                  .delay_allreduce(true)
                  .allreduce_trigger_params({"fc1.weight"})
                  .validate();
            }),
            concord::ErrorCode::kInvalidArgument);
  EXPECT_EQ(CodeOf([] { concord::DdpOptions().bucket_cap_mb(-1).validate(); }),
            concord::ErrorCode::kInvalidArgument);
  EXPECT_EQ(CodeOf([] {
              concord::DdpOptions()
                  .slowmo(concord::SlowMoOptions().sgp_graph("star"))
                  .validate();
            }),
            concord::ErrorCode::kInvalidArgument);
  EXPECT_EQ(CodeOf([] {
              concord::DdpOptions()
                  .slowmo(concord::SlowMoOptions())
                  .comm_hook("fp16")
                  .validate();
            }),
            concord::ErrorCode::kInvalidArgument);
}

// Statistics, the audit of the samples a step takes, and the timeline of a
// job given a trace file: what concord-train reports, through the API.
TEST(ObservabilityTest, StatsSamplesSinceCommitAndTheTimeline) {
  const std::string path = ::testing::TempDir() + "/concord-api-trace-" +
                           std::to_string(::getpid()) + ".json";
  EXPECT_EQ(CodeOf([] {
              concord::Job(concord::JobOptions().trace_file(
                  "/nonexistent/dir/trace.json"));
            }),
            concord::ErrorCode::kInvalidArgument);
  {
    concord::Job job(concord::JobOptions().trace_file(path));
    Net net;
    concord::DistributedDataParallel ddp(net, job);
    torch::optim::SGD opt(ddp->parameters(), 0.01);
    concord::ElasticSampler sampler(
        10, job, concord::ElasticSamplerOptions().shuffle(false));
    concord::ElasticState state(ddp, opt, sampler);
    EXPECT_TRUE(sampler.since_commit().empty());
    std::vector<int64_t> begun;
    state.on_step_begin([&](int64_t step) { begun.push_back(step); });
    std::vector<std::vector<size_t>> consumed;
    concord::run_elastic(state, [&] {
      while (auto indices = sampler.next(4)) {
        consumed.push_back(sampler.since_commit());
        opt.zero_grad();
        ddp->forward(torch::ones({static_cast<int64_t>(indices->size()), 4}))
            .sum()
            .backward();
        {
          concord::TraceScope scope(job, "optimizer");
          opt.step();
        }
        state.commit();
        EXPECT_TRUE(sampler.since_commit().empty());
      }
    });
    // Windows of 4 (a world of one), then the tail.
    ASSERT_EQ(consumed.size(), 3u);
    EXPECT_EQ(consumed[0], (std::vector<size_t>{0, 1, 2, 3}));
    EXPECT_EQ(consumed[1], (std::vector<size_t>{4, 5, 6, 7}));
    EXPECT_EQ(consumed[2], (std::vector<size_t>{8, 9}));
    EXPECT_EQ(begun, (std::vector<int64_t>{1, 2, 3}));
    const concord::DdpStats stats = ddp->stats();
    EXPECT_EQ(stats.iterations, 3);
    ASSERT_FALSE(stats.bucket_bytes.empty());
    ASSERT_FALSE(stats.bucket_params.empty());
    EXPECT_TRUE(state.reform_log().empty());
  }
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  for (const char* name :
       {"step", "forward", "optimizer", "wait for buckets"}) {
    EXPECT_NE(text.str().find(std::string("\"name\":\"") + name + "\""),
              std::string::npos)
        << name << " is not in " << text.str().substr(0, 2000);
  }
  std::remove(path.c_str());
}

// A model with BatchNorm in a container, in a custom module and at the root.
struct BnNetImpl : torch::nn::Module {
  BnNetImpl()
      : seq(register_module("seq",
                            torch::nn::Sequential(torch::nn::Linear(4, 3),
                                                  torch::nn::BatchNorm1d(3)))),
        bn(register_module("bn", concord::SyncBatchNorm(3))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return bn->forward(seq->forward(x));
  }
  torch::nn::Sequential seq;
  concord::SyncBatchNorm bn;  // a typed member: SyncBatchNorm from the start
};
TORCH_MODULE(BnNet);

TEST(PublicSyncBatchNormTest,
     ConvertKeepsTheTensorsAndAloneNormalisesAsBatchNorm) {
  torch::manual_seed(3);
  BnNet net;
  auto old_bn = net->seq[1]->as<torch::nn::BatchNorm1d>();
  ASSERT_NE(old_bn, nullptr);
  torch::Tensor weight = old_bn->weight;
  net = concord::convert_sync_batchnorm(net);
  auto converted = net->seq[1]->as<concord::SyncBatchNorm>();
  ASSERT_NE(converted, nullptr) << "the Sequential's layer was not rebound";
  EXPECT_TRUE(converted->weight.is_same(weight));
  std::ostringstream printed;
  printed << *net;
  EXPECT_NE(printed.str().find("concord::SyncBatchNorm(3"), std::string::npos)
      << printed.str();

  // A world of one: SyncBatchNorm is BatchNorm, through DDP too.
  concord::Job job;
  concord::DistributedDataParallel ddp(net, job);
  auto x = torch::randn({6, 4});
  auto h = net->seq[0]->as<torch::nn::Linear>()->forward(x);
  auto expected = torch::batch_norm(
      torch::batch_norm(h, converted->weight, converted->bias, {}, {}, true,
                        0.1, 1e-5, false),
      net->bn->weight, net->bn->bias, {}, {}, true, 0.1, 1e-5, false);
  EXPECT_TRUE(torch::allclose(ddp->forward(x), expected, 1e-5, 1e-6));

  // The root itself a BatchNorm: its holder cannot hold the conversion.
  torch::nn::BatchNorm2d root(5);
  EXPECT_EQ(CodeOf([&] { concord::convert_sync_batchnorm(root); }),
            concord::ErrorCode::kInvalidArgument);
  auto as_module = concord::convert_sync_batchnorm(root.ptr());
  EXPECT_NE(std::dynamic_pointer_cast<concord::SyncBatchNormImpl>(as_module),
            nullptr);
}

TEST(PublicSlowMoTest, AloneItTrainsAndMisuseIsAnError) {
  concord::Job job;
  Net net;
  const auto slowmo = concord::SlowMoOptions().localsgd_frequency(2);
  EXPECT_EQ(CodeOf([&] {
              concord::DistributedDataParallel bad(
                  net, job,
                  concord::DdpOptions().slowmo(slowmo).comm_hook("fp16"));
            }),
            concord::ErrorCode::kInvalidArgument);
  EXPECT_EQ(CodeOf([&] {
              concord::DistributedDataParallel bad(
                  net, job,
                  concord::DdpOptions().slowmo(
                      concord::SlowMoOptions().sgp_graph("mesh")));
            }),
            concord::ErrorCode::kInvalidArgument);
  EXPECT_EQ(CodeOf([&] {
              concord::DistributedDataParallel bad(
                  net, job,
                  concord::DdpOptions().slowmo(
                      concord::SlowMoOptions().slowmo_momentum(1.5)));
            }),
            concord::ErrorCode::kInvalidArgument);
  {
    concord::DistributedDataParallel plain(net, job);
    torch::optim::SGD opt(plain->parameters(), 0.1);
    EXPECT_EQ(CodeOf([&] { plain->perform_slowmo(opt); }),
              concord::ErrorCode::kFailedPrecondition);
  }

  // A world of one: SlowMo's averages change nothing.
  torch::manual_seed(5);
  Net alone;
  auto expected = alone->parameters();
  for (auto& p : expected) p = p.detach().clone();
  concord::DistributedDataParallel ddp(net, job,
                                       concord::DdpOptions().slowmo(slowmo));
  {
    torch::NoGradGuard no_grad;
    for (size_t k = 0; k < expected.size(); ++k) {
      net->parameters()[k].copy_(expected[k]);
    }
  }
  torch::optim::SGD opt(ddp->parameters(), 0.1);
  torch::optim::SGD ref(alone->parameters(), 0.1);
  concord::ElasticState state(ddp, opt);
  concord::run_elastic(state, [&] {
    for (int step = 0; step < 4; ++step) {
      auto x = torch::full({2, 4}, static_cast<float>(step + 1) / 4);
      opt.zero_grad();
      ddp->forward(x).pow(2).sum().backward();
      opt.step();
      if (step == 0) {
        EXPECT_EQ(CodeOf([&] { ddp->perform_slowmo(opt); }),
                  concord::ErrorCode::kFailedPrecondition);
      }
      state.commit();
      ddp->perform_slowmo(opt);
      ref.zero_grad();
      alone->forward(x).pow(2).sum().backward();
      ref.step();
    }
  });
  for (size_t k = 0; k < expected.size(); ++k) {
    EXPECT_TRUE(net->parameters()[k].allclose(alone->parameters()[k]));
  }
}

}  // namespace
