#include "coordinator/core/event_log.h"

#include <algorithm>
#include <iterator>
#include <utility>

namespace concord::coordinator {

Event& EventLog::Add(absl::Time time, std::string kind, std::string worker_id,
                     std::string message) {
  if (events_.size() >= kMax) events_.pop_front();
  Event& e = events_.emplace_back();
  e.seq = next_seq_++;
  e.time = time;
  e.kind = std::move(kind);
  e.worker_id = std::move(worker_id);
  e.message = std::move(message);
  return e;
}

std::vector<Event> EventLog::After(int64_t after, int64_t* lost) const {
  *lost = 0;
  auto first = events_.end();
  while (first != events_.begin() && std::prev(first)->seq > after) {
    --first;
  }
  if (first == events_.begin() && first != events_.end()) {
    *lost = std::max<int64_t>(0, first->seq - after - 1);
  }
  return std::vector<Event>(first, events_.end());
}

std::vector<v1::Event> EventLog::Page(int64_t after, int limit) const {
  std::vector<v1::Event> out;
  auto it =
      std::upper_bound(events_.begin(), events_.end(), after,
                       [](int64_t seq, const Event& e) { return seq < e.seq; });
  for (; it != events_.end() && static_cast<int>(out.size()) < limit; ++it) {
    out.push_back(ToProto(*it));
  }
  return out;
}

std::vector<v1::Event> EventLog::Recent(size_t n) const {
  const size_t first = events_.size() > n ? events_.size() - n : 0;
  std::vector<v1::Event> out;
  for (size_t i = first; i < events_.size(); ++i) {
    out.push_back(ToProto(events_[i]));
  }
  return out;
}

void EventLog::Export(v1::JobRecord& record) const {
  for (const Event& e : events_) *record.add_events() = ToProto(e);
  record.set_next_event_seq(next_seq_);
}

void EventLog::Restore(const v1::JobRecord& record) {
  for (const v1::Event& e : record.events()) {
    events_.push_back(FromProto(e));
  }
  next_seq_ = std::max<int64_t>(record.next_event_seq(),
                                events_.empty() ? 1 : events_.back().seq + 1);
}

v1::Event EventLog::ToProto(const Event& e) {
  v1::Event out;
  out.set_seq(e.seq);
  out.set_time_unix_ms(absl::ToUnixMillis(e.time));
  out.set_kind(e.kind);
  out.set_worker_id(e.worker_id);
  out.set_message(e.message);
  return out;
}

Event EventLog::FromProto(const v1::Event& e) {
  Event out;
  out.seq = e.seq();
  out.time = absl::FromUnixMillis(e.time_unix_ms());
  out.kind = e.kind();
  out.worker_id = e.worker_id();
  out.message = e.message();
  return out;
}

}  // namespace concord::coordinator
