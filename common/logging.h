#pragma once
// Logging: spdlog, one line per event, to stderr.

#include <spdlog/spdlog.h>

#include <string>

namespace concord {

// Sets the default logger's pattern, name (shown in every line) and level
// ("debug", "info", "warn", "error"). Call once per process, from main.
void InitLogging(const std::string& name, const std::string& level = "info");

}  // namespace concord
