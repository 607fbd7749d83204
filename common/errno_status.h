#pragma once
// A failed system call on a file as a Status, one line: "<what> <path>:
// <strerror(errno)>", UNAVAILABLE (a disk or a mount that may come back).
// Read errno before anything else can change it.

#include <cerrno>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace concord {

inline absl::Status ErrnoStatus(absl::string_view what,
                                absl::string_view path) {
  return absl::UnavailableError(
      absl::StrCat(what, " ", path, ": ", std::strerror(errno)));
}

}  // namespace concord
