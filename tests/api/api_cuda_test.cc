// The public API on a GPU, through libconcord.so and <concord/concord.h>
// alone: a world of one over NCCL on cuda:0 (NCCL refuses two ranks on one
// device; several ranks sharing a GPU over Gloo are the examples' gpu tests,
// examples_*_cuda). Without a device every test says "CONCORD_TEST_SKIPPED: no
// CUDA device" (the ctest SKIP_REGULAR_EXPRESSION).
#include <concord/concord.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <utility>

namespace {

// A Sequential, so that convert_sync_batchnorm can rebind its BatchNorm (a
// typed member could not be).
struct NetImpl : torch::nn::Module {
  NetImpl()
      : seq(register_module(
            "seq",
            torch::nn::Sequential(
                torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3).padding(1)),
                torch::nn::BatchNorm2d(8), torch::nn::ReLU(),
                torch::nn::Flatten(), torch::nn::Linear(8 * 6 * 6, 5)))) {}
  torch::Tensor forward(const torch::Tensor& x) { return seq->forward(x); }
  torch::nn::Sequential seq;
};
TORCH_MODULE(Net);

class ApiCudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available())
      GTEST_SKIP() << "CONCORD_TEST_SKIPPED: no CUDA device";
    // Both sides run the same convolutions: cuDNN must pick the same
    // algorithms and no atomics for the results to be equal bit for bit.
    at::globalContext().setDeterministicCuDNN(true);
    at::globalContext().setBenchmarkCuDNN(false);
  }
  static concord::JobOptions OnTheGpu() {
    return concord::JobOptions().device("cuda").backend("nccl");
  }
  // Two nets with the same parameters on `device`: one to train alone,
  // one to wrap.
  static std::pair<Net, Net> Twins(uint64_t seed, torch::Device device) {
    torch::manual_seed(seed);
    Net plain;
    Net wrapped;
    {
      torch::NoGradGuard no_grad;
      auto src = plain->parameters();
      auto dst = wrapped->parameters();
      for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
    }
    plain->to(device);
    wrapped->to(device);
    return {plain, wrapped};
  }
};

TEST_F(ApiCudaTest, TheJobIsOnItsLocalRanksDeviceOverNccl) {
  concord::Job job(OnTheGpu());
  EXPECT_EQ(job.device(), torch::Device(torch::kCUDA, 0));
  EXPECT_EQ(job.backend(), "nccl");
  EXPECT_EQ(job.world_size(), 1);
}

TEST_F(ApiCudaTest, ADeviceThatIsNotThereIsAOneLineError) {
  const std::string missing =
      "cuda:" + std::to_string(torch::cuda::device_count());
  try {
    concord::Job job(concord::JobOptions().device(missing));
    ADD_FAILURE() << "no error for " << missing;
  } catch (const concord::Error& e) {
    EXPECT_EQ(e.code(), concord::ErrorCode::kFailedPrecondition) << e.what();
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
  }
}

// One rank: NCCL's allreduce averages over one, so DDP trains as the module
// does.
TEST_F(ApiCudaTest, DdpOverNcclTrainsAsTheModuleAlone) {
  concord::Job job(OnTheGpu());
  const torch::Device device = job.device();
  auto [plain, wrapped] = Twins(11, device);
  concord::DistributedDataParallel ddp(wrapped, job,
                                       concord::DdpOptions().bucket_cap_mb(1));
  torch::optim::SGD opt_plain(plain->parameters(),
                              torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::SGD opt_ddp(ddp->parameters(),
                            torch::optim::SGDOptions(0.05).momentum(0.9));
  for (int step = 0; step < 4; ++step) {
    auto x = torch::randn({4, 3, 6, 6}, device);
    auto y = torch::randint(0, 5, {4},
                            torch::TensorOptions(device).dtype(torch::kLong));
    opt_plain.zero_grad();
    opt_ddp.zero_grad();
    torch::cross_entropy_loss(plain->forward(x), y).backward();
    torch::cross_entropy_loss(ddp->forward(x), y).backward();
    opt_plain.step();
    opt_ddp.step();
  }
  auto a = plain->parameters();
  auto b = ddp->module()->parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(b[i].is_cuda());
    EXPECT_TRUE(torch::equal(a[i], b[i])) << "parameter " << i;
  }
}

TEST_F(ApiCudaTest, SyncBatchNormAloneNormalisesAsBatchNorm) {
  concord::Job job(OnTheGpu());
  const torch::Device device = job.device();
  auto [plain, synced] = Twins(12, device);
  synced = concord::convert_sync_batchnorm(synced);
  ASSERT_NE(synced->seq[1]->as<concord::SyncBatchNorm>(), nullptr);
  concord::DistributedDataParallel ddp(synced, job);
  auto x = torch::randn({8, 3, 6, 6}, device);
  // Concord's CUDA kernels against cuDNN's batch norm: the same statistics,
  // summed in another order.
  EXPECT_TRUE(torch::allclose(ddp->forward(x), plain->forward(x), 1e-4, 1e-5));
  auto buffers = plain->named_buffers();
  for (const auto& b : synced->named_buffers()) {
    if (b.key().find("running_") == std::string::npos) continue;
    EXPECT_TRUE(b.value().is_cuda());
    EXPECT_TRUE(torch::allclose(b.value(), buffers[b.key()], 1e-4, 1e-6))
        << b.key();
  }
}

// The elastic loop and SlowMo on the device: a world of one commits every
// step, and LocalSGD's averages over one change nothing.
TEST_F(ApiCudaTest, TheElasticLoopWithSlowMoTrainsAsTheModuleAlone) {
  concord::Job job(OnTheGpu());
  const torch::Device device = job.device();
  const auto twins = Twins(13, device);  // the loop's lambda captures them
  Net plain = twins.first;
  Net wrapped = twins.second;
  concord::DistributedDataParallel ddp(
      wrapped, job,
      concord::DdpOptions().slowmo(
          concord::SlowMoOptions().localsgd_frequency(2)));
  torch::optim::SGD opt(ddp->parameters(), 0.05);
  torch::optim::SGD ref(plain->parameters(), 0.05);
  concord::ElasticState state(ddp, opt);
  concord::run_elastic(state, [&] {
    while (state.step() < 6) {
      auto x = torch::randn({4, 3, 6, 6}, device);
      opt.zero_grad();
      ddp->forward(x).pow(2).mean().backward();
      opt.step();
      state.commit();
      ddp->perform_slowmo(opt);
      ref.zero_grad();
      plain->forward(x).pow(2).mean().backward();
      ref.step();
    }
  });
  EXPECT_EQ(state.step(), 6);
  auto a = plain->parameters();
  auto b = wrapped->parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(b[i].is_cuda());
    EXPECT_TRUE(torch::allclose(a[i], b[i], 1e-5, 1e-6)) << "parameter " << i;
  }
}

}  // namespace
