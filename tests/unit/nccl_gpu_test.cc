// The NCCL communicator on a real device, one rank (label gpu): NCCL refuses
// two ranks on one GPU, so what one GPU can show is a whole generation's
// life — non-blocking initialisation through the generation's store, the
// collectives on CUDA tensors, abort when the generation ends, and the next
// generation's communicator. Several ranks are the multigpu tests' part
// (tests/gpu/). Without a device every test says "CONCORD_TEST_SKIPPED: no CUDA
// device" (the ctest SKIP_REGULAR_EXPRESSION).

#include <gtest/gtest.h>
#include <nccl.h>
#include <torch/torch.h>

#include "worker/comm/nccl/nccl_communicator.h"
#include "worker/comm/store.h"

namespace concord::comm {
namespace {

class NcclGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available())
      GTEST_SKIP() << "CONCORD_TEST_SKIPPED: no CUDA device";
  }

  absl::StatusOr<std::unique_ptr<NcclCommunicator>> Generation(int64_t g) {
    NcclOptions options;
    options.rank = 0;
    options.size = 1;
    options.generation = g;
    options.device = 0;
    options.connect_timeout = absl::Seconds(60);
    PrefixStore store(absl::StrCat("generation/", g, "/"), &store_);
    return NcclCommunicator::Create(options, &store);
  }

  InMemoryStore store_;
  const CollectiveOptions opts_{absl::Seconds(60)};
};

TEST_F(NcclGpuTest, AGenerationsLifeInitCollectivesAbortAndTheNext) {
  auto first = Generation(1);
  ASSERT_TRUE(first.ok()) << first.status();
  NcclCommunicator& comm = **first;
  EXPECT_EQ(comm.rank(), 0);
  EXPECT_EQ(comm.size(), 1);
  EXPECT_EQ(comm.generation(), 1);

  const auto cuda = torch::TensorOptions().device(torch::kCUDA, 0);
  for (auto dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16,
                     torch::kDouble, torch::kInt, torch::kLong}) {
    torch::Tensor t = torch::arange(1000, cuda.dtype(dtype));
    const torch::Tensor expected = t.clone();
    ASSERT_TRUE(comm.AllreduceSum(t, opts_)->Wait(absl::Seconds(60)).ok());
    EXPECT_TRUE(torch::equal(t, expected)) << dtype;  // a world of one
  }
  torch::Tensor b = torch::full({17}, 3.0, cuda);
  ASSERT_TRUE(comm.Broadcast(b, 0, opts_)->Wait(absl::Seconds(60)).ok());
  EXPECT_TRUE(torch::equal(b, torch::full({17}, 3.0, cuda)));
  torch::Tensor in = torch::arange(5, cuda), out = torch::empty_like(in);
  const absl::Status gathered =
      comm.Allgather(out, in, opts_)->Wait(absl::Seconds(60));
  ASSERT_TRUE(gathered.ok()) << gathered;
  EXPECT_TRUE(torch::equal(out, in));

  // The generation ends: every later collective fails at once, ABORTED.
  comm.Abort();
  comm.Abort();  // idempotent
  torch::Tensor after = torch::ones({4}, cuda);
  const absl::Status s =
      comm.AllreduceSum(after, opts_)->Wait(absl::Seconds(5));
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;

  // The next generation's communicator starts from its own unique id.
  auto second = Generation(2);
  ASSERT_TRUE(second.ok()) << second.status();
  torch::Tensor t = torch::full({1 << 20}, 2.0, cuda);
  ASSERT_TRUE((*second)->AllreduceSum(t, opts_)->Wait(absl::Seconds(60)).ok());
  EXPECT_EQ(t.sum().item<double>(), 2.0 * (1 << 20));
}

