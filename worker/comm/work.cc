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
    return absl::DeadlineExceededError("collective did not finish within " +
                                       absl::FormatDuration(timeout));
  }
  return status_;
}

void PromiseWork::Abort() {
  MarkDone(absl::AbortedError("collective aborted"));
}

void PromiseWork::MarkDone(absl::Status status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return;
    done_ = true;
    status_ = std::move(status);
    completed_at_ = absl::Now();
  }
  cv_.notify_all();
}

std::optional<absl::Time> PromiseWork::CompletedAt() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!done_) return std::nullopt;
  return completed_at_;
}

std::shared_ptr<PromiseWork> PromiseWork::Done(absl::Status status) {
  auto work = std::make_shared<PromiseWork>();
  work->MarkDone(std::move(status));
  return work;
}

namespace {

class ThenWork final : public Work {
 public:
  ThenWork(std::shared_ptr<Work> inner,
           std::function<absl::Status(const Waiter&)> then)
      : inner_(std::move(inner)), then_(std::move(then)) {}

  // Completed = Wait() will not block.
  bool IsCompleted() const override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (done_) return true;
    }
    return inner_->IsCompleted();
  }

  absl::Status Wait(absl::Duration timeout) override {
    return Finish(inner_->Wait(timeout),
                  [timeout](const auto& w) { return w->Wait(timeout); });
  }

  absl::Status Synchronize(absl::Duration timeout) override {
    return Finish(inner_->Synchronize(timeout),
                  [timeout](const auto& w) { return w->Synchronize(timeout); });
  }

  // The collective's end; `then` runs later, on a waiter.
  std::optional<absl::Time> CompletedAt() const override {
    return inner_->CompletedAt();
  }

  void Abort() override {
    inner_->Abort();
    std::lock_guard<std::mutex> lock(mu_);
    if (!done_) {
      done_ = true;
      status_ = absl::AbortedError("collective aborted");
    }
  }

 private:
  // Runs `then` once, after `inner` ended with `s` (its Wait or Synchronize).
  absl::Status Finish(absl::Status s, const Waiter& wait) {
    if (s.code() == absl::StatusCode::kDeadlineExceeded) return s;
    std::lock_guard<std::mutex> lock(mu_);
    if (!done_) {
      done_ = true;
      status_ = s.ok() ? then_(wait) : s;
    }
    return status_;
  }

  std::shared_ptr<Work> inner_;
  std::function<absl::Status(const Waiter&)> then_;
  mutable std::mutex mu_;
  bool done_ = false;
  absl::Status status_;
};

}  // namespace

std::shared_ptr<Work> Then(
    std::shared_ptr<Work> inner,
    std::function<absl::Status(const Waiter& wait)> then) {
  return std::make_shared<ThenWork>(std::move(inner), std::move(then));
}

std::shared_ptr<Work> Then(std::shared_ptr<Work> inner,
                           std::function<absl::Status()> then) {
  return Then(std::move(inner),
              [then = std::move(then)](const Waiter&) { return then(); });
}

}  // namespace concord::comm
