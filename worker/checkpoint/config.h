#pragma once
// What a job's checkpoints are (see Note [Checkpoints] in
// worker/checkpoint/checkpointer.h): the one place their options, defaults
// and environment variables live. Torch-free: concord-run parses its flags
// into it and passes it on to the workers with ToEnvironment.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/job_defaults.h"

namespace concord::checkpoint {

// A test hook: the write stops (as a crash would leave it) at a stage.
enum class WriteFault {
  kNone,
  kBeforeManifest,  // the data files written, no manifest
  kBeforeRename,    // the manifest written, the directory not renamed
  kDuringLatest,    // renamed; `latest` half-written, not renamed
};

// A test hook of the disk tier's writer: CONCORD_TEST_CHECKPOINT_FAULT=
// "STAGE:N" (STAGE: before-manifest, before-rename or during-latest) makes
// the process that writes its N-th checkpoint (concord-run, or a worker
// without it) stop that write at STAGE and SIGKILL itself: a crash at that
// point of the write.
struct TestCrash {
  WriteFault stage = WriteFault::kNone;
  int64_t nth = 0;
};
// INVALID_ARGUMENT naming the variable when malformed; kNone when unset.
absl::StatusOr<TestCrash> TestCrashFromEnvironment();

struct Config {
  // Where checkpoints go: DIR/<job>/step-<N>/. Empty: no checkpoints.
  std::string dir;
  // A checkpoint at every commit of a step that is a multiple of `every`
  // (at least 1 with a dir).
  int64_t every = 0;
  // Complete checkpoints kept on disk (at least 1).
  int keep = kDefaultCheckpointKeep;
  // Whether a generation whose members hold no committed step goes on from
  // the newest checkpoint (--no-resume: false).
  bool resume = true;
  // Parameters and optimizer state copied into the memory snapshot during
  // the next step (see Note [Overlapped snapshots] in
  // worker/checkpoint/memory.h): for programs that write them only in an
  // optimizer step after a backward.
  bool overlap = false;
  // The node agent's shared-memory file for this node's snapshot
  // (concord-run sets it; the agent writes it to disk). Empty: the worker
  // keeps its snapshot in its own memory and writes it itself.
  std::string memory;
  // The disk tier's test hook (CONCORD_TEST_CHECKPOINT_FAULT).
  TestCrash test_crash;

  bool enabled() const { return !dir.empty(); }
};

// INVALID_ARGUMENT naming the field (`prefix` + its name, upper case after
// a prefix ending in "_": an environment variable) when a dir has no
// positive `every`, `every` comes without a dir, or `keep` < 1.
absl::Status Validate(const Config& config, const std::string& prefix);

// CONCORD_CHECKPOINT_DIR, CONCORD_CHECKPOINT_EVERY, CONCORD_CHECKPOINT_KEEP,
// CONCORD_CHECKPOINT_RESUME and CONCORD_CHECKPOINT_OVERLAP (0 or 1) and
// CONCORD_CHECKPOINT_MEMORY
// (common/environment.h). INVALID_ARGUMENT names the variable that is
// malformed.
absl::StatusOr<Config> FromEnvironment();

// `dir` as the job's spec names it (JobSpec.checkpoint_dir): absolute
// (against the working directory), lexically normal, without a trailing
// '/'; "" stays "". Every process of a job that writes or reads its
// checkpoints uses this form, so that the coordinator's path for a step is
// theirs (see Note [One job's checkpoints] in coordinator/core/core.h).
std::string NormalDir(const std::string& dir);

// The variables FromEnvironment reads, "NAME=value", for concord-run's
// workers (none without a dir).
std::vector<std::string> ToEnvironment(const Config& config);

}  // namespace concord::checkpoint
