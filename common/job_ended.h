#pragma once
// How a worker learns that its job has already succeeded: the coordinator's
// answer to a Join or a wait for a generation that will never come
// (FAILED_PRECONDITION naming the job and these words). A worker that was
// out when the job ended (taken out as hung or stopped, or never admitted)
// has nothing left to do, and ends with one line and exit status 0.

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"

namespace concord {

inline constexpr absl::string_view kJobSucceededText = "has already succeeded";

inline bool IsJobSucceeded(const absl::Status& status) {
  return absl::IsFailedPrecondition(status) &&
         absl::StrContains(status.message(), kJobSucceededText);
}

}  // namespace concord
