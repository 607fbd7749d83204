#pragma once
// The Core behind one mutex, shared by the worker and operator services:
// serialises access, answers pending calls after every change, and writes
// changed jobs to the Store before a mutating call returns (see Note
// [Persistence] in core.h).
//
// Thread-safety: every method may be called from any thread, except where
// it says "with mu() held".

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "coordinator/core/core.h"
#include "coordinator/metrics/metrics.h"
#include "coordinator/store/history_file.h"
#include "coordinator/store/store.h"

namespace concord::coordinator {

// Note [Asynchronous waits]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// A call that waits on the core (Join until its generation forms, KvGet until
// its keys are set, a WatchMembership stream until the view changes) holds no
// thread. It is a Waiter registered with the host under its job, with one of
// three kinds (placement, kv, view) and a deadline. After every change the host
// takes the jobs the core woke (Core::TakeWokenJobs) and re-asks only the
// waiters of those jobs whose kind's epoch moved (Core::Epochs): an arriving
// worker re-asks no other Join, a formed generation answers all its waiters in
// one pass, a KvSet re-asks only that job's KvGets. A waiter is re-asked under
// the mutex and never calls into gRPC there: what it has to send or finish it
// hands to Defer(), and the host runs those after releasing the mutex. A waiter
// is removed exactly once: answered by its poll, cancelled (Cancel, from the
// call's OnCancel), expired at its deadline (one timer thread for all), or
// abandoned at shutdown (UNAVAILABLE).
//
// A job whose save failed (the store unreachable, or this replica no longer
// leads) keeps its waiters unanswered: nothing the store does not hold is
// told to a worker (a successor would not know it). They are answered once
// a retried save succeeds (Tick), or abandoned (UNAVAILABLE) at shutdown,
// and the worker asks the next replica.

class CoreHost {
 public:
  // A pending call (see Note [Asynchronous waits]). Both methods run with mu()
  // held and must not call into gRPC (use Defer).
  class Waiter {
   public:
    virtual ~Waiter() = default;
    // Re-asks the core; true when the call is answered and the waiter is
    // to be removed.
    virtual bool Poll(Core& core) = 0;
    // The host removed the waiter without an answer: its deadline passed
    // (DEADLINE_EXCEEDED) or the coordinator is shutting down (UNAVAILABLE).
    virtual void Abandon(absl::Status status) = 0;
  };
  enum class WaitKind { kPlacement, kKv, kView };
  using WaiterId = uint64_t;

  // `store` and `metrics` may be null; both, and `clock`, must outlive this.
  CoreHost(const Clock* clock, Store* store, Metrics* metrics);
  // Stops the timer thread; call Shutdown first to answer pending waiters.
  ~CoreHost();
  CoreHost(const CoreHost&) = delete;
  CoreHost& operator=(const CoreHost&) = delete;

  // Loads every record from the store into the core. Call once, before
  // serving (after SetHistory). Errors: those of Store::LoadAll and
  // Core::RestoreJob.
  absl::Status Restore();
  // Where saved events go (see Note [Coordinator history] in
  // store/history_file.h); null: nowhere. Must outlive this; call before
  // Restore.
  void SetHistory(HistoryFile* history) { history_ = history; }

  // Holds mu(); on destruction saves what changed, re-asks the woken
  // waiters, releases the mutex and then runs what they deferred.
  class Lock {
   public:
    explicit Lock(CoreHost* host) : host_(host), lock_(host->mu_) {}
    ~Lock();
    Lock(const Lock&) = delete;
    Lock& operator=(const Lock&) = delete;

   private:
    CoreHost* host_;
    std::unique_lock<std::mutex> lock_;
  };

  // Runs `fn(core)` under the mutex, saves what it changed, answers waiters.
  template <typename Fn>
  auto Mutate(Fn&& fn) {
    Lock lock(this);
    return std::forward<Fn>(fn)(core_);
  }
  // Runs `fn(core)` under the mutex; `fn` must not change the core.
  template <typename Fn>
  auto Read(Fn&& fn) {
    std::lock_guard<std::mutex> lock(mu_);
    return std::forward<Fn>(fn)(static_cast<const Core&>(core_));
  }

  // With mu() held (inside Mutate or a Lock): polls `waiter` once (when
  // Answerable) and, unless that answered it, registers it under `job_id`
  // until `deadline`. Returns its id, or 0 when it was answered at once. While
  // shutting down the waiter is abandoned at once (UNAVAILABLE) and 0 returned.
  // The waiter must outlive its registration.
  WaiterId Wait(const std::string& job_id, WaitKind kind, absl::Time deadline,
                Waiter* waiter);
  // With mu() held: whether `job_id`'s waiters may be answered now: none of
  // its changes waits to be saved. When not, its waiters are polled (all of
  // them) once it is saved.
  bool Answerable(const std::string& job_id);
  // With mu() held: removes a registered waiter without answering it (its
  // call was cancelled). False when it is no longer registered (answered,
  // expired or abandoned already).
  bool Cancel(WaiterId id);
  // With mu() held: runs `fn` once the mutex is released (gRPC writes and
  // finishes of waiters).
  void Defer(std::function<void()> fn);

  // Only with mu() held.
  Core& core() { return core_; }
  bool shutting_down() const { return shutting_down_; }
  // Registered waiters (for tests and metrics).
  size_t waiter_count();

  // Runs Core::Tick, retries failed saves, answers waiters.
  void Tick();
  // Abandons every waiter (UNAVAILABLE) and refuses new ones. Idempotent.
  void Shutdown();

 private:
  struct Entry {
    std::string job_id;
    WaitKind kind;
    absl::Time deadline;
    Waiter* waiter;
  };
  struct JobWaiters {
    JobEpochs seen;
    std::set<WaiterId> ids[3];  // by WaitKind
  };

  // With mu() held: saves dirty jobs and re-asks the woken waiters.
  void AfterChange();
  // Saves the dirty jobs; with `arrivals`, also those whose only changes
  // were arrivals (see Note [Persistence] in core.h).
  void SaveDirty(bool arrivals);
  // `job_id` was saved: its new events go to the history, held waiters are
  // released.
  void Saved(const std::string& job_id);
  // Polls the waiters of `jobs`: all of them, or (`all` false) those whose
  // kind's epoch moved.
  void PollJobs(const std::vector<std::string>& jobs, bool all);
  // With mu() held: polls `id`; removes it when answered.
  void PollOne(WaiterId id);
  void Remove(WaiterId id);
  void TimerLoop();
  // Runs and clears the deferred work; without mu() held.
  void RunDeferred(std::vector<std::function<void()>> work);

  std::mutex mu_;
  Core core_;
  Store* store_;
  Metrics* metrics_;
  std::set<std::string> unsaved_;  // failed saves, retried on Tick
  // Woken while unsaved: their waiters are polled once saved.
  std::set<std::string> held_;
  std::vector<std::string> released_;  // saved since: to poll
  HistoryFile* history_ = nullptr;
  std::map<std::string, int64_t> history_written_;  // last event seq
  bool shutting_down_ = false;

  WaiterId next_id_ = 1;
  std::map<WaiterId, Entry> waiters_;
  std::map<std::string, JobWaiters> by_job_;
  std::set<std::pair<absl::Time, WaiterId>> deadlines_;
  std::vector<std::function<void()>> deferred_;

  std::condition_variable timer_cv_;  // a nearer deadline, or stopping
  bool timer_stop_ = false;
  std::thread timer_;
};

}  // namespace concord::coordinator
