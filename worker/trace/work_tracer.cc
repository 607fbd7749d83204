#include "worker/trace/work_tracer.h"

#include <algorithm>
#include <optional>
#include <utility>

namespace concord::trace {

WorkTracer::WorkTracer(std::shared_ptr<Recorder> recorder)
    : recorder_(std::move(recorder)), thread_([this] { Loop(); }) {}

WorkTracer::~WorkTracer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void WorkTracer::Watch(std::shared_ptr<comm::Work> work, std::string name,
                       int tid, Args args) {
  Pending p{std::move(work), std::move(name), tid,
            std::move(args), NowMicros(),     recorder_->rank()};
  bool has_step = false;
  for (const auto& [key, value] : p.args) has_step |= key == "step";
  if (!has_step) p.args.emplace_back("step", recorder_->step());
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(p));
  }
  cv_.notify_all();
}

void WorkTracer::Loop() {
  bool stopping = false;
  for (;;) {
    Pending p;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopped, and every work seen to
      stopping = stop_;
      p = std::move(queue_.front());
      queue_.pop_front();
    }
    // Bounded waits, so that a stop is noticed while a collective hangs.
    // Once stopped, the works that have ended are still recorded (a short
    // job may end before this thread first ran) and the others dropped.
    absl::Status s;
    for (;;) {
      s = p.work->Wait(stopping ? absl::ZeroDuration()
                                : absl::Milliseconds(100));
      if (s.code() != absl::StatusCode::kDeadlineExceeded || stopping) break;
      std::lock_guard<std::mutex> lock(mu_);
      stopping = stop_;
    }
    if (s.code() == absl::StatusCode::kDeadlineExceeded) continue;
    if (!s.ok()) p.args.emplace_back("failed", 1);
    // The work's own end where it knows it: this thread may notice late
    // (a loaded machine), and the next step's collective on the same track
    // must not seem to start before this one ended.
    const std::optional<absl::Time> at = p.work->CompletedAt();
    const int64_t end_us =
        std::max(p.start_us, at ? absl::ToUnixMicros(*at) : NowMicros());
    recorder_->Complete(p.name, p.tid, p.start_us, end_us, std::move(p.args),
                        p.rank);
  }
}

}  // namespace concord::trace
