#pragma once
// Writing a whole buffer to a file descriptor: the trace and history files'
// writers (one write(2) a record where the kernel allows, so that a killed
// process leaves whole lines), and at an offset (a checkpoint's holes).

#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <string_view>

namespace concord {

// Writes all of `data`, retrying short writes and EINTR; false when a
// write failed (a full disk: the callers lose the record, never the work).
inline bool WriteAll(int fd, std::string_view data) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

// Writes all of `data` at `offset` (pwrite(2)), retrying short writes and
// EINTR; false when a write failed (errno says why).
inline bool WriteAllAt(int fd, std::string_view data, uint64_t offset) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::pwrite(fd, data.data() + done, data.size() - done,
                               static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return false;
    if (n == 0) {
      errno = EIO;
      return false;
    }
    done += static_cast<size_t>(n);
  }
  return true;
}

}  // namespace concord
