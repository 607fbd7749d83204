#pragma once
// Bearer tokens: reading them from files, comparing them in constant time,
// making new ones (no gRPC here: common/grpc_auth.h attaches them to
// calls).
//
// A token file holds one token: its first line, surrounding whitespace
// trimmed. Tokens are 16 to 4096 printable ASCII characters without spaces.

#include <string>

#include "absl/status/statusor.h"

namespace concord {

// Errors: NOT_FOUND / PERMISSION_DENIED (cannot open), INVALID_ARGUMENT
// (empty, too short or long, or characters a header cannot carry). Messages
// name the path.
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

// The same checks on a token given directly.
absl::Status ValidateToken(const std::string& token);

// True when `a == b`; the time taken depends only on the lengths.
bool ConstantTimeEquals(const std::string& a, const std::string& b);

// 32 random bytes from the kernel (getrandom), as 64 hex characters.
std::string GenerateToken();

// Writes `token` to a new file `path` readable only by its owner (0600).
// Errors: ALREADY_EXISTS, or the errno's code with the path named.
absl::Status WriteTokenFile(const std::string& path, const std::string& token);

// "Bearer <token>" -> token; empty when the header is not a bearer token.
std::string BearerTokenOf(const std::string& authorization_header);

}  // namespace concord
