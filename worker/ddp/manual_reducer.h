#pragma once
// apex.parallel.Reducer: gradients are reduced only when the program asks
// (e.g. every few iterations), not during backward.
//
// Reduce() flattens the gradients of each dtype into one tensor, allreduces
// it, divides by the world size and copies the result back (apex's
// flat_dist_call). Parameters without a gradient are skipped: every rank
// must have gradients for the same parameters.

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "worker/comm/communicator.h"

namespace concord::ddp {

class ManualReducer {
 public:
  ManualReducer(std::vector<at::Tensor> params,
                std::shared_ptr<comm::Communicator> comm,
                comm::CollectiveOptions options = {})
      : params_(std::move(params)), comm_(std::move(comm)), options_(options) {}

  // Blocks until every gradient is the average over ranks. A collective: all
  // ranks call it at the same point. Errors: those of Work::Wait.
  absl::Status Reduce();

 private:
  std::vector<at::Tensor> params_;
  std::shared_ptr<comm::Communicator> comm_;
  comm::CollectiveOptions options_;
};

}  // namespace concord::ddp
