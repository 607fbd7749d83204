#pragma once
// A job's timing and checkpoint defaults and the one check between them, for
// every layer that has them: concord-run's flags (tools/launcher.h), the
// worker's environment (common/environment.h), the public JobOptions (through
// the worker) and the coordinator, which fills a JobSpec's unset fields with
// them (coordinator/core/core_validation.cc).

#include <cstdint>
#include <string>

namespace concord {

inline constexpr int64_t kDefaultHeartbeatIntervalMs = 1000;
inline constexpr int64_t kDefaultHeartbeatTimeoutMs = 10000;
inline constexpr int64_t kDefaultRendezvousTimeoutMs = 300000;
inline constexpr int64_t kDefaultCollectiveTimeoutMs = 300000;
// Complete checkpoints kept on disk (see Note [Checkpoints] in
// worker/checkpoint/checkpointer.h).
inline constexpr int kDefaultCheckpointKeep = 3;

// Empty when a heartbeat timeout of `timeout_ms` suits an interval of
// `interval_ms` (the coordinator must see at least one heartbeat within
// the timeout); otherwise what is wrong, naming the two values as the
// caller calls them.
inline std::string HeartbeatTimeoutProblem(int64_t interval_ms,
                                           int64_t timeout_ms,
                                           const std::string& interval_name,
                                           const std::string& timeout_name) {
  if (timeout_ms > interval_ms) return "";
  return timeout_name + " (" + std::to_string(timeout_ms) + ") must exceed " +
         interval_name + " (" + std::to_string(interval_ms) + ")";
}

}  // namespace concord
