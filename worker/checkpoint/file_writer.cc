#include "worker/checkpoint/file_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "common/write_all.h"

namespace concord::checkpoint {
namespace {

// The errno of writing `n` bytes of `data` to `fd`, 0 when all were.
int WriteErrno(int fd, const char* data, size_t n) {
  errno = 0;
  if (WriteAll(fd, std::string_view(data, n))) return 0;
  return errno == 0 ? EIO : errno;
}

}  // namespace

absl::StatusOr<std::unique_ptr<FileWriter>> FileWriter::Create(
    const std::string& path, size_t buffer) {
  const int fd =
      ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot create ", path, ": ", std::strerror(errno)));
  }
  // Set after the open, so that a filesystem without O_DIRECT (EINVAL)
  // leaves the file as it was made.
  const int flags = ::fcntl(fd, F_GETFL);
  const bool direct = flags >= 0 && ::fcntl(fd, F_SETFL, flags | O_DIRECT) == 0;
  const size_t capacity =
      std::max(kAlign, (buffer + kAlign - 1) / kAlign * kAlign);
  std::unique_ptr<FileWriter> w(new FileWriter(fd, path, capacity, direct));
  for (auto& b : w->buffers_) {
    b.reset(static_cast<char*>(std::aligned_alloc(kAlign, capacity)));
    if (b == nullptr) {
      return absl::UnavailableError(
          absl::StrCat("cannot write ", path, ": no memory for its buffers"));
    }
  }
  return w;
}

FileWriter::FileWriter(int fd, std::string path, size_t buffer, bool direct)
    : fd_(fd),
      path_(std::move(path)),
      capacity_(buffer),
      direct_(direct),
      buffers_{{nullptr, std::free}, {nullptr, std::free}} {}

FileWriter::~FileWriter() {
  Wait();
  if (fd_ >= 0) ::close(fd_);
}

void FileWriter::Wait() {
  if (!pending_.valid()) return;
  const int e = pending_.get();
  if (error_ == 0) error_ = e;
}

bool FileWriter::Append(const void* data, size_t n) {
  const char* from = static_cast<const char*>(data);
  while (n > 0 && error_ == 0) {
    const size_t take = std::min(n, capacity_ - fill_);
    std::memcpy(buffers_[current_].get() + fill_, from, take);
    fill_ += take;
    from += take;
    n -= take;
    size_ += take;
    if (fill_ == capacity_) Flush();
  }
  return error_ == 0;
}

void FileWriter::Flush() {
  Wait();  // the other buffer is free again
  if (error_ != 0) return;
  const char* full = buffers_[current_].get();
  const size_t n = fill_;
  const int fd = fd_;
  pending_ = std::async(std::launch::async,
                        [fd, full, n] { return WriteErrno(fd, full, n); });
  current_ ^= 1;
  fill_ = 0;
}

absl::Status FileWriter::Finish() {
  Wait();
  if (error_ == 0 && fill_ > 0) {
    const char* data = buffers_[current_].get();
    const size_t aligned = direct_ ? fill_ / kAlign * kAlign : 0;
    if (aligned > 0) error_ = WriteErrno(fd_, data, aligned);
    if (error_ == 0 && aligned < fill_) {
      // The tail is not a whole block: written through the page cache.
      if (direct_) {
        const int flags = ::fcntl(fd_, F_GETFL);
        if (flags < 0 || ::fcntl(fd_, F_SETFL, flags & ~O_DIRECT) != 0) {
          error_ = errno;
        }
      }
      if (error_ == 0) {
        error_ = WriteErrno(fd_, data + aligned, fill_ - aligned);
      }
    }
    fill_ = 0;
  }
  if (error_ == 0 && ::fsync(fd_) != 0) error_ = errno;
  if (::close(fd_) != 0 && error_ == 0) error_ = errno;
  fd_ = -1;
  if (error_ != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot write ", path_, ": ", std::strerror(error_)));
  }
  return absl::OkStatus();
}

}  // namespace concord::checkpoint
