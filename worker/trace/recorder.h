#pragma once
// Timelines in Chrome's trace-event format (Perfetto, chrome://tracing):
// what a worker did when — forward, backward, each bucket's allreduce, the
// optimizer step — on a track of its rank.
//
// Note [Trace files]
// ~~~~~~~~~~~~~~~~~~
// One file per worker process, in the JSON Array Format with one event per
// line: "[", the first event, then ",{event}" lines, and "]" when the recorder
// is closed. Each line is written with one write(2) as the event ends, so a
// worker killed at any point leaves a file that Chrome and Perfetto open (the
// format allows the missing "]") and that MergeTraceFiles (merge.h) reads up to
// the last whole line. Timestamps are CLOCK_REALTIME in microseconds, which the
// processes of one host share, so the files of a job's workers merge into one
// timeline without shifting. Tracks: pid = the rank in the current generation
// ("rank R", labelled with the worker id), tid 0 = the training thread
// (forward, backward, optimizer, the wait for the buckets), tid 1 + b = bucket
// b's allreduce (from its launch to its completion; buckets overlap one
// another, so each has a track of its own). A generation change is a global
// instant event.
//
// Cost when off: the library holds a null std::shared_ptr<Recorder>; every
// instrumentation point is one pointer test.
//
// Threads: every method may be called from any thread.

#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace concord::trace {

// Microseconds since the Unix epoch (CLOCK_REALTIME).
int64_t NowMicros();

// Numeric event arguments ("args" of the event), e.g. {"step", 12}.
using Args = std::vector<std::pair<std::string, int64_t>>;

class Recorder {
 public:
  static constexpr int kTrainThread = 0;
  // Bucket b's allreduce track.
  static int BucketThread(size_t bucket) {
    return 1 + static_cast<int>(bucket);
  }

  // Creates (truncates) `path`; `label` names the writer (the worker id) in
  // the track names. INVALID_ARGUMENT with the path and the reason when the
  // file cannot be created.
  static absl::StatusOr<std::shared_ptr<Recorder>> Create(
      const std::string& path, std::string label);
  // Writes the closing "]".
  ~Recorder();
  Recorder(const Recorder&) = delete;
  Recorder& operator=(const Recorder&) = delete;

  // Events go to rank `rank`'s track from now on. Names the track the first
  // time this recorder uses it, and marks the change with an instant event
  // "generation G" (args: generation, rank, world_size).
  void SetGeneration(int64_t generation, int rank, int world_size);
  // The training step that events are tagged with (args.step), 0 until set.
  void SetStep(int64_t step);
  int64_t step() const;
  // The rank events go to now (0 until SetGeneration).
  int rank() const;

  // A complete ("X") event on thread track `tid` of rank `rank` (-1: the
  // current one), tagged with the current step unless `args` has one.
  void Complete(std::string_view name, int tid, int64_t start_us,
                int64_t end_us, Args args = {}, int rank = -1);
  // An instant ("i") event on the training track; global = drawn across
  // every track.
  void Instant(std::string_view name, Args args = {}, bool global = false);
  // Names thread track `tid` of the current rank (once per rank and tid).
  void NameThread(int tid, std::string_view name);

  // Times a scope as a complete event on the training track. A null
  // recorder makes it do nothing.
  class Span {
   public:
    Span(const std::shared_ptr<Recorder>& recorder, std::string_view name,
         int tid = kTrainThread)
        : recorder_(recorder.get()),
          name_(recorder_ != nullptr ? name : std::string_view()),
          tid_(tid),
          start_(recorder_ != nullptr ? NowMicros() : 0) {}
    ~Span() {
      if (recorder_ != nullptr) {
        recorder_->Complete(name_, tid_, start_, NowMicros());
      }
    }
    Span(const Span&) = delete;
    Span& operator=(const Span&) = delete;

   private:
    Recorder* recorder_;
    std::string_view name_;  // a literal, or a string outliving the span
    int tid_;
    int64_t start_;
  };

 private:
  Recorder(int fd, std::string label) : fd_(fd), label_(std::move(label)) {}
  // Appends one event line (the caller holds mu_).
  void WriteLocked(const std::string& event_json);
  void NameThreadLocked(int tid, std::string_view name);

  const int fd_;
  const std::string label_;
  mutable std::mutex mu_;
  bool first_ = true;
  int rank_ = 0;
  int64_t step_ = 0;
  std::set<int> named_processes_;
  std::set<std::pair<int, int>> named_threads_;  // (rank, tid)
};

}  // namespace concord::trace
