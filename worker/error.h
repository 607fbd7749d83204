#pragma once
// Between absl::Status (inside Concord) and concord::Error (the exception of
// the public API, include/concord/error.h): code that cannot return a status
// (autograd hooks and callbacks run inside `loss.backward()`; the public
// API) throws, and code that catches turns it back into a status.

#include "absl/status/status.h"
#include "concord/error.h"

namespace concord {

inline Error ToError(const absl::Status& status) {
  return Error(static_cast<ErrorCode>(status.code()),
               std::string(status.message()));
}

inline absl::Status ToStatus(const Error& error) {
  return absl::Status(static_cast<absl::StatusCode>(error.code()),
                      error.message());
}

inline void ThrowIfError(const absl::Status& status) {
  if (!status.ok()) throw ToError(status);
}

}  // namespace concord
