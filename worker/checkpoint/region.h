#pragma once
// The memory tier's region (see Note [Snapshot region] in
// worker/checkpoint/memory.h): torch-free, so that concord-run, which owns
// a node's region, and the workers that write it share this header.

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/job_defaults.h"

namespace concord::checkpoint {

struct RegionHeader {
  enum State : uint32_t {
    kEmpty = 0,
    kWriting = 1,
    kReady = 2,
    kPersisting = 3
  };
  char magic[8];
  uint32_t version;
  std::atomic<uint32_t> state;
  std::atomic<uint64_t> sequence;  // of the last complete snapshot
  int64_t step;
  uint64_t layout_offset, layout_size;
  uint64_t bytes;  // header, layout and data: what a reader maps
  // 1: the disk tier writes this snapshot (the writer is rank 0).
  uint32_t persist;
  int32_t writer_pid;
  // The job's id, for the persister's path: any id the coordinator
  // accepts, NUL-terminated.
  char job[kMaxIdLength + 1];
  // The persister's: the sequence it last wrote.
  std::atomic<uint64_t> persisted;
  // The writer's: this snapshot's stall of the training step (its copy into
  // the region), and the snapshots it skipped because the persister held
  // the region (the persister reports both).
  uint64_t stall_ns;
  std::atomic<uint64_t> skipped;
  // Rung (Region::Ring) by a writer that published a snapshot and by the
  // persister's owner; the persister sleeps on it.
  std::atomic<uint32_t> doorbell;
};
static_assert(std::atomic<uint32_t>::is_always_lock_free &&
                  std::atomic<uint64_t>::is_always_lock_free,
              "the snapshot header's atomics are shared across processes");

inline constexpr size_t kHeaderBytes = 4096;
static_assert(sizeof(RegionHeader) <= kHeaderBytes);

class Region {
 public:
  // The shared-memory file `path` (made, empty, when missing), or memory of
  // this process's own (a memfd) when `path` is empty. UNAVAILABLE naming
  // the path when it cannot be opened or mapped, or is a symbolic link.
  static absl::StatusOr<std::unique_ptr<Region>> Open(const std::string& path);
  // A new shared-memory file `path`, made by this call (its owner,
  // concord-run: a file or link already there, someone else's, is never
  // taken). UNAVAILABLE naming the path otherwise.
  static absl::StatusOr<std::unique_ptr<Region>> Create(
      const std::string& path);
  // The same memory mapped again: a persister in the writer's own process
  // maps (and remaps, when a snapshot grew) its own view, never the one the
  // writer may be remapping.
  absl::StatusOr<std::unique_ptr<Region>> Share() const;
  ~Region();
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;

  // Maps at least `bytes` (a file grows to it). UNAVAILABLE when it cannot
  // (no memory left in /dev/shm).
  absl::Status Reserve(size_t bytes);
  // Maps what the header says a snapshot takes (a reader of a region
  // another process grew).
  absl::Status MapAll();
  RegionHeader& header() { return *reinterpret_cast<RegionHeader*>(base_); }
  char* base() { return static_cast<char*>(base_); }
  size_t mapped() const { return mapped_; }
  const std::string& path() const { return path_; }

  // Wakes the persister waiting on this memory, in any process.
  void Ring();
  // Sleeps until the doorbell differs from `seen` (a value of
  // header().doorbell read before looking for work) or `timeout` passes.
  void WaitForRing(uint32_t seen, std::chrono::milliseconds timeout);

 private:
  Region() = default;
  absl::Status Map(size_t bytes);
  absl::Status MapFile();  // what the file holds, at least the header

  std::string path_;
  int fd_ = -1;
  void* base_ = nullptr;
  size_t mapped_ = 0;
};

}  // namespace concord::checkpoint
