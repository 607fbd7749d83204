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
// own, in order, so the disk works while the caller serializes. Bytes the
// caller keeps until the file is finished (AppendLasting: a record's data
// in the snapshot region, which the archive writer places at a 4 KiB file
// offset, see Note [Archive writer] in worker/zip_writer.h) are not copied
// when they lie 4 KiB-aligned: their whole pages join the queue as they are
// (the block before them goes as far as it was filled, a whole number of
// pages), and only their last partial page is copied into a block. The last
// partial block is written after turning O_DIRECT off (fcntl), so the file
// has its exact size; Finish fsyncs (O_DIRECT alone does not flush the
// device's cache or the file's metadata). A filesystem that refuses O_DIRECT
// (tmpfs) gets the same queue over buffered writes, every byte copied.
//
// Note [Write queue]
// ~~~~~~~~~~~~~~~~~~
// How many blocks may wait for the disk decides whether the serializer's
// CPU and the disk overlap. An archive writer takes a record's CRC-32
// before it hands over any of the record's bytes: with LibTorch's (miniz),
// at 352 M parameters a record is 268 MB and its CRC about 90 ms, during
// which the disk has only what is queued. With two blocks (16 MB) it went
// idle: the write took the disk's time plus the serializer's (0.6 of `dd`'s
// bandwidth, bench/checkpoint_vs_pytorch.py). The blocks come from a
// WriteBuffers pool that grows as the queue needs them, up to its limit
// (kDefaultQueue: the disk's ~2 GB/s over such a CRC), and is reused by the
// files after (the persister keeps one for its lifetime, so its blocks are
// faulted in once). A small checkpoint's records are small: its queue stays
// a few blocks deep. Pages queued in place (AppendLasting) take no block:
// a snapshot's big records wait for the disk without a limit and without a
// copy.

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
  // The same for bytes that stay valid and unchanged until Finish returns
  // (or the writer is destroyed): where the file is written with O_DIRECT
  // and both the file's size and `data` are kAlign-aligned, the whole
  // kAlign units are written from `data` itself, not copied.
  bool AppendLasting(const void* data, size_t n);
  // Appends `n` zero bytes, leaving the whole kAlign units among them
  // unwritten (a sparse hole, which reads back as zeros): another process
  // writes them later (see Note [Shards written where they are] in
  // worker/checkpoint/disk.h). False once a write failed.
  bool Skip(size_t n);
  // Writes what is buffered, fsyncs and closes. UNAVAILABLE naming the path
  // and the error of the first write that failed.
  absl::Status Finish();

  bool direct() const { return direct_; }
  uint64_t size() const { return size_; }
  // The bytes copied into blocks (the rest went from the caller's memory).
  uint64_t copied() const { return copied_; }

 private:
  struct Block {
    char* data;  // null: `n` bytes skipped (Skip)
    size_t n;
    bool owned;  // a block of buffers_, given back once written
  };
  FileWriter(int fd, std::string path, std::shared_ptr<WriteBuffers> buffers,
             bool direct);
  // Queues the full current block and takes the next (waiting for the
  // writing thread to free one when the pool is at its limit).
  void Flush();
  // Takes the next current block, waiting as Flush does; none once a write
  // failed.
  void TakeBlock(std::unique_lock<std::mutex>& lock);
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
  uint64_t copied_ = 0;
  bool skipped_ = false;  // some bytes were left as a hole (Skip)

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Block> queue_;  // in file order, each a whole number of kAlign
  bool stop_ = false;
  int error_ = 0;  // the errno of the first write that failed
  // What failed first ("an O_DIRECT write of N bytes at offset O", "fsync"),
  // for the message; and the bytes the queue wrote (or tried) so far.
  std::string failed_in_;
  uint64_t written_ = 0;
  std::thread writer_;
};

}  // namespace concord::checkpoint
