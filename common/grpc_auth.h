#pragma once
// Bearer tokens on gRPC calls (common/auth.h has the tokens themselves).

#include <grpcpp/client_context.h>

#include <string>

namespace concord {

// Adds `authorization: Bearer <token>` to a call (nothing when empty).
void AddBearerToken(grpc::ClientContext& context, const std::string& token);

}  // namespace concord
