#include "tools/progress.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_format.h"

namespace concord::train {

std::string FormatProgressLine(const ProgressLine& p) {
  return absl::StrFormat(
      "epoch %d/%d step %d/%d loss %.6f samples/s %.1f generation %d world "
      "%d",
      p.epoch, p.epochs, p.step, p.total_steps, p.loss, p.samples_per_second,
      p.generation, p.world_size);
}

int64_t StepsToEpochEnd(int64_t samples, int64_t position, int world,
                        int64_t batch, int64_t accumulation) {
  // The same windows as concord-train's elastic_batch.
  auto window = [&](int64_t pos) {
    const int64_t remaining = samples - pos;
    int64_t take = std::min<int64_t>(world * batch, remaining);
    if (remaining - take < world) take = remaining;
    return take;
  };
  int64_t steps = 0;
  while (position < samples) {
    for (int64_t micro = 1; micro < accumulation; ++micro) {
      const int64_t take = window(position);
      if (position + take >= samples) break;
      position += take;
    }
    position += window(position);
    ++steps;
  }
  return steps;
}

void Progress::Update(const ProgressLine& p) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!terminal_) {
    out_ << FormatProgressLine(p) << std::endl;
    return;
  }
  constexpr int kWidth = 24;
  const double done = p.total_steps > 0
                          ? std::clamp(static_cast<double>(p.step) /
                                           static_cast<double>(p.total_steps),
                                       0.0, 1.0)
                          : 0.0;
  const int filled = static_cast<int>(std::floor(done * kWidth));
  const std::string bar =
      std::string(static_cast<size_t>(filled), '#') +
      std::string(static_cast<size_t>(kWidth - filled), '.');
  // '\r' back to the line's start, the bar, then erase what a longer
  // previous bar left (ESC [ K).
  out_ << absl::StrFormat("\r[%s] %3.0f%% %s\x1b[K", bar, done * 100,
                          FormatProgressLine(p))
       << std::flush;
  bar_open_ = true;
}

void Progress::BreakLineLocked() {
  if (!bar_open_) return;
  out_ << "\n" << std::flush;
  bar_open_ = false;
}

void Progress::BreakLine() {
  std::lock_guard<std::mutex> lock(mu_);
  BreakLineLocked();
}

void Progress::WithLineBroken(const std::function<void()>& write) {
  std::lock_guard<std::mutex> lock(mu_);
  BreakLineLocked();
  write();
}

void Progress::PrintLine(const std::string& line) {
  std::lock_guard<std::mutex> lock(mu_);
  BreakLineLocked();
  out_ << line << std::endl;
}

namespace {

class BreakingSink final : public spdlog::sinks::sink {
 public:
  BreakingSink(Progress* progress, std::shared_ptr<spdlog::sinks::sink> inner)
      : progress_(progress), inner_(std::move(inner)) {}
  void log(const spdlog::details::log_msg& msg) override {
    progress_->WithLineBroken([&] { inner_->log(msg); });
  }
  void flush() override { inner_->flush(); }
  void set_pattern(const std::string& pattern) override {
    inner_->set_pattern(pattern);
  }
  void set_formatter(std::unique_ptr<spdlog::formatter> f) override {
    inner_->set_formatter(std::move(f));
  }

 private:
  Progress* progress_;
  std::shared_ptr<spdlog::sinks::sink> inner_;
};

}  // namespace

std::shared_ptr<spdlog::sinks::sink> Progress::WrapSink(
    std::shared_ptr<spdlog::sinks::sink> inner) {
  return std::make_shared<BreakingSink>(this, std::move(inner));
}

}  // namespace concord::train
