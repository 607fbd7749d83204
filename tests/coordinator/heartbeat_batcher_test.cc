// The node agent's heartbeat batching (agent/heartbeat_batcher.h) as a
// policy, on a simulated clock: see Note [Heartbeat batching].

#include "agent/heartbeat_batcher.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "absl/time/time.h"

namespace concord::agent {
namespace {

std::string W(int i) { return "w" + std::to_string(i); }

const absl::Time kT0 = absl::FromUnixSeconds(1000000);

BatchPolicy Policy(absl::Duration max_delay, size_t max_batch = 4096) {
  BatchPolicy p;
  p.interval = absl::Seconds(1);
  p.max_delay = max_delay;
  p.expect_within = absl::Seconds(3);
  p.max_batch = max_batch;
  return p;
}

TEST(HeartbeatBatcherTest, ANodesHeartbeatsGoOutTogether) {
  HeartbeatBatcher<int> b(Policy(absl::Milliseconds(100)));
  for (int i = 0; i < 8; ++i) b.Add(W(i), i, kT0);  // heard from all once
  ASSERT_EQ(b.TakeIfDue(kT0).size(), 8u);
  // The next round arrives spread over 50 ms: nothing goes out until the
  // eighth is there, then all at once, oldest first.
  for (int i = 0; i < 7; ++i) {
    const absl::Time now = kT0 + absl::Seconds(1) + absl::Milliseconds(7 * i);
    b.Add(W(i), i, now);
    EXPECT_EQ(b.Due(now), kT0 + absl::Seconds(1) + absl::Milliseconds(100));
    EXPECT_TRUE(b.TakeIfDue(now).empty());
  }
  const absl::Time last = kT0 + absl::Seconds(1) + absl::Milliseconds(50);
  b.Add(W(7), 7, last);
  EXPECT_LE(b.Due(last), last);
  auto batch = b.TakeIfDue(last);
  ASSERT_EQ(batch.size(), 8u);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(batch[i].second, i);
  EXPECT_EQ(b.pending(), 0u);
  EXPECT_EQ(b.Due(last), absl::InfiniteFuture());
}

TEST(HeartbeatBatcherTest, ASilentWorkerHoldsABatchAtMostMaxDelay) {
  HeartbeatBatcher<int> b(Policy(absl::Milliseconds(100)));
  for (int i = 0; i < 4; ++i) b.Add(W(i), i, kT0);
  b.TakeIfDue(kT0);
  // w3 has hung: the others wait for it no longer than max_delay.
  const absl::Time t = kT0 + absl::Seconds(1);
  for (int i = 0; i < 3; ++i) b.Add(W(i), i, t);
  EXPECT_TRUE(b.TakeIfDue(t + absl::Milliseconds(99)).empty());
  EXPECT_EQ(b.TakeIfDue(t + absl::Milliseconds(100)).size(), 3u);
  // More than max_delay late, it is not waited for at all; silent for
  // expect_within (3 s) after it was due, it is forgotten.
  const absl::Time later = kT0 + absl::Seconds(5);
  for (int i = 0; i < 3; ++i) b.Add(W(i), i, later);
  EXPECT_EQ(b.TakeIfDue(later).size(), 3u);
  EXPECT_EQ(b.known(), 3u);
}

TEST(HeartbeatBatcherTest, AWorkerThatWentAwayIsNotWaitedFor) {
  HeartbeatBatcher<int> b(Policy(absl::Seconds(10)));
  b.Add("a", 0, kT0);
  b.Add("b", 1, kT0);
  b.TakeIfDue(kT0);
  b.Forget("b");
  EXPECT_EQ(b.known(), 1u);
  b.Add("a", 2, kT0 + absl::Seconds(1));
  EXPECT_EQ(b.TakeIfDue(kT0 + absl::Seconds(1)).size(), 1u);
  // Forgetting a worker with a heartbeat pending keeps that heartbeat.
  b.Add("a", 3, kT0 + absl::Seconds(2));
  b.Forget("a");
  EXPECT_EQ(b.pending(), 1u);
  EXPECT_EQ(b.TakeIfDue(kT0 + absl::Seconds(2)).size(), 1u);
}

TEST(HeartbeatBatcherTest, AFullBatchGoesAtOnce) {
  HeartbeatBatcher<int> b(Policy(absl::Seconds(10), /*max_batch=*/3));
  for (int i = 0; i < 5; ++i) b.Add(W(i), i, kT0);
  b.TakeIfDue(kT0);
  const absl::Time t = kT0 + absl::Seconds(1);
  b.Add(W(0), 0, t);
  b.Add(W(1), 1, t);
  EXPECT_TRUE(b.TakeIfDue(t).empty());
  b.Add(W(2), 2, t);
  EXPECT_EQ(b.TakeIfDue(t).size(), 3u);
}

// Eight workers heartbeating every second from random phases, each waiting
// for its answer (1 ms after the batch goes out) before sleeping again:
// within a few seconds they leave in phase, one batch a second.
TEST(HeartbeatBatcherTest, WorkersFallIntoPhase) {
  constexpr int kWorkers = 8;
  constexpr int kSeconds = 60;
  for (unsigned seed = 1; seed <= 20; ++seed) {
    SCOPED_TRACE(seed);
    HeartbeatBatcher<int> b(Policy(absl::Milliseconds(250)));
    std::mt19937 rng(seed);
    std::vector<absl::Time> next(kWorkers);
    for (auto& t : next) t = kT0 + absl::Milliseconds(rng() % 1000);
    int batches = 0, heartbeats = 0;
    absl::Time now = kT0;
    const absl::Time end = kT0 + absl::Seconds(kSeconds);
    while (now < end) {
      // The next event: a worker's heartbeat or the batch's due time.
      absl::Time arrival = *std::min_element(next.begin(), next.end());
      const absl::Time due = b.Due(now);
      if (due <= arrival) {
        now = std::max(now, due);
        auto batch = b.TakeIfDue(now);
        ASSERT_FALSE(batch.empty());
        ++batches;
        heartbeats += static_cast<int>(batch.size());
        for (auto& [worker, i] : batch) {
          next[i] = now + absl::Milliseconds(1) + absl::Seconds(1);
        }
        continue;
      }
      now = arrival;
      for (int i = 0; i < kWorkers; ++i) {
        if (next[i] == arrival) {
          b.Add(W(i), i, now);
          next[i] = absl::InfiniteFuture();  // waits for its answer
        }
      }
    }
    EXPECT_GE(heartbeats, kWorkers * (kSeconds - 2));
    // One batch a second, once in phase.
    EXPECT_LE(batches, kSeconds + 2 * kWorkers) << heartbeats;
  }
}

}  // namespace
}  // namespace concord::agent
