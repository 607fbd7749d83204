#pragma once
// The disk tier's writer (see Note [Checkpoints] in
// worker/checkpoint/checkpointer.h): a thread that writes the snapshots of
// memory regions to disk, off the training thread. concord-run runs one over
// its node's region (the node agent's: the workers only copy into memory);
// a worker without an agent runs one over its own.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "concord/v1/worker.pb.h"
#include "worker/checkpoint/config.h"
#include "worker/checkpoint/file_writer.h"
#include "worker/checkpoint/region.h"

namespace concord::checkpoint {

struct PersisterStats {
  int64_t written = 0;
  // Snapshots replaced by a newer one before the writer got to them (a
  // checkpoint falls due while the last one is still being written: the
  // newest wins, none waits).
  int64_t superseded = 0;
  int64_t failed = 0;
  int64_t last_step = -1;  // of the last checkpoint written
  uint64_t last_bytes = 0;
  double last_seconds = 0;
  std::string last_error;
  // The step of the newest snapshot when its write failed and none was
  // written since (-1: the last write was not a failure).
  int64_t failing_step = -1;
};

// A write the persister finished, for whoever reports it (concord-run
// tells the coordinator through its node agent): a checkpoint written, or
// one that failed (`error` set; `path` is where it was going).
struct PersistReport {
  std::string job;
  // The process whose snapshot this is (RegionHeader::writer_pid): whose
  // credential the node agent's report carries (see Note [One job's
  // checkpoints] in coordinator/core/core.h).
  int64_t writer_pid = 0;
  std::string path;
  std::string error;
  int64_t step = 0, epoch = 0, samples = 0, world_size = 0, generation = 0;
  // See Note [Runs] in coordinator/core/core.h (0: a memory-only report,
  // whose content is not read: the coordinator takes it as the job's run).
  int64_t run = 0;
  uint64_t bytes = 0;
  double seconds = 0;
  // The training step's stall for this snapshot (RegionHeader::stall_ns).
  double stall_seconds = 0;
  // Due checkpoints not written since the previous report: skipped by the
  // writer (the region was being persisted) or superseded before the
  // persister got to them.
  int64_t skipped = 0;
  // A snapshot in the region only (another node's writer persists): no
  // write; `step`, `bytes` (the region's) and `stall_seconds` set (see Note
  // [Resume source] in coordinator/core/core.h).
  bool memory = false;
};

// What the coordinator keeps of `report` (a node agent's report, or a
// worker's of its own write), written now on `node`.
v1::CheckpointReport ReportOf(const PersistReport& report,
                              const std::string& node);

// Note [Persister priority]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// The persister's thread (and the threads its file writes start) runs at nice
// kNice: on a node whose cores train, the background write takes what training
// leaves rather than stretching the steps (a due checkpoint that finds the last
// still being written is skipped and counted, never waited for).
class Persister {
 public:
  static constexpr int kNice = 10;

  // Writes the snapshots `region` marks for the disk tier into `dir`,
  // keeping `keep` (see Note [Checkpoint directories]). `region` must outlive
  // the persister and be its own (Region::Share in the writer's process):
  // the persister's thread remaps it. Wakes when a writer rings the
  // region's doorbell, and every `poll`.
  // `crash`: the test hook TestCrashFromEnvironment reads.
  // `on_report` (may be empty) runs on the persister's thread after each
  // write for the disk tier, written or failed, and for each snapshot not
  // for the disk tier (PersistReport::memory).
  Persister(Region* region, std::string dir, int keep, TestCrash crash = {},
            std::function<void(const PersistReport&)> on_report = {},
            std::chrono::milliseconds poll = std::chrono::seconds(1));
  // Writes what is ready, then stops.
  ~Persister();
  Persister(const Persister&) = delete;
  Persister& operator=(const Persister&) = delete;

  // Returns once every snapshot ready before the call has been written (or
  // failed).
  void Flush();
  PersisterStats stats() const;

  // Writes the region's snapshot if one is ready for the disk tier and not
  // written yet; false when there was none. The thread's step; Flush's.
  bool PersistOnce();

 private:
  void Loop();

  Region* region_;
  const std::string dir_;
  const int keep_;
  const TestCrash crash_;
  // See Note [Write queue] in worker/checkpoint/file_writer.h: kept across
  // writes, so that its blocks are faulted in once.
  const std::shared_ptr<WriteBuffers> buffers_ =
      std::make_shared<WriteBuffers>();
  const std::function<void(const PersistReport&)> on_report_;
  int64_t attempts_ = 0;  // writes begun (the test crash counts them)
  const std::chrono::milliseconds poll_;
  mutable std::mutex mu_;
  bool stop_ = false;
  // One PersistOnce at a time; held while region_ is remapped (Ring from
  // another thread takes it).
  std::mutex write_mu_;
  PersisterStats stats_;  // guarded by mu_
  int64_t failing_ = 0;   // failures since the last write; guarded by mu_
  // Skipped and superseded snapshots already reported; guarded by write_mu_.
  int64_t reported_skips_ = 0;
  std::thread thread_;
};

}  // namespace concord::checkpoint
