#pragma once
// The coordinator's core: membership, generations, rendezvous, health and the
// rendezvous key-value store, as a plain state machine.
//
// It knows nothing of gRPC and never blocks or sleeps: time comes from a
// Clock, and callers that want to wait (the RPC layer) re-ask whenever
// `version()` changes. Not thread-safe: the service layer serialises every
// call with its own mutex.
//
// Note [Generations]: a generation is a fixed set of members with ranks
// 0..n-1. Any membership change ends it; the next one gets a higher number.
// Anything addressed to another generation than the current one is refused
// with ABORTED. Generation numbers never go backwards.

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "concord/v1/worker.pb.h"

namespace concord::coordinator {

struct Assignment {
  int64_t generation = 0;
  int32_t rank = -1;
  int32_t world_size = 0;
  int32_t authoritative_rank = 0;
  std::vector<v1::Member> members;  // ordered by rank
  absl::Duration heartbeat_interval;
};

struct Event {
  absl::Time time;
  std::string kind;  // "join", "generation", "leave", "failure", "job"
  std::string worker_id;
  std::string message;
};

class Core {
 public:
  explicit Core(const Clock* clock);

  // Registers a worker. Creates the job on its first Join. Returns at once;
  // the assignment is available from `Assignment()` once the generation has
  // formed (max_workers registered).
  // Errors: INVALID_ARGUMENT (empty ids, min/max out of range, non-positive
  // durations), FAILED_PRECONDITION (spec differs from the job's, or the job
  // has ended), ALREADY_EXISTS (worker_id is a member of the current running
  // generation).
  absl::Status Join(const v1::JoinRequest& request);

  // The worker's place in the current generation, or nullopt while the
  // rendezvous is still open. NOT_FOUND for an unknown job/worker;
  // FAILED_PRECONDITION when the job has failed (message says why).
  absl::StatusOr<std::optional<Assignment>> GetAssignment(
      const std::string& job_id, const std::string& worker_id) const;

  // Records liveness and the committed step. ABORTED when `generation` is not
  // current (or has ended), NOT_FOUND for an unknown job or a worker that is
  // not a member, FAILED_PRECONDITION when the job has failed.
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(
      const v1::HeartbeatRequest& request);

  // COMPLETED marks the member done (the job succeeds when every member has
  // completed); any other reason ends the generation. A worker still waiting
  // for a generation withdraws (its `generation` is ignored). Errors as for
  // Heartbeat.
  absl::StatusOr<v1::LeaveResponse> Leave(const v1::LeaveRequest& request);

  // Key-value store scoped to (job, generation). ABORTED when the generation
  // is not current; INVALID_ARGUMENT for an empty key; NOT_FOUND for an
  // unknown job. Setting a key again overwrites it.
  absl::Status KvSet(const v1::KvSetRequest& request);
  // Values of every key, or nullopt when one is not set yet.
  absl::StatusOr<std::optional<std::vector<std::string>>> KvGet(
      const v1::KvGetRequest& request) const;

  // Declares members whose last heartbeat is older than the job's timeout
  // failed, and fails jobs whose rendezvous outlived its timeout. Call
  // periodically.
  void Tick();

  // Bumped on every state change; lets waiters know when to re-ask.
  uint64_t version() const { return version_; }

  // For status and tests.
  std::vector<Event> Events(const std::string& job_id) const;
  std::optional<v1::JobState> State(const std::string& job_id) const;
  int64_t CurrentGeneration(const std::string& job_id) const;

 private:
  struct MemberState {
    std::string worker_id;
    std::string host;
    int64_t committed_step = 0;
    absl::Time joined;
    absl::Time last_heartbeat;
    int32_t rank = -1;
    bool completed = false;
  };
  struct Job {
    v1::JobSpec spec;
    v1::JobState state = v1::JOB_STATE_RENDEZVOUS;
    std::string failure;
    int64_t generation = 0;  // current; 0 before the first forms
    int32_t authoritative_rank = 0;
    std::vector<MemberState> members;  // of the current generation, by rank
    std::vector<MemberState> waiting;  // registered for the next generation
    absl::Time rendezvous_started;
    std::map<std::string, std::string> kv;  // of the current generation
    std::vector<Event> events;
  };

  Job* FindJob(const std::string& job_id);
  const Job* FindJob(const std::string& job_id) const;
  absl::Status CheckGeneration(const Job& job, int64_t generation) const;
  void MaybeFormGeneration(Job& job);
  void EndGeneration(Job& job, const std::string& why);
  void AddEvent(Job& job, std::string kind, std::string worker_id,
                std::string message);
  void Changed() { ++version_; }

  const Clock* clock_;
  std::map<std::string, Job> jobs_;
  uint64_t version_ = 0;
};

}  // namespace concord::coordinator
