// The NCCL communicator over several GPUs (label multigpu): one rank per
// visible device, ranks as threads of this process (NCCL allows that; it
// refuses two ranks on one device). Collectives, CPU control tensors staged
// through the device, ordering after the current stream (see Note [NCCL
// streams]), the next generation made by the members' agreed plan when a
// rank finishes early, and abort on a hung collective followed by the
// survivors' next generation (see Note [Re-forming NCCL]), stream-ordered waits
// and the watchdog that ends a collective nobody waits for (see Note
// [Stream-ordered waits]). With fewer than two
// devices every test says "skipped: fewer than 2 CUDA devices" (the ctest
// SKIP_REGULAR_EXPRESSION).

#include <gtest/gtest.h>
#include <nccl.h>
#include <torch/torch.h>

#include <functional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "concord/config.h"
#include "worker/comm/nccl/nccl_communicator.h"
#include "worker/comm/next_communicator.h"
#include "worker/comm/store.h"

#if CONCORD_TORCH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace concord::comm {
namespace {

const absl::Duration kTimeout = absl::Seconds(120);

class NcclMultiGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    world_ = static_cast<int>(torch::cuda::device_count());
    if (world_ < 2) GTEST_SKIP() << "skipped: fewer than 2 CUDA devices";
  }

  // Runs body(rank) on one thread per rank.
  void Ranks(int n, const std::function<void(int)>& body) {
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) threads.emplace_back(body, r);
    for (auto& t : threads) t.join();
  }

  // Generation 1 over every device: comms_[r] on cuda:r.
  void Connect() {
    comms_.assign(static_cast<size_t>(world_), nullptr);
    Ranks(world_, [&](int r) {
      NcclOptions o;
      o.rank = r;
      o.size = world_;
      o.generation = 1;
      o.device = r;
      o.connect_timeout = kTimeout;
      PrefixStore store("g1/", &store_);
      auto made = NcclCommunicator::Create(o, &store);
      ASSERT_TRUE(made.ok()) << made.status();
      comms_[static_cast<size_t>(r)] = std::move(*made);
    });
  }

  static torch::TensorOptions On(int device) {
    return torch::TensorOptions().device(
        torch::kCUDA, static_cast<torch::DeviceIndex>(device));
  }

  int world_ = 0;
  InMemoryStore store_;
  std::vector<std::shared_ptr<NcclCommunicator>> comms_;
  const CollectiveOptions opts_{kTimeout};
};

TEST_F(NcclMultiGpuTest, CollectivesSumOverEveryDevice) {
  Connect();
  Ranks(world_, [&](int r) {
    Communicator& c = *comms_[static_cast<size_t>(r)];
    const double n = world_;
    for (auto dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16}) {
      torch::Tensor t = torch::full({1 << 20}, r + 1.0, On(r).dtype(dtype));
      ASSERT_TRUE(c.AllreduceSum(t, opts_)->Wait(kTimeout).ok());
      EXPECT_EQ(t[12345].item<double>(), n * (n + 1) / 2) << dtype;
    }
    torch::Tensor in = torch::full({3}, static_cast<double>(r), On(r));
    torch::Tensor out = torch::empty({3 * world_}, On(r));
    ASSERT_TRUE(c.Allgather(out, in, opts_)->Wait(kTimeout).ok());
    for (int q = 0; q < world_; ++q) EXPECT_EQ(out[3 * q].item<double>(), q);
    torch::Tensor b = torch::full({5}, static_cast<double>(r), On(r));
    ASSERT_TRUE(c.Broadcast(b, world_ - 1, opts_)->Wait(kTimeout).ok());
    EXPECT_EQ(b[4].item<double>(), world_ - 1);
  });
}

