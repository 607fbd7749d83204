#pragma once
// Request builders shared by the coordinator core's unit tests: one job,
// workers w0, w1, ... each with its own secret (see Note [Worker binding]).

#include <string>

#include "absl/strings/str_cat.h"
#include "concord/v1/worker.pb.h"

namespace concord::coordinator::testing {

inline constexpr char kJob[] = "job";

inline std::string Worker(int i) { return absl::StrCat("w", i); }

inline std::string Secret(const std::string& worker) {
  return absl::StrCat(worker, "-secret-0123456789");
}

// Durations left 0: the defaults (1 s / 10 s / 300 s). Checkpoints under
// kCheckpointDir.
inline constexpr char kCheckpointDir[] = "/ckpt";
inline v1::JobSpec Spec(int max_workers, int min_workers = 1) {
  v1::JobSpec spec;
  spec.set_job_id(kJob);
  spec.set_checkpoint_dir(kCheckpointDir);
  spec.set_min_workers(min_workers);
  spec.set_max_workers(max_workers);
  return spec;
}

inline v1::JoinRequest JoinReq(const v1::JobSpec& spec,
                               const std::string& worker,
                               int64_t committed_step = 0) {
  v1::JoinRequest r;
  *r.mutable_spec() = spec;
  r.set_worker_id(worker);
  r.set_worker_secret(Secret(worker));
  r.set_host(absl::StrCat(worker, ".local"));
  r.set_committed_step(committed_step);
  return r;
}

// A Join from a worker that was a member of `previous_generation`. While that
// generation runs, it is a re-form request (see Note [Re-forming]).
inline v1::JoinRequest RejoinReq(const v1::JobSpec& spec,
                                 const std::string& worker,
                                 int64_t previous_generation,
                                 int64_t committed_step = 0,
                                 const std::string& reform_reason = "") {
  v1::JoinRequest r = JoinReq(spec, worker, committed_step);
  r.set_previous_generation(previous_generation);
  r.set_reform_reason(reform_reason);
  return r;
}

inline v1::HeartbeatRequest HeartbeatReq(const std::string& worker,
                                         int64_t generation, int64_t step = 0) {
  v1::HeartbeatRequest r;
  r.set_job_id(kJob);
  r.set_worker_id(worker);
  r.set_worker_secret(Secret(worker));
  r.set_generation(generation);
  r.set_step(step);
  return r;
}

inline v1::LeaveRequest LeaveReq(const std::string& worker, int64_t generation,
                                 v1::LeaveReason reason) {
  v1::LeaveRequest r;
  r.set_job_id(kJob);
  r.set_worker_id(worker);
  r.set_worker_secret(Secret(worker));
  r.set_generation(generation);
  r.set_reason(reason);
  return r;
}

}  // namespace concord::coordinator::testing
