#pragma once
// This machine's host name: the default node id of a worker
// (CONCORD_NODE_ID) and of concord-run (--node-id), which must agree for the
// resume source (see Note [Resume source] in coordinator/core/core.h), and
// part of default worker ids. One home, so that they do.

#include <unistd.h>

#include <string>

namespace concord {

// gethostname(2); "unknown" when it fails.
inline std::string HostName() {
  char host[256] = {0};
  if (::gethostname(host, sizeof(host) - 1) != 0 || host[0] == '\0') {
    return "unknown";
  }
  return host;
}

}  // namespace concord