TEST_F(NcclMultiGpuTest, CpuControlTensorsAreStagedThroughTheDevice) {
  Connect();
  Ranks(world_, [&](int r) {
    Communicator& c = *comms_[static_cast<size_t>(r)];
    // find_unused_parameters' bitmap is a CPU long tensor.
    torch::Tensor bitmap = torch::zeros({7}, torch::kLong);
    bitmap[r % 7] = 1;
    ASSERT_TRUE(c.AllreduceSum(bitmap, opts_)->Wait(kTimeout).ok());
    EXPECT_TRUE(bitmap.device().is_cpu());
    EXPECT_EQ(bitmap.sum().item<int64_t>(), world_);
  });
}

#if CONCORD_TORCH_CUDA
TEST_F(NcclMultiGpuTest, ACollectiveWaitsForTheCurrentStream) {
  Connect();
  Ranks(world_, [&](int r) {
    Communicator& c = *comms_[static_cast<size_t>(r)];
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(r));
    // The tensor's last writer runs long on a side stream that is current:
    // without the NCCL stream's wait (see Note [NCCL streams]) NCCL would read
    // it before it is written.
    c10::cuda::CUDAStream side =
        c10::cuda::getStreamFromPool(false, static_cast<c10::DeviceIndex>(r));
    c10::cuda::CUDAStreamGuard on_side(side);
    torch::Tensor a = torch::randn({2048, 2048}, On(r));
    torch::Tensor t = torch::zeros({1 << 16}, On(r));
    for (int i = 0; i < 20; ++i) a = torch::mm(a, a).tanh();
    t.fill_(static_cast<double>(r + 1));
    ASSERT_TRUE(c.AllreduceSum(t, opts_)->Wait(kTimeout).ok());
    const double n = world_;
    EXPECT_EQ(t.min().item<double>(), n * (n + 1) / 2);
  });
}
#endif

#if CONCORD_TORCH_CUDA
TEST_F(NcclMultiGpuTest, SynchronizeOrdersTheCurrentStreamAfterTheCollective) {
  Connect();
  Ranks(world_, [&](int r) {
    Communicator& c = *comms_[static_cast<size_t>(r)];
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(r));
    torch::Tensor t = torch::full({1 << 22}, static_cast<double>(r + 1), On(r));
    // See Note [Stream-ordered waits]: the host does not wait; kernels queued
    // afterwards on the current stream see the sum.
    ASSERT_TRUE(c.AllreduceSum(t, opts_)->Synchronize(kTimeout).ok());
    torch::Tensor doubled = t * 2;
    const double n = world_;
    EXPECT_EQ(doubled.min().item<double>(), n * (n + 1));
    EXPECT_EQ(doubled.max().item<double>(), n * (n + 1));
  });
}
#endif

TEST_F(NcclMultiGpuTest, TheWatchdogAbortsAHungCollectiveNobodyWaitsFor) {
  Connect();
  // The last rank never comes; the others only order their streams after
  // the allreduce and drop the work: the watchdog still ends it.
  const int dead = world_ - 1;
  Ranks(dead, [&](int r) {
    NcclCommunicator& c = *comms_[static_cast<size_t>(r)];
    torch::Tensor t = torch::ones({4096}, On(r));
    EXPECT_TRUE(c.AllreduceSum(t, {absl::Seconds(2)})->Synchronize().ok());
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (!c.failed() && absl::Now() < deadline)
      absl::SleepFor(absl::Milliseconds(10));
    EXPECT_TRUE(c.failed()) << "the watchdog did not abort within 30 s";
    EXPECT_FALSE(c.usable());
    // Every later collective fails at once.
    EXPECT_FALSE(c.AllreduceSum(t, opts_)->Wait(kTimeout).ok());
  });
  comms_[static_cast<size_t>(dead)]->Abort();
}

