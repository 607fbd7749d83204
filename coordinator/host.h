#pragma once
// The Core behind one mutex, shared by the worker and operator services:
// serialises access, wakes blocked calls after every change, and writes
// changed jobs to the Store before a mutating call returns (Note
// [Persistence] in core.h).
//
// Thread-safety: every method may be called from any thread.

#include <grpcpp/server_context.h>

#include <condition_variable>
#include <mutex>
#include <set>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "coordinator/core.h"
#include "coordinator/metrics.h"
#include "coordinator/store.h"

namespace concord::coordinator {

class CoreHost {
 public:
  // `store` and `metrics` may be null; both, and `clock`, must outlive this.
  CoreHost(const Clock* clock, Store* store, Metrics* metrics)
      : core_(clock), store_(store), metrics_(metrics) {}

  // Loads every record from the store into the core. Call once, before
  // serving. Errors: those of Store::LoadAll and Core::RestoreJob.
  absl::Status Restore();

  // Runs `fn(core)` under the mutex, saves what it changed, wakes waiters.
  template <typename Fn>
  auto Mutate(Fn&& fn) {
    std::unique_lock<std::mutex> lock(mu_);
    Finally done{this};
    return std::forward<Fn>(fn)(core_);
  }
  // Runs `fn(core)` under the mutex; `fn` must not change the core.
  template <typename Fn>
  auto Read(Fn&& fn) {
    std::lock_guard<std::mutex> lock(mu_);
    return std::forward<Fn>(fn)(static_cast<const Core&>(core_));
  }

  // With `lock` (on mu()) held on entry and exit: waits until `poll(core)`
  // (an absl::StatusOr<std::optional<T>>) fails or has a value, re-asking
  // after every change; returns that, or DEADLINE_EXCEEDED after `timeout`
  // or the call's deadline, CANCELLED, UNAVAILABLE (shutting down).
  template <typename Poll>
  auto WaitFor(const grpc::ServerContext& context, absl::Duration timeout,
               std::unique_lock<std::mutex>& lock, Poll poll)
      -> decltype(poll(std::declval<Core&>()));

  // Waits (lock held) until the core's membership_version() differs from
  // `seen`, shutdown begins, or `max` passes.
  void WaitForChange(std::unique_lock<std::mutex>& lock, uint64_t seen,
                     absl::Duration max);

  std::mutex& mu() { return mu_; }
  // Only with mu() held.
  Core& core() { return core_; }
  bool shutting_down() const { return shutting_down_; }
  // Saves dirty jobs and wakes waiters; with mu() held.
  void AfterChange();

  // Runs Core::Tick, retries failed saves, wakes waiters.
  void Tick();
  // Makes blocked calls return UNAVAILABLE promptly. Idempotent.
  void Shutdown();

 private:
  struct Finally {
    CoreHost* host;
    ~Finally() { host->AfterChange(); }
  };
  void SaveDirty();

  std::mutex mu_;
  std::condition_variable changed_;
  Core core_;
  Store* store_;
  Metrics* metrics_;
  std::set<std::string> unsaved_;  // failed saves, retried on Tick
  bool shutting_down_ = false;
};

template <typename Poll>
auto CoreHost::WaitFor(const grpc::ServerContext& context,
                       absl::Duration timeout,
                       std::unique_lock<std::mutex>& lock, Poll poll)
    -> decltype(poll(std::declval<Core&>())) {
  // How often a blocked call looks for cancellation even when nothing
  // changes.
  constexpr absl::Duration kCancelPoll = absl::Milliseconds(200);
  const absl::Time deadline =
      std::min(absl::Now() + timeout, absl::FromChrono(context.deadline()));
  while (true) {
    auto result = poll(core_);
    if (!result.ok() || result->has_value()) return result;
    if (shutting_down_) {
      return absl::UnavailableError("the coordinator is shutting down");
    }
    if (context.IsCancelled()) {
      return absl::CancelledError("the call was cancelled");
    }
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "gave up after waiting ", absl::FormatDuration(timeout)));
    }
    changed_.wait_for(
        lock, absl::ToChronoNanoseconds(std::min(deadline - now, kCancelPoll)));
  }
}

}  // namespace concord::coordinator
