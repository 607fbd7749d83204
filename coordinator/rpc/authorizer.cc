#include "coordinator/rpc/authorizer.h"

#include "absl/strings/str_cat.h"
#include "common/auth.h"

namespace concord::coordinator {

absl::Status Authorizer::Check(const grpc::ServerContextBase& context,
                               Role role, const char* method) const {
  const auto& metadata = context.client_metadata();
  auto it = metadata.find("authorization");
  if (it == metadata.end()) {
    return absl::UnauthenticatedError(absl::StrCat(
        method, ": missing 'authorization: Bearer <token>' metadata"));
  }
  const std::string token =
      BearerTokenOf(std::string(it->second.data(), it->second.size()));
  // Both comparisons always run.
  const bool worker = ConstantTimeEquals(worker_token_, token);
  const bool op = ConstantTimeEquals(operator_token_, token);
  if (!worker && !op) {
    return absl::UnauthenticatedError(
        absl::StrCat(method, ": unknown bearer token"));
  }
  if (role == Role::kWorker && !worker) {
    return absl::PermissionDeniedError(
        absl::StrCat(method, " needs a worker token; got the operator's"));
  }
  if (role == Role::kOperator && !op) {
    return absl::PermissionDeniedError(
        absl::StrCat(method, " needs an operator token; got a worker's"));
  }
  return absl::OkStatus();
}

}  // namespace concord::coordinator
