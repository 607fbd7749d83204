#include "coordinator/host/host.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace concord::coordinator {

CoreHost::CoreHost(const Clock* clock, Store* store, Metrics* metrics)
    : core_(clock), store_(store), metrics_(metrics) {
  timer_ = std::thread([this] { TimerLoop(); });
}

CoreHost::~CoreHost() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    timer_stop_ = true;
  }
  timer_cv_.notify_all();
  timer_.join();
}

absl::Status CoreHost::Restore() {
  if (store_ == nullptr) return absl::OkStatus();
  absl::StatusOr<std::vector<v1::JobRecord>> records = store_->LoadAll();
  if (!records.ok()) return records.status();
  std::lock_guard<std::mutex> lock(mu_);
  for (const v1::JobRecord& record : *records) {
    absl::Status s = core_.RestoreJob(record);
    if (!s.ok()) return s;
    spdlog::info("restored job {}: generation {}, state {}",
                 record.spec().job_id(), record.generation(),
                 v1::JobState_Name(record.state()));
    // Its events were written by the replica that made them.
    history_written_[record.spec().job_id()] =
        core_.LastEventSeq(record.spec().job_id());
  }
  core_.TakeDirtyJobs();
  return absl::OkStatus();
}

CoreHost::Lock::~Lock() {
  host_->AfterChange();
  std::vector<std::function<void()>> work = std::move(host_->deferred_);
  host_->deferred_.clear();
  lock_.unlock();
  host_->RunDeferred(std::move(work));
}

void CoreHost::RunDeferred(std::vector<std::function<void()>> work) {
  for (std::function<void()>& fn : work) fn();
}

void CoreHost::SaveDirty(bool arrivals) {
  for (std::string& id : core_.TakeDirtyJobs(arrivals)) {
    unsaved_.insert(std::move(id));
  }
  for (auto it = unsaved_.begin(); it != unsaved_.end();) {
    std::optional<v1::JobRecord> record;
    if (store_ != nullptr) record = core_.ExportJob(*it);
    absl::Status s =
        record.has_value() ? store_->Save(*record) : absl::OkStatus();
    if (s.ok()) {
      Saved(*it);
      it = unsaved_.erase(it);
      continue;
    }
    spdlog::error("cannot save job {}: {} (retrying)", *it, s.ToString());
    if (metrics_ != nullptr) metrics_->RecordStoreError();
    ++it;
  }
}

void CoreHost::Saved(const std::string& job_id) {
  if (history_ != nullptr) {
    int64_t& written = history_written_[job_id];
    int64_t lost = 0;
    std::vector<Event> events = core_.EventsAfter(job_id, written, &lost);
    if (!events.empty() || lost > 0) {
      history_->Write(job_id, events, lost);
      written = core_.LastEventSeq(job_id);
    }
  }
  if (held_.erase(job_id) > 0) released_.push_back(job_id);
}

bool CoreHost::Answerable(const std::string& job_id) {
  if (!core_.Dirty(job_id) && unsaved_.count(job_id) == 0) return true;
  held_.insert(job_id);
  return false;
}

void CoreHost::AfterChange() {
  SaveDirty(/*arrivals=*/false);
  // A poll may change the core again (a watch stream opening or closing):
  // until nothing more woke.
  while (true) {
    std::vector<std::string> released = std::move(released_);
    released_.clear();
    std::vector<std::string> woken = core_.TakeWokenJobs();
    if (released.empty() && woken.empty()) break;
    PollJobs(released, /*all=*/true);
    PollJobs(woken, /*all=*/false);
    SaveDirty(/*arrivals=*/false);
  }
}

void CoreHost::PollJobs(const std::vector<std::string>& jobs, bool all) {
  for (const std::string& job_id : jobs) {
    // Not saved: its waiters wait for the save (Saved releases them).
    if (!Answerable(job_id)) continue;
    auto it = by_job_.find(job_id);
    if (it == by_job_.end()) continue;
    const JobEpochs now = core_.Epochs(job_id);
    JobEpochs& seen = it->second.seen;
    const bool moved[3] = {all || now.placement != seen.placement,
                           all || now.kv != seen.kv,
                           all || now.view != seen.view};
    seen = now;
    std::vector<WaiterId> due;
    for (int kind = 0; kind < 3; ++kind) {
      if (!moved[kind]) continue;
      due.insert(due.end(), it->second.ids[kind].begin(),
                 it->second.ids[kind].end());
    }
    // `it` may go when its last waiter does.
    for (WaiterId id : due) PollOne(id);
  }
}

