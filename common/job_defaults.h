#pragma once
// A job's timing and checkpoint defaults and the one check between them, for
// every layer that has them: concord-run's flags (tools/launcher.h), the
// worker's environment (common/environment.h), the public JobOptions (through
// the worker) and the coordinator, which fills a JobSpec's unset fields with
// them (coordinator/core/core_validation.cc).

#include <cstddef>
#include <cstdint>
#include <string>

namespace concord {

inline constexpr int64_t kDefaultHeartbeatIntervalMs = 1000;
inline constexpr int64_t kDefaultHeartbeatTimeoutMs = 10000;
inline constexpr int64_t kDefaultRendezvousTimeoutMs = 300000;
inline constexpr int64_t kDefaultCollectiveTimeoutMs = 300000;
// How long a straggler evicted for the first time waits before it may join
// again (docs/reliability.md, "Stragglers"); doubled at each later eviction.
inline constexpr int64_t kDefaultStragglerCooldownMs = 60000;
// The longest id of a job or a worker, everywhere: the coordinator refuses
// a longer one, and a node's snapshot region holds one whole (its header's
// job field, worker/checkpoint/region.h).
inline constexpr size_t kMaxIdLength = 128;
// Complete checkpoints kept on disk (see Note [Checkpoints] in
// worker/checkpoint/checkpointer.h).
inline constexpr int kDefaultCheckpointKeep = 3;

// Empty when `policy` names what is done with a straggler ("report", or
// "evict": docs/reliability.md, "Stragglers"); otherwise what is wrong,
// naming it as the caller calls it.
inline std::string StragglerPolicyProblem(const std::string& policy,
                                          const std::string& name) {
  if (policy == "report" || policy == "evict") return "";
  return name + " must be report or evict; got '" + policy + "'";
}

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
