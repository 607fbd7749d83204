#pragma once
// The autograd function behind SyncBatchNorm's training forward (see Note
// [SyncBN arithmetic] in sync_batch_norm.h). Internal to worker/syncbn.

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <memory>

#include "worker/comm/communicator.h"

namespace concord::syncbn {

struct SyncBnCall {
  // Null: statistics of the local batch (a world of one).
  std::shared_ptr<comm::Communicator> communicator;
  comm::CollectiveOptions options;
  double eps = 1e-5;
  // Running-average factor; none: cumulative average.
  c10::optional<double> momentum;
};

// y = SyncBN(input) with group statistics; updates running_mean/var and
// num_batches_tracked in place when they are defined. weight and bias may be
// undefined (affine = false). Blocks on one allgather; its backward on one
// allreduce. Throws c10::Error for bad inputs, concord::Error when a
// collective fails.
at::Tensor SyncBatchNormTrain(const at::Tensor& input, const at::Tensor& weight,
                              const at::Tensor& bias, at::Tensor running_mean,
                              at::Tensor running_var,
                              at::Tensor num_batches_tracked,
                              const SyncBnCall& call);

}  // namespace concord::syncbn
