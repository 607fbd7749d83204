#include "worker/checkpoint/config.h"

#include <filesystem>
#include <system_error>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/environment.h"
#include "common/status_macros.h"

namespace concord::checkpoint {

absl::Status Validate(const Config& config, const std::string& prefix) {
  // An environment variable's prefix ("CONCORD_CHECKPOINT_") names its
  // fields in upper case.
  const bool variable = absl::EndsWith(prefix, "_");
  const std::string every = prefix + (variable ? "EVERY" : "every");
  const std::string keep = prefix + (variable ? "KEEP" : "keep");
  if (config.dir.empty()) {
    if (config.every != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(every, ": ", config.every, " without a checkpoint dir"));
    }
    return absl::OkStatus();
  }
  if (config.every < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(every,
                     ": a checkpoint dir needs a number of "
                     "steps >= 1 between checkpoints, got ",
                     config.every));
  }
  if (config.keep < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(keep, ": must be at least 1, got ", config.keep));
  }
  return absl::OkStatus();
}

absl::StatusOr<Config> FromEnvironment() {
  Config c;
  c.dir = NormalDir(env::Get(env::kCheckpointDir));
  CONCORD_RETURN_IF_ERROR(env::GetInt(env::kCheckpointEvery, &c.every));
  int64_t keep = 0, resume = 0, overlap = 0;
  CONCORD_RETURN_IF_ERROR(env::GetInt(env::kCheckpointKeep, &keep));
  c.keep = static_cast<int>(keep);
  CONCORD_RETURN_IF_ERROR(env::GetInt(env::kCheckpointResume, &resume));
  c.resume = resume == 1;
  CONCORD_RETURN_IF_ERROR(env::GetInt(env::kCheckpointOverlap, &overlap));
  c.overlap = overlap == 1;
  c.memory = env::Get(env::kCheckpointMemory);
  CONCORD_ASSIGN_OR_RETURN(c.test_crash, TestCrashFromEnvironment());
  CONCORD_RETURN_IF_ERROR(Validate(c, "CONCORD_CHECKPOINT_"));
  return c;
}

absl::StatusOr<TestCrash> TestCrashFromEnvironment() {
  const std::string spec = env::Get(env::kTestCheckpointFault);
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
        env::kTestCheckpointFault.name, "='", spec,
        "': expected before-manifest, before-rename or during-latest, ':', "
        "and N >= 1"));
  }
  return crash;
}

std::string NormalDir(const std::string& dir) {
  if (dir.empty()) return dir;
  std::error_code ec;
  std::filesystem::path p = std::filesystem::absolute(dir, ec);
  if (ec) p = dir;
  std::string normal = p.lexically_normal().string();
  while (normal.size() > 1 && normal.back() == '/') normal.pop_back();
  return normal;
}

std::vector<std::string> ToEnvironment(const Config& config) {
  if (!config.enabled()) return {};
  std::vector<std::string> assignments = {
      env::Assign(env::kCheckpointDir, config.dir),
      env::Assign(env::kCheckpointEvery, absl::StrCat(config.every)),
      env::Assign(env::kCheckpointKeep, absl::StrCat(config.keep)),
      env::Assign(env::kCheckpointResume, config.resume ? "1" : "0")};
  if (config.overlap) {
    assignments.push_back(env::Assign(env::kCheckpointOverlap, "1"));
  }
  if (!config.memory.empty()) {
    assignments.push_back(env::Assign(env::kCheckpointMemory, config.memory));
  }
  return assignments;
}

}  // namespace concord::checkpoint
