// Stream-ordered waits on CPU (see Note [Stream-ordered waits]): which waits
// the training code asks for (Synchronize where the device may order a stream,
// Wait where the host needs the data or a verdict), observed through a
// communicator that wraps real Gloo and counts them. On the CPU both end in a
// host wait, so the results are those of Gloo.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <memory>
#include <mutex>

#include "rank_threads.h"
#include "worker/comm/coalesced.h"
#include "worker/ddp/engine.h"

namespace concord {
namespace {

using concord::testing::RunRanks;

struct WaitCounts {
  std::atomic<int> waits{0};
  std::atomic<int> synchronizes{0};
};

// Forwards to `inner`, counting how it is waited for.
class CountingWork final : public comm::Work {
 public:
  CountingWork(std::shared_ptr<comm::Work> inner, WaitCounts* counts)
      : inner_(std::move(inner)), counts_(counts) {}
  bool IsCompleted() const override { return inner_->IsCompleted(); }
  absl::Status Wait(absl::Duration timeout) override {
    ++counts_->waits;
    return inner_->Wait(timeout);
  }
  absl::Status Synchronize(absl::Duration timeout) override {
    ++counts_->synchronizes;
    return inner_->Synchronize(timeout);
  }
  void Abort() override { inner_->Abort(); }

 private:
  std::shared_ptr<comm::Work> inner_;
  WaitCounts* counts_;
};

// A Gloo communicator whose float collectives (gradients, buffers,
// statistics) are counted in `data` and the others (the unused-parameter
// bitmap, the model check, the layout) in `control`.
class CountingCommunicator final : public comm::Communicator {
 public:
  CountingCommunicator(std::shared_ptr<comm::Communicator> inner,
                       WaitCounts* data, WaitCounts* control)
      : inner_(std::move(inner)), data_(data), control_(control) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  int64_t generation() const override { return inner_->generation(); }
  std::shared_ptr<comm::Work> AllreduceSum(
      at::Tensor t, const comm::CollectiveOptions& o) override {
    return Count(t, inner_->AllreduceSum(t, o));
  }
  std::shared_ptr<comm::Work> Broadcast(
      at::Tensor t, int root, const comm::CollectiveOptions& o) override {
    return Count(t, inner_->Broadcast(t, root, o));
  }
  std::shared_ptr<comm::Work> Allgather(
      at::Tensor out, at::Tensor in,
      const comm::CollectiveOptions& o) override {
    return Count(in, inner_->Allgather(out, in, o));
  }
  std::shared_ptr<comm::Work> ReduceSum(
      at::Tensor t, int root, const comm::CollectiveOptions& o) override {
    return Count(t, inner_->ReduceSum(t, root, o));
  }
  std::shared_ptr<comm::Work> Exchange(
      at::Tensor send, std::vector<int> to, std::vector<at::Tensor> recv,
      std::vector<int> from, const comm::CollectiveOptions& o) override {
    return Count(send, inner_->Exchange(send, std::move(to), std::move(recv),
                                        std::move(from), o));
  }
  void Abort() override { inner_->Abort(); }

 private:
  std::shared_ptr<comm::Work> Count(const at::Tensor& t,
                                    std::shared_ptr<comm::Work> work) {
    WaitCounts* counts = t.is_floating_point() ? data_ : control_;
    return std::make_shared<CountingWork>(std::move(work), counts);
  }

