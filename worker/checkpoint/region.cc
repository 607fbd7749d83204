#include "worker/checkpoint/region.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/errno_status.h"
#include "common/status_macros.h"

namespace concord::checkpoint {
namespace {

absl::Status Errno(const std::string& what, const std::string& path) {
  return ErrnoStatus(what, path.empty() ? "anonymous memory" : path);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Region>> Region::Open(const std::string& path) {
  std::unique_ptr<Region> r(new Region());
  r->path_ = path;
  r->fd_ = path.empty()
               ? ::memfd_create("concord-checkpoint", MFD_CLOEXEC)
               : ::open(path.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC,
                        0600);
  if (r->fd_ < 0) return Errno("cannot open", path);
  CONCORD_RETURN_IF_ERROR(r->MapFile());
  return r;
}

absl::StatusOr<std::unique_ptr<Region>> Region::Create(
    const std::string& path) {
  std::unique_ptr<Region> r(new Region());
  r->path_ = path;
  r->fd_ = ::open(path.c_str(),
                  O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (r->fd_ < 0) return Errno("cannot create", path);
  CONCORD_RETURN_IF_ERROR(r->MapFile());
  return r;
}

absl::StatusOr<std::unique_ptr<Region>> Region::Share() const {
  std::unique_ptr<Region> r(new Region());
  r->path_ = path_;
  r->fd_ = ::fcntl(fd_, F_DUPFD_CLOEXEC, 0);
  if (r->fd_ < 0) return Errno("cannot share", path_);
  CONCORD_RETURN_IF_ERROR(r->MapFile());
  return r;
}

absl::Status Region::MapFile() {
  struct stat st {};
  if (::fstat(fd_, &st) != 0) return Errno("cannot stat", path_);
  const size_t size = static_cast<size_t>(st.st_size);
  return Map(size < kHeaderBytes ? kHeaderBytes : size);
}

// A futex on the header's doorbell (not FUTEX_PRIVATE: the mapping is
// shared between processes, and between the Regions of one).
void Region::Ring() {
  auto* word = reinterpret_cast<uint32_t*>(&header().doorbell);
  header().doorbell.fetch_add(1, std::memory_order_acq_rel);
  ::syscall(SYS_futex, word, FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

void Region::WaitForRing(uint32_t seen, std::chrono::milliseconds timeout) {
  auto* word = reinterpret_cast<uint32_t*>(&header().doorbell);
  struct timespec ts {};
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1000);
  ts.tv_nsec = static_cast<long>(timeout.count() % 1000 * 1000000);
  // Returns at once when the doorbell rang since `seen` was read (EAGAIN).
  ::syscall(SYS_futex, word, FUTEX_WAIT, seen, &ts, nullptr, 0);
}

Region::~Region() {
  if (base_ != nullptr) ::munmap(base_, mapped_);
  if (fd_ >= 0) ::close(fd_);
}

// MAP_POPULATE: the pages are made in one pass when the region grows
// rather than faulted in one by one during a copy. The first snapshot,
// which grows the region, still pays for them (74 ms against 9.5 ms for
// 168 MB here, bench/checkpoint_vs_pytorch.py); later ones reuse them.
absl::Status Region::Map(size_t bytes) {
  if (bytes <= mapped_) return absl::OkStatus();
  struct stat st {};
  if (::fstat(fd_, &st) != 0) return Errno("cannot stat", path_);
  if (static_cast<size_t>(st.st_size) < bytes) {
    // A memfd has no size limit of its own: growing one past the machine's
    // memory would end in the OOM killer, not in an error.
    const long pages = ::sysconf(_SC_PHYS_PAGES);
    const long page = ::sysconf(_SC_PAGESIZE);
    if (path_.empty() && pages > 0 && page > 0 &&
        bytes / static_cast<size_t>(page) >= static_cast<size_t>(pages)) {
      errno = ENOMEM;
      return Errno("cannot grow", path_);
    }
    // posix_fallocate: a /dev/shm without room fails here, not with a
    // SIGBUS at the copy.
    if (int e = ::posix_fallocate(fd_, 0, static_cast<off_t>(bytes)); e != 0) {
      errno = e;
      return Errno("cannot grow", path_);
    }
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_POPULATE, fd_, 0);
  if (p == MAP_FAILED) return Errno("cannot map", path_);
  if (base_ != nullptr) ::munmap(base_, mapped_);
  base_ = p;
  mapped_ = bytes;
  return absl::OkStatus();
}

absl::Status Region::Reserve(size_t bytes) {
  // Grow by a quarter more than asked: a state that grows a little (an
  // optimizer's state appearing after its first step) maps once.
  if (bytes <= mapped_) return absl::OkStatus();
  return Map(bytes + bytes / 4);
}

absl::Status Region::MapAll() {
  const uint64_t bytes = header().bytes;
  if (bytes <= mapped_) return absl::OkStatus();
  return Map(static_cast<size_t>(bytes));
}

}  // namespace concord::checkpoint
