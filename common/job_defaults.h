#pragma once
// A job's timing and checkpoint defaults and the one check between them, for
// every layer that has them: concord-run's flags (tools/launcher.h), the
// worker's environment (common/environment.h), the public JobOptions (through
// the worker) and the coordinator, which fills a JobSpec's unset fields with
// them (coordinator/core/core_validation.cc).

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/time/time.h"

namespace concord {

inline constexpr int64_t kDefaultHeartbeatIntervalMs = 1000;
inline constexpr int64_t kDefaultHeartbeatTimeoutMs = 10000;
inline constexpr int64_t kDefaultRendezvousTimeoutMs = 300000;
inline constexpr int64_t kDefaultCollectiveTimeoutMs = 300000;
// The same two as the worker's options hold them (every collective's, every
// communicator's connection and the join's timeout when nobody set one).
inline constexpr absl::Duration kDefaultRendezvousTimeout =
    absl::Milliseconds(kDefaultRendezvousTimeoutMs);
inline constexpr absl::Duration kDefaultCollectiveTimeout =
    absl::Milliseconds(kDefaultCollectiveTimeoutMs);
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

// The longest checkpoint folder (JobSpec.checkpoint_dir) the coordinator
// keeps.
inline constexpr size_t kMaxCheckpointDirLength = 1024;

// Empty when `dir` can be a job's checkpoint folder as the coordinator keeps
// it (JobSpec.checkpoint_dir): empty (none), or an absolute path with no
// empty, "." or ".." part and no trailing '/' (what the worker's
// checkpoint::NormalDir makes of what it was given); otherwise what is
// wrong.
inline std::string CheckpointDirProblem(const std::string& dir) {
  if (dir.empty()) return "";
  if (dir.size() > kMaxCheckpointDirLength) {
    return "is " + std::to_string(dir.size()) + " characters; at most " +
           std::to_string(kMaxCheckpointDirLength);
  }
  if (dir[0] != '/') return "must be an absolute path";
  if (dir == "/") return "";
  if (dir.back() == '/') return "must not end with '/'";
  size_t start = 1;
  while (start <= dir.size()) {
    size_t end = dir.find('/', start);
    if (end == std::string::npos) end = dir.size();
    const std::string part = dir.substr(start, end - start);
    if (part.empty() || part == "." || part == "..") {
      return "must be a normal path (no empty, '.' or '..' part)";
    }
    start = end + 1;
  }
  return "";
}

// Where the checkpoint of `job` at `step` lives under the checkpoint folder
// `dir` (see Note [Checkpoint directories] in worker/checkpoint/disk.h): the
// one path the coordinator names for it, and the one a worker loads.
inline std::string CheckpointStepPath(const std::string& dir,
                                      const std::string& job, int64_t step) {
  return dir + (!dir.empty() && dir.back() == '/' ? "" : "/") + job + "/step-" +
         std::to_string(step);
}

}  // namespace concord
