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
// shape and offset), then the tensors' bytes from a page boundary on, each
// at a 64-byte boundary, those of 64 KiB or more at a page (the disk tier
// writes them to the disk from here with O_DIRECT).
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

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

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

// The bytes a region needs to hold `content` as a snapshot.
size_t SnapshotBytes(const Content& content);

// Note [Overlapped snapshots]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A snapshot's copy need not stall the step that follows the commit: until
// that step's optimizer writes them, the parameters and the optimizer's
// state are only read (the forward and the backward read parameters; they
// write activations, gradients and buffers). As CheckFreq (FAST 2021) does,
// an overlapped snapshot stalls the step only for Stage, which clones
// everything else (the buffers, the user's values, the RNG's state, every
// tensor not on the CPU), and a thread of its own then writes the region
// (BeginSnapshot: growing it the first time, and copying the live
// parameters and optimizer state) while the next step's forward runs. The
// training thread joins that thread and publishes the snapshot
// (FinishSnapshot) before anything may write those tensors: at the first
// gradient of the next backward, before a re-form or a resume changes them,
// and before the next snapshot. The region says kWriting until then (a
// worker that dies meanwhile leaves a torn snapshot: never read).
// FinishSnapshot compares each live tensor's version counter with the one it
// had at Stage: an in-place write in between (a program that clamps its
// weights before its forward) means the copy may be torn, and the snapshot
// is dropped (the region says kEmpty), never published. A write through
// .data() keeps no version and is not seen: hence overlapping is an option
// (CheckpointOptions::overlap) for programs that write parameters only in an
// optimizer step after a backward.

// The live tensors of a staged content and their version counters then.
using Versions = std::vector<std::pair<at::Tensor, uint32_t>>;
struct Staged {
  Content content;
  Versions live;
};
// `content` with every tensor cloned but the CPU tensors among `deferred`
// (compared by identity), which stay the live tensors: an overlapped
// snapshot's stall.
Staged Stage(const Content& content, const std::vector<at::Tensor>& deferred);

// Note [Holes]
// ~~~~~~~~~~~~
// A snapshot's content may have holes: optimizer state tensors on the meta
// device, of the shape and dtype the real ones have, that another worker of
// the node copies into the region itself (a sharded optimizer's shards,
// see Note [Shards copied where they are] in worker/elastic/state.h). The
// writer lays them out as any tensor (LayOutSnapshot: the header and the
// layout are complete before a byte is copied), copies everything else
// (CopySnapshot), and publishes only once the node's other workers said
// they filled theirs: each finds its tensors through ReadLaidOut, which
// reads the layout of the snapshot being written, and copies into them. A
// content with holes is never written to disk as it is.

// A snapshot laid out in its region and not yet published: its tensors in
// Flatten's order and the offset in the region each goes to.
struct PendingSnapshot {
  Region* region = nullptr;
  int64_t step = 0;
  std::vector<at::Tensor> tensors;
  std::vector<size_t> offsets;
};
// Whether an optimizer's state in `content` has holes (see Note [Holes]).
bool HasHoles(const Content& content);
// BeginSnapshot's first half: claims `region`, grows it if need be and
// writes its header and `content`'s layout, copying no tensor.
absl::StatusOr<WriteResult> LayOutSnapshot(Region& region,
                                           const Content& content,
                                           const std::string& job, bool persist,
                                           PendingSnapshot* pending);
// Its second half: copies every tensor of what LayOutSnapshot laid out but
// the holes.
void CopySnapshot(const PendingSnapshot& pending);
// WriteSnapshot but the publishing (LayOutSnapshot, then CopySnapshot):
// claims `region`, grows it if need be and copies `content` in; `pending`
// says what FinishSnapshot publishes. The region says kWriting until then.
absl::StatusOr<WriteResult> BeginSnapshot(Region& region,
                                          const Content& content,
                                          const std::string& job, bool persist,
                                          PendingSnapshot* pending);
// Drops a laid-out snapshot unpublished: the region says kEmpty.
void DropSnapshot(const PendingSnapshot& pending);
// Publishes what BeginSnapshot copied as complete (kReady, the persister
// rung) with `stall_seconds` as its stall, and returns its step; ABORTED
// naming a tensor of `live` written since its Stage (the snapshot is
// dropped: see the Note).
absl::StatusOr<int64_t> FinishSnapshot(const PendingSnapshot& pending,
                                       double stall_seconds,
                                       const Versions& live = {});

// The complete snapshot in `region` (its tensors are views of the region:
// valid while it is mapped and nobody writes it). NOT_FOUND when it holds
// none (empty, or torn by a writer that died); INVALID_ARGUMENT for a
// malformed one.
absl::StatusOr<Content> ReadSnapshot(Region& region);
// The snapshot of `step` that the worker `writer_pid` is writing into
// `region` (laid out, not published), its tensors views of the region: a
// node's other worker fills its holes through it (see Note [Holes]).
// FAILED_PRECONDITION when the region holds no such snapshot being written;
// INVALID_ARGUMENT for a malformed layout.
absl::StatusOr<Content> ReadLaidOut(Region& region, int64_t step,
                                    int32_t writer_pid);

}  // namespace concord::checkpoint
