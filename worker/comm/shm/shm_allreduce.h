#pragma once
// A sum allreduce through shared memory for a Gloo generation whose ranks
// all run on one host (see Note [Shared-memory allreduce] below).

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/job_defaults.h"
#include "worker/comm/store.h"

namespace concord::comm {

struct ShmAllreduceOptions {
  int rank = 0;
  int size = 1;
  // Whether this rank wants the group (CONCORD_SHM). A rank that does not
  // still takes part in Create, so that every rank reaches the same
  // verdict: no group unless every rank wants one.
  bool enabled = true;
  // Bytes of each slot (two sets of `size` slots are mapped). A tensor
  // larger than this goes through in windows.
  size_t window_bytes = 4 << 20;
  absl::Duration setup_timeout = kDefaultCollectiveTimeout;
};

// The ring chunks of a Gloo allreduce of `elements` elements of
// `element_size` bytes over `size` ranks (gloo/allreduce.cc's segment
// arithmetic; exposed for tests).
// Gloo's ring gives each rank a chunk of this many elements (the last ones
// shorter or empty): element i is in chunk i / GlooRingChunkElements(...).
size_t GlooRingChunkElements(size_t elements, size_t element_size, int size);

// Note [Shared-memory allreduce]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// When every rank of a Gloo generation runs on one host, a sum allreduce goes
// through a shared-memory segment instead of Gloo's TCP pairs (what NCCL and
// MPI do within a node; PyTorch's Gloo has only TCP on a host). Torch-free,
// tested with ranks as threads and, in the multi-process tests, as processes.
//
// The same arithmetic as Gloo: Gloo's ring allreduce (gloo/allreduce.cc,
// the algorithm PyTorch's ProcessGroupGloo uses) splits the buffer into
// numSegments = roundUp(max(ceil(bytes / 1 MiB), 2 W), W) segments, W / W'th
// of them per rank ("chunk" c = segment / (numSegments / W)), and sums chunk
// c along the ring down from rank c - 1, each hop adding the received
// partial sum to its own value: a_c + (a_{c+1} + (... + (a_{c+W-2} +
// a_{c+W-1}))), indices mod W. Here every element is summed in that order,
// whatever rank computes it, so results are bit-identical to Gloo's (and so
// to PyTorch's DDP on Gloo) for any W, not only where addition commutes.
//
// The segment holds two sets of W slots of `window` bytes (double
// buffering). A call goes through the tensor a window at a time: every rank
// copies its window into its slot of the current set; a barrier; each rank
// sums 1/W of the window's elements (reading every slot, in the order above)
// and writes them into its own slot (it is the only reader of those
// elements); a barrier; each rank copies every rank's share out. The next
// window uses the other set, so two barriers a window suffice: a rank
// writes a set again only after the barriers of the window in between,
// which its peers reach only once they have copied that set out.
//
// Setup (Create, collective, through the generation's store): rank 0
// creates the segment under a random name, reserves its memory
// (posix_fallocate: no SIGBUS on a full /dev/shm) and publishes the name;
// every rank maps it, checks it, and records its pid and start time; every
// rank publishes whether that worked, rank 0 reads those one by one (any
// store's read limit; it stops at the first "no") and publishes the verdict
// (O(size) store traffic), and the group exists only if it worked everywhere
// (otherwise the caller keeps Gloo: another host, another IPC or pid
// namespace, no /dev/shm, a rank with CONCORD_SHM=0). Rank 0 unlinks the
// name once every rank has mapped it, so nothing is left in /dev/shm when
// processes die.
//
// Failures: a rank that waits at a barrier checks, every 20 ms, the group's
// abort flag (set by Abort() or the destructor of any rank, and by a rank
// whose barrier failed: a rank that leaves, whose generation ends or whose
// collective failed fails its peers at once, as closing Gloo's pairs does)
// and whether each peer process still lives (a SIGKILLed peer fails the
// others within that time, as a closed socket does); past the timeout it
// fails. All are UNAVAILABLE, as Gloo's IoException, and a failed group
// fails every later call.

// Note [Shared-memory broadcast]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The same segment carries Gloo's broadcasts on one host (a sharded
// optimizer's updated parameters after every step, the state a re-form
// sends): a window at a time, the root copies its window into its slot of
// the current set; one barrier; every other rank copies it out. One
// barrier a window suffices with the two sets: the root writes a set again
// only after the barrier of the window in between, which its peers reach
// only once they have copied that set out (the same rule as Sum's, whose
// windows share the count of sets with these). The bytes move as they are,
// whatever the dtype: bit for bit Gloo's broadcast.

class ShmAllreduce {
 public:
  // Collective: every rank of the group calls it with the same options but
  // its rank. Returns the group, or why not (the caller then uses Gloo):
  // FAILED_PRECONDITION where shared memory cannot join these ranks,
  // UNAVAILABLE/DEADLINE_EXCEEDED/ABORTED from the store.
  static absl::StatusOr<std::unique_ptr<ShmAllreduce>> Create(
      const ShmAllreduceOptions& options, Store* store);
  // Fails a peer waiting on this rank (the group is over).
  ~ShmAllreduce();
  ShmAllreduce(const ShmAllreduce&) = delete;
  ShmAllreduce& operator=(const ShmAllreduce&) = delete;

  // In place; every rank calls it with the same n, in the same order. T is
  // float, double, int32_t or int64_t (instantiated in the .cc).
  template <typename T>
  absl::Status Sum(T* data, size_t n, absl::Duration timeout);

  // Overwrites `bytes` bytes at `data` with `root`'s (see Note [Shared-memory
  // broadcast]); every rank calls it with the same bytes and root, in the
  // same order as Sum. Errors as Sum's.
  absl::Status Broadcast(void* data, size_t bytes, int root,
                         absl::Duration timeout);

  // Fails the collective in flight here and at every peer; later calls
  // fail at once. Safe from any thread.
  void Abort();

  int rank() const { return options_.rank; }
  int size() const { return options_.size; }

 private:
  struct Header;
  struct Peer;
  struct Setup;  // Create's parts
  static size_t HeaderBytes(int size);
  Peer* peers() const;
  ShmAllreduce(const ShmAllreduceOptions& options, void* base, size_t bytes);
  // Waits until every rank has arrived at this rank's next barrier.
  absl::Status Barrier(absl::Time deadline);
  absl::Status PeersAlive() const;
  uint8_t* Slot(int set, int rank) const;

  ShmAllreduceOptions options_;
  void* base_;
  size_t bytes_;
  Header* header_;
  uint32_t barriers_ = 0;  // barriers this rank has passed
  uint64_t windows_ = 0;   // windows this rank has gone through
};

}  // namespace concord::comm
