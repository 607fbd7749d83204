#pragma once
// A test hook of the worker library: programs on the public API killed at a
// chosen point of a chosen step, without changing the program.
//
// CONCORD_TEST_FAULT="LOCAL:STEP:POINT:MODULE:N[:stall=S][,...]" makes the
// worker that concord-run started as local worker LOCAL (CONCORD_LOCAL_RANK)
// kill itself with SIGKILL at the N-th POINT of the DistributedDataParallel
// named MODULE (ElasticState::add's name) in step STEP (the step being
// taken: the committed one plus one). POINT: "forward" (after the step's
// agreement, before the module's buffer broadcast), "backward" (in a
// synchronised backward of the module, before its first bucket's
// allreduce, while the peers may have launched theirs) or "bucket" (before
// the N-th bucket's allreduce of a synchronised backward: with N >= 2,
// between two buckets) or "zero" (MODULE is then a ZeroRedundancyOptimizer's
// ElasticState name: in its step, after its local update, before the
// parameters' broadcast). With ":stall=S" it does not die but sleeps S
// seconds there, idle, once (a hang: see Note [Hangs] in
// coordinator/core/hang_rule.h). Only a worker's first run does either
// (CONCORD_RESTART_COUNT unset or 0). Read by
// WorkerOptions::FromEnvironment; concord-train has its own
// (CONCORD_TEST_KILL, tools/fault_injection.h).

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace concord::worker {

struct TestFault {
  enum class Point { kForward, kBackward, kBucket, kZero };
  int64_t step = 0;
  Point point = Point::kForward;
  std::string module;
  int occurrence = 1;
  // Sleep this long instead of dying (zero: die).
  absl::Duration stall;
};

// The faults of `spec` for local worker `local_rank` (those of others are
// dropped). INVALID_ARGUMENT names what is malformed.
absl::StatusOr<std::vector<TestFault>> ParseTestFaults(const std::string& spec,
                                                       int local_rank);

// Counts the points of the step being taken and dies at a scheduled one.
// Training thread (and the autograd thread it waits for).
class TestFaults {
 public:
  explicit TestFaults(std::vector<TestFault> faults)
      : faults_(std::move(faults)), fired_(faults_.size(), false) {}
  bool empty() const { return faults_.empty(); }
  // `module` reaches `point` in step `step`: SIGKILL (or the stall) when
  // scheduled.
  void Reached(int64_t step, TestFault::Point point, const std::string& module);

 private:
  std::vector<TestFault> faults_;
  std::vector<bool> fired_;  // per fault: a stall happens once
  int64_t counted_step_ = -1;
  std::vector<int> counts_;  // per fault, of the counted step
};

}  // namespace concord::worker
