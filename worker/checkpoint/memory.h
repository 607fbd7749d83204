#pragma once
// The memory tier of checkpoints (see Note [Checkpoints] in
// worker/checkpoint/checkpointer.h): one snapshot of a job's committed state
// in a region of memory, shared between the worker that writes it and the
// node agent that writes it to disk and keeps it when the workers die.
//
// Note [Snapshot region]
// ~~~~~~~~~~~~~~~~~~~~~~
// The region is a file in /dev/shm (concord-run's, named in
// CONCORD_CHECKPOINT_MEMORY: it outlives the workers) or anonymous memory
// (a worker without an agent). A fixed header comes first, then the
// content's layout as JSON (Flatten's skeleton and each tensor's dtype,
// shape and offset), then the tensors' bytes, each at a 64-byte boundary.
// The region is made as large as the state once and reused; it grows (a
// new size of the file, mapped again) only when the state does.
//
// The header's `state` says who may touch the bytes:
//   kEmpty     nothing there yet;
//   kWriting   a worker is copying a snapshot in (one that died there left
//              a torn snapshot: never read);
//   kReady     a complete snapshot of step `step`, number `sequence`;
//   kPersisting  the same, being written to disk by the agent: a worker
//              whose commit falls due now skips that checkpoint (it does
//              not wait: the step goes on), as DLRover's flash checkpoint
//              does.
// The writer moves the state to kWriting with a compare-and-swap from any
// state but kPersisting, the persister from kReady to kPersisting, and each
// puts back kReady when done (release stores: the bytes are visible before
// the state). std::atomic of 32 and 64 bits is lock-free and
// address-free on the platforms Concord runs on, so the header's atomics
// work across processes.

#include <string>

#include "absl/status/statusor.h"
#include "worker/checkpoint/content.h"
#include "worker/checkpoint/region.h"

namespace concord::checkpoint {

// What WriteSnapshot did.
enum class WriteResult { kWritten, kSkippedBusy };

// Copies `content` into `region` as snapshot of step content.counters.step
// (see Note [Snapshot region]): the step's stall. `persist`: the disk tier
// writes it. kSkippedBusy when the agent is still writing the last one to
// disk. UNAVAILABLE when the region cannot grow to the content.
absl::StatusOr<WriteResult> WriteSnapshot(Region& region,
                                          const Content& content,
                                          const std::string& job, bool persist);

// The complete snapshot in `region` (its tensors are views of the region:
// valid while it is mapped and nobody writes it). NOT_FOUND when it holds
// none (empty, or torn by a writer that died); INVALID_ARGUMENT for a
// malformed one.
absl::StatusOr<Content> ReadSnapshot(Region& region);

}  // namespace concord::checkpoint
