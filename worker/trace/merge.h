#pragma once
// Merging the per-worker trace files of a job (see Note [Trace files] in
// recorder.h) into one.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace concord::trace {

struct MergeResult {
  int64_t events = 0;
  int files = 0;              // inputs that existed
  int64_t skipped_lines = 0;  // lines that were not a whole event (a kill)
};

// Writes every event of `inputs` (in that order; missing inputs are
// skipped: a worker may die before tracing) to `output` as one JSON array.
// A line that does not parse (the cut-off last line of a killed writer) is
// skipped and counted. INVALID_ARGUMENT when `output` cannot be written.
absl::StatusOr<MergeResult> MergeTraceFiles(
    const std::vector<std::string>& inputs, const std::string& output);

}  // namespace concord::trace
