#pragma once
// A test hook of the worker library: programs on the public API killed at a
// chosen point of a chosen step, without changing the program.
//
// CONCORD_TEST_FAULT="LOCAL:STEP:POINT:MODULE:N[,...]" makes the worker
// that concord-run started as local worker LOCAL (CONCORD_LOCAL_RANK) kill
// itself with SIGKILL at the N-th POINT of the DistributedDataParallel
// named MODULE (ElasticState::add's name) in step STEP (the step being
// taken: the committed one plus one). POINT: "forward" (after the step's
// agreement, before the module's buffer broadcast) or "backward" (in a
// synchronised backward of the module, before its first bucket's
// allreduce, while the peers may have launched theirs). Only a worker's
// first run dies this way (CONCORD_RESTART_COUNT unset or 0). Read by
// WorkerOptions::FromEnvironment; concord-train has its own
// (CONCORD_TEST_KILL, tools/fault_injection.h).

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace concord::worker {

struct TestFault {
  enum class Point { kForward, kBackward };
  int64_t step = 0;
  Point point = Point::kForward;
  std::string module;
  int occurrence = 1;
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
      : faults_(std::move(faults)) {}
  bool empty() const { return faults_.empty(); }
  // `module` reaches `point` in step `step`: SIGKILL when scheduled.
  void Reached(int64_t step, TestFault::Point point, const std::string& module);

 private:
  std::vector<TestFault> faults_;
  int64_t counted_step_ = -1;
  std::vector<int> counts_;  // per fault, of the counted step
};

}  // namespace concord::worker
