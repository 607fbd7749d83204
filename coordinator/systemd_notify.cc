#include "coordinator/systemd_notify.h"

#include <systemd/sd-daemon.h>

#include <chrono>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

namespace concord::coordinator {
namespace {

int64_t MonotonicNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// One line: sd_notify's messages are newline-separated assignments.
std::string OneLine(const std::string& text) {
  return absl::StrReplaceAll(text, {{"\n", " "}, {"\r", " "}});
}

}  // namespace

SystemdNotifier SystemdNotifier::FromEnvironment() {
  SystemdNotifier notifier;
  const char* socket = std::getenv("NOTIFY_SOCKET");
  notifier.active_ = socket != nullptr && socket[0] != '\0';
  uint64_t usec = 0;
  // > 0: enabled for this process (WATCHDOG_PID, if set, is ours).
  if (notifier.active_ && sd_watchdog_enabled(0, &usec) > 0 && usec > 0) {
    notifier.watchdog_ = absl::Microseconds(static_cast<int64_t>(usec));
  }
  return notifier;
}

SystemdNotifier::SystemdNotifier(SystemdNotifier&& other) noexcept
    : active_(other.active_),
      watchdog_(other.watchdog_),
      last_ping_ns_(other.last_ping_ns_.load()) {}

void SystemdNotifier::Send(const std::string& message) {
  if (!active_) return;
  // Errors (the manager went away) are not ours to handle: systemd notices a
  // missing READY=1 or watchdog ping by itself.
  (void)sd_notify(0, message.c_str());
}

void SystemdNotifier::Ready(const std::string& status) {
  Send(absl::StrCat("READY=1\nSTATUS=", OneLine(status)));
}

void SystemdNotifier::Status(const std::string& status) {
  Send(absl::StrCat("STATUS=", OneLine(status)));
}

void SystemdNotifier::Stopping(const std::string& status) {
  Send(absl::StrCat("STOPPING=1\nSTATUS=", OneLine(status)));
}

void SystemdNotifier::Alive() {
  if (!active_ || watchdog_ == absl::ZeroDuration()) return;
  const int64_t now = MonotonicNs();
  const int64_t half = absl::ToInt64Nanoseconds(watchdog_) / 2;
  int64_t last = last_ping_ns_.load(std::memory_order_relaxed);
  if (last != 0 && now - last < half) return;
  // One thread wins the ping.
  if (!last_ping_ns_.compare_exchange_strong(last, now)) return;
  Send("WATCHDOG=1");
}

}  // namespace concord::coordinator
