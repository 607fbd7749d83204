#include "worker/comm/work.h"

#include <chrono>
#include <memory>

namespace concord::comm {

bool PromiseWork::IsCompleted() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

absl::Status PromiseWork::Wait(absl::Duration timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (timeout == absl::InfiniteDuration()) {
    cv_.wait(lock, [this] { return done_; });
  } else if (!cv_.wait_for(lock, absl::ToChronoNanoseconds(timeout),
                           [this] { return done_; })) {
    return absl::DeadlineExceededError(
        "collective did not finish within " + absl::FormatDuration(timeout));
  }
  return status_;
}

void PromiseWork::Abort() { MarkDone(absl::AbortedError("collective aborted")); }

void PromiseWork::MarkDone(absl::Status status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return;
    done_ = true;
    status_ = std::move(status);
  }
  cv_.notify_all();
}

std::shared_ptr<PromiseWork> PromiseWork::Done(absl::Status status) {
  auto work = std::make_shared<PromiseWork>();
  work->MarkDone(std::move(status));
  return work;
}

}  // namespace concord::comm
