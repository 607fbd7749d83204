#pragma once
// ZeroRedundancyOptimizer's options (concord/zero.h), in a header of their
// own: plain data, for code that only passes them on (concord-train's
// flags).

#include <torch/arg.h>

namespace concord {

struct ZeroOptions {
  // PyTorch's parameters_as_bucket_view: the parameters each rank steps
  // live in one flat tensor per rank (their data are views into it), so a
  // step sends one tensor per rank. Parameters that need no gradient stay
  // outside.
  TORCH_ARG(bool, parameters_as_bucket_view) = false;
  // PyTorch's overlap_with_ddp: the step runs inside DDP's backward, each
  // bucket's share as soon as its gradients are reduced, through the hook
  // hook_with_zero_step or hook_with_zero_step_interleaved (concord/zero.h)
  // registered on the DistributedDataParallel; step() then does nothing.
  // The shards follow DDP's buckets, known once DDP has rebuilt them: as
  // PyTorch's, the first two backwards update nothing. One parameter
  // group; parameters_as_bucket_view is ignored (the parameters of each
  // bucket's share are flat already). Under run_elastic too (see
  // concord/zero.h).
  TORCH_ARG(bool, overlap_with_ddp) = false;
};

}  // namespace concord
