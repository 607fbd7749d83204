#pragma once
// concord-train's progress output: one line per --log-interval steps, or on
// a terminal a bar redrawn in place.

#include <spdlog/sinks/sink.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <ostream>
#include <string>

namespace concord::train {

struct ProgressLine {
  int64_t epoch = 1;  // 1-based
  int64_t epochs = 1;
  int64_t step = 0;
  int64_t total_steps = 0;  // the job's, at the current world size
  double loss = 0;
  double samples_per_second = 0;
  int64_t generation = 0;
  int world_size = 1;
};

// "epoch E/EPOCHS step S/TOTAL loss L samples/s X generation G world W".
std::string FormatProgressLine(const ProgressLine& p);

// Optimizer steps from `position` to the end of an epoch of `samples`
// samples (elastic sharding: each step takes world x batch of them, a tail
// smaller than the world goes with the step before; `accumulation`
// micro-batches per step).
int64_t StepsToEpochEnd(int64_t samples, int64_t position, int world,
                        int64_t batch, int64_t accumulation);

// Threads: Update on the training thread; BreakLine from any (logging).
class Progress {
 public:
  // `terminal`: draw a bar in place ('\r', erase to the end of the line)
  // instead of printing lines.
  Progress(std::ostream& out, bool terminal) : out_(out), terminal_(terminal) {}

  bool terminal() const { return terminal_; }
  void Update(const ProgressLine& p);
  // Ends the bar's line (if one is drawn) so that what comes next starts on
  // a line of its own; the next Update draws a new bar.
  void BreakLine();
  // Ends the bar's line, then runs `write` (which prints whole lines
  // elsewhere, e.g. on stderr) before the bar can be drawn again.
  void WithLineBroken(const std::function<void()>& write);
  // Prints `line` (and a newline) on a line of its own.
  void PrintLine(const std::string& line);

  // A spdlog sink that ends the bar's line before every log line it passes
  // on to `inner`.
  std::shared_ptr<spdlog::sinks::sink> WrapSink(
      std::shared_ptr<spdlog::sinks::sink> inner);

 private:
  void BreakLineLocked();

  std::ostream& out_;
  const bool terminal_;
  std::mutex mu_;
  bool bar_open_ = false;
};

}  // namespace concord::train
