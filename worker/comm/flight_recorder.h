#pragma once
// Note [Flight recorder]
// ~~~~~~~~~~~~~~~~~~~~~~
// A worker's record of its collectives, live (c10d's flight recorder is read
// after the fact): every collective issued on a communicator of the current
// generation (RecordedCommunicator wraps the generation's communicator and
// its groups), numbered 1, 2, ... on the generation's own communicator (the
// members issue them in the same order, so the numbers compare across
// members), with its kind, bytes, and when it was issued and ended. The
// heartbeat thread polls it once a beat (Poll: a Work's IsCompleted never
// blocks, and CompletedAt gives the true end): the number issued, the oldest
// still in flight and for how long, and the last one that ended go to the
// coordinator with every heartbeat (worker.proto's WorkerProgress), from
// which it tells a member that waits from one that hangs (see Note [Hangs] in
// coordinator/core/hang_rule.h). The last kKept entries are kept for
// Recent(), whatever their generation.

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "worker/comm/communicator.h"
#include "worker/comm/work.h"

namespace concord::comm {

struct CollectiveRecord {
  int64_t generation = 0;
  int64_t seq = 0;  // on the generation's communicator; 0 on a group
  std::string kind;
  int64_t bytes = 0;
  absl::Time issued;
  std::optional<absl::Time> ended;
};

class FlightRecorder {
 public:
  static constexpr size_t kKept = 64;

  // A communicator of `generation` begins: numbering starts again at 1
  // (a newer generation only; an older one's late collectives are kept
  // out of the counts).
  void BeginGeneration(int64_t generation);
  // A collective issued on a communicator of `generation` (`main`: the
  // generation's own, else one of its groups), running as `work`.
  void Issued(int64_t generation, bool main, const char* kind, int64_t bytes,
              const std::shared_ptr<Work>& work);

  struct Snapshot {
    int64_t generation = 0;
    int64_t collectives = 0;  // issued on the generation's communicator
    // The oldest collective of the generation in flight.
    std::optional<CollectiveRecord> pending;
    // The last one that ended (of any generation).
    std::optional<CollectiveRecord> last;
  };
  // Looks at the works in flight (never blocks) and says where things stand.
  Snapshot Poll(absl::Time now);
  // The last kKept collectives, oldest first (as of the last Poll for their
  // ends).
  std::vector<CollectiveRecord> Recent() const;
  // Time threads spent blocked in Wait/Synchronize of recorded works, in
  // all (RecordedCommunicator's works add to it).
  void Waited(absl::Duration d);
  absl::Duration waited() const;

 private:
  struct Entry {
    CollectiveRecord record;
    std::weak_ptr<Work> work;
  };
  // Moves the entries whose work ended into done_ (mu_ held).
  void Sweep(absl::Time now);

  mutable std::mutex mu_;
  int64_t generation_ = 0;
  int64_t collectives_ = 0;
  std::deque<Entry> in_flight_;        // in issue order
  std::deque<CollectiveRecord> done_;  // the last kKept that ended
  absl::Duration waited_;
};

// A communicator whose collectives a FlightRecorder records, and the time
// its callers spend waiting for them; everything else is the inner one's.
// `main`: the generation's own communicator (its collectives are numbered),
// else a group of it.
class RecordedCommunicator final : public Communicator {
 public:
  RecordedCommunicator(std::shared_ptr<Communicator> inner,
                       std::shared_ptr<FlightRecorder> recorder, bool main);
  // Once aborted, the inner communicator is let go on a thread of its own:
  // its destructor waits for the operation in flight, and a collective that
  // waits on a peer that hangs alive (its connections open, unlike a dead
  // one's) ends only at its timeout. Whoever drops the last reference (the
  // training thread, at a re-form) must not wait for that.
  ~RecordedCommunicator() override;

  // The communicator this one records (for a derivation from it: see Note
  // [Re-forming NCCL]); `c` itself when it is not a RecordedCommunicator.
  static std::shared_ptr<Communicator> Inner(
      const std::shared_ptr<Communicator>& c);

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  int64_t generation() const override { return inner_->generation(); }
  std::shared_ptr<Work> AllreduceSum(at::Tensor tensor,
                                     const CollectiveOptions& options) override;
  std::shared_ptr<Work> Broadcast(at::Tensor tensor, int root,
                                  const CollectiveOptions& options) override;
  std::shared_ptr<Work> Allgather(at::Tensor output, at::Tensor input,
                                  const CollectiveOptions& options) override;
  std::shared_ptr<Work> ReduceSum(at::Tensor tensor, int root,
                                  const CollectiveOptions& options) override;
  std::shared_ptr<Work> Exchange(at::Tensor send, std::vector<int> to,
                                 std::vector<at::Tensor> recv,
                                 std::vector<int> from,
                                 const CollectiveOptions& options) override;
  void Abort() override {
    aborted_.store(true);
    inner_->Abort();
  }

 private:
  std::shared_ptr<Work> Record(const char* kind, int64_t bytes,
                               std::shared_ptr<Work> work);

  std::shared_ptr<Communicator> inner_;
  std::shared_ptr<FlightRecorder> recorder_;
  bool main_;
  std::atomic<bool> aborted_{false};
};

}  // namespace concord::comm
