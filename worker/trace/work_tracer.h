#pragma once
// Timing asynchronous collectives for the timeline (see Note [Trace files]).

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "worker/comm/work.h"
#include "worker/trace/recorder.h"

namespace concord::trace {

// Records each watched Work as a complete event from the moment it is
// watched (its launch) to the moment it completes. A thread of its own
// waits for the works in the order they were watched (a communicator
// completes them in issue order), so nothing is added to the thread that
// launches them but a queue push; Work::Wait may be called by several
// threads, and ends for all of them together.
//
// Threads: Watch may be called from any thread.
class WorkTracer {
 public:
  explicit WorkTracer(std::shared_ptr<Recorder> recorder);
  // Stops waiting: the works that have ended are recorded, those still
  // pending are not.
  ~WorkTracer();
  WorkTracer(const WorkTracer&) = delete;
  WorkTracer& operator=(const WorkTracer&) = delete;

  // The event is named `name`, on thread track `tid` of the rank events go
  // to now (a work aborted by a re-form is recorded after the recorder
  // moved to the new generation's rank); a failed or aborted work gets
  // args.failed = 1. `step` is the recorder's step now unless in `args`.
  void Watch(std::shared_ptr<comm::Work> work, std::string name, int tid,
             Args args);

 private:
  struct Pending {
    std::shared_ptr<comm::Work> work;
    std::string name;
    int tid = 0;
    Args args;
    int64_t start_us = 0;
    int rank = 0;
  };
  void Loop();

  std::shared_ptr<Recorder> recorder_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Pending> queue_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace concord::trace
