#include "worker/checkpoint/config.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/env.h"
#include "common/status_macros.h"

namespace concord::checkpoint {

absl::Status Validate(const Config& config, const std::string& prefix) {
  if (config.dir.empty()) {
    if (config.every != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          prefix, "every: ", config.every, " without a checkpoint dir"));
    }
    return absl::OkStatus();
  }
  if (config.every < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix,
                     "every: a checkpoint dir needs a number of "
                     "steps >= 1 between checkpoints, got ",
                     config.every));
  }
  if (config.keep < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, "keep: must be at least 1, got ", config.keep));
  }
  return absl::OkStatus();
}

absl::StatusOr<Config> FromEnvironment() {
  Config c;
  c.dir = Env("CONCORD_CHECKPOINT_DIR");
  CONCORD_RETURN_IF_ERROR(EnvInt("CONCORD_CHECKPOINT_EVERY", 0, 0, &c.every));
  int64_t keep = 0, resume = 0;
  CONCORD_RETURN_IF_ERROR(
      EnvInt("CONCORD_CHECKPOINT_KEEP", kDefaultKeep, 1, &keep));
  c.keep = static_cast<int>(keep);
  CONCORD_RETURN_IF_ERROR(EnvInt("CONCORD_CHECKPOINT_RESUME", 1, 0, &resume));
  if (resume > 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CONCORD_CHECKPOINT_RESUME='", resume, "': expected 0 or 1"));
  }
  c.resume = resume == 1;
  c.memory = Env("CONCORD_CHECKPOINT_MEMORY");
  CONCORD_ASSIGN_OR_RETURN(c.test_crash, TestCrashFromEnvironment());
  CONCORD_RETURN_IF_ERROR(Validate(c, "CONCORD_CHECKPOINT_"));
  return c;
}

absl::StatusOr<TestCrash> TestCrashFromEnvironment() {
  const std::string spec = Env("CONCORD_TEST_CHECKPOINT_FAULT");
  TestCrash crash;
  if (spec.empty()) return crash;
  const std::vector<std::string> parts = absl::StrSplit(spec, ':');
  const std::string stage = parts[0];
  if (stage == "before-manifest") {
    crash.stage = WriteFault::kBeforeManifest;
  } else if (stage == "before-rename") {
    crash.stage = WriteFault::kBeforeRename;
  } else if (stage == "during-latest") {
    crash.stage = WriteFault::kDuringLatest;
  }
  if (parts.size() != 2 || crash.stage == WriteFault::kNone ||
      !absl::SimpleAtoi(parts[1], &crash.nth) || crash.nth < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CONCORD_TEST_CHECKPOINT_FAULT='", spec,
        "': expected before-manifest, before-rename or during-latest, ':', "
        "and N >= 1"));
  }
  return crash;
}

std::vector<std::pair<std::string, std::string>> ToEnvironment(
    const Config& config) {
  if (!config.enabled()) return {};
  std::vector<std::pair<std::string, std::string>> env = {
      {"CONCORD_CHECKPOINT_DIR", config.dir},
      {"CONCORD_CHECKPOINT_EVERY", absl::StrCat(config.every)},
      {"CONCORD_CHECKPOINT_KEEP", absl::StrCat(config.keep)},
      {"CONCORD_CHECKPOINT_RESUME", config.resume ? "1" : "0"}};
  if (!config.memory.empty()) {
    env.emplace_back("CONCORD_CHECKPOINT_MEMORY", config.memory);
  }
  return env;
}

}  // namespace concord::checkpoint
