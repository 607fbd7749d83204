// See Note [Flight recorder] in worker/comm/flight_recorder.h: what a worker
// tells the coordinator of its collectives, from real Gloo communicators
// (ranks as threads) and from works completed by hand; and the test hook
// that stalls a worker (worker/test_fault.h).

#include "worker/comm/flight_recorder.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <thread>
#include <vector>

#include "worker/comm/gloo/gloo_communicator.h"
#include "worker/comm/store.h"
#include "worker/test_fault.h"

namespace concord::comm {
namespace {

TEST(FlightRecorderTest, CountsTheGenerationsCollectivesAndTheOldestInFlight) {
  FlightRecorder recorder;
  recorder.BeginGeneration(3);
  auto first = std::make_shared<PromiseWork>();
  auto second = std::make_shared<PromiseWork>();
  auto group = std::make_shared<PromiseWork>();
  recorder.Issued(3, /*main=*/true, "allreduce", 16, first);
  recorder.Issued(3, /*main=*/false, "allgather", 8, group);
  recorder.Issued(3, /*main=*/true, "broadcast", 4, second);
  FlightRecorder::Snapshot s = recorder.Poll(absl::Now());
  EXPECT_EQ(s.generation, 3);
  EXPECT_EQ(s.collectives, 2);  // a group's are not numbered
  ASSERT_TRUE(s.pending.has_value());
  EXPECT_EQ(s.pending->seq, 1);
  EXPECT_EQ(s.pending->kind, "allreduce");
  EXPECT_FALSE(s.last.has_value());

  first->MarkDone(absl::OkStatus());
  group->MarkDone(absl::OkStatus());
  s = recorder.Poll(absl::Now());
  ASSERT_TRUE(s.pending.has_value());
  EXPECT_EQ(s.pending->seq, 2);
  EXPECT_EQ(s.pending->kind, "broadcast");
  ASSERT_TRUE(s.last.has_value());

  // A work nobody holds any more has ended.
  second.reset();
  s = recorder.Poll(absl::Now());
  EXPECT_FALSE(s.pending.has_value());
  EXPECT_EQ(recorder.Recent().size(), 3u);

  // A new generation numbers from 1; a late collective of the old one
  // counts in no generation.
  recorder.BeginGeneration(4);
  recorder.Issued(3, true, "allreduce", 4, PromiseWork::Done(absl::OkStatus()));
  s = recorder.Poll(absl::Now());
  EXPECT_EQ(s.generation, 4);
  EXPECT_EQ(s.collectives, 0);
  EXPECT_FALSE(s.pending.has_value());
  recorder.BeginGeneration(2);  // never backwards
  EXPECT_EQ(recorder.Poll(absl::Now()).generation, 4);
}

TEST(FlightRecorderTest, RecordsRealCollectivesAndWhoIsMissing) {
  InMemoryStore store;
  auto recorders = std::vector<std::shared_ptr<FlightRecorder>>{
      std::make_shared<FlightRecorder>(), std::make_shared<FlightRecorder>()};
  std::vector<std::shared_ptr<Communicator>> comms(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      GlooOptions o;
      o.rank = r;
      o.size = 2;
      o.generation = 5;
      auto c = GlooCommunicator::Create(o, &store);
      ASSERT_TRUE(c.ok()) << c.status();
      comms[static_cast<size_t>(r)] = std::make_shared<RecordedCommunicator>(
          std::shared_ptr<Communicator>(std::move(*c)),
          recorders[static_cast<size_t>(r)], true);
    });
  }
  for (auto& t : threads) t.join();
  threads.clear();
  ASSERT_TRUE(comms[0] && comms[1]);
  CollectiveOptions opts;
  // Both take part in #1.
  std::vector<std::shared_ptr<Work>> works;
  for (int r = 0; r < 2; ++r) {
    works.push_back(
        comms[static_cast<size_t>(r)]->AllreduceSum(torch::ones({4}), opts));
  }
  for (auto& w : works) ASSERT_TRUE(w->Wait().ok());
  // Rank 0 alone enters #2: it waits there, rank 1 has issued 1.
  auto lonely = comms[0]->Broadcast(torch::ones({4}), 0, opts);
  absl::SleepFor(absl::Milliseconds(50));
  const FlightRecorder::Snapshot s0 = recorders[0]->Poll(absl::Now());
  const FlightRecorder::Snapshot s1 = recorders[1]->Poll(absl::Now());
  EXPECT_EQ(s0.collectives, 2);
  ASSERT_TRUE(s0.pending.has_value());
  EXPECT_EQ(s0.pending->seq, 2);
  EXPECT_EQ(s0.pending->kind, "broadcast");
  EXPECT_GE(absl::Now() - s0.pending->issued, absl::Milliseconds(50));
  EXPECT_EQ(s1.collectives, 1);
  EXPECT_FALSE(s1.pending.has_value());
  ASSERT_TRUE(s1.last.has_value());
  EXPECT_EQ(s1.last->kind, "allreduce");
  // Rank 1 comes: it ends.
  ASSERT_TRUE(comms[1]->Broadcast(torch::zeros({4}), 0, opts)->Wait().ok());
  ASSERT_TRUE(lonely->Wait().ok());
  EXPECT_FALSE(recorders[0]->Poll(absl::Now()).pending.has_value());
  // The inner communicator is what a derivation gets.
  EXPECT_NE(RecordedCommunicator::Inner(comms[0]).get(), comms[0].get());
  EXPECT_EQ(RecordedCommunicator::Inner(comms[0])->rank(), 0);
}

TEST(TestFaultTest, StallsAreParsedAndMalformedOnesNamed) {
  auto faults =
      worker::ParseTestFaults("1:5:bucket:model:2:stall=30,0:3:forward:m:1", 1);
  ASSERT_TRUE(faults.ok()) << faults.status();
  ASSERT_EQ(faults->size(), 1u);
  EXPECT_EQ((*faults)[0].point, worker::TestFault::Point::kBucket);
  EXPECT_EQ((*faults)[0].occurrence, 2);
  EXPECT_EQ((*faults)[0].stall, absl::Seconds(30));
  for (const char* bad :
       {"1:5:bucket:model:2:stall=0", "1:5:bucket:model:2:x",
        "1:5:sideways:model:1", "1:5:forward:model:1:stall="}) {
    auto parsed = worker::ParseTestFaults(bad, 1);
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument)
        << bad;
  }
}

}  // namespace
}  // namespace concord::comm
