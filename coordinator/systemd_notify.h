#pragma once
// Tells systemd how the coordinator is doing (sd_notify(3)), for units with
// Type=notify and WatchdogSec=. Without NOTIFY_SOCKET in the environment (not
// started by systemd, or another Type=) every call does nothing.
//
// Note [Watchdog pings]
// ~~~~~~~~~~~~~~~~~~~~~
// WATCHDOG=1 must prove that the service works, not only that some thread runs.
// The coordinator pings from the thread that ticks the core (Server's on_tick,
// after CoreHost::Tick returned: the core's mutex was free and its timeouts
// were checked), and a standby from its campaign loop (etcd was polled). A core
// stuck behind its mutex stops the pings, and systemd restarts the service
// after WatchdogSec.

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/time/time.h"

namespace concord::coordinator {

class SystemdNotifier {
 public:
  // Reads NOTIFY_SOCKET, WATCHDOG_USEC and WATCHDOG_PID (through libsystemd);
  // call in main, before other threads start. libsystemd's sd_notify reads
  // NOTIFY_SOCKET again at every send, so it must stay set.
  static SystemdNotifier FromEnvironment();
  // A notifier that never sends anything.
  SystemdNotifier() = default;
  SystemdNotifier(const SystemdNotifier&) = delete;
  SystemdNotifier& operator=(const SystemdNotifier&) = delete;
  SystemdNotifier(SystemdNotifier&& other) noexcept;

  // Whether systemd listens (NOTIFY_SOCKET was set).
  bool active() const { return active_; }
  // The watchdog's interval (WatchdogSec=); zero when it is off.
  absl::Duration watchdog_interval() const { return watchdog_; }

  // READY=1 with STATUS=`status`: startup is complete (the gRPC port accepts
  // connections, or an etcd standby is standing by). Repeating it is
  // harmless.
  void Ready(const std::string& status);
  // STATUS=`status` (shown by systemctl status).
  void Status(const std::string& status);
  // STOPPING=1 with STATUS=`status`: shutdown has begun.
  void Stopping(const std::string& status);
  // WATCHDOG=1, at most once per half watchdog interval (the rest return at
  // once). Thread-safe and cheap: call it from a path that proves the service
  // is alive (see Note [Watchdog pings]).
  void Alive();

 private:
  void Send(const std::string& message);

  bool active_ = false;
  absl::Duration watchdog_ = absl::ZeroDuration();
  // When the last WATCHDOG=1 went out, in ns of the monotonic clock.
  std::atomic<int64_t> last_ping_ns_{0};
};

}  // namespace concord::coordinator
