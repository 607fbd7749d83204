#include "common/logging.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"

namespace concord {
namespace {

constexpr const char* kPattern = "[%Y-%m-%d %H:%M:%S.%e] [%n] [%^%l%$] %v";

// Every logger that was the library's stays alive: a thread may still hold
// the pointer Log() gave it.
std::mutex keep_mu;
std::vector<std::shared_ptr<spdlog::logger>>& Kept() {
  static auto* kept = new std::vector<std::shared_ptr<spdlog::logger>>();
  return *kept;
}

spdlog::logger* Keep(std::shared_ptr<spdlog::logger> logger) {
  std::lock_guard<std::mutex> lock(keep_mu);
  Kept().push_back(logger);
  return logger.get();
}

std::atomic<spdlog::logger*>& Library() {
  static std::atomic<spdlog::logger*> library{[] {
    auto logger = std::make_shared<spdlog::logger>(
        "concord", std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
    logger->set_pattern(kPattern);
    logger->set_level(spdlog::level::info);
    return Keep(std::move(logger));
  }()};
  return library;
}

}  // namespace

void InitLogging(const std::string& name, const std::string& level) {
  auto logger = spdlog::stderr_color_mt(name);
  logger->set_pattern(kPattern);
  logger->set_level(spdlog::level::from_str(level));
  spdlog::set_default_logger(logger);
  Library().store(Keep(std::move(logger)));
}

spdlog::logger* Log() { return Library().load(); }

absl::StatusOr<spdlog::level::level_enum> ParseLogLevel(
    absl::string_view name) {
  for (auto level :
       {spdlog::level::trace, spdlog::level::debug, spdlog::level::info,
        spdlog::level::warn, spdlog::level::err, spdlog::level::critical,
        spdlog::level::off}) {
    const auto sv = spdlog::level::to_string_view(level);
    if (name == absl::string_view(sv.data(), sv.size())) return level;
  }
  if (name == "warn") return spdlog::level::warn;  // spdlog's is "warning"
  return absl::InvalidArgumentError(
      absl::StrCat("'", name,
                   "': not a log level (trace, debug, info, warn, error, "
                   "critical, off)"));
}

}  // namespace concord
