#pragma once
// One writing run per job folder (see Note [One writer per folder]).
//
// Note [One writer per folder]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A job's checkpoint folder DIR/<job> is written by one run of the job at a
// time (see Note [Runs] in coordinator/core/core.h): the same job id
// launched twice, or on two hosts over a shared filesystem, with two
// coordinators, would otherwise write over each other's steps, remove each
// other's staging and move `latest` back and forth. Its lock file
// DIR/<job>/.writer names the run that writes there, with the host, pid and
// time of the process that took it, as one JSON line. Every process of that
// run that writes there (a node agent's persister, a worker writing itself,
// a worker without an agent) holds a shared flock(2) on it from its first
// write until it exits: the lock is held for as long as any writer of the
// run lives. A writer of another run takes the folder only when nobody holds
// the lock (an exclusive flock succeeds: the earlier run's writers are all
// gone, however they ended), rewrites the line and holds it shared like the
// others. Otherwise its write is refused, FAILED_PRECONDITION, with one line
// naming the run that writes there, its host and pid, and the way out;
// nothing in the folder changes. A process of the folder's own run never
// waits for another: shared locks do not exclude each other. Over NFS,
// Linux implements flock(2) with the server's byte-range locks, so the rule
// holds across hosts there too.

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace concord::checkpoint {

// The line a lock file holds.
struct WriterIdentity {
  int64_t run = 0;
  std::string host;
  int64_t pid = 0;
  int64_t since_unix_ms = 0;
  // "run 1796242482921132 (host h, pid 42, since 2026-12-02 20:01:02 UTC)".
  std::string Describe() const;
};

// The identity in `text` (the lock file's line); INVALID_ARGUMENT when it is
// not one (an empty file: a lock being taken).
absl::StatusOr<WriterIdentity> ParseWriterIdentity(const std::string& text);

// One process's hold on one folder's lock.
class WriterLock {
 public:
  WriterLock() = default;
  WriterLock(const WriterLock&) = delete;
  WriterLock& operator=(const WriterLock&) = delete;
  ~WriterLock() { Release(); }

  // Holds `job_dir`'s lock for `run` (see Note [One writer per folder]): at
  // once when this object holds it already, else taken as the Note says.
  // FAILED_PRECONDITION naming the other run's writer; UNAVAILABLE when the
  // file cannot be opened or locked.
  absl::Status Hold(const std::string& job_dir, int64_t run);
  void Release();
  bool held() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
  std::string dir_;
  int64_t run_ = 0;
};

// The process's own hold on `job_dir`'s lock for `run`, kept until the
// process exits (one per folder, shared by its threads).
absl::Status HoldWriterLock(const std::string& job_dir, int64_t run);

}  // namespace concord::checkpoint
