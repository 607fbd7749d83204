#include "worker/elastic/retryable.h"

namespace concord::elastic {

bool Retryable(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kDeadlineExceeded:
      return true;
    default:
      return false;
  }
}

}  // namespace concord::elastic
