#pragma once
// The coordinator's history (concord-coordinator --history-file FILE): the
// decisions this replica made durable, for tests/history.py.
//
// Note [Coordinator history]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// JSON Lines appended to FILE, one per job event (core.h's Event: join,
// generation, leave, failure, drain, job, stop, ...), written by the host once
// the job's record holding the event was saved to the store (with no store:
// once the change is made). So a leader cut off from etcd writes nothing it
// could not save, and what a successor loads it does not write again: every
// generation appears once, from the replica that made it. Fields: event (the
// kind), job, seq (the job's event number, which continues across fail-overs),
// time_us (CLOCK_REALTIME), pid, worker and message where the event has them;
// formed generations add generation and members (worker ids by rank),
// ended ones generation. Events the core dropped before they were written
// (beyond its per-job cap between two saves) are one "gap" line with
// `lost`. Each line is one write(2), so a killed replica leaves whole lines.
//
// Thread-safety: Write may be called from any thread.

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/core/core.h"

namespace concord::coordinator {

class HistoryFile {
 public:
  // Opens `path` for appending. INVALID_ARGUMENT naming the path when it
  // cannot be.
  static absl::StatusOr<std::unique_ptr<HistoryFile>> Open(
      const std::string& path);
  ~HistoryFile();
  HistoryFile(const HistoryFile&) = delete;
  HistoryFile& operator=(const HistoryFile&) = delete;

  // `events` of `job_id`, oldest first; `lost` events before them were
  // dropped unwritten.
  void Write(const std::string& job_id, const std::vector<Event>& events,
             int64_t lost);

 private:
  explicit HistoryFile(int fd) : fd_(fd) {}
  void WriteLine(const std::string& line);

  const int fd_;
  std::mutex mu_;
};

}  // namespace concord::coordinator
