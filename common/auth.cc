#include "common/auth.h"

#include <fcntl.h>
#include <sys/random.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace concord {
namespace {

constexpr size_t kMinTokenLength = 16;
constexpr size_t kMaxTokenLength = 4096;

absl::Status ErrnoStatus(int err, const std::string& what) {
  const std::string message = absl::StrCat(what, ": ", std::strerror(err));
  switch (err) {
    case ENOENT:
      return absl::NotFoundError(message);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(message);
    case EEXIST:
      return absl::AlreadyExistsError(message);
    default:
      return absl::UnavailableError(message);
  }
}

}  // namespace

absl::Status ValidateToken(const std::string& token) {
  if (token.size() < kMinTokenLength || token.size() > kMaxTokenLength) {
    return absl::InvalidArgumentError(
        absl::StrCat("a token must have ", kMinTokenLength, " to ",
                     kMaxTokenLength, " characters; got ", token.size()));
  }
  for (char c : token) {
    if (c <= ' ' || c > '~') {
      return absl::InvalidArgumentError(
          "a token must be printable ASCII without spaces");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  if (path.empty()) return absl::InvalidArgumentError("empty token file path");
  std::ifstream in(path);
  if (!in) return ErrnoStatus(errno, absl::StrCat("token file ", path));
  std::string line;
  std::getline(in, line);
  if (in.bad()) return ErrnoStatus(errno, absl::StrCat("token file ", path));
  const std::string token(absl::StripAsciiWhitespace(line));
  absl::Status valid = ValidateToken(token);
  if (!valid.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("token file ", path, ": ", valid.message()));
  }
  return token;
}

bool ConstantTimeEquals(const std::string& a, const std::string& b) {
  // Compare every byte of `a` against `b` (wrapped), so the loop length does
  // not depend on where they differ.
  volatile unsigned char diff = a.size() == b.size() ? 0 : 1;
  if (b.empty()) return a.empty();
  for (size_t i = 0; i < a.size(); ++i) {
    diff = diff | static_cast<unsigned char>(a[i] ^ b[i % b.size()]);
  }
  return diff == 0;
}

std::string GenerateToken() {
  unsigned char bytes[32];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
  }
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(bytes), sizeof(bytes)));
}

absl::Status WriteTokenFile(const std::string& path, const std::string& token) {
  const int fd =
      open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("token file ", path));
  const std::string text = token + "\n";
  const ssize_t n = write(fd, text.data(), text.size());
  const int err = errno;
  close(fd);
  if (n != static_cast<ssize_t>(text.size())) {
    return ErrnoStatus(err, absl::StrCat("writing token file ", path));
  }
  return absl::OkStatus();
}

std::string BearerTokenOf(const std::string& header) {
  constexpr absl::string_view kPrefix = "Bearer ";
  if (!absl::StartsWith(header, kPrefix)) return "";
  return header.substr(kPrefix.size());
}

}  // namespace concord
