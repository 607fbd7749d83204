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
};

}  // namespace concord
