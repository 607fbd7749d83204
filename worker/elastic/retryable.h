#pragma once
// Torch-free: the elastic loop's one decision about a failed collective or
// re-form, tested with the codes that produce it (see Note [NCCL failures and
// re-forming], Gloo's timeouts).

#include "absl/status/status.h"

namespace concord::elastic {

// Whether a failed collective's status means "re-form and go on":
// UNAVAILABLE (a peer or the generation went away), ABORTED, and
// DEADLINE_EXCEEDED (a collective timed out). Anything else stops the loop.
bool Retryable(const absl::Status& status);

}  // namespace concord::elastic
