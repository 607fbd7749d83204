#include "common/grpc_auth.h"

namespace concord {

void AddBearerToken(grpc::ClientContext& context, const std::string& token) {
  if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
}

}  // namespace concord
