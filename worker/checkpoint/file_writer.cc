#include "worker/checkpoint/file_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "common/write_all.h"

namespace concord::checkpoint {
namespace {

// The errno of writing `n` bytes of `data` to `fd`, 0 when all were;
// kWroteNothing when a write(2) returned 0 (no errno to say).
constexpr int kWroteNothing = -1;
int WriteErrno(int fd, const char* data, size_t n) {
  errno = 0;
  if (WriteAll(fd, std::string_view(data, n))) return 0;
  return errno == 0 ? kWroteNothing : errno;
}

// Moves the file offset `n` bytes on, leaving them unwritten (a hole).
int SkipErrno(int fd, size_t n) {
  return ::lseek(fd, static_cast<off_t>(n), SEEK_CUR) < 0 ? errno : 0;
}

std::string ErrorText(int error) {
  return error == kWroteNothing ? "a write(2) wrote nothing"
                                : std::strerror(error);
}

size_t RoundUp(size_t n, size_t to) {
  return std::max(to, (n + to - 1) / to * to);
}

}  // namespace

WriteBuffers::WriteBuffers(size_t block, size_t limit)
    : block_(RoundUp(block, kAlign)),
      max_blocks_(std::max<size_t>(2, limit / block_)) {}

WriteBuffers::~WriteBuffers() {
  for (char* b : all_) std::free(b);
}

char* WriteBuffers::TryTake(bool* no_memory) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!free_.empty()) {
    char* b = free_.back();
    free_.pop_back();
    return b;
  }
  if (all_.size() >= max_blocks_) return nullptr;
  char* b = static_cast<char*>(std::aligned_alloc(kAlign, block_));
  if (b == nullptr) {
    *no_memory = true;
    return nullptr;
  }
  all_.push_back(b);
  return b;
}

void WriteBuffers::Give(char* b) {
  std::lock_guard<std::mutex> lock(mu_);
  free_.push_back(b);
}

size_t WriteBuffers::made() const {
  std::lock_guard<std::mutex> lock(mu_);
  return all_.size();
}

absl::StatusOr<std::unique_ptr<FileWriter>> FileWriter::Create(
    const std::string& path, std::shared_ptr<WriteBuffers> buffers) {
  if (buffers == nullptr) buffers = std::make_shared<WriteBuffers>();
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
  std::unique_ptr<FileWriter> w(
      new FileWriter(fd, path, std::move(buffers), direct));
  bool no_memory = false;
  w->current_ = w->buffers_->TryTake(&no_memory);
  if (w->current_ == nullptr) {
    return absl::UnavailableError(absl::StrCat(
        "cannot write ", path,
        no_memory ? ": no memory for its buffers" : ": its buffers are taken"));
  }
  w->writer_ = std::thread([raw = w.get()] { raw->WriteQueued(); });
  return w;
}

FileWriter::FileWriter(int fd, std::string path,
                       std::shared_ptr<WriteBuffers> buffers, bool direct)
    : fd_(fd),
      path_(std::move(path)),
      buffers_(std::move(buffers)),
      direct_(direct) {}

FileWriter::~FileWriter() {
  Drain();
  if (current_ != nullptr) buffers_->Give(current_);
  if (fd_ >= 0) ::close(fd_);
}

void FileWriter::WriteQueued() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopped, and all written
    const Block b = queue_.front();
    const bool failed = error_ != 0;
    const uint64_t at = written_;
    lock.unlock();
    const int e = failed              ? 0
                  : b.data == nullptr ? SkipErrno(fd_, b.n)
                                      : WriteErrno(fd_, b.data, b.n);
    if (b.owned) buffers_->Give(b.data);
    lock.lock();
    queue_.pop_front();
    written_ += b.n;
    if (error_ == 0 && e != 0) {
      error_ = e;
      failed_in_ = absl::StrCat(direct_ ? "an O_DIRECT write" : "a write",
                                " of ", b.n, " bytes at offset ", at);
    }
    cv_.notify_all();
  }
}

