#pragma once
// The gRPC face of the coordinator for operators (operator.proto). Every
// method checks the operator token first (UNAUTHENTICATED without a known
// token, PERMISSION_DENIED with a worker's), then validates the request.
// Never blocks beyond the core's mutex. Thread-safe.

#include <grpcpp/grpcpp.h>

#include "concord/v1/operator.grpc.pb.h"
#include "coordinator/host/host.h"
#include "coordinator/metrics/metrics.h"
#include "coordinator/rpc/authorizer.h"

namespace concord::coordinator {

class OperatorServiceImpl final : public v1::OperatorService::Service {
 public:
  // All must outlive the service; `metrics` may be null.
  OperatorServiceImpl(CoreHost* host, const Authorizer* auth, Metrics* metrics)
      : host_(host), auth_(auth), metrics_(metrics) {}

  grpc::Status ListJobs(grpc::ServerContext* context,
                        const v1::ListJobsRequest* request,
                        v1::ListJobsResponse* response) override;
  // Errors as Core::GetJob.
  grpc::Status GetJob(grpc::ServerContext* context,
                      const v1::GetJobRequest* request,
                      v1::JobStatus* response) override;
  // Errors as Core::ListEvents.
  grpc::Status ListEvents(grpc::ServerContext* context,
                          const v1::ListEventsRequest* request,
                          v1::ListEventsResponse* response) override;
  // Errors as Core::DrainWorker.
  grpc::Status DrainWorker(grpc::ServerContext* context,
                           const v1::DrainWorkerRequest* request,
                           v1::DrainWorkerResponse* response) override;
  // Errors as Core::StopJob.
  grpc::Status StopJob(grpc::ServerContext* context,
                       const v1::StopJobRequest* request,
                       v1::StopJobResponse* response) override;

 private:
  // Checks the token, runs `fn(core)` (a read or a mutation) and copies its
  // StatusOr value into `response`.
  template <bool kMutates, typename Fn, typename Response>
  grpc::Status Call(grpc::ServerContext* context, const char* method, Fn fn,
                    Response* response);

  CoreHost* host_;
  const Authorizer* auth_;
  Metrics* metrics_;
};

}  // namespace concord::coordinator
