#pragma once
// The communicator of one generation: a fixed group of ranks 0..size-1.
//
// Collectives are issued in the same order on every rank (the reducer
// guarantees that) and run asynchronously; each returns a Work. Tensors must
// be contiguous, stay alive and untouched until the Work completes.
// Implementations: gloo/ (CPU, TCP) and nccl/ (GPU).

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>

#include "absl/time/time.h"
#include "worker/comm/work.h"

namespace concord::comm {

struct CollectiveOptions {
  // A collective that has not finished after this long fails (UNAVAILABLE).
  absl::Duration timeout = absl::Minutes(5);
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // The generation this communicator belongs to; it is never reused for
  // another.
  virtual int64_t generation() const = 0;

  // In-place sum over all ranks. May be called from any thread; issue order
  // is execution order.
  virtual std::shared_ptr<Work> AllreduceSum(
      at::Tensor tensor, const CollectiveOptions& options) = 0;

  // Overwrites `tensor` on every rank with `root`'s.
  virtual std::shared_ptr<Work> Broadcast(at::Tensor tensor, int root,
                                          const CollectiveOptions& options) = 0;

  // Gathers every rank's `input` into `output` on every rank: rank r's
  // elements land at output[r * n, (r + 1) * n), n = input.numel(). `output`
  // has size() * n elements of `input`'s dtype (both contiguous, distinct).
  // Returns INVALID_ARGUMENT through the Work for mismatched tensors.
  virtual std::shared_ptr<Work> Allgather(at::Tensor output, at::Tensor input,
                                          const CollectiveOptions& options) = 0;

  // Gives the communicator up (its generation is over): every collective
  // queued or in flight fails with ABORTED, later ones fail at once, and the
  // transport is torn down so that peers still waiting on this rank fail
  // too instead of running into their timeouts. Never blocks; any thread.
  // The object may only be destroyed once its operation in flight has
  // returned (the destructor waits for that, at most a collective timeout).
  virtual void Abort() = 0;
};

}  // namespace concord::comm