void FileWriter::Drain() {
  if (!writer_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  writer_.join();
}

bool FileWriter::Append(const void* data, size_t n) {
  // After a failure there is no current block (Flush gave it back): every
  // later call fails at once.
  if (current_ == nullptr) return false;
  const char* from = static_cast<const char*>(data);
  const size_t capacity = buffers_->block();
  while (n > 0) {
    const size_t take = std::min(n, capacity - fill_);
    std::memcpy(current_ + fill_, from, take);
    fill_ += take;
    from += take;
    n -= take;
    size_ += take;
    copied_ += take;
    if (fill_ == capacity) Flush();
    if (current_ == nullptr) return false;
  }
  std::lock_guard<std::mutex> lock(mu_);
  return error_ == 0;
}

bool FileWriter::AppendLasting(const void* data, size_t n) {
  const size_t body = n / kAlign * kAlign;
  if (!direct_ || current_ == nullptr || size_ % kAlign != 0 ||
      reinterpret_cast<uintptr_t>(data) % kAlign != 0 || body == 0) {
    return Append(data, n);
  }
  // See Note [Direct writes]: the bytes before (a whole number of kAlign),
  // then the body from where it lies, then the tail through a block.
  std::unique_lock<std::mutex> lock(mu_);
  if (error_ != 0) return false;
  if (fill_ > 0) {
    queue_.push_back({current_, fill_, /*owned=*/true});
    current_ = nullptr;
    fill_ = 0;
  }
  queue_.push_back({const_cast<char*>(static_cast<const char*>(data)), body,
                    /*owned=*/false});
  size_ += body;
  cv_.notify_all();
  if (current_ == nullptr) TakeBlock(lock);
  lock.unlock();
  if (current_ == nullptr) return false;
  return Append(static_cast<const char*>(data) + body, n - body);
}

bool FileWriter::Skip(size_t n) {
  static const char kZeros[kAlign] = {};
  // Zeros through the block up to the next kAlign unit, and after the last.
  const auto zeros = [this](size_t k) {
    for (; k > 0;) {
      const size_t take = std::min(k, kAlign);
      if (!Append(kZeros, take)) return false;
      k -= take;
    }
    return true;
  };
  const size_t head = std::min(n, (kAlign - size_ % kAlign) % kAlign);
  if (!zeros(head)) return false;
  n -= head;
  const size_t body = n / kAlign * kAlign;
  if (body > 0) {
    std::unique_lock<std::mutex> lock(mu_);
    if (error_ != 0 || current_ == nullptr) return false;
    // The block so far is a whole number of kAlign (the file's size is).
    if (fill_ > 0) {
      queue_.push_back({current_, fill_, /*owned=*/true});
      current_ = nullptr;
      fill_ = 0;
    }
    queue_.push_back({nullptr, body, /*owned=*/false});
    size_ += body;
    skipped_ = true;
    cv_.notify_all();
    if (current_ == nullptr) TakeBlock(lock);
    lock.unlock();
    if (current_ == nullptr) return false;
  }
  return zeros(n - body);
}

void FileWriter::Flush() {
  std::unique_lock<std::mutex> lock(mu_);
  queue_.push_back({current_, fill_, /*owned=*/true});
  current_ = nullptr;
  fill_ = 0;
  cv_.notify_all();
  TakeBlock(lock);
}

void FileWriter::TakeBlock(std::unique_lock<std::mutex>& lock) {
  bool no_memory = false;
  // The queue is written in order: a block comes back after the one before
  // it, so the wait ends once the thread has written one.
  while (error_ == 0 && (current_ = buffers_->TryTake(&no_memory)) == nullptr) {
    if (no_memory) {
      error_ = ENOMEM;
      failed_in_ = "taking a block for its queue";
      break;
    }
    cv_.wait(lock);
  }
  if (error_ != 0 && current_ != nullptr) {
    buffers_->Give(current_);
    current_ = nullptr;
  }
}

absl::Status FileWriter::Finish() {
  Drain();
  int error = error_;
  std::string in = failed_in_;
  // The first failure of the steps below, and in which.
  auto fail = [&](int e, std::string what) {
    if (error != 0 || e == 0) return;
    error = e;
    in = std::move(what);
  };
  if (error == 0 && fill_ > 0) {
    const size_t aligned = direct_ ? fill_ / kAlign * kAlign : 0;
    if (aligned > 0) {
      fail(WriteErrno(fd_, current_, aligned),
           absl::StrCat("an O_DIRECT write of ", aligned, " bytes at offset ",
                        written_));
      written_ += aligned;
    }
    if (error == 0 && aligned < fill_) {
      // The tail is not a whole block: written through the page cache.
      if (direct_) {
        const int flags = ::fcntl(fd_, F_GETFL);
        if (flags < 0 || ::fcntl(fd_, F_SETFL, flags & ~O_DIRECT) != 0) {
          fail(errno, "turning O_DIRECT off");
        }
      }
      if (error == 0) {
        fail(WriteErrno(fd_, current_ + aligned, fill_ - aligned),
             absl::StrCat("a buffered write of the last ", fill_ - aligned,
                          " bytes at offset ", written_));
        written_ += fill_ - aligned;
      }
    }
    fill_ = 0;
  }
  if (current_ != nullptr) {
    buffers_->Give(current_);
    current_ = nullptr;
  }
  // A file that ends in a hole has its size all the same.
  if (error == 0 && skipped_ &&
      ::ftruncate(fd_, static_cast<off_t>(size_)) != 0) {
    fail(errno, "setting its size");
  }
  if (error == 0 && ::fsync(fd_) != 0) fail(errno, "fsync");
  if (::close(fd_) != 0) fail(errno, "close");
  fd_ = -1;
  error_ = error;
  failed_in_ = in;
  if (error != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot write ", path_, ", ", in, ": ", ErrorText(error)));
  }
  return absl::OkStatus();
}

}  // namespace concord::checkpoint
