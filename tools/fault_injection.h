#pragma once
// concord-train's fault injection for the multi-process tests.

#include <spdlog/spdlog.h>

#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/environment.h"

namespace concord::train {

// Test hook: CONCORD_TEST_KILL="LOCAL:STEP:PHASE[,...]" makes the worker
// that concord-run started as local worker LOCAL (CONCORD_LOCAL_RANK) kill
// itself with SIGKILL when it takes step STEP, in PHASE (forward: before the
// forward; backward: while buckets are in flight; optimizer: right after
// optimizer.step(), before the commit; slowmo: after the commit, before
// SlowMo's averaging). Only a worker's first run dies this
// way (CONCORD_RESTART_COUNT unset or 0), so a restarted one does not.
//
// Test hook: CONCORD_TEST_BUSY="LOCAL:STEP:SECONDS" makes local worker LOCAL
// compute (spin one core) for SECONDS before it takes step STEP, outside the
// step, as pytorch/examples' MNIST tests its model between epochs on rank 0
// while the others wait in the next step's agreement: busy, not hung (see
// Note [Hangs] in coordinator/core/hang_rule.h). First run only.
//
// Test hook: CONCORD_TEST_MIN_STEP_MS=N makes every step take at least N ms
// (the worker sleeps out the rest before the next one, to a grid of N ms
// that every process of the machine shares), so that a test that acts on a
// running job (starts a joiner, waits for a restarted worker) gets the same
// wall time on a fast transport or machine as on a slow one.
struct FaultInjection {
  std::vector<std::pair<int64_t, std::string>> faults;  // (step, phase)
  int64_t step = 0;                                     // the step being taken
  std::chrono::milliseconds min_step{0};
  int64_t busy_step = -1;  // CONCORD_TEST_BUSY's
  double busy_seconds = 0;
  std::chrono::steady_clock::time_point last_step{};

  static FaultInjection FromEnvironment() {
    FaultInjection f;
    int64_t ms = 0, restarts = 0, local = -1;
    for (absl::Status st : {env::GetInt(env::kTestMinStepMs, &ms),
                            env::GetInt(env::kRestartCount, &restarts),
                            env::GetLocalRank(&local)}) {
      if (!st.ok()) {
        std::cerr << "concord-train: " << st.message() << std::endl;
        std::exit(2);
      }
    }
    f.min_step = std::chrono::milliseconds(ms);
    if (const std::string busy = env::Get(env::kTestBusy);
        !busy.empty() && restarts == 0) {
      std::vector<std::string> parts = absl::StrSplit(busy, ':');
      int who = -1;
      if (parts.size() != 3 || !absl::SimpleAtoi(parts[0], &who) ||
          !absl::SimpleAtoi(parts[1], &f.busy_step) || f.busy_step < 1 ||
          !absl::SimpleAtod(parts[2], &f.busy_seconds) ||
          !(f.busy_seconds > 0)) {
        std::cerr << "concord-train: " << env::kTestBusy.name << "='" << busy
                  << "': expected LOCAL:STEP:SECONDS (STEP >= 1, SECONDS > 0)"
                  << std::endl;
        std::exit(2);
      }
      if (who != local) f.busy_step = -1;
    }
    const std::string spec = env::Get(env::kTestKill);
    if (spec.empty() || restarts != 0) return f;
    for (absl::string_view one : absl::StrSplit(spec, ',')) {
      std::vector<std::string> parts = absl::StrSplit(one, ':');
      int who = -1;
      int64_t at = -1;
      if (parts.size() != 3 || !absl::SimpleAtoi(parts[0], &who) ||
          !absl::SimpleAtoi(parts[1], &at) ||
          (parts[2] != "forward" && parts[2] != "backward" &&
           parts[2] != "optimizer" && parts[2] != "slowmo")) {
        std::cerr << "concord-train: " << env::kTestKill.name << "='" << spec
                  << "': expected LOCAL:STEP:forward|backward|optimizer|"
                     "slowmo[,...]"
                  << std::endl;
        std::exit(2);
      }
      if (who == local) {
        f.faults.emplace_back(at, parts[2]);
      }
    }
    return f;
  }
  // At the start of a step: waits until min_step has passed since the last,
  // to the next point of a grid of min_step on the steady clock. The clock is
  // the machine's, so a test's workers start their paced steps together:
  // none arrives last at every collective only because of when its own
  // pacing began (a phase that would persist, and that the straggler rule
  // would rightly name: see Note [Stragglers]), only because it is slower.
  void Pace() {
    if (min_step.count() <= 0) return;
    using Clock = std::chrono::steady_clock;
    const auto grid = std::chrono::duration_cast<Clock::duration>(min_step);
    const Clock::duration due = (last_step + grid).time_since_epoch();
    std::this_thread::sleep_until(
        Clock::time_point(((due + grid - Clock::duration(1)) / grid) * grid));
    last_step =
        Clock::time_point((Clock::now().time_since_epoch() / grid) * grid);
  }
  // Before step `next` (outside it): CONCORD_TEST_BUSY's computing, once.
  void MaybeBusy(int64_t next) {
    if (next != busy_step) return;
    busy_step = -1;
    spdlog::warn("CONCORD_TEST_BUSY: computing for {} s before step {}",
                 busy_seconds, next);
    const auto until =
        std::chrono::steady_clock::now() +
        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
            std::chrono::duration<double>(busy_seconds));
    volatile uint64_t x = 1;
    while (std::chrono::steady_clock::now() < until) {
      for (int i = 0; i < 100000; ++i) x = x * 6364136223846793005ULL + 1;
    }
    spdlog::warn("CONCORD_TEST_BUSY: done");
  }
  bool Armed(const char* phase) const {
    for (const auto& [at, p] : faults) {
      if (p == phase) return true;
    }
    return false;
  }
  void MaybeDie(const char* phase) const {
    for (const auto& [at, p] : faults) {
      if (at != step || p != phase) continue;
      spdlog::warn("CONCORD_TEST_KILL: killing myself at step {} in {}", step,
                   phase);
      std::raise(SIGKILL);
    }
  }
};

}  // namespace concord::train
