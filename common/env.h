#pragma once
// Reading CONCORD_* environment variables (see Note [Worker environment] in
// worker/session.h): the one way the worker library and its parts read
// them, with errors that name the variable.

#include <cstdint>
#include <cstdlib>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace concord {

// The variable's value, or `fallback` when it is not set.
inline std::string Env(const char* name, const std::string& fallback = "") {
  const char* v = std::getenv(name);
  return v == nullptr ? fallback : std::string(v);
}

// An integer variable >= `min` into `*out` (`fallback` when unset or
// empty); INVALID_ARGUMENT naming it otherwise.
inline absl::Status EnvInt(const char* name, int64_t fallback, int64_t min,
                           int64_t* out) {
  const std::string text = Env(name);
  if (text.empty()) {
    *out = fallback;
    return absl::OkStatus();
  }
  if (!absl::SimpleAtoi(text, out) || *out < min) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, "='", text, "': expected an integer >= ", min));
  }
  return absl::OkStatus();
}

}  // namespace concord
