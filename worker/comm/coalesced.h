#pragma once
// Broadcast of many tensors as few flat messages, one per dtype (PyTorch's
// _broadcast_coalesced).

#include <ATen/core/Tensor.h>

#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/comm/communicator.h"

namespace concord::comm {

// Overwrites every tensor with `root`'s values: blocks until done for CPU
// tensors; for device tensors the current stream waits instead (see Note
// [Stream-ordered waits] in worker/comm/work.h). Must be
// called on every rank with tensors of the same shapes, dtypes and order.
// Errors: those of Work::Wait.
absl::Status BroadcastCoalesced(Communicator& comm,
                                const std::vector<at::Tensor>& tensors,
                                int root, const CollectiveOptions& options);

// Replaces `*bytes` with `root`'s (its length first, then the bytes, as CPU
// tensors). Blocks. Every rank calls it. Errors: those of Work::Wait.
absl::Status BroadcastBytes(Communicator& comm, int root, std::string* bytes,
                            const CollectiveOptions& options);

// Every rank's `value`, in rank order (two allgathers: the lengths, then
// the bytes). Blocks. Every rank calls it. Errors: those of Work::Wait.
absl::StatusOr<std::vector<std::string>> AllgatherStrings(
    Communicator& comm, const std::string& value,
    const CollectiveOptions& options);

// Every rank's `value`, in rank order, on the ranks in `roots` (sorted or
// not, no duplicates, each in range); an empty vector on the others. The
// lengths are allgathered, then each rank sends its bytes (padded to the
// longest) to every root with one Exchange: nothing else is gathered where
// it is not kept (a sharded optimizer's state reaching only the ranks that
// write checkpoints). With `skip`, root `root` gets nothing from `rank`
// where skip(root, rank) (an empty string in its place; every rank's
// `skip` says the same). Blocks. Every rank calls it with the same `roots`.
// Errors: those of Work::Wait; INVALID_ARGUMENT for a root out of range.
absl::StatusOr<std::vector<std::string>> GatherStrings(
    Communicator& comm, const std::string& value, const std::vector<int>& roots,
    const CollectiveOptions& options,
    const std::function<bool(int root, int rank)>& skip = nullptr);

}  // namespace concord::comm
