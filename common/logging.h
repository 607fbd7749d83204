#pragma once
// Logging: spdlog, one line per event, to stderr.
//
// Note [Library logging]
// ~~~~~~~~~~~~~~~~~~~~~~
// Concord's libraries (the worker library inside a user's training program,
// the node agent) log through Log(), a logger of their own named "concord"
// on standard error, never through spdlog's default logger: that one belongs
// to the program (it writes to standard output, where a program prints its
// own results). A Job sets its level (JobOptions::log_level,
// CONCORD_LOG_LEVEL). Tools call InitLogging from main, which makes one
// stderr logger the default and the library's alike, so that a tool's lines
// and its libraries' look the same.

#include <spdlog/spdlog.h>

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace concord {

// Sets the default logger's pattern, name (shown in every line) and level
// ("trace", "debug", "info", "warn", "error", "critical", "off"), and makes
// it the library logger too. Call once per process, from main.
void InitLogging(const std::string& name, const std::string& level = "info");

// The libraries' logger (see Note [Library logging]). Never null; any thread.
spdlog::logger* Log();

// A level by its name (those of InitLogging); INVALID_ARGUMENT naming the
// accepted ones otherwise.
absl::StatusOr<spdlog::level::level_enum> ParseLogLevel(absl::string_view name);

}  // namespace concord