void CoreHost::PollOne(WaiterId id) {
  auto it = waiters_.find(id);
  if (it == waiters_.end()) return;
  if (it->second.waiter->Poll(core_)) Remove(id);
}

void CoreHost::Remove(WaiterId id) {
  auto it = waiters_.find(id);
  if (it == waiters_.end()) return;
  deadlines_.erase({it->second.deadline, id});
  auto job = by_job_.find(it->second.job_id);
  if (job != by_job_.end()) {
    job->second.ids[static_cast<int>(it->second.kind)].erase(id);
    bool empty = true;
    for (const auto& ids : job->second.ids) empty = empty && ids.empty();
    if (empty) by_job_.erase(job);
  }
  waiters_.erase(it);
}

CoreHost::WaiterId CoreHost::Wait(const std::string& job_id, WaitKind kind,
                                  absl::Time deadline, Waiter* waiter) {
  if (shutting_down_) {
    waiter->Abandon(absl::UnavailableError("the coordinator is shutting down"));
    return 0;
  }
  if (Answerable(job_id) && waiter->Poll(core_)) return 0;
  const WaiterId id = next_id_++;
  auto [job, inserted] = by_job_.try_emplace(job_id);
  // A new group has seen nothing yet: what it waits on is now.
  if (inserted) job->second.seen = core_.Epochs(job_id);
  job->second.ids[static_cast<int>(kind)].insert(id);
  const bool nearest =
      deadlines_.empty() || deadline < deadlines_.begin()->first;
  deadlines_.insert({deadline, id});
  waiters_.emplace(id, Entry{job_id, kind, deadline, waiter});
  if (nearest) timer_cv_.notify_all();
  return id;
}

bool CoreHost::Cancel(WaiterId id) {
  if (waiters_.count(id) == 0) return false;
  Remove(id);
  return true;
}

void CoreHost::Defer(std::function<void()> fn) {
  deferred_.push_back(std::move(fn));
}

size_t CoreHost::waiter_count() {
  std::lock_guard<std::mutex> lock(mu_);
  return waiters_.size();
}

void CoreHost::TimerLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!timer_stop_) {
    if (deadlines_.empty()) {
      timer_cv_.wait(lock);
      continue;
    }
    const absl::Time next = deadlines_.begin()->first;
    const absl::Time now = absl::Now();
    if (next > now) {
      // Capped: a watch stream waits forever (absl::InfiniteFuture).
      timer_cv_.wait_for(lock, absl::ToChronoNanoseconds(
                                   std::min(next - now, absl::Hours(1))));
      continue;
    }
    while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
      const WaiterId id = deadlines_.begin()->second;
      Waiter* waiter = waiters_.at(id).waiter;
      Remove(id);
      waiter->Abandon(absl::DeadlineExceededError("the wait timed out"));
    }
    AfterChange();  // an abandoned watch may have changed the core
    std::vector<std::function<void()>> work = std::move(deferred_);
    deferred_.clear();
    lock.unlock();
    RunDeferred(std::move(work));
    lock.lock();
  }
}

void CoreHost::Tick() {
  Lock lock(this);
  core_.Tick();
  SaveDirty(/*arrivals=*/true);  // See Note [Persistence]: the grouped arrivals
}

void CoreHost::Shutdown() {
  std::vector<std::function<void()>> work;
  {
    std::lock_guard<std::mutex> lock(mu_);
    shutting_down_ = true;
    SaveDirty(/*arrivals=*/true);
    while (!waiters_.empty()) {
      const WaiterId id = waiters_.begin()->first;
      Waiter* waiter = waiters_.begin()->second.waiter;
      Remove(id);
      waiter->Abandon(
          absl::UnavailableError("the coordinator is shutting down"));
    }
    work = std::move(deferred_);
    deferred_.clear();
  }
  RunDeferred(std::move(work));
}

}  // namespace concord::coordinator