  std::shared_ptr<comm::Communicator> inner_;
  WaitCounts* data_;
  WaitCounts* control_;
};

std::mutex& RngMutex() {
  static std::mutex mu;
  return mu;
}

torch::nn::Sequential MakeNet() {
  std::lock_guard<std::mutex> lock(RngMutex());
  torch::manual_seed(7);
  return torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::ReLU(),
                               torch::nn::Linear(8, 2));
}

// One synchronised backward on `world` ranks; rank 0's counts of the
// backward only (creation's broadcasts and destruction are left out).
// Returns rank 0's gradients.
struct Snapshot {
  int waits = 0;
  int synchronizes = 0;
};

std::vector<torch::Tensor> Backward(int world, DdpOptions options,
                                    ddp::ReducerInternals internals,
                                    Snapshot* data_after,
                                    Snapshot* control_after) {
  WaitCounts counts_data, counts_control;
  WaitCounts* data = &counts_data;
  WaitCounts* control = &counts_control;
  std::vector<torch::Tensor> grads;
  std::mutex mu;
  RunRanks(world, [&](int rank, std::shared_ptr<comm::Communicator> gloo) {
    WaitCounts ignored_data, ignored_control;
    auto counting = std::make_shared<CountingCommunicator>(
        gloo, rank == 0 ? data : &ignored_data,
        rank == 0 ? control : &ignored_control);
    auto net = MakeNet();
    auto ddp = ddp::Engine::Create(net.ptr(), counting, 0, options, internals);
    ASSERT_TRUE(ddp.ok()) << ddp.status();
    if (rank == 0) {
      data->waits = data->synchronizes = 0;
      control->waits = control->synchronizes = 0;
    }
    torch::Tensor x = torch::full({3, 4}, 1.0 + rank);
    (*ddp)->Forward([&] { return net->forward(x); }).sum().backward();
    if (rank == 0) {
      // Taken now: destroying the DDP waits for what it launched.
      *data_after = {data->waits.load(), data->synchronizes.load()};
      *control_after = {control->waits.load(), control->synchronizes.load()};
      std::lock_guard<std::mutex> lock(mu);
      for (const auto& p : net->parameters()) grads.push_back(p.grad().clone());
    }
  });
  return grads;
}

TEST(StreamWaitTest, BackwardOrdersTheBucketsAndTheHostDoesNotWait) {
  Snapshot data, control;
  const auto grads = Backward(2, DdpOptions{}, {}, &data, &control);
  // Every bucket is synchronized, none waited for: on a device the end of
  // backward only orders the current stream after the allreduce.
  EXPECT_GT(data.synchronizes, 0);
  EXPECT_EQ(data.waits, 0);
  EXPECT_EQ(control.waits, 0);
  ASSERT_FALSE(grads.empty());
}

TEST(StreamWaitTest, BlockingWaitHasTheHostWaitForEveryBucket) {
  Snapshot data, control, stream_data, stream_control;
  ddp::ReducerInternals internals;
  internals.blocking_wait = true;
  const auto blocking = Backward(2, DdpOptions{}, internals, &data, &control);
  EXPECT_GT(data.waits, 0);
  const auto stream =
      Backward(2, DdpOptions{}, {}, &stream_data, &stream_control);
  // The same buckets: waited for in one mode, synchronized in the other.
  EXPECT_EQ(data.waits, stream_data.synchronizes);
  EXPECT_EQ(data.synchronizes, 0);  // the model has no buffers
  EXPECT_EQ(stream_data.waits, 0);
  ASSERT_EQ(blocking.size(), stream.size());
  for (size_t i = 0; i < blocking.size(); ++i) {
    EXPECT_TRUE(torch::equal(blocking[i], stream[i])) << i;
  }
}

TEST(StreamWaitTest, FindUnusedParametersWaitsForItsBitmapOnTheHost) {
  // PyTorch reads the bitmap on the host too.
  Snapshot data, control;
  DdpOptions options;
  options.find_unused_parameters(true);
  Backward(2, options, {}, &data, &control);
  EXPECT_EQ(control.waits, 1);
  EXPECT_EQ(data.waits, 0);
}

TEST(StreamWaitTest, BlockingWaitCanBeSwitchedBetweenIterations) {
  RunRanks(1, [&](int, std::shared_ptr<comm::Communicator> comm) {
    auto net = MakeNet();
    auto ddp = ddp::Engine::Create(net.ptr(), comm, 0);
    ASSERT_TRUE(ddp.ok()) << ddp.status();
    EXPECT_FALSE((*ddp)->blocking_wait());  // c10d's default
    (*ddp)->SetBlockingWait(true);
    EXPECT_TRUE((*ddp)->blocking_wait());
  });
}

TEST(StreamWaitTest, BroadcastCoalescedSynchronizes) {
  RunRanks(2, [&](int rank, std::shared_ptr<comm::Communicator> gloo) {
    WaitCounts data, control;
    CountingCommunicator counting(gloo, &data, &control);
    std::vector<at::Tensor> tensors = {torch::full({3}, 1.0 + rank),
                                       torch::full({2}, 5 + rank, at::kLong)};
    comm::CollectiveOptions opts;
    ASSERT_TRUE(comm::BroadcastCoalesced(counting, tensors, 0, opts).ok());
    EXPECT_TRUE(torch::equal(tensors[0], torch::full({3}, 1.0)));
    EXPECT_TRUE(torch::equal(tensors[1], torch::full({2}, 5, at::kLong)));
    EXPECT_EQ(data.synchronizes.load() + control.synchronizes.load(), 2);
    EXPECT_EQ(data.waits.load() + control.waits.load(), 0);
  });
}

// A work done at once that counts how it is waited for.
std::shared_ptr<comm::Work> DoneWork(WaitCounts* counts) {
  return std::make_shared<CountingWork>(
      comm::PromiseWork::Done(absl::OkStatus()), counts);
}

TEST(ThenTest, SynchronizeRunsTheContinuationWithASynchronizingWaiter) {
  WaitCounts inner, nested;
  int runs = 0;
  auto work = comm::Then(DoneWork(&inner), [&](const comm::Waiter& wait) {
    ++runs;
    return wait(DoneWork(&nested));
  });
  ASSERT_TRUE(work->Synchronize().ok());
  ASSERT_TRUE(work->Synchronize().ok());
  EXPECT_EQ(runs, 1);
  EXPECT_EQ(inner.synchronizes.load(), 2);
  EXPECT_EQ(inner.waits.load(), 0);
  EXPECT_EQ(nested.synchronizes.load(), 1);
  EXPECT_EQ(nested.waits.load(), 0);
}

TEST(ThenTest, WaitRunsTheContinuationWithAWaitingWaiter) {
  WaitCounts inner, nested;
  auto work = comm::Then(DoneWork(&inner), [&](const comm::Waiter& wait) {
    return wait(DoneWork(&nested));
  });
  ASSERT_TRUE(work->Wait().ok());
  EXPECT_EQ(inner.waits.load(), 1);
  EXPECT_EQ(nested.waits.load(), 1);
  EXPECT_EQ(inner.synchronizes.load() + nested.synchronizes.load(), 0);
}

TEST(ThenTest, AFailedInnerWorkSkipsTheContinuation) {
  bool ran = false;
  auto work =
      comm::Then(comm::PromiseWork::Done(absl::UnavailableError("peer gone")),
                 [&](const comm::Waiter&) {
                   ran = true;
                   return absl::OkStatus();
                 });
  EXPECT_EQ(work->Synchronize().code(), absl::StatusCode::kUnavailable);
  EXPECT_FALSE(ran);
}

TEST(ThenTest, ASynchronizeThatTimesOutLeavesTheContinuationForLater) {
  auto inner = std::make_shared<comm::PromiseWork>();
  int runs = 0;
  auto work = comm::Then(inner, [&]() {
    ++runs;
    return absl::OkStatus();
  });
  EXPECT_EQ(work->Synchronize(absl::Milliseconds(1)).code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(runs, 0);
  inner->MarkDone(absl::OkStatus());
  EXPECT_TRUE(work->Synchronize().ok());
  EXPECT_EQ(runs, 1);
}

}  // namespace
}  // namespace concord
