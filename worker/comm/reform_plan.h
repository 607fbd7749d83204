#pragma once
// Note [Re-forming NCCL]
// ~~~~~~~~~~~~~~~~~~~~~~
// How a worker gets the communicator of its next generation. Gloo connects a
// new one every generation (a TCP rendezvous costs little). NCCL initialisation
// is expensive (bootstrap, topology detection, channel setup), so where the new
// generation is the old one minus some members, in the same order, it is
// derived from the old communicator instead:
//
//   - NCCL >= 2.27: ncclCommShrink, excluding the old ranks that are gone;
//     in abort mode (NCCL_SHRINK_ABORT, which first ends the parent's
//     operations in flight) when a member died or a collective of the old
//     generation failed, in default mode when members left cleanly at a
//     step boundary everyone agreed on;
//   - older NCCL: ncclCommSplit, which every member of the old
//     communicator must call, so only when every member is still there to
//     call it (the same members re-forming, e.g. after workers that waited
//     to be admitted gave up) and nothing failed: a worker that left is not
//     a member of the new generation and takes no part in its agreement;
//   - otherwise a new initialisation through the generation's store: when
//     workers joined (no derivation can add ranks), when the new ranks are
//     not the survivors in their old order, when the old communicator was
//     already aborted (its generation ended under it), or with Gloo.
//
// The members agree on one plan (next_communicator.h): each says whether its
// old communicator is usable and whether it saw a failure, and the plan is
// made from what they said together. The decision needs no device: this
// file is torch-free and tested on CPU (tests/unit/reform_plan_test.cc); the
// NCCL calls live in nccl/nccl_communicator.cc.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "worker/device.h"

namespace concord::comm {

// NCCL_VERSION_CODE from which ncclCommShrink exists (2.27.0).
inline constexpr int kNcclShrinkVersion = 22700;

struct GenerationChange {
  Backend backend = Backend::kGloo;
  // NCCL_VERSION_CODE of the NCCL Concord was built with; 0 for none.
  int nccl_version = 0;
  // The old generation's communicator is still held and was not aborted.
  bool parent_usable = false;
  // A collective of the old generation failed or timed out (a member
  // died or hangs).
  bool parent_failed = false;
  // Every member that is gone left cleanly at an agreed boundary (end of
  // data) rather than dying.
  bool departed_cleanly = false;
  // Worker ids by rank, in the old and in the new generation.
  std::vector<std::string> previous;
  std::vector<std::string> next;
};

struct ReformPlan {
  enum class How { kNewInit, kShrink, kSplit };
  How how = How::kNewInit;
  // kShrink: NCCL_SHRINK_ABORT rather than NCCL_SHRINK_DEFAULT.
  bool abort_in_flight = false;
  // kShrink: the old ranks that are gone, ascending.
  std::vector<int> excluded;
  // Why, for the log.
  std::string why;
};

absl::string_view HowName(ReformPlan::How how);

// What the coordinator says of how a generation's ranks follow from the
// generation before it (worker.proto's RankChange).
struct RankChange {
  int64_t previous_generation = 0;
  int previous_world_size = 0;
  std::vector<int> departed;  // ascending
  bool order_kept = false;
};

// The workers of generation `generation` (of `world_size`) by rank, as labels
// that GenerationChange compares: a worker's label is "g<G>r<R>" from the
// generation G it first shared with this worker and its rank R there, so a
// survivor keeps the label it had in `previous` (the labels of generation
// `previous_generation`). Without a RankChange from `previous_generation`
// (the first generation, a worker that missed one, a coordinator that
// restarted) or when the order was not kept, every label is new, which plans
// a new initialisation. The coordinator never sends the member table to
// workers: that would be the square of the job's size per rendezvous.
std::vector<std::string> NextRankLabels(
    const std::vector<std::string>& previous, int64_t previous_generation,
    int64_t generation, int world_size,
    const std::optional<RankChange>& change);

ReformPlan PlanNextCommunicator(const GenerationChange& change);

}  // namespace concord::comm
