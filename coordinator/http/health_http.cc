#include "coordinator/http/health_http.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace concord::coordinator {

absl::StatusOr<std::unique_ptr<HealthHttpServer>> HealthHttpServer::Start(
    const std::string& address) {
  const size_t colon = address.rfind(':');
  int port = -1;
  if (colon == std::string::npos ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 ||
      port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("health address '", address, "' is not host:port"));
  }
  std::string host = address.substr(0, colon);
  if (host == "localhost") host = "127.0.0.1";
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("health address '", address, "': host must be IPv4"));
  }
  std::unique_ptr<HealthHttpServer> server(new HealthHttpServer());
  server->fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (server->fd_ < 0 ||
      bind(server->fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) !=
          0 ||
      listen(server->fd_, 16) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on '", address,
                                               "': ", std::strerror(errno)));
  }
  socklen_t len = sizeof(addr);
  getsockname(server->fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  server->port_ = ntohs(addr.sin_port);
  server->thread_ = std::thread([s = server.get()] { s->Loop(); });
  return server;
}

HealthHttpServer::~HealthHttpServer() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  if (fd_ >= 0) close(fd_);
}

void HealthHttpServer::Loop() {
  while (!stop_) {
    pollfd p{fd_, POLLIN, 0};
    if (poll(&p, 1, 100) <= 0) continue;
    const int conn = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (conn < 0) continue;
    // Read what the client sent (a request line at least), briefly.
    pollfd c{conn, POLLIN, 0};
    if (poll(&c, 1, 1000) > 0) {
      char buf[1024];
      (void)!read(conn, buf, sizeof(buf));
    }
    const bool serving = serving_;
    const std::string body = serving ? "SERVING\n" : "NOT_SERVING\n";
    const std::string response = absl::StrCat(
        "HTTP/1.1 ", serving ? "200 OK" : "503 Service Unavailable",
        "\r\nContent-Type: text/plain\r\nContent-Length: ", body.size(),
        "\r\nConnection: close\r\n\r\n", body);
    (void)!send(conn, response.data(), response.size(), MSG_NOSIGNAL);
    close(conn);
  }
}

}  // namespace concord::coordinator
