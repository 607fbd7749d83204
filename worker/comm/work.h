#pragma once
// An asynchronous collective's handle (c10d's Work, without exceptions).

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace concord::comm {

class Work {
 public:
  virtual ~Work() = default;

  // True once the collective finished, failed or was aborted. Never blocks.
  virtual bool IsCompleted() const = 0;

  // Blocks until the collective ends or `timeout` passes. Returns:
  //   OK                 - done; the output is valid.
  //   DEADLINE_EXCEEDED  - `timeout` passed first; the work is still running.
  //   UNAVAILABLE        - a peer went away or the transport failed: the
  //                        communicator is broken; abort and re-form.
  //   ABORTED            - Abort() was called.
  //   INVALID_ARGUMENT   - the collective's arguments were bad (a bug).
  // Any thread may call it, several times.
  virtual absl::Status Wait(
      absl::Duration timeout = absl::InfiniteDuration()) = 0;

  // Note [Stream-ordered waits]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // Synchronize() makes the output usable by what the caller issues next,
  // without the host waiting where the collective runs on a device: the current
  // CUDA stream waits (an event, as c10d's WorkNCCL::synchronize does) and
  // kernels queued on it afterwards see the result. Returns a failure already
  // known (the statuses of Wait, never DEADLINE_EXCEEDED); OK does not mean the
  // collective has ended: the communicator's watchdog enforces its timeout by
  // aborting, and a failure shows in later collectives. Where the host must see
  // the data (CPU tensors, staged ones included) it is Wait(timeout), the
  // default.
  virtual absl::Status Synchronize(
      absl::Duration timeout = absl::InfiniteDuration()) {
    return Wait(timeout);
  }

  // Gives up on the collective: Wait() returns ABORTED from now on. What the
  // transport does with the operation in flight is the communicator's
  // business (Gloo lets it run into its timeout; NCCL aborts the
  // communicator). Never blocks.
  virtual void Abort() = 0;

  // When the collective ended (done, failed or aborted), where the work
  // knows: a timeline takes its end from here rather than from when a
  // waiter got round to noticing. nullopt while running or when unknown.
  virtual std::optional<absl::Time> CompletedAt() const { return std::nullopt; }
};

// A Work completed by whoever runs the operation, via MarkDone().
class PromiseWork : public Work {
 public:
  bool IsCompleted() const override;
  absl::Status Wait(absl::Duration timeout) override;
  void Abort() override;
  std::optional<absl::Time> CompletedAt() const override;

  // Records the outcome and wakes waiters; later calls are ignored.
  void MarkDone(absl::Status status);
  // A work that is already done.
  static std::shared_ptr<PromiseWork> Done(absl::Status status);

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  absl::Status status_;
  absl::Time completed_at_;
};

// How a continuation waits for the collectives it issues itself: the way
// its own work was waited for (Wait or Synchronize, with that timeout).
using Waiter = std::function<absl::Status(const std::shared_ptr<Work>&)>;

// A work that completes when `inner` has and `then` has run after it (on the
// first thread that waits for it, once, only when `inner` succeeded): how a
// communication hook decompresses a result. `then`'s status becomes the
// work's. Synchronize() runs `then` after inner's Synchronize(), so `then`
// must only queue device work on the current stream for device tensors (it
// does with ATen ops) and wait for its own collectives with `wait`.
std::shared_ptr<Work> Then(
    std::shared_ptr<Work> inner,
    std::function<absl::Status(const Waiter& wait)> then);
std::shared_ptr<Work> Then(std::shared_ptr<Work> inner,
                           std::function<absl::Status()> then);

}  // namespace concord::comm
