#pragma once
// Note [NCCL failures and re-forming]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Which NCCL results end a generation and which end the worker. Torch-free and
// NCCL-free (the result is NCCL's ncclResult_t as an int; nccl_communicator.cc
// checks the values against nccl.h), so that the decision is tested on CPU.
//
// A collective or an init that fails because a peer, the network or the
// system failed (ncclUnhandledCudaError, ncclSystemError, ncclInternalError,
// ncclRemoteError, a timeout) is UNAVAILABLE: the generation is over and the
// survivors re-form (elastic::Retryable). A call NCCL calls incorrect —
// ncclInvalidArgument, ncclInvalidUsage — fails the same way in every
// generation: two ranks of the job on one GPU ("Duplicate GPU detected",
// at init), a bad argument. Re-forming would repeat it until some timeout,
// so it is FAILED_PRECONDITION: the worker stops with NCCL's one line.

#include "absl/status/status.h"

namespace concord::comm {

// ncclResult_t's values (nccl.h, stable since NCCL 2.0; ncclRemoteError
// since 2.13, ncclInProgress since 2.14).
enum class NcclResult : int {
  kSuccess = 0,
  kUnhandledCudaError = 1,
  kSystemError = 2,
  kInternalError = 3,
  kInvalidArgument = 4,
  kInvalidUsage = 5,
  kRemoteError = 6,
  kInProgress = 7,
};

// OK for success and in-progress; otherwise the code above.
absl::StatusCode NcclResultCode(int result);

}  // namespace concord::comm
