#pragma once
// Request validation for the coordinator core: every field of every request
// is checked before anything changes. Each function returns OK or
// INVALID_ARGUMENT naming the field and the rule.
//
// Rules: job and worker ids are 1-128 characters of [A-Za-z0-9._:-] and do
// not start with '.'; worker secrets 16-256 printable ASCII characters;
// hosts at most 255 bytes; messages and reasons (reform_reason too) at most
// 4096 bytes; text is UTF-8; keys 1-1024 bytes, values at most 4 MiB, at most
// 4096 keys per KvGet; steps and generations (previous_generation too)
// non-negative; rates and timings finite and non-negative; waits at most
// 1 h. Spec limits are in ValidateSpec.

#include <string>

#include "absl/status/status.h"
#include "concord/v1/operator.pb.h"
#include "concord/v1/worker.pb.h"

namespace concord::coordinator {

// The core and the service cost O(N) per rendezvous of N workers (no thread
// per waiting worker: see Note [Asynchronous waits] in host.h); a store bounds
// it lower (docs/operators.md, "Capacity").
inline constexpr int32_t kMaxWorkersPerJob = 131072;
inline constexpr int64_t kMaxWaitMs = 3600 * 1000;

absl::Status ValidateId(const char* field, const std::string& id);

// The spec with zero durations replaced by their defaults.
v1::JobSpec WithDefaults(v1::JobSpec spec);
// Checks a spec with defaults applied.
absl::Status ValidateSpec(const v1::JobSpec& spec);
// FAILED_PRECONDITION naming the first field where `got` differs from the
// job's spec (both with defaults applied).
absl::Status CompareSpecs(const v1::JobSpec& job, const v1::JobSpec& got);

// The spec is checked by the caller, after defaults.
absl::Status ValidateRequest(const v1::JoinRequest& r);
absl::Status ValidateRequest(const v1::HeartbeatRequest& r);
absl::Status ValidateRequest(const v1::LeaveRequest& r);
absl::Status ValidateRequest(const v1::KvSetRequest& r);
absl::Status ValidateRequest(const v1::ReportCheckpointRequest& r);
absl::Status ValidateRequest(const v1::KvGetRequest& r);
absl::Status ValidateRequest(const v1::WatchMembershipRequest& r);
// See Note [Exited workers] in core.h: a node agent's exit report.
absl::Status ValidateExit(const std::string& job_id,
                          const std::string& worker_id,
                          const std::string& secret, const std::string& how);
// What a node agent saw of a worker's process (Core::ProcessSeen).
absl::Status ValidateProcess(const std::string& job_id,
                             const std::string& worker_id,
                             const v1::ProcessView& v);
// See Note [Runs] in core.h: checkpoints are ordered by run, then step.
bool OlderCheckpoint(const v1::CheckpointReport& a,
                     const v1::CheckpointReport& b);
// A node agent's checkpoint report (Core::CheckpointReported), or one kept
// in a job's record.
absl::Status ValidateCheckpoint(const std::string& job_id,
                                const v1::CheckpointReport& r);
// A written or failed checkpoint of the job whose checkpoint folder is
// `checkpoint_dir`: PERMISSION_DENIED for a path other than the one its step
// has there (see Note [One job's checkpoints] in core.h).
absl::Status CheckCheckpointPath(const std::string& job_id,
                                 const std::string& checkpoint_dir,
                                 const v1::CheckpointReport& r);
absl::Status ValidateRequest(const v1::GetJobRequest& r);
absl::Status ValidateRequest(const v1::ListEventsRequest& r);
absl::Status ValidateRequest(const v1::DrainWorkerRequest& r);
absl::Status ValidateRequest(const v1::StopJobRequest& r);

}  // namespace concord::coordinator
