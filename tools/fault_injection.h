#pragma once
// concord-train's fault injection for the multi-process tests.

#include <spdlog/spdlog.h>

#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace concord::train {

// Test hook: CONCORD_TEST_KILL="LOCAL:STEP:PHASE[,...]" makes the worker
// that concord-run started as local worker LOCAL (CONCORD_LOCAL_RANK) kill
// itself with SIGKILL when it takes step STEP, in PHASE (forward: before the
// forward; backward: while buckets are in flight; optimizer: right after
// optimizer.step(), before the commit; slowmo: after the commit, before
// SlowMo's averaging). Only a worker's first run dies this
// way (CONCORD_RESTART_COUNT unset or 0), so a restarted one does not.
struct FaultInjection {
  std::vector<std::pair<int64_t, std::string>> faults;  // (step, phase)
  int64_t step = 0;                                     // the step being taken

  static FaultInjection FromEnvironment() {
    FaultInjection f;
    const char* spec = std::getenv("CONCORD_TEST_KILL");
    const char* restarts = std::getenv("CONCORD_RESTART_COUNT");
    const char* local = std::getenv("CONCORD_LOCAL_RANK");
    if (spec == nullptr ||
        (restarts != nullptr && std::string(restarts) != "0")) {
      return f;
    }
    for (absl::string_view one : absl::StrSplit(spec, ',')) {
      std::vector<std::string> parts = absl::StrSplit(one, ':');
      int who = -1;
      int64_t at = -1;
      if (parts.size() != 3 || !absl::SimpleAtoi(parts[0], &who) ||
          !absl::SimpleAtoi(parts[1], &at) ||
          (parts[2] != "forward" && parts[2] != "backward" &&
           parts[2] != "optimizer" && parts[2] != "slowmo")) {
        std::cerr << "concord-train: CONCORD_TEST_KILL='" << spec
                  << "': expected LOCAL:STEP:forward|backward|optimizer|"
                     "slowmo[,...]"
                  << std::endl;
        std::exit(2);
      }
      if (local != nullptr && std::to_string(who) == local) {
        f.faults.emplace_back(at, parts[2]);
      }
    }
    return f;
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
