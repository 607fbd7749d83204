#include "worker/checkpoint/region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace concord::checkpoint {
namespace {

absl::Status Errno(const std::string& what, const std::string& path) {
  return absl::UnavailableError(
      absl::StrCat(what, " ", path.empty() ? "anonymous memory" : path, ": ",
                   std::strerror(errno)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Region>> Region::Open(const std::string& path) {
  std::unique_ptr<Region> r(new Region());
  r->path_ = path;
  if (!path.empty()) {
    r->fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (r->fd_ < 0) return Errno("cannot open", path);
    struct stat st {};
    if (::fstat(r->fd_, &st) != 0) return Errno("cannot stat", path);
    const size_t size = static_cast<size_t>(st.st_size);
    CONCORD_RETURN_IF_ERROR(r->Map(size < kHeaderBytes ? kHeaderBytes : size));
    return r;
  }
  CONCORD_RETURN_IF_ERROR(r->Map(kHeaderBytes));
  return r;
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
  if (fd_ >= 0) {
    struct stat st {};
    if (::fstat(fd_, &st) != 0) return Errno("cannot stat", path_);
    if (static_cast<size_t>(st.st_size) < bytes) {
      // posix_fallocate: a /dev/shm without room fails here, not with a
      // SIGBUS at the copy.
      if (int e = ::posix_fallocate(fd_, 0, static_cast<off_t>(bytes));
          e != 0) {
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
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (p == MAP_FAILED) return Errno("cannot map", path_);
  if (base_ != nullptr) {
    std::memcpy(p, base_, kHeaderBytes);  // the header's counters
    ::munmap(base_, mapped_);
  }
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
