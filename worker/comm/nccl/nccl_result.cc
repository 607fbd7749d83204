#include "worker/comm/nccl/nccl_result.h"

namespace concord::comm {

absl::StatusCode NcclResultCode(int result) {
  switch (static_cast<NcclResult>(result)) {
    case NcclResult::kSuccess:
    case NcclResult::kInProgress:
      return absl::StatusCode::kOk;
    case NcclResult::kInvalidArgument:
    case NcclResult::kInvalidUsage:
      return absl::StatusCode::kFailedPrecondition;
    default:
      return absl::StatusCode::kUnavailable;
  }
}

}  // namespace concord::comm
