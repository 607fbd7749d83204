#pragma once
// The disk tier's writer (Note [Checkpoints] in
// worker/checkpoint/checkpointer.h): a thread that writes the snapshots of
// memory regions to disk, off the training thread. concord-run runs one over
// its node's region (the node agent's: the workers only copy into memory);
// a worker without an agent runs one over its own.

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "worker/checkpoint/config.h"
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
};

// A checkpoint the persister wrote, for whoever reports it (concord-run
// tells the coordinator through its node agent).
struct WrittenCheckpoint {
  std::string job;
  std::string path;
  int64_t step = 0, epoch = 0, samples = 0, world_size = 0, generation = 0;
  uint64_t bytes = 0;
  double seconds = 0;
};

class Persister {
 public:
  // Writes the snapshots `region` marks for the disk tier into `dir`,
  // keeping `keep` (Note [Checkpoint directories]). `region` must outlive
  // the persister. Polls every `poll` and on Notify.
  // `crash`: the test hook TestCrashFromEnvironment reads.
  // `on_written` (may be empty) runs on the persister's thread after each
  // checkpoint written.
  Persister(Region* region, std::string dir, int keep, TestCrash crash = {},
            std::function<void(const WrittenCheckpoint&)> on_written = {},
            std::chrono::milliseconds poll = std::chrono::milliseconds(50));
  // Writes what is ready, then stops.
  ~Persister();
  Persister(const Persister&) = delete;
  Persister& operator=(const Persister&) = delete;

  // A snapshot may be ready.
  void Notify();
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
  const std::function<void(const WrittenCheckpoint&)> on_written_;
  int64_t attempts_ = 0;  // writes begun (the test crash counts them)
  const std::chrono::milliseconds poll_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  bool notified_ = false;
  std::mutex write_mu_;   // one PersistOnce at a time
  PersisterStats stats_;  // guarded by mu_
  int64_t failing_ = 0;   // failures since the last write; guarded by mu_
  std::thread thread_;
};

}  // namespace concord::checkpoint
