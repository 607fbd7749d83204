// See Note [NCCL failures and re-forming]: which NCCL results re-form the job
// (retryable in the elastic loop) and which stop the worker.
#include "worker/comm/nccl/nccl_result.h"

#include <gtest/gtest.h>

#include "worker/elastic/retryable.h"

namespace concord::comm {
namespace {

TEST(NcclResultTest, APeerOrSystemFailureEndsTheGenerationAndReforms) {
  for (NcclResult r :
       {NcclResult::kUnhandledCudaError, NcclResult::kSystemError,
        NcclResult::kInternalError, NcclResult::kRemoteError}) {
    const absl::StatusCode code = NcclResultCode(static_cast<int>(r));
    EXPECT_EQ(code, absl::StatusCode::kUnavailable) << static_cast<int>(r);
    EXPECT_TRUE(elastic::Retryable(absl::Status(code, "x")));
  }
}

// Two ranks on one GPU ("Duplicate GPU detected" at init) fail in every
// generation: re-forming would loop, so the worker stops with the error.
TEST(NcclResultTest, AnIncorrectCallStopsTheWorkerInsteadOfReformingForever) {
  for (NcclResult r :
       {NcclResult::kInvalidArgument, NcclResult::kInvalidUsage}) {
    const absl::StatusCode code = NcclResultCode(static_cast<int>(r));
    EXPECT_EQ(code, absl::StatusCode::kFailedPrecondition)
        << static_cast<int>(r);
    EXPECT_FALSE(elastic::Retryable(absl::Status(code, "x")));
  }
}

TEST(NcclResultTest, SuccessAndInProgressAreNotFailures) {
  EXPECT_EQ(NcclResultCode(static_cast<int>(NcclResult::kSuccess)),
            absl::StatusCode::kOk);
  EXPECT_EQ(NcclResultCode(static_cast<int>(NcclResult::kInProgress)),
            absl::StatusCode::kOk);
  // A result a later NCCL adds is a failure of the generation.
  EXPECT_EQ(NcclResultCode(42), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace concord::comm
