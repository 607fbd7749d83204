#pragma once
// See Note [Unreachable peers] in coordinator/core/core.h, the worker's side: a
// reachability port that only accepts connections, and a probe of other
// workers' ports. Torch-free.

#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace concord::worker {

// A TCP listener on `host` (port chosen by the kernel) that accepts every
// connection and closes it at once, on a thread of its own, until
// destroyed.
class ProbeListener {
 public:
  // UNAVAILABLE when no socket can be bound on `host`.
  static absl::StatusOr<std::unique_ptr<ProbeListener>> Start(
      const std::string& host);
  ~ProbeListener();
  ProbeListener(const ProbeListener&) = delete;
  ProbeListener& operator=(const ProbeListener&) = delete;

  int port() const { return port_; }

 private:
  ProbeListener(int fd, int port, int wake_read, int wake_write);
  void Loop();

  const int fd_;
  const int port_;
  const int wake_read_;  // readable once the destructor wants the loop gone
  const int wake_write_;
  std::thread thread_;
};

// Connects to every (host, port) at once and waits at most `timeout`:
// true for an endpoint that accepted or refused (its host answered), false
// for one that did not answer in time or is unreachable (no route, a bad
// address). Same order as `endpoints`.
std::vector<bool> ProbeReachable(
    const std::vector<std::pair<std::string, int>>& endpoints,
    absl::Duration timeout);

// Whether a re-form's reason says a peer may be unreachable rather than
// dead: a collective or a connection that timed out (Gloo's "Timed out",
// comm::Work's "collective did not finish within"), or a communicator that
// did not connect. Re-form reasons are status messages without their code,
// so this reads their words; the unit test holds every wording it knows.
bool SuggestsUnreachablePeer(std::string_view why);

}  // namespace concord::worker
