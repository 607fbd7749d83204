#include "worker/test_fault.h"

#include <csignal>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/logging.h"

namespace concord::worker {

absl::StatusOr<std::vector<TestFault>> ParseTestFaults(const std::string& spec,
                                                       int local_rank) {
  std::vector<TestFault> out;
  if (spec.empty()) return out;
  for (absl::string_view one : absl::StrSplit(spec, ',')) {
    std::vector<std::string> parts = absl::StrSplit(one, ':');
    int local = -1;
    TestFault f;
    double stall_s = 0;
    const bool stall_ok =
        parts.size() == 5 ||
        (parts.size() == 6 && absl::StartsWith(parts[5], "stall=") &&
         absl::SimpleAtod(parts[5].substr(6), &stall_s) && stall_s > 0 &&
         stall_s <= 86400);
    if (!stall_ok || !absl::SimpleAtoi(parts[0], &local) ||
        !absl::SimpleAtoi(parts[1], &f.step) || f.step < 1 ||
        (parts[2] != "forward" && parts[2] != "backward" &&
         parts[2] != "bucket" && parts[2] != "zero") ||
        parts[3].empty() || !absl::SimpleAtoi(parts[4], &f.occurrence) ||
        f.occurrence < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "CONCORD_TEST_FAULT: '", one,
          "': expected LOCAL:STEP:forward|backward|bucket|zero:NAME:"
          "N[:stall=SECONDS] (STEP, N >= 1; 0 < SECONDS <= "
          "86400)"));
    }
    f.stall = absl::Seconds(stall_s);
    f.point = parts[2] == "forward"    ? TestFault::Point::kForward
              : parts[2] == "backward" ? TestFault::Point::kBackward
              : parts[2] == "bucket"   ? TestFault::Point::kBucket
                                       : TestFault::Point::kZero;
    f.module = parts[3];
    if (local == local_rank) out.push_back(std::move(f));
  }
  return out;
}

void TestFaults::Reached(int64_t step, TestFault::Point point,
                         const std::string& module) {
  if (step != counted_step_) {
    counted_step_ = step;
    counts_.assign(faults_.size(), 0);
  }
  for (size_t i = 0; i < faults_.size(); ++i) {
    const TestFault& f = faults_[i];
    if (f.step != step || f.point != point || f.module != module) continue;
    if (++counts_[i] != f.occurrence || fired_[i]) continue;
    const char* where = point == TestFault::Point::kForward    ? "forward"
                        : point == TestFault::Point::kBackward ? "backward"
                        : point == TestFault::Point::kBucket   ? "bucket"
                                                               : "zero";
    if (f.stall > absl::ZeroDuration()) {
      fired_[i] = true;
      Log()->warn(
          "CONCORD_TEST_FAULT: stalling for {} s at step {}, {} {} of '{}'",
          absl::ToDoubleSeconds(f.stall), step, where, f.occurrence, module);
      Log()->flush();
      absl::SleepFor(f.stall);
      Log()->warn("CONCORD_TEST_FAULT: stall over, going on");
      continue;
    }
    Log()->warn("CONCORD_TEST_FAULT: killing myself at step {}, {} {} of '{}'",
                step, where, f.occurrence, module);
    Log()->flush();
    std::raise(SIGKILL);
  }
}

}  // namespace concord::worker
