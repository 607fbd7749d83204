#pragma once
// Note [ZeRO partition]
// ~~~~~~~~~~~~~~~~~~~~~
// Which rank steps which parameter under ZeroRedundancyOptimizer
// (include/concord/zero.h), as PyTorch's ZeroRedundancyOptimizer
// ._partition_parameters decides it: the parameter groups in order, each
// group's parameters sorted by element count, largest first (a stable sort:
// equal sizes keep their order), each given to the rank with the fewest
// elements so far over all groups (the lowest such rank on a tie). A rank's
// parameters of a group are in the order they were given to it. Every
// parameter is placed, trainable or not. Torch-free: counts in, indices
// out, the same on every rank.

#include <cstdint>
#include <string>
#include <vector>

namespace concord::zero {

// shards[rank][group]: indices into that group's parameter list.
using Partition = std::vector<std::vector<std::vector<int>>>;

// `numels[group][i]`: the element count of the group's i-th parameter.
// `world_size` >= 1.
Partition PartitionParameters(const std::vector<std::vector<int64_t>>& numels,
                              int world_size);

// For every parameter, flattened over the groups in order (PyTorch's
// state_dict indices), the rank that steps it.
std::vector<int> OwnerOf(const Partition& partition,
                         const std::vector<std::vector<int64_t>>& numels);

// Note [ZeRO overlap partition]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With ZeroOptions::overlap_with_ddp the shards follow DDP's buckets (as
// PyTorch's ZeroRedundancyOptimizer._bucket_assignments_per_rank decides):
// - whole buckets: bucket b to rank b % world;
// - shard_buckets: the buckets by increasing element count (a stable sort),
//   each cut into runs of consecutive parameters, a run closed before the
//   parameter that would bring it to the threshold (total elements / world)
//   unless that parameter is the run's first; each run, and the bucket's
//   remainder, goes to the rank with the fewest elements so far among
//   those not yet holding part of this bucket (the lowest on a tie). A
//   bucket cut into more runs than there are ranks (PyTorch asserts there:
//   "All indices are disallowed") gives its further runs to the rank with
//   the fewest elements among all: a job that shrinks under run_elastic
//   keeps a layout it could start with at its first world size, which
//   otherwise may not fit the smaller one.
// A rank's parameters are in the order its runs were given to it. The
// broadcasts after a step go bucket by bucket, each bucket's runs in rank
// order.

// One run of a bucket's parameters given to one rank: `length` parameters
// from `offset` in the bucket's list.
struct BucketRun {
  int bucket = 0;
  int rank = 0;
  int offset = 0;
  int length = 0;
};

struct BucketAssignment {
  // In the order they were given.
  std::vector<BucketRun> runs;
  // ranks[bucket]: the ranks holding part of it, ascending, each once.
  std::vector<std::vector<int>> ranks;
};

// `buckets[b]`: the element counts of bucket b's parameters, in the
// bucket's order (none empty). `world_size` >= 1.
BucketAssignment AssignBuckets(const std::vector<std::vector<int64_t>>& buckets,
                               int world_size, bool shard_buckets);

// Note [ZeRO mirrors]
// ~~~~~~~~~~~~~~~~~~~
// Under run_elastic each rank's shard of the optimizer state has a second
// home, so that a rank that dies takes no state with it: its mirror, a
// rank that steps the same parameters with the same gradients alongside
// (the same arithmetic on the same inputs, so both copies stay bit-identical
// without sending state). For Adam and AdamW a mirror moves the state alone
// (the moments, about half of the update's work) and takes the parameters
// from their owner's broadcast, as every other rank does; if the step fails
// before they arrive and the job goes on from it, the mirror makes them from
// the step's start and the new state, the owner's arithmetic (see
// OptimizerSnapshot::StepStateTaking in
// worker/checkpoint/optimizer_snapshot.h). Other optimizers' mirrors step
// whole, and so does every mirror where every rank steps every shard
// (EveryRankStepsAll: two ranks), since nobody broadcasts there. A step waits
// for its slowest rank, and a rank's update and state grow with the elements it
// steps (its own shard's and those it mirrors), so the mirrors even those out:
// the shards are taken largest first (by element count, the lower rank on a
// tie), and each shard's mirror is the rank stepping the fewest elements so far
// (the first after the shard's rank cyclically on a tie) on another node where
// there is one (among every other rank when all share the shard's node).
// Shards of one size on one node give a ring: rank r mirrors on r + 1. One
// rank alone has none (-1). The partition's shards are uneven where a few
// parameters are large (PyTorch's greedy partition places whole
// parameters), and then the largest shards' mirrors go to the smallest:
// two matrices of 1 M elements, one of 0.5 M and small ones over 4 ranks
// (bench/zero_vs_ddp.py's model) step at most 1.57 M elements a rank
// rather than 2.1 M with a ring. The mirrors are
// decided at each re-form, and when the overlap's shards are first made
// (nothing is stepped before); add_param_group keeps them, its new
// parameters mirrored where their shard's other parameters are.
// `nodes[r]`: rank r's node; `sizes[r]`: the elements of rank r's shard
// (ShardSizes), or empty for shards of one size.
std::vector<int> MirrorsOf(const std::vector<std::string>& nodes,
                           const std::vector<int64_t>& sizes = {});

// Whether every rank steps every non-empty shard, its own or as its mirror
// (`mirrors` from MirrorsOf, `sizes` from ShardSizes; a rank missing from
// `sizes` counts as non-empty): one rank alone, or two mirroring each
// other. No rank then needs another's parameters after a step, and none
// broadcasts them (see Note [Elastic ZeRO] in api/zero.cc).
bool EveryRankStepsAll(const std::vector<int>& mirrors,
                       const std::vector<int64_t>& sizes);

// The elements of each rank's shard.
std::vector<int64_t> ShardSizes(
    const Partition& partition,
    const std::vector<std::vector<int64_t>>& numels);

// Note [ZeRO sources]
// ~~~~~~~~~~~~~~~~~~~
// After a re-form every member says which parameters it holds at the job's
// step (see Note [Elastic ZeRO] in api/zero.cc). What it holds of a step
// it took part in: its shards as the step left them (`stepped`: the local
// update of the step after committed step `base` ran) or as the step's
// start copied them (`copied`). OfferAt picks the version of the job's
// step `step`: the live one when it is that step's, the copy when the job
// went back to the step's start, none otherwise (a newcomer, a worker of an
// older step).
enum class Offer { kLive, kCopy, kNone };
Offer OfferAt(int64_t base, bool stepped, bool copied, int64_t step);

// Each parameter from the lowest rank offering it (`offers[rank]`: the
// indices it holds; out-of-range ones are ignored): its rank, -1 where none
// does (`missing`, in order).
struct Sources {
  std::vector<int> rank;
  std::vector<int64_t> missing;
};
Sources SourcesOf(const std::vector<std::vector<int64_t>>& offers,
                  int64_t parameters);

}  // namespace concord::zero
