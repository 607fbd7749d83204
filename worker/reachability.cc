#include "worker/reachability.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace concord::worker {
namespace {

// The first address of host:port (numeric or a name), or an empty
// addrinfo pointer.
struct AddrInfoDeleter {
  void operator()(addrinfo* a) const { freeaddrinfo(a); }
};
using AddrInfo = std::unique_ptr<addrinfo, AddrInfoDeleter>;

AddrInfo Resolve(const std::string& host, int port, bool passive) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_family = AF_UNSPEC;
  if (passive) hints.ai_flags = AI_PASSIVE;
  addrinfo* out = nullptr;
  const std::string service = std::to_string(port);
  if (getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(),
                  &hints, &out) != 0) {
    return AddrInfo();
  }
  return AddrInfo(out);
}

}  // namespace

absl::StatusOr<std::unique_ptr<ProbeListener>> ProbeListener::Start(
    const std::string& host) {
  AddrInfo addr = Resolve(host, 0, /*passive=*/true);
  if (!addr) {
    return absl::UnavailableError(
        absl::StrCat("reachability port: cannot resolve ", host));
  }
  const int fd = ::socket(addr->ai_family,
                          addr->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0 || ::bind(fd, addr->ai_addr, addr->ai_addrlen) != 0 ||
      ::listen(fd, SOMAXCONN) != 0) {
    const std::string error = std::strerror(errno);
    if (fd >= 0) ::close(fd);
    return absl::UnavailableError(
        absl::StrCat("reachability port on ", host, ": ", error));
  }
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  const int port =
      bound.ss_family == AF_INET6
          ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
          : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  int wake[2];
  if (::pipe2(wake, O_CLOEXEC) != 0) {
    ::close(fd);
    return absl::UnavailableError("reachability port: pipe failed");
  }
  return std::unique_ptr<ProbeListener>(
      new ProbeListener(fd, port, wake[0], wake[1]));
}

ProbeListener::ProbeListener(int fd, int port, int wake_read, int wake_write)
    : fd_(fd), port_(port), wake_read_(wake_read), wake_write_(wake_write) {
  thread_ = std::thread([this] { Loop(); });
}

ProbeListener::~ProbeListener() {
  const char byte = 0;
  while (::write(wake_write_, &byte, 1) < 0 && errno == EINTR) {
  }
  thread_.join();
  ::close(fd_);
  ::close(wake_read_);
  ::close(wake_write_);
}

void ProbeListener::Loop() {
  for (;;) {
    pollfd fds[2] = {{fd_, POLLIN, 0}, {wake_read_, POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) return;
    for (;;) {
      const int conn = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (conn < 0) break;  // EAGAIN: all taken
      ::close(conn);
    }
  }
}

std::vector<bool> ProbeReachable(
    const std::vector<std::pair<std::string, int>>& endpoints,
    absl::Duration timeout) {
  std::vector<bool> reachable(endpoints.size(), false);
  std::vector<pollfd> fds;
  std::vector<size_t> which;
  for (size_t i = 0; i < endpoints.size(); ++i) {
    AddrInfo addr = Resolve(endpoints[i].first, endpoints[i].second, false);
    if (!addr) continue;
    const int fd = ::socket(
        addr->ai_family, addr->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) continue;
    if (::connect(fd, addr->ai_addr, addr->ai_addrlen) == 0) {
      reachable[i] = true;
      ::close(fd);
      continue;
    }
    if (errno == ECONNREFUSED) {
      reachable[i] = true;
    } else if (errno == EINPROGRESS) {
      fds.push_back({fd, POLLOUT, 0});
      which.push_back(i);
      continue;
    }
    ::close(fd);
  }
  const absl::Time deadline = absl::Now() + timeout;
  size_t pending = fds.size();
  while (pending > 0) {
    const int64_t left = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (left <= 0) break;
    const int n = ::poll(fds.data(), fds.size(), static_cast<int>(left));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    for (size_t k = 0; k < fds.size(); ++k) {
      if (fds[k].fd < 0 || fds[k].revents == 0) continue;
      int error = 0;
      socklen_t len = sizeof(error);
      ::getsockopt(fds[k].fd, SOL_SOCKET, SO_ERROR, &error, &len);
      // Accepted, or refused by a host that answered.
      reachable[which[k]] = error == 0 || error == ECONNREFUSED;
      ::close(fds[k].fd);
      fds[k].fd = -1;
      --pending;
    }
  }
  for (pollfd& p : fds) {
    if (p.fd >= 0) ::close(p.fd);
  }
  return reachable;
}

bool SuggestsUnreachablePeer(std::string_view why) {
  const std::string lower = absl::AsciiStrToLower(std::string(why));
  return absl::StrContains(lower, "timed out") ||
         absl::StrContains(lower, "deadline_exceeded") ||
         // comm::Work's own collective timeout (worker/comm/work.cc).
         absl::StrContains(lower, "did not finish within") ||
         absl::StrContains(lower, "did not connect");
}

}  // namespace concord::worker
