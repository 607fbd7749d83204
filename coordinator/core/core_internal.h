#pragma once
// Helpers shared by the core's translation units (core.cc, core_views.cc).

#include <algorithm>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"

namespace concord::coordinator::internal {

// Jobs one coordinator holds at most (ended jobs included).
inline constexpr size_t kMaxJobs = 10000;
// Events in a JobStatus.
inline constexpr size_t kRecentEvents = 20;

// "10s", "10.2s", "0.25s": whole seconds stay whole (absl::FormatDuration
// would write 300s as "5m").
inline std::string Seconds(absl::Duration d) {
  const int64_t ms = absl::ToInt64Milliseconds(d);
  if (ms % 1000 == 0) return absl::StrCat(ms / 1000, "s");
  std::string s = absl::StrFormat("%.3f", static_cast<double>(ms) / 1000.0);
  while (!s.empty() && s.back() == '0') s.pop_back();
  return absl::StrCat(s, "s");
}

inline absl::Status JobNotFound(const std::string& job_id) {
  return absl::NotFoundError(absl::StrCat("unknown job '", job_id, "'"));
}

}  // namespace concord::coordinator::internal
