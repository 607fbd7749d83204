#pragma once
// A minimal HTTP/1.0 GET against a loopback port, for the tests and the
// benchmarks that read the coordinator's health and metrics endpoints.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include "absl/strings/str_cat.h"

namespace concord {

// GET http://127.0.0.1:port/path: the whole response, or "" on error. Waits
// at most 5 s for each read.
inline std::string HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  std::string out;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string request =
        absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
    (void)!send(fd, request.data(), request.size(), MSG_NOSIGNAL);
    char buf[65536];
    pollfd p{fd, POLLIN, 0};
    while (poll(&p, 1, 5000) > 0) {
      const ssize_t n = read(fd, buf, sizeof(buf));
      if (n <= 0) break;
      out.append(buf, static_cast<size_t>(n));
    }
  }
  close(fd);
  return out;
}

}  // namespace concord
