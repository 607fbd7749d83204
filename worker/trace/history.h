#pragma once
// A worker's history: what it did that a checker can verify after the run
// (tests/history.py, see Note [History checker] there).
//
// Cost when off: the session holds a null pointer. When on, a commit
// hashes every parameter (a copy to the host for device tensors): meant for
// tests and audits, not for speed.
//
// Threads: every method may be called from any thread.

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace concord::trace {

struct CommitRecord {
  int64_t generation = 0;
  int rank = 0;
  int world_size = 0;
  int64_t step = 0;
  int64_t epoch = 0;
  uint64_t digest = 0;
  bool replicated = true;
  std::optional<std::vector<int64_t>> samples;
};

// Note [History files]
// ~~~~~~~~~~~~~~~~~~~~
// One file per worker id (JobOptions::history_file or CONCORD_HISTORY_FILE;
// `concord-run --history DIR` gives each worker DIR/<worker id>.history),
// opened for appending, so that a restarted worker with the same id goes on in
// the same file; every record says the process (pid). JSON Lines: one object
// per line, written with one write(2) when the thing is done, so a worker
// killed at any point leaves whole lines (a last line without its newline was
// not written and is ignored). Records ("event"):
//   generation  the coordinator placed this worker in `generation` as `rank`
//               of `world` (written when the Join is answered, before the
//               communicator connects)
//   restore     the state this worker goes on from in `generation`: `step`
//               committed steps, `epoch`, the parameters' `digest` (after
//               the first Sync and after every re-form: what the
//               authoritative rank had), `replicated` as for a commit
//   commit      this worker committed `step` (of `epoch`) in `generation`:
//               `digest` of its parameters after the step (hex; equal on
//               every member when `replicated`, i.e. plain DDP), `samples`:
//               the job's window of the step (ElasticSampler's indices of
//               all ranks, in order) when the state has a sampler
//   checkpoint  this worker copied the commit of `step` (of `epoch`) in
//               `generation` into its node's checkpoint memory (see Note
//               [Checkpoints]); `disk`: marked for the disk tier (rank 0's)
//   resume      no member of `generation` held a committed step: the state
//               came from step `step` of a checkpoint (`source`: "memory"
//               or "disk"); `digest` of the parameters resumed, as for a
//               restore (a restore record of the same state follows)
//   finish      the program finished (`ok`, `message`)
// Every record has `worker`, `pid`, `job` and `time_us` (CLOCK_REALTIME
// microseconds, shared by the processes of one host).

class HistoryLog {
 public:
  // Opens `path` for appending (creating it). INVALID_ARGUMENT with the path
  // and the reason when it cannot be opened.
  static absl::StatusOr<std::shared_ptr<HistoryLog>> Create(
      const std::string& path, std::string worker_id, std::string job_id);
  ~HistoryLog();
  HistoryLog(const HistoryLog&) = delete;
  HistoryLog& operator=(const HistoryLog&) = delete;

  void Generation(int64_t generation, int rank, int world_size);
  void Restore(int64_t generation, int64_t step, int64_t epoch, uint64_t digest,
               bool replicated);
  void Commit(const CommitRecord& record);
  void Checkpoint(int64_t generation, int64_t step, int64_t epoch, bool disk);
  void Resume(int64_t generation, int64_t step, const std::string& source,
              uint64_t digest, bool replicated);
  void Finish(bool ok, const std::string& message);

 private:
  HistoryLog(int fd, std::string worker_id, std::string job_id)
      : fd_(fd), worker_id_(std::move(worker_id)), job_id_(std::move(job_id)) {}
  // Writes `fields` (a JSON object without its braces) after the common
  // ones, as one line.
  void Write(const std::string& event, const std::string& fields);

  const int fd_;
  const std::string worker_id_;
  const std::string job_id_;
  std::mutex mu_;
};

// FNV-1a (64 bits) over `size` bytes, continuing from `hash` (start with
// kDigestSeed): the parameters' digest, the same on every host.
inline constexpr uint64_t kDigestSeed = 14695981039346656037ull;
uint64_t DigestBytes(uint64_t hash, const void* data, size_t size);

}  // namespace concord::trace
