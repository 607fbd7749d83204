#pragma once
// A job's checkpoint records, one part of the coordinator's core (core.h):
// the job's run, the complete checkpoints kept and the totals of the writes
// reported, the memory snapshots the node agents hold, and the checkpoint a
// generation is told to resume from (see Note [Resume source], see Note [One
// job's checkpoints] and see Note [Runs] in core.h).
//
// Plain state with no clock and no events: the core checks a report's fields
// and who sends it (core_validation.h, the worker's binding), passes the time
// in, and turns what Record says into the job's event.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "concord/v1/coordinator_state.pb.h"
#include "concord/v1/operator.pb.h"
#include "concord/v1/worker.pb.h"

namespace concord::coordinator {

class CheckpointRecords {
 public:
  // The complete checkpoints kept: the newest by (run, step).
  static constexpr size_t kKept = 10;
  // The nodes whose memory snapshots a job of `spec` keeps: twice its
  // max_workers (nodes come and go), at least 16.
  static size_t MaxMemoryNodes(const v1::JobSpec& spec) {
    return std::max<size_t>(16, 2 * static_cast<size_t>(spec.max_workers()));
  }
  // See Note [Runs] in core.h: a run begun at `now` after `previous`.
  static int64_t RunAfter(absl::Time now, int64_t previous);

  // See Note [Runs] in core.h: the job's run (0 before the first).
  int64_t run() const { return run_; }
  // A new run at `now`: the job was created, or started again (see Note
  // [Starting again] in core.h). The memory snapshots (the ended run's
  // agents' memory) and the resume source are dropped; the kept checkpoints
  // and the totals stay.
  void BeginRun(absl::Time now);

  // A report of the job of `spec`, its fields and its path checked already:
  // kept (see Note [Checkpoints] in worker/checkpoint/checkpointer.h).
  // `writer` is the worker that wrote it itself (then it is not in its
  // node's memory), empty for a node agent's. Returns the message of the
  // "checkpoint" event it makes, "" for none (a memory snapshot, a failure
  // after the first). FAILED_PRECONDITION for a report of another run,
  // RESOURCE_EXHAUSTED for a memory snapshot older than all those kept with
  // no room left (see Note [One job's checkpoints] in core.h); nothing
  // changes then.
  absl::StatusOr<std::string> Record(const v1::JobSpec& spec,
                                     const v1::CheckpointReport& report,
                                     const std::string& writer);

  // See Note [Resume source] in core.h: names what a generation of the job
  // of `spec` that has just formed resumes from: nothing when `held` (one of
  // its members holds a committed step); else the newest kept checkpoint at
  // its step's path in the job's folder, and the newest memory snapshot at
  // least as new. Returns the generation event's words on it ("" for
  // nothing named).
  std::string NameResume(const v1::JobSpec& spec, bool held);
  const std::optional<v1::CheckpointReport>& resume_from() const {
    return resume_from_;
  }
  const std::optional<v1::CheckpointReport>& resume_memory() const {
    return resume_memory_;
  }

  // The kept checkpoints, by (run, step) ascending.
  const std::vector<v1::CheckpointReport>& kept() const { return kept_; }
  const v1::CheckpointTotals& totals() const { return totals_; }
  // By node, the newest snapshot in its memory.
  const std::map<std::string, v1::CheckpointReport>& memory_snapshots() const {
    return memory_snapshots_;
  }

  // See Note [Persistence] in core.h: the records into the job's record, and
  // back. Restore takes a record as it is (a record without a run begins one
  // at `now`); Check then says whether what it took is consistent
  // (INVALID_ARGUMENT naming the job `job_id` and what is wrong).
  void Export(v1::JobRecord& record) const;
  void Restore(const v1::JobRecord& record, absl::Time now);
  absl::Status Check(const std::string& job_id) const;

 private:
  // Drops the memory snapshots older than the newest kept checkpoint: they
  // can never be named.
  void PruneMemory();

  int64_t run_ = 0;
  std::vector<v1::CheckpointReport> kept_;
  v1::CheckpointTotals totals_;
  std::map<std::string, v1::CheckpointReport> memory_snapshots_;
  // Of the current generation.
  std::optional<v1::CheckpointReport> resume_from_;
  std::optional<v1::CheckpointReport> resume_memory_;
};

}  // namespace concord::coordinator
