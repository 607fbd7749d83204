#include "coordinator/rpc/operator_service.h"

#include "absl/status/statusor.h"
#include "common/grpc_status.h"

namespace concord::coordinator {

template <bool kMutates, typename Fn, typename Response>
grpc::Status OperatorServiceImpl::Call(grpc::ServerContext* context,
                                       const char* method, Fn fn,
                                       Response* response) {
  RpcScope scope(metrics_, method);
  absl::Status auth = auth_->Check(*context, Role::kOperator, method);
  if (!auth.ok()) return scope.Done(ToGrpcStatus(auth));
  absl::StatusOr<Response> result;
  if constexpr (kMutates) {
    result = host_->Mutate(fn);
  } else {
    result = host_->Read(fn);
  }
  if (!result.ok()) return scope.Done(ToGrpcStatus(result.status()));
  *response = *std::move(result);
  return scope.Done(grpc::Status::OK);
}

grpc::Status OperatorServiceImpl::ListJobs(grpc::ServerContext* context,
                                           const v1::ListJobsRequest* request,
                                           v1::ListJobsResponse* response) {
  return Call<false>(
      context, "ListJobs",
      [](const Core& core) {
        return absl::StatusOr<v1::ListJobsResponse>(core.ListJobs());
      },
      response);
}

grpc::Status OperatorServiceImpl::GetJob(grpc::ServerContext* context,
                                         const v1::GetJobRequest* request,
                                         v1::JobStatus* response) {
  return Call<false>(
      context, "GetJob",
      [&](const Core& core) { return core.GetJob(*request); }, response);
}

grpc::Status OperatorServiceImpl::ListEvents(
    grpc::ServerContext* context, const v1::ListEventsRequest* request,
    v1::ListEventsResponse* response) {
  return Call<false>(
      context, "ListEvents",
      [&](const Core& core) { return core.ListEvents(*request); }, response);
}

grpc::Status OperatorServiceImpl::DrainWorker(
    grpc::ServerContext* context, const v1::DrainWorkerRequest* request,
    v1::DrainWorkerResponse* response) {
  return Call<true>(
      context, "DrainWorker",
      [&](Core& core) { return core.DrainWorker(*request); }, response);
}

grpc::Status OperatorServiceImpl::StopJob(grpc::ServerContext* context,
                                          const v1::StopJobRequest* request,
                                          v1::StopJobResponse* response) {
  return Call<true>(
      context, "StopJob", [&](Core& core) { return core.StopJob(*request); },
      response);
}

}  // namespace concord::coordinator
