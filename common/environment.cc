#include "common/environment.h"

#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace concord::env {

const std::vector<const Variable*>& All() {
  static const std::vector<const Variable*> all = {
      &kCoordinator,
      &kJobId,
      &kMinWorkers,
      &kMaxWorkers,
      &kSettleMs,
      &kHeartbeatIntervalMs,
      &kHeartbeatTimeoutMs,
      &kHangTimeoutMs,
      &kStragglers,
      &kStragglerCooldownMs,
      &kRendezvousTimeoutMs,
      &kCollectiveTimeoutMs,
      &kWorkerId,
      &kNodeId,
      &kLocalRank,
      &kRestartCount,
      &kCommHost,
      &kTokenFile,
      &kToken,
      &kTlsCa,
      &kTlsCert,
      &kTlsKey,
      &kTraceFile,
      &kHistoryFile,
      &kDevice,
      &kBackend,
      &kSharedMemory,
      &kLogLevel,
      &kCheckpointDir,
      &kCheckpointEvery,
      &kCheckpointKeep,
      &kCheckpointResume,
      &kCheckpointOverlap,
      &kCheckpointMemory,
      &kTestFault,
      &kTestCheckpointFault,
      &kTestKill,
      &kTestAgentLingerMs,
      &kTestMinStepMs,
      &kTestShardsAsBytes,
      &kTestCheckpointHoles,
      &kTestBusy,
  };
  return all;
}

const Variable* Find(absl::string_view name) {
  for (const Variable* v : All()) {
    if (v->name == name) return v;
  }
  return nullptr;
}

namespace {

const char* Raw(const Variable& v) {
  return std::getenv(std::string(v.name).c_str());
}

}  // namespace

std::string Get(const Variable& v, const std::string& fallback) {
  const char* value = Raw(v);
  return value == nullptr ? fallback : std::string(value);
}

bool IsSet(const Variable& v) { return Raw(v) != nullptr; }

absl::Status GetInt(const Variable& v, int64_t* out) {
  return GetInt(v, v.int_default, v.int_min, out);
}

absl::Status GetInt(const Variable& v, int64_t fallback, int64_t min,
                    int64_t* out) {
  const std::string text = Get(v);
  if (text.empty()) {
    *out = fallback;
    return absl::OkStatus();
  }
  if (!absl::SimpleAtoi(text, out) || *out < min || *out > v.int_max) {
    return absl::InvalidArgumentError(absl::StrCat(
        v.name, "='", text, "': expected ",
        v.int_max == kNoMax    ? absl::StrCat("an integer >= ", min)
        : v.int_max == min + 1 ? absl::StrCat(min, " or ", v.int_max)
                               : absl::StrCat(min, " to ", v.int_max)));
  }
  return absl::OkStatus();
}

absl::Status GetLocalRank(int64_t* out) {
  if (IsSet(kLocalRank)) return GetInt(kLocalRank, out);
  // torchrun's name, for programs started by other launchers.
  const char* torchrun = std::getenv("LOCAL_RANK");
  if (torchrun == nullptr || *torchrun == '\0') {
    *out = kLocalRank.int_default;
    return absl::OkStatus();
  }
  if (!absl::SimpleAtoi(torchrun, out) || *out < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("LOCAL_RANK='", torchrun, "': expected an integer >= 0"));
  }
  return absl::OkStatus();
}

std::string Assign(const Variable& v, absl::string_view value) {
  return absl::StrCat(v.name, "=", value);
}

bool PassedOn(absl::string_view assignment) {
  const size_t eq = assignment.find('=');
  if (eq == absl::string_view::npos) return false;
  const Variable* v = Find(assignment.substr(0, eq));
  return v != nullptr &&
         (v->set_by == SetBy::kUser || v->set_by == SetBy::kTest);
}

std::string Table() {
  std::string out =
      "The CONCORD_* environment variables of a worker. concord-run sets "
      "those\nset by \"concord-run\" for each worker (a value in its own "
      "environment is not\npassed on) and passes on those set by \"you\" or "
      "\"tests\"; a program run\nwithout concord-run reads them all.\n";
  for (const Variable* v : All()) {
    std::string def;
    if (!v->default_text.empty()) {
      def = std::string(v->default_text);
    } else if (v->integer) {
      def = absl::StrCat(v->int_default);
    } else {
      def = "none";
    }
    const char* by = v->set_by == SetBy::kLauncher ? "concord-run"
                     : v->set_by == SetBy::kTest   ? "tests"
                     : v->set_by == SetBy::kUser   ? "you"
                                                   : "you, without concord-run";
    std::string range;
    if (v->integer && v->int_max == kNoMax) {
      range = absl::StrCat(", >= ", v->int_min);
    }
    absl::StrAppend(&out, "\n", v->name, "\n    ", v->type, range,
                    "; default: ", def, "; set by ", by, "\n    ", v->meaning,
                    "\n");
  }
  return out;
}

}  // namespace concord::env
