#include "coordinator/host.h"

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"

namespace concord::coordinator {

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
  }
  core_.TakeDirtyJobs();
  return absl::OkStatus();
}

void CoreHost::SaveDirty() {
  for (std::string& id : core_.TakeDirtyJobs()) unsaved_.insert(std::move(id));
  if (store_ == nullptr) {
    unsaved_.clear();
    return;
  }
  for (auto it = unsaved_.begin(); it != unsaved_.end();) {
    std::optional<v1::JobRecord> record = core_.ExportJob(*it);
    absl::Status s =
        record.has_value() ? store_->Save(*record) : absl::OkStatus();
    if (s.ok()) {
      it = unsaved_.erase(it);
      continue;
    }
    spdlog::error("cannot save job {}: {} (retrying)", *it, s.ToString());
    if (metrics_ != nullptr) metrics_->RecordStoreError();
    ++it;
  }
}

void CoreHost::AfterChange() {
  SaveDirty();
  changed_.notify_all();
}

void CoreHost::WaitForChange(std::unique_lock<std::mutex>& lock, uint64_t seen,
                             absl::Duration max) {
  changed_.wait_for(lock, absl::ToChronoNanoseconds(max), [&] {
    return shutting_down_ || core_.membership_version() != seen;
  });
}

void CoreHost::Tick() {
  std::lock_guard<std::mutex> lock(mu_);
  core_.Tick();
  AfterChange();
}

void CoreHost::Shutdown() {
  std::lock_guard<std::mutex> lock(mu_);
  shutting_down_ = true;
  changed_.notify_all();
}

}  // namespace concord::coordinator
