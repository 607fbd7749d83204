#pragma once
// Who may call what: every RPC of the worker and operator services starts
// with Authorizer::Check for its role.
//
// A caller presents `authorization: Bearer <token>` metadata. No or an
// unknown token: UNAUTHENTICATED. A known token of the other role:
// PERMISSION_DENIED. The token is compared with both configured tokens in
// constant time. Thread-safe (immutable after construction).

#include <grpcpp/server_context.h>

#include <string>

#include "absl/status/status.h"

namespace concord::coordinator {

enum class Role { kWorker, kOperator };

class Authorizer {
 public:
  // Both tokens must be valid (common/auth.h) and differ; Server::Start
  // checks that.
  Authorizer(std::string worker_token, std::string operator_token)
      : worker_token_(std::move(worker_token)),
        operator_token_(std::move(operator_token)) {}

  // `method` names the call in the error message.
  absl::Status Check(const grpc::ServerContextBase& context, Role role,
                     const char* method) const;

 private:
  std::string worker_token_;
  std::string operator_token_;
};

}  // namespace concord::coordinator