TEST_F(NcclGpuTest, SynchronizedWorksAreWatchedUntilTheyEnd) {
  auto comm = Generation(1);
  ASSERT_TRUE(comm.ok()) << comm.status();
  const auto cuda = torch::TensorOptions().device(torch::kCUDA, 0);
  // See Note [Stream-ordered waits]: dropped right after Synchronize, the works
  // still complete (the watchdog holds them and their tensors), and what
  // the current stream does next sees every result.
  torch::Tensor t = torch::ones({1 << 20}, cuda);
  for (int i = 0; i < 20; ++i) {
    ASSERT_TRUE((*comm)->AllreduceSum(t, opts_)->Synchronize().ok());
    t.add_(1);
  }
  EXPECT_EQ(t.min().item<double>(), 21.0);
  EXPECT_TRUE((*comm)->usable());
  EXPECT_FALSE((*comm)->failed());
  // A staged CPU tensor needs the host: Synchronize waits for it.
  torch::Tensor host = torch::full({8}, 5.0);
  ASSERT_TRUE((*comm)->AllreduceSum(host, opts_)->Synchronize().ok());
  EXPECT_TRUE(torch::equal(host, torch::full({8}, 5.0)));
}

TEST_F(NcclGpuTest, CpuTensorsAreStagedOthersRefused) {
  auto comm = Generation(1);
  ASSERT_TRUE(comm.ok()) << comm.status();
  // See Note [NCCL streams]: a CPU control tensor goes through the device and
  // back, and stays a CPU tensor.
  torch::Tensor bitmap = torch::arange(6, torch::kLong);
  ASSERT_TRUE(
      (*comm)->AllreduceSum(bitmap, opts_)->Wait(absl::Seconds(60)).ok());
  EXPECT_TRUE(bitmap.device().is_cpu());
  EXPECT_TRUE(torch::equal(bitmap, torch::arange(6, torch::kLong)));
  const auto cuda = torch::TensorOptions().device(torch::kCUDA, 0);
  const absl::Status strided =
      (*comm)
          ->AllreduceSum(torch::ones({4, 4}, cuda).t(), opts_)
          ->Wait(absl::Seconds(5));
  EXPECT_EQ(strided.code(), absl::StatusCode::kInvalidArgument) << strided;
  if (torch::cuda::device_count() > 1) {
    const absl::Status other =
        (*comm)
            ->AllreduceSum(torch::ones({3}, cuda.device(torch::kCUDA, 1)),
                           opts_)
            ->Wait(absl::Seconds(5));
    EXPECT_EQ(other.code(), absl::StatusCode::kInvalidArgument) << other;
  }
}

TEST_F(NcclGpuTest, TheSameMemberSplitsAShrinkLeavingNobodyOutIsRefused) {
  // See Note [Re-forming NCCL]: the same members derive by split;
  // ncclCommShrink must leave a rank out (NCCL refuses an empty list), so
  // Shrink refuses one before NCCL sees it, and the parent stays usable.
  auto first = Generation(1);
  ASSERT_TRUE(first.ok()) << first.status();
  NcclCommunicator& parent = **first;
  auto shrunk =
      parent.Shrink({}, /*abort_in_flight=*/false, 2, absl::Seconds(60));
  EXPECT_EQ(shrunk.status().code(), NCCL_VERSION_CODE >= kNcclShrinkVersion
                                        ? absl::StatusCode::kInvalidArgument
                                        : absl::StatusCode::kFailedPrecondition)
      << shrunk.status();
  EXPECT_TRUE(parent.usable());
  auto next = parent.Split(0, 0, 2, absl::Seconds(60));
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_FALSE(parent.usable());
  EXPECT_EQ((*next)->generation(), 2);
  EXPECT_EQ((*next)->size(), 1);
  torch::Tensor t =
      torch::full({9}, 2.0, torch::TensorOptions().device(torch::kCUDA, 0));
  ASSERT_TRUE((*next)->AllreduceSum(t, opts_)->Wait(absl::Seconds(60)).ok());
  EXPECT_EQ(t[8].item<double>(), 2.0);
  // A spent communicator derives nothing more.
  auto again = parent.Split(0, 0, 3, absl::Seconds(5));
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(NcclGpuTest, ADeviceThatIsNotThereIsInvalidArgument) {
  NcclOptions options;
  options.device = static_cast<int>(torch::cuda::device_count());
  InMemoryStore store;
  auto comm = NcclCommunicator::Create(options, &store);
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kInvalidArgument)
      << comm.status();
}

}  // namespace
}  // namespace concord::comm
