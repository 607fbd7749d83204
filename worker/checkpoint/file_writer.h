#pragma once
// A checkpoint file's writer (torch-free): the disk tier's bytes go to the
// disk without the page cache where the filesystem allows it.
//
// Note [Direct writes]
// ~~~~~~~~~~~~~~~~~~~~
// A buffered write(2) copies every byte into the page cache first, in the
// kernel, one 4 KiB page at a time: measured here (bench/checkpoint.cc, perf)
// that copy took most of a checkpoint's write, which reached a fifth of the
// disk's O_DIRECT bandwidth. A FileWriter copies the caller's bytes into two 4
// KiB-aligned buffers and writes each full one with O_DIRECT on a thread of its
// own, so the disk works on one buffer while the caller serializes into the
// other. The last partial block is written after turning O_DIRECT off (fcntl),
// so the file has its exact size; Finish fsyncs (O_DIRECT alone does not flush
// the device's cache or the file's metadata). A filesystem that refuses
// O_DIRECT (tmpfs) gets the same double buffering over buffered writes.

#include <cstddef>
#include <cstdint>
#include <future>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace concord::checkpoint {

class FileWriter {
 public:
  static constexpr size_t kAlign = 4096;
  static constexpr size_t kDefaultBuffer = size_t{8} << 20;

  // Creates `path` (it must not exist). UNAVAILABLE naming it when it
  // cannot. `buffer` is rounded up to a multiple of kAlign.
  static absl::StatusOr<std::unique_ptr<FileWriter>> Create(
      const std::string& path, size_t buffer = kDefaultBuffer);
  // Waits for a write in flight and closes; a file not Finished keeps what
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
  FileWriter(int fd, std::string path, size_t buffer, bool direct);
  // Hands the full current buffer to the writing thread.
  void Flush();
  // Waits for the write in flight; its error kept.
  void Wait();

  int fd_;
  const std::string path_;
  const size_t capacity_;
  bool direct_;
  std::unique_ptr<char, void (*)(void*)> buffers_[2];
  int current_ = 0;
  size_t fill_ = 0;
  std::future<int> pending_;  // the errno of the write in flight, 0 if none
  int error_ = 0;
  uint64_t size_ = 0;
};

}  // namespace concord::checkpoint
