#pragma once
// When a node agent sends its workers' heartbeats (see Note [Heartbeat
// batching]). A plain policy with the time passed in: no threads, no gRPC.
//
// Not thread-safe: the agent calls it under its own mutex.

#include <cstddef>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"

namespace concord::agent {

struct BatchPolicy {
  // The workers' heartbeat interval.
  absl::Duration interval = absl::Seconds(1);
  // The longest a heartbeat waits for the rest of the node's.
  absl::Duration max_delay = absl::Milliseconds(250);
  // A worker not heard from for this long (after it was due) is forgotten.
  absl::Duration expect_within = absl::Seconds(3);
  // A batch goes out as soon as it holds this many.
  size_t max_batch = 4096;
};

template <typename T>

// Note [Heartbeat batching]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// Each worker heartbeats `interval` after the answer to its last heartbeat, and
// the call gives up after an interval. The agent answers the heartbeats it sent
// together at the same moment, so it knows when each of those workers will be
// back: one interval after the batch, as a group. A heartbeat that arrives is
// held for max_delay while
//  (a) another worker is expected back within max_delay / 2 of it (so it
//      arrives inside the hold even a little late), or
//  (b) a group heavier than the pending heartbeats (more workers; equal
//      ones ordered by their least worker id) is expected back within the
//      next interval;
// otherwise, or when the last expected one arrives, they go out as one
// message. (a) merges workers whose phases are close. By (b) a lighter
// group moves max_delay a round towards a heavier one, so that some round
// finds the two within max_delay / 2 and (a) merges them, while the
// heaviest group never waits for a lighter one further than max_delay
// away. Groups only merge, so after about interval / max_delay rounds per
// merge a node's workers heartbeat in phase: one message an interval a
// node (HeartbeatBatcherTest.WorkersFallIntoPhase, 8 workers from random
// phases). A heartbeat waits for nobody it has no reason to expect: a
// worker never answered yet, or one more than max_delay late (it exited,
// or hangs); a worker silent for expect_within is forgotten. max_delay
// must stay well under the interval, after which the worker's call gives
// up; the agent uses a quarter of it. A heartbeat reaches the coordinator
// at most max_delay late, which the heartbeat timeout (several intervals)
// absorbs.

class HeartbeatBatcher {
 public:
  explicit HeartbeatBatcher(BatchPolicy policy) : policy_(policy) {}

  // A heartbeat of `worker` arrived at `now`.
  void Add(const std::string& worker, T item, absl::Time now) {
    if (pending_.empty()) first_ = now;
    pending_.push_back({worker, std::move(item)});
    ++pending_of_[worker];
  }

  // `worker` went away (its process ended): not waited for any more.
  void Forget(const std::string& worker) { expected_.erase(worker); }

  // When the pending heartbeats are due to go out (InfiniteFuture with
  // none): max_delay after the oldest while a worker without one pending
  // is expected back within max_delay / 2 of it, or a group heavier than the
  // pending one is expected back within the next interval; else (or with
  // the batch full) at once.
  absl::Time Due(absl::Time now) const {
    if (pending_.empty()) return absl::InfiniteFuture();
    if (pending_.size() >= policy_.max_batch) return first_;
    const absl::Time hold = first_ + policy_.max_delay;
    // Half of max_delay: one expected within it arrives inside the hold
    // even a little late.
    const absl::Time soon = first_ + policy_.max_delay / 2;
    // Groups expected ahead: when back, how many, the least worker id.
    std::map<absl::Time, std::pair<size_t, const std::string*>> ahead;
    for (const auto& [worker, back] : expected_) {
      if (pending_of_.count(worker) != 0) continue;
      if (back < first_ - policy_.max_delay) continue;  // late: not waited for
      if (back <= soon) return hold;                    // about to arrive
      if (back > hold + policy_.interval) continue;
      auto& group = ahead[back];
      if (group.first++ == 0) group.second = &worker;  // ids come in order
    }
    const size_t mine = pending_of_.size();
    const std::string& my_least = pending_of_.begin()->first;
    for (const auto& [back, group] : ahead) {
      if (group.first > mine ||
          (group.first == mine && *group.second < my_least)) {
        return hold;
      }
    }
    return first_;
  }

  // The pending heartbeats, oldest first, if they are due at `now`; else
  // none. Their workers are expected back an interval after `now`.
  std::vector<std::pair<std::string, T>> TakeIfDue(absl::Time now) {
    if (Due(now) > now) return {};
    return TakeAll(now);
  }
  std::vector<std::pair<std::string, T>> TakeAll(absl::Time now) {
    std::vector<std::pair<std::string, T>> out = std::move(pending_);
    pending_.clear();
    pending_of_.clear();
    for (auto it = expected_.begin(); it != expected_.end();) {
      it = now - it->second > policy_.expect_within ? expected_.erase(it)
                                                    : std::next(it);
    }
    for (const auto& [worker, item] : out) {
      expected_[worker] = now + policy_.interval;
    }
    return out;
  }

  size_t pending() const { return pending_.size(); }
  // Workers whose return is predicted (answered, not forgotten).
  size_t known() const { return expected_.size(); }

 private:
  BatchPolicy policy_;
  std::vector<std::pair<std::string, T>> pending_;
  std::map<std::string, int> pending_of_;  // pending heartbeats by worker
  // When each worker answered lately is expected back.
  std::map<std::string, absl::Time> expected_;
  absl::Time first_;  // arrival of the oldest pending heartbeat
};

}  // namespace concord::agent
