#include "coordinator/core/watches.h"

namespace concord::coordinator {

void Watches::Opened(const std::string& worker_id) {
  WatchState& watch = watches_[worker_id];
  ++watch.open;
  idle_.erase(worker_id);
  SetLost(worker_id, watch, std::nullopt);
}

void Watches::SetLost(const std::string& worker_id, WatchState& watch,
                      std::optional<absl::Time> at) {
  watch.lost_at = at;
  if (at.has_value()) {
    lost_.insert(worker_id);
  } else {
    lost_.erase(worker_id);
  }
}

bool Watches::Closed(const std::string& worker_id, bool lost, bool bound,
                     absl::Time now) {
  auto it = watches_.find(worker_id);
  if (it == watches_.end() || it->second.open <= 0) return false;
  WatchState& watch = it->second;
  --watch.open;
  SetLost(worker_id, watch,
          lost ? std::optional<absl::Time>(now) : std::nullopt);
  if (watch.open == 0 && !bound) {
    SetLost(worker_id, watch, std::nullopt);
    watches_.erase(it);
    return false;
  }
  if (watch.open == 0) idle_.insert(worker_id);
  return true;
}

void Watches::Rebound(const std::string& worker_id) {
  auto watch = watches_.find(worker_id);
  if (watch != watches_.end()) SetLost(worker_id, watch->second, std::nullopt);
}

void Watches::ForgetReleased(
    const std::map<std::string, std::string>& bindings) {
  for (auto it = idle_.begin(); it != idle_.end();) {
    auto watch = watches_.find(*it);
    if (watch == watches_.end() || watch->second.open > 0) {
      it = idle_.erase(it);
    } else if (bindings.count(*it) == 0) {
      lost_.erase(*it);
      watches_.erase(watch);
      it = idle_.erase(it);
    } else {
      ++it;
    }
  }
}

std::optional<absl::Time> Watches::LostAt(const std::string& worker_id) const {
  auto watch = watches_.find(worker_id);
  if (watch == watches_.end() || watch->second.open > 0) return std::nullopt;
  return watch->second.lost_at;
}

int64_t Watches::open(const std::string& worker_id) const {
  auto watch = watches_.find(worker_id);
  return watch == watches_.end() ? 0 : watch->second.open;
}

}  // namespace concord::coordinator
