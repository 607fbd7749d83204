#pragma once
// A job's events, one part of the coordinator's core (core.h): numbered from
// 1, never reused, bounded (the oldest are dropped beyond kMax), persisted
// with the job and shown in its status, in ListEvents and in the saved history
// (see Note [Coordinator history] in coordinator/store/history_file.h). The
// core makes them; time is passed in.

#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "concord/v1/coordinator_state.pb.h"
#include "concord/v1/operator.pb.h"

namespace concord::coordinator {

struct Event {
  int64_t seq = 0;
  absl::Time time;
  // "job", "join", "generation", "leave", "failure", "drain", "checkpoint",
  // "stop", "straggler" (see Note [Stragglers] in hang_rule.h).
  std::string kind;
  std::string worker_id;
  std::string message;
  // A "generation" event's generation, and, when it formed, its members'
  // worker ids by rank (see Note [Coordinator history]; not persisted).
  int64_t generation = 0;
  std::vector<std::string> members;
};

class EventLog {
 public:
  // Events kept at most per job.
  static constexpr size_t kMax = 10000;

  // Appends the next event, at `time`, the oldest dropped beyond kMax.
  // Returns it (a generation's event gets its number and members).
  Event& Add(absl::Time time, std::string kind, std::string worker_id,
             std::string message);

  // Oldest first.
  const std::deque<Event>& all() const { return events_; }
  bool empty() const { return events_.empty(); }
  const Event& back() const { return events_.back(); }
  Event& back() { return events_.back(); }
  // The events numbered above `after`, oldest first; `lost`: how many of
  // those were dropped already.
  std::vector<Event> After(int64_t after, int64_t* lost) const;
  // At most `limit` of the events numbered above `after`, oldest first.
  std::vector<v1::Event> Page(int64_t after, int limit) const;
  // The newest `n` (all when fewer), oldest first.
  std::vector<v1::Event> Recent(size_t n) const;
  // The number of the last event (0: none yet).
  int64_t last_seq() const { return next_seq_ - 1; }

  // See Note [Persistence] in core.h. Restore appends the record's events;
  // the next number is past the record's and past its last event.
  void Export(v1::JobRecord& record) const;
  void Restore(const v1::JobRecord& record);

  static v1::Event ToProto(const Event& e);
  static Event FromProto(const v1::Event& e);

 private:
  std::deque<Event> events_;
  int64_t next_seq_ = 1;
};

}  // namespace concord::coordinator
