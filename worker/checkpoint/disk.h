#pragma once
// The disk tier of checkpoints (see Note [Checkpoints] in
// worker/checkpoint/checkpointer.h): the files of a checkpoint (see Note
// [Checkpoint format]) in a directory per checkpoint, written so that a crash
// at any point leaves every complete checkpoint loadable and nothing
// half-written loaded.
//
// Note [Checkpoint directories]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
//   DIR/<job>/step-<N>/   model.pt, optimizer.pt, ..., state.pt,
//                         manifest.json
//   DIR/<job>/latest      "step-<N>\n": the newest complete one
//   DIR/<job>/.writer     the run that writes here (see Note [One writer
//                         per folder] in worker/checkpoint/writer_lock.h)
// A checkpoint is written into DIR/<job>/.staging-step-<N>-<pid>/, each
// file fsynced; manifest.json last (the step, epoch, samples, world size,
// generation, run, and each file's size and CRC-32), fsynced with the
// directory; then the directory is renamed to step-<N> and DIR/<job>
// fsynced; then `latest` is replaced by rename (written and fsynced
// first). Only then are checkpoints beyond the newest `keep` deleted, and
// staging directories of older steps (a writer that crashed). So:
//  - a directory named step-<N> always has its manifest; a crash before
//    the rename leaves only a staging directory, never loaded;
//  - loading checks the manifest (its JSON, the job), every file's size and
//    CRC-32, and the archives themselves; a checkpoint that fails any check
//    is passed over with one warning line naming what is wrong, and the
//    next older one is tried;
//  - `latest` is for people and Python; the loader takes the newest step-N
//    that passes its checks, so a crash between the rename and `latest`
//    loses nothing;
//  - newest is by run, then step (see Note [Runs] in
//    coordinator/core/core.h), for the loader, `latest` and pruning alike;
//    a later run's step-N replaces an earlier run's.
// Only the run that holds the folder's writer lock writes (FAILED_PRECONDITION
// naming the holder otherwise, nothing changed).
// A write that fails (a full disk, a directory made read-only or removed)
// removes its staging directory and returns the error; the checkpoints
// already there stay.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/checkpoint/config.h"
#include "worker/checkpoint/content.h"
#include "worker/checkpoint/file_writer.h"

namespace concord::checkpoint {

// Note [Shards written where they are]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A plain loop's checkpoint of a sharded optimizer (save_checkpoint with a
// ZeroRedundancyOptimizer) is one `<name>.pt` that PyTorch loads, yet no rank
// gathers the state to write it. Each rank sends rank 0 its shard's shapes,
// dtypes and CRC-32s (holes, see OptimizerContent::hole_crc); rank 0 writes the
// checkpoint's files into the staging directory, each hole's record with the
// CRC of the bytes it will hold (ZipWriter::AddHole: the file's CRC-32 in the
// manifest comes from the pieces', as always) and its data left unwritten
// (FileWriter::Skip: a sparse hole, its whole pages never written by rank 0),
// and says where each hole lies (WriteOptions::fill_holes, after every file is
// written and synced, before the manifest). Every rank then writes its own
// shard into the file itself (pwrite at those offsets, fdatasync) where it sees
// the staging file, the same size and the same first bytes (a filesystem shared
// with rank 0); a rank that does not, or cannot open it, sends the bytes to
// rank 0, which writes them. (The holes are taken as zeros in what a rank
// compares, as some are filled while others look.) Only when every hole is
// filled and synced does rank 0 write the manifest and publish the checkpoint;
// a failure anywhere removes the staging directory and fails the checkpoint on
// every rank. Rank 0 thus holds its own shard and, at most, the shards of ranks
// that cannot reach its filesystem.

// A hole of a file being written: the bytes of optimizer `optimizer`'s
// state `key` of parameter `index` go to `offset` of `path`.
struct FileHole {
  std::string optimizer;
  int64_t index = 0;
  std::string key;
  std::string path;
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

struct WriteOptions {
  int keep = 3;
  WriteFault fault = WriteFault::kNone;
  // Where the files' blocks come from (see Note [Write queue] in
  // worker/checkpoint/file_writer.h); null: a pool for this write alone.
  std::shared_ptr<WriteBuffers> buffers;
  // A content with holes (OptimizerContent::hole_crc): fills them, once
  // every file is written and synced, before the manifest (see Note
  // [Shards written where they are]). Its error fails the write. Without
  // it, holes are INTERNAL.
  std::function<absl::Status(const std::vector<FileHole>&)> fill_holes;
};

struct WriteStats {
  std::string path;  // of the checkpoint written
  uint64_t bytes = 0;
  double seconds = 0;
  // Set when the checkpoint is complete but `latest` could not be pointed
  // at it (it loads: the loader takes the newest complete step-N).
  std::string warning;
};

// Writes `content` as DIR/<job>/step-<N> (see Note [Checkpoint directories]).
// Errors: UNAVAILABLE naming the file or directory that could not be
// written (the staging directory is removed); ABORTED at a WriteFault.
absl::StatusOr<WriteStats> WriteCheckpoint(const Content& content,
                                           const std::string& dir,
                                           const std::string& job,
                                           const WriteOptions& options);

// A complete checkpoint as its manifest describes it.
struct CheckpointInfo {
  std::string path;
  int64_t step = 0;
  int64_t epoch = 0;
  int64_t position = 0;
  int64_t world_size = 0;
  int64_t generation = 0;
  // See Note [Runs] in coordinator/core/core.h (0: written before runs).
  int64_t run = 0;
  uint64_t bytes = 0;
};

// Every DIR/<job>/step-<N> whose manifest parses, newest first (by run, then
// step; see Note [Runs] in coordinator/core/core.h), the files there at
// their sizes but not read. A missing DIR/<job> is none.
std::vector<CheckpointInfo> ListCheckpoints(const std::string& dir,
                                            const std::string& job);

// The checkpoint of `job` at `path`, every file checked against the
// manifest, whose job id must be `job` (not only its folder's name).
// INVALID_ARGUMENT (DATA_LOSS for a size or checksum that differs) naming
// the file and what is wrong.
absl::StatusOr<Content> LoadCheckpoint(const std::string& path,
                                       const std::string& job);

// The newest checkpoint of `job` in `dir` that loads (see Note [Checkpoint
// directories]), of run `only_run` alone unless it is 0: one warning line
// for each newer one passed over. NOT_FOUND when there is none.
struct Loaded {
  CheckpointInfo info;
  Content content;
};
absl::StatusOr<Loaded> LoadNewest(const std::string& dir,
                                  const std::string& job, int64_t only_run = 0);

}  // namespace concord::checkpoint