// The new generation's communicator, every member of `next` (old ranks) in
// parallel, by MakeNextCommunicator as Session does; each sums over it.
void NextGeneration(const std::vector<std::shared_ptr<NcclCommunicator>>& old,
                    const std::vector<int>& next, bool departed_cleanly,
                    Store* store, ReformPlan::How expected) {
  std::vector<std::string> previous, ids;
  for (size_t r = 0; r < old.size(); ++r) previous.push_back(absl::StrCat(r));
  for (int r : next) ids.push_back(absl::StrCat(r));
  std::vector<std::thread> threads;
  for (size_t i = 0; i < next.size(); ++i) {
    threads.emplace_back([&, i] {
      const int device = next[i];
      NextCommunicatorRequest req;
      req.backend = Backend::kNccl;
      req.nccl_version = NCCL_VERSION_CODE;
      req.previous = previous;
      req.next = ids;
      req.departed_cleanly = departed_cleanly;
      req.rank = static_cast<int>(i);
      req.generation = 2;
      req.timeout = kTimeout;
      auto made = MakeNextCommunicator(
          req, old[static_cast<size_t>(device)], store, [&] {
            NcclOptions o;
            o.rank = static_cast<int>(i);
            o.size = static_cast<int>(next.size());
            o.generation = 2;
            o.device = device;
            o.connect_timeout = kTimeout;
            PrefixStore fresh("g2/", store);
            return absl::StatusOr<std::unique_ptr<Communicator>>(
                NcclCommunicator::Create(o, &fresh));
          });
      ASSERT_TRUE(made.ok()) << made.status();
      EXPECT_EQ(made->plan.how, expected) << made->plan.why;
      Communicator& c = *made->communicator;
      EXPECT_EQ(c.size(), static_cast<int>(next.size()));
      EXPECT_EQ(c.generation(), 2);
      torch::Tensor t = torch::ones(
          {1000}, torch::TensorOptions().device(
                      torch::kCUDA, static_cast<torch::DeviceIndex>(device)));
      ASSERT_TRUE(c.AllreduceSum(t, {kTimeout})->Wait(kTimeout).ok());
      EXPECT_EQ(t[999].item<double>(), static_cast<double>(next.size()));
    });
  }
  for (auto& t : threads) t.join();
}

TEST_F(NcclMultiGpuTest, ARankThatFinishesEarlyLeavesASmallerCommunicator) {
  Connect();
  // The last rank runs out of data and leaves at the agreed boundary.
  std::vector<int> stay;
  for (int r = 0; r + 1 < world_; ++r) stay.push_back(r);
  comms_.back()->Abort();  // it exits; its communicator goes with it
  InMemoryStore g2;
  NextGeneration(comms_, stay, /*departed_cleanly=*/true, &g2,
                 NCCL_VERSION_CODE >= kNcclShrinkVersion
                     ? ReformPlan::How::kShrink
                     : ReformPlan::How::kNewInit);
}

TEST_F(NcclMultiGpuTest, AHungCollectiveAbortsAndTheSurvivorsGoOn) {
  Connect();
  // Every rank but the last allreduces; the last never comes (it hangs or
  // died): the others' collective passes its timeout and aborts.
  const int dead = world_ - 1;
  Ranks(dead, [&](int r) {
    torch::Tensor t = torch::ones({4096}, On(r));
    const absl::Time start = absl::Now();
    absl::Status s = comms_[static_cast<size_t>(r)]
                         ->AllreduceSum(t, {absl::Seconds(3)})
                         ->Wait(absl::Seconds(60));
    EXPECT_FALSE(s.ok());
    EXPECT_LT(absl::Now() - start, absl::Seconds(30)) << "no hang";
    EXPECT_TRUE(comms_[static_cast<size_t>(r)]->failed());
  });
  comms_[static_cast<size_t>(dead)]->Abort();
  std::vector<int> stay;
  for (int r = 0; r < dead; ++r) stay.push_back(r);
  // The timed-out communicators were aborted: the survivors init anew.
  InMemoryStore g2;
  NextGeneration(comms_, stay, /*departed_cleanly=*/false, &g2,
                 ReformPlan::How::kNewInit);
}

}  // namespace
}  // namespace concord::comm
