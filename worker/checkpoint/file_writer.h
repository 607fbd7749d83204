#pragma once
// A checkpoint file's writer (torch-free): the disk tier's bytes go to the
// disk without the page cache where the filesystem allows it.
//
// Note [Direct writes]
// ~~~~~~~~~~~~~~~~~~~~
// A buffered write(2) copies every byte into the page cache first, in the
// kernel, one 4 KiB page at a time: measured here (bench/checkpoint.cc, perf)
// that copy took most of a checkpoint's write, which reached a fifth of the
// disk's O_DIRECT bandwidth. A FileWriter copies the caller's bytes into 4
// KiB-aligned blocks and writes each full one with O_DIRECT on a thread of its
// own, in order, so the disk works while the caller serializes. The last
// partial block is written after turning O_DIRECT off (fcntl), so the file
// has its exact size; Finish fsyncs (O_DIRECT alone does not flush the
// device's cache or the file's metadata). A filesystem that refuses O_DIRECT
// (tmpfs) gets the same queue over buffered writes.
//
// Note [Write queue]
// ~~~~~~~~~~~~~~~~~~
// How many blocks may wait for the disk decides whether the serializer's
// CPU and the disk overlap. LibTorch's archive writer (miniz) takes a
// record's CRC-32 before it hands over any of the record's bytes: at 352 M
// parameters a record is 268 MB and its CRC about 90 ms, during which the
// disk has only what is queued. With two blocks (16 MB) it went idle: the
// write took the disk's time plus the serializer's (0.6 of `dd`'s
// bandwidth, bench/checkpoint_vs_pytorch.py). The blocks come from a
// WriteBuffers pool that grows as the queue needs them, up to its limit
// (kDefaultQueue: the disk's ~2 GB/s over such a CRC), and is reused by the
// files after (the persister keeps one for its lifetime, so its blocks are
// faulted in once). A small checkpoint's records are small: its queue stays
// a few blocks deep.

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace concord::checkpoint {

// See Note [Write queue]: kAlign-aligned blocks of one size, made when
// asked for up to a limit, kept for reuse. Thread-safe.
class WriteBuffers {
 public:
  static constexpr size_t kAlign = 4096;
  static constexpr size_t kDefaultBlock = size_t{8} << 20;
  static constexpr size_t kDefaultQueue = size_t{256} << 20;

  // `block` is rounded up to a multiple of kAlign; the limit is at least
  // two blocks.
  explicit WriteBuffers(size_t block = kDefaultBlock,
                        size_t limit = kDefaultQueue);
  ~WriteBuffers();
  WriteBuffers(const WriteBuffers&) = delete;
  WriteBuffers& operator=(const WriteBuffers&) = delete;

  size_t block() const { return block_; }
  // A free block, else a new one while under the limit; nullptr when every
  // block is out (or none could be allocated: `*no_memory` then).
  char* TryTake(bool* no_memory);
  void Give(char* b);
  // Blocks made so far (the queue's deepest, for tests and benchmarks).
  size_t made() const;

 private:
  const size_t block_;
  const size_t max_blocks_;
  mutable std::mutex mu_;
  std::vector<char*> free_;
  std::vector<char*> all_;
};

class FileWriter {
 public:
  static constexpr size_t kAlign = WriteBuffers::kAlign;

  // Creates `path` (it must not exist). UNAVAILABLE naming it when it
  // cannot. `buffers`: where its blocks come from (shared by files written
  // one after another; null: a pool of the default size of its own).
  static absl::StatusOr<std::unique_ptr<FileWriter>> Create(
      const std::string& path, std::shared_ptr<WriteBuffers> buffers = nullptr);
  // Waits for the writes queued and closes; a file not Finished keeps what
  // reached it.
  ~FileWriter();
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;

  // Appends `n` bytes; false once a write failed (Finish says why).
  bool Append(const void* data, size_t n);
  // Writes what is buffered, fsyncs and closes. UNAVAILABLE naming the path
  // and the error of the first write that failed.
  absl::Status Finish();

  bool direct() const { return direct_; }
  uint64_t size() const { return size_; }

 private:
  struct Block {
    char* data;
    size_t n;
  };
  FileWriter(int fd, std::string path, std::shared_ptr<WriteBuffers> buffers,
             bool direct);
  // Queues the full current block and takes the next (waiting for the
  // writing thread to free one when the pool is at its limit).
  void Flush();
  // Waits until the queue is written; stops the writing thread.
  void Drain();
  void WriteQueued();

  int fd_;
  const std::string path_;
  const std::shared_ptr<WriteBuffers> buffers_;
  bool direct_;
  char* current_ = nullptr;
  size_t fill_ = 0;
  uint64_t size_ = 0;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Block> queue_;  // full blocks, in file order
  bool stop_ = false;
  int error_ = 0;  // the errno of the first write that failed
  std::thread writer_;
};

}  // namespace concord::checkpoint
