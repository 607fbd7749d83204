// See Note [Watchdog pings] in coordinator/systemd_notify.h through the real
// server: WATCHDOG=1 goes out from the tick thread while the core ticks, and
// stops while the core is stuck behind its mutex. The test plays systemd: it
// owns the unix datagram socket that NOTIFY_SOCKET names.

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <future>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "coordinator/server.h"
#include "coordinator/systemd_notify.h"

namespace concord::coordinator {
namespace {

using Clock = std::chrono::steady_clock;

// systemd's end of the notification socket.
class NotifySocket {
 public:
  NotifySocket() {
    char dir[] = "/tmp/concord-watchdog-XXXXXX";
    dir_ = mkdtemp(dir);
    path_ = dir_ + "/notify";
    fd_ = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path_.c_str());
    bound_ = bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    timeval timeout{0, 50000};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  }
  ~NotifySocket() {
    close(fd_);
    unlink(path_.c_str());
    rmdir(dir_.c_str());
  }
  bool bound() const { return bound_; }
  const std::string& path() const { return path_; }

  // Receives for `duration`; returns the times of the WATCHDOG=1 messages.
  std::vector<Clock::time_point> Pings(std::chrono::milliseconds duration) {
    std::vector<Clock::time_point> pings;
    const auto end = Clock::now() + duration;
    char buffer[4096];
    while (Clock::now() < end) {
      const ssize_t n = recv(fd_, buffer, sizeof(buffer) - 1, 0);
      if (n <= 0) continue;
      if (std::string(buffer, static_cast<size_t>(n)).find("WATCHDOG=1") !=
          std::string::npos) {
        pings.push_back(Clock::now());
      }
    }
    return pings;
  }

 private:
  std::string dir_, path_;
  int fd_ = -1;
  bool bound_ = false;
};

TEST(WatchdogTest, PingsStopWhileTheCoreIsStuck) {
  NotifySocket systemd;
  ASSERT_TRUE(systemd.bound());
  // 400 ms watchdog: a ping every 200 ms (the core ticks every 50 ms).
  setenv("NOTIFY_SOCKET", systemd.path().c_str(), 1);
  setenv("WATCHDOG_USEC", "400000", 1);
  unsetenv("WATCHDOG_PID");
  // sd_notify reads NOTIFY_SOCKET at every send: it stays set until the end.
  SystemdNotifier notifier = SystemdNotifier::FromEnvironment();
  ASSERT_TRUE(notifier.active());
  ASSERT_EQ(notifier.watchdog_interval(), absl::Milliseconds(400));

  ServerOptions options;
  options.worker_token = "worker-token-0123456789";
  options.operator_token = "operator-token-0123456789";
  options.tick_interval = absl::Milliseconds(50);
  options.on_tick = [&notifier] { notifier.Alive(); };
  auto server = Server::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();

  // Ticking: about 5 pings a second.
  std::vector<Clock::time_point> healthy =
      systemd.Pings(std::chrono::milliseconds(1000));
  // (3 leaves room for a loaded machine; more than 6 would break the rate
  // limit of one ping per half interval.)
  EXPECT_GE(healthy.size(), 3u);
  EXPECT_LE(healthy.size(), 6u);

  // A stuck core: something holds the core's mutex and never returns.
  std::mutex mu;
  std::condition_variable cv;
  bool release = false;
  std::promise<void> holding;
  std::thread stuck([&] {
    (*server)->host().Read([&](const Core&) {
      holding.set_value();
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return release; });
      return 0;
    });
  });
  holding.get_future().wait();
  // A ping already past the tick's lock may still land: skip 100 ms.
  systemd.Pings(std::chrono::milliseconds(100));
  EXPECT_TRUE(systemd.Pings(std::chrono::milliseconds(1000)).empty())
      << "pings went on while the core was stuck";

  {
    std::lock_guard<std::mutex> lock(mu);
    release = true;
  }
  cv.notify_all();
  stuck.join();
  EXPECT_GE(systemd.Pings(std::chrono::milliseconds(1000)).size(), 2u)
      << "pings did not resume";
  (*server)->Shutdown();
  unsetenv("NOTIFY_SOCKET");
  unsetenv("WATCHDOG_USEC");
}

TEST(WatchdogTest, NothingWithoutNotifySocket) {
  unsetenv("NOTIFY_SOCKET");
  setenv("WATCHDOG_USEC", "400000", 1);
  SystemdNotifier notifier = SystemdNotifier::FromEnvironment();
  unsetenv("WATCHDOG_USEC");
  EXPECT_FALSE(notifier.active());
  EXPECT_EQ(notifier.watchdog_interval(), absl::ZeroDuration());
  notifier.Ready("x");  // no socket: nothing to send, nothing to fail
  notifier.Alive();
}

}  // namespace
}  // namespace concord::coordinator
