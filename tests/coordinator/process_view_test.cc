// What a node agent sees of its workers' processes (see Note [What the agent
// sees] in agent/process_view.h): /proc's lines parsed, and real processes
// of this machine looked at (running, sleeping, stopped, gone).

#include "agent/process_view.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/time/clock.h"

namespace concord::agent {
namespace {

TEST(ParseProcStatTest, ReadsStateCpuAndStartTime) {
  // proc(5): utime 14, stime 15, starttime 22; the name may hold spaces and
  // parentheses.
  const std::string line =
      "4242 (my (odd) name) S 1 4242 4242 0 -1 4194560 100 0 0 0 "
      "250 50 0 0 20 0 12 0 987654 1000000 200 18446744073709551615";
  const std::optional<ProcStat> s = ParseProcStat(line);
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->state, 'S');
  EXPECT_EQ(s->cpu_ticks, 300);
  EXPECT_EQ(s->start_time, 987654u);
  for (const std::string bad :
       {"", "4242 (name", "4242 name) S 1", "4242 (n) S 1 2 3",
        "4242 (n) SS 1 4242 4242 0 -1 0 0 0 0 0 250 50 0 0 20 0 1 0 9 1 2",
        "4242 (n) S 1 4242 4242 0 -1 0 0 0 0 0 x 50 0 0 20 0 1 0 9 1 2",
        "4242 (n) S 1 4242 4242 0 -1 0 0 0 0 0 -5 50 0 0 20 0 1 0 9 1 2"}) {
    EXPECT_FALSE(ParseProcStat(bad).has_value()) << bad;
  }
}

TEST(ParseProcStatTest, StateNames) {
  EXPECT_EQ(StateName('R'), "running");
  EXPECT_EQ(StateName('S'), "sleeping");
  EXPECT_EQ(StateName('I'), "sleeping");
  EXPECT_EQ(StateName('D'), "disk");
  EXPECT_EQ(StateName('T'), "stopped");
  EXPECT_EQ(StateName('t'), "stopped");
  EXPECT_EQ(StateName('Z'), "zombie");
  EXPECT_EQ(StateName('?'), "");
}

// The process state the watch reports for `pid`, waiting up to 5 s for it to
// become `want` (a signal takes effect a moment later).
std::string StateOf(ProcessWatch& watch, pid_t pid, const std::string& want) {
  std::string state;
  const absl::Time end = absl::Now() + absl::Seconds(5);
  do {
    std::optional<v1::ProcessView> v = watch.View(pid);
    state = v.has_value() ? v->state() : "gone";
    if (state == want) break;
    absl::SleepFor(absl::Milliseconds(10));
  } while (absl::Now() < end);
  return state;
}

TEST(ProcessWatchTest, SeesRealProcessesAsTheyAre) {
  ProcessWatch watch(nullptr);
  // This process: it has used CPU; no GPU view without NVML.
  std::optional<v1::ProcessView> self = watch.View(getpid());
  ASSERT_TRUE(self.has_value());
  EXPECT_FALSE(self->has_gpu_percent());
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    for (;;) pause();
  }
  EXPECT_EQ(StateOf(watch, child, "sleeping"), "sleeping");
  kill(child, SIGSTOP);
  EXPECT_EQ(StateOf(watch, child, "stopped"), "stopped");
  kill(child, SIGCONT);
  EXPECT_EQ(StateOf(watch, child, "sleeping"), "sleeping");
  kill(child, SIGKILL);
  EXPECT_EQ(StateOf(watch, child, "zombie"), "zombie");  // not reaped yet
  waitpid(child, nullptr, 0);
  EXPECT_FALSE(watch.View(child).has_value());  // gone
  // Not pids.
  EXPECT_FALSE(watch.View(0).has_value());
  EXPECT_FALSE(watch.View(-3).has_value());
  EXPECT_FALSE(watch.View(int64_t{1} << 40).has_value());
}

TEST(ProcessWatchTest, ABusyProcessUsesCpu) {
  ProcessWatch watch(nullptr);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    for (volatile uint64_t i = 0;; i = i + 1) {
    }
  }
  const std::optional<v1::ProcessView> before = watch.View(child);
  absl::SleepFor(absl::Milliseconds(500));
  const std::optional<v1::ProcessView> after = watch.View(child);
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  ASSERT_TRUE(before.has_value() && after.has_value());
  // A spinning process: well above the rule's idle share (0.1 of a core),
  // even on a loaded 2-core machine.
  EXPECT_GE(after->cpu_ms() - before->cpu_ms(), 100);
}

// Without a driver (CI) there is no GPU view, and why; with one (a GPU
// machine), samples are percentages of the processes NVML saw.
TEST(GpuActivityTest, ThereIsAGpuViewOnlyWithNvml) {
  std::string why;
  std::unique_ptr<GpuActivity> gpu = GpuActivity::Open(&why);
  if (gpu == nullptr) {
    EXPECT_FALSE(why.empty());
    return;
  }
  for (const auto& [pid, percent] : gpu->Sample()) {
    EXPECT_GT(pid, 0);
    EXPECT_GE(percent, 0);
    EXPECT_LE(percent, 100);
  }
}

}  // namespace
}  // namespace concord::agent
