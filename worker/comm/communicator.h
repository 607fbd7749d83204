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
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/job_defaults.h"
#include "worker/comm/work.h"

namespace concord::comm {

struct CollectiveOptions {
  // A collective that has not finished after this long fails (UNAVAILABLE).
  absl::Duration timeout = kDefaultCollectiveTimeout;
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

  // Sums `tensor` over all ranks into `root`'s `tensor`; on the other ranks
  // `tensor` is scratch afterwards (its contents are unspecified). Dtypes as
  // for AllreduceSum.
  virtual std::shared_ptr<Work> ReduceSum(at::Tensor tensor, int root,
                                          const CollectiveOptions& options) = 0;

  // Point-to-point: sends `send` to every rank in `to` and receives
  // `recv[i]` (same dtype and size as `send`) from `from[i]`; a rank may
  // appear at most once in each list and never be this rank. Only the
  // listed peers take part, but every rank issues its Exchange at the same
  // point of the collective order as the others (like a collective, with
  // empty lists where it has nothing to send or receive), which is how the
  // messages are matched. Bytes sent: send.nbytes() per entry of `to`.
  // Returns INVALID_ARGUMENT through the Work for bad peers or tensors.
  virtual std::shared_ptr<Work> Exchange(at::Tensor send, std::vector<int> to,
                                         std::vector<at::Tensor> recv,
                                         std::vector<int> from,
                                         const CollectiveOptions& options) = 0;

  // Gives the communicator up (its generation is over): every collective
  // queued or in flight fails with ABORTED, later ones fail at once, and the
  // transport is torn down so that peers still waiting on this rank fail
  // too instead of running into their timeouts. Never blocks; any thread.
  // The object may only be destroyed once its operation in flight has
  // returned (the destructor waits for that, at most a collective timeout).
  virtual void Abort() = 0;
};

// Exchange's argument checks, shared by the implementations: peers in range,
// never `rank` itself, no duplicates; one receive tensor per `from`, each
// with `send`'s dtype and size, contiguous and distinct from `send`.
inline absl::Status CheckExchangeArguments(const at::Tensor& send,
                                           const std::vector<int>& to,
                                           const std::vector<at::Tensor>& recv,
                                           const std::vector<int>& from,
                                           int rank, int size) {
  if (recv.size() != from.size()) {
    return absl::InvalidArgumentError(absl::StrCat("exchange has ", recv.size(),
                                                   " receive tensors for ",
                                                   from.size(), " peers"));
  }
  for (const std::vector<int>* peers : {&to, &from}) {
    std::vector<bool> seen(static_cast<size_t>(size), false);
    for (int peer : *peers) {
      if (peer < 0 || peer >= size || peer == rank) {
        return absl::InvalidArgumentError(absl::StrCat(
            "exchange peer ", peer, " is not another rank of ", size));
      }
      if (seen[static_cast<size_t>(peer)]) {
        return absl::InvalidArgumentError(
            absl::StrCat("exchange peer ", peer, " is listed twice"));
      }
      seen[static_cast<size_t>(peer)] = true;
    }
  }
  if (!send.defined() || !send.is_contiguous()) {
    return absl::InvalidArgumentError(
        "exchange tensors must be defined and contiguous");
  }
  for (const at::Tensor& r : recv) {
    if (!r.defined() || !r.is_contiguous() ||
        r.scalar_type() != send.scalar_type() || r.numel() != send.numel() ||
        r.device() != send.device()) {
      return absl::InvalidArgumentError(
          "exchange receive tensors must be contiguous, with the send "
          "tensor's dtype, size and device");
    }
    if (r.numel() > 0 && r.is_alias_of(send)) {
      return absl::InvalidArgumentError(
          "an exchange receive tensor aliases the send tensor");
    }
  }
  return absl::OkStatus();
}

}  // namespace concord::comm
