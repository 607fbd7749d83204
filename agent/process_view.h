#pragma once
// Note [What the agent sees]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// A worker says in its heartbeats what it is doing (see Note [Hangs] in
// coordinator/core/hang_rule.h). What it cannot say is what happens while it
// cannot speak, and what its CPU time does not show: a process stopped
// (SIGSTOP, a debugger) sends nothing at all, and a rank whose kernels keep
// its GPU busy while its host thread sleeps in a synchronize uses no CPU.
// Its node agent looks from outside. Each heartbeat carries the worker's pid
// (WorkerProgress.pid); when the agent passes a heartbeat on it adds what it
// sees of that process (NodeHeartbeat.process, a ProcessView):
//  - its state and CPU time, from /proc/<pid>/stat (the CPU time of all its
//    threads); "disk" when a thread of it is in uninterruptible sleep
//    (/proc/<pid>/task: a read from a hung network filesystem);
//  - where NVML is there, the highest streaming-multiprocessor utilisation
//    NVML sampled for the process on any GPU since the agent last asked.
//    The agent loads the driver's libnvidia-ml.so.1 itself (GpuActivity): it
//    needs no CUDA to build, and reports no GPU where there is none.
// A worker whose heartbeats are late (1.5 intervals) the agent reports alone
// (NodeRequest.processes) once an interval, until it heartbeats again, its
// process is gone or its exit is reported: how a stopped process is named
// "stopped" rather than only silent. The pid is checked against the
// process's start time, so a pid reused after the worker ended is never taken
// for it. The coordinator takes the view as evidence of progress only (CPU,
// a busy GPU: see Note [Hangs]) and to say what a hung or silent member's
// process was doing; liveness stays the worker's own heartbeat.

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "concord/v1/worker.pb.h"

namespace concord::agent {

// One line of /proc/<pid>/stat, parsed.
struct ProcStat {
  char state = '?';
  int64_t cpu_ticks = 0;    // utime + stime, in clock ticks
  uint64_t start_time = 0;  // since boot, in clock ticks (the pid's identity)
};
// nullopt for a line that is not /proc/<pid>/stat's (the command name may
// hold spaces and parentheses: the state follows the last ')').
std::optional<ProcStat> ParseProcStat(absl::string_view line);

// ProcessView.state for a /proc state letter: R "running", S and I
// "sleeping", D "disk", T and t "stopped", Z and X "zombie"; "" otherwise.
std::string StateName(char state);

// The GPU activity of processes, from NVML (see Note [What the agent sees]).
class GpuActivity {
 public:
  // NVML loaded and initialised with at least one GPU; nullptr without (no
  // driver, no GPU), with why in `why` when given.
  static std::unique_ptr<GpuActivity> Open(std::string* why = nullptr);
  ~GpuActivity();
  GpuActivity(const GpuActivity&) = delete;
  GpuActivity& operator=(const GpuActivity&) = delete;

  // The highest SM utilisation of each process NVML sampled on any GPU since
  // the last call, in percent.
  std::map<pid_t, int> Sample();

  struct Nvml;

 private:
  explicit GpuActivity(std::unique_ptr<Nvml> nvml);
  std::unique_ptr<Nvml> nvml_;
};

// What the agent sees of the processes of its workers, by pid (not
// thread-safe: the agent calls it under its mutex).
class ProcessWatch {
 public:
  // `gpu`: nullptr for no GPU view.
  explicit ProcessWatch(std::unique_ptr<GpuActivity> gpu);

  // The view of process `pid` now, or nullopt when it is gone, is not one this
  // watch saw before under that pid (a reused pid), or `pid` is not a pid.
  // The first view of a pid fixes its identity (its start time).
  std::optional<v1::ProcessView> View(int64_t pid);
  // Forgets `pid` (its worker exited).
  void Forget(int64_t pid) { known_.erase(static_cast<pid_t>(pid)); }
  // Samples the GPUs again when the last sample is older than `every`.
  void RefreshGpu(absl::Duration every);

 private:
  std::unique_ptr<GpuActivity> gpu_;
  std::map<pid_t, int> gpu_percent_;
  absl::Time gpu_sampled_ = absl::InfinitePast();
  std::map<pid_t, uint64_t> known_;  // pid -> its start time
  int64_t ticks_per_second_ = 100;
};

}  // namespace concord::agent
