#include "worker/checkpoint/checkpointer.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <system_error>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/job_defaults.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "worker/checkpoint/disk.h"

namespace concord::checkpoint {

absl::StatusOr<std::unique_ptr<Checkpointer>> Checkpointer::Create(
    const Config& given, const std::string& job) {
  Config config = given;
  config.dir = NormalDir(given.dir);  // the form the coordinator names
  std::unique_ptr<Checkpointer> c(new Checkpointer(config, job));
  CONCORD_ASSIGN_OR_RETURN(c->region_, Region::Open(config.memory));
  if (config.memory.empty()) {
    CONCORD_ASSIGN_OR_RETURN(c->persister_region_, c->region_->Share());
    // See Note [Writes from the worker]: its writes are reported as the
    // worker's own (memory-only snapshots have no one to tell).
    Checkpointer* self = c.get();
    c->persister_ = std::make_unique<Persister>(
        c->persister_region_.get(), config.dir, config.keep, config.test_crash,
        [self](const PersistReport& r) {
          if (!r.memory) self->Report(r);
        });
  }
  return c;
}

Checkpointer::~Checkpointer() {
  if (preparer_.joinable()) preparer_.join();
  Fence();
  if (persister_ != nullptr) persister_->Flush();
}

void Checkpointer::Save(const Content& content, bool wait,
                        const std::vector<at::Tensor>& deferred) {
  holes_ = HoleState::kNone;
  if (!writes_memory_) return;
  if (preparer_.joinable()) preparer_.join();
  Fence();
  const auto start = std::chrono::steady_clock::now();
  const auto since_start = [&start] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                         start)
        .count();
  };
  // See Note [Holes]: published once the node's other workers filled them
  // (Filled), never written to disk as it is.
  const bool holes = HasHoles(content);
  filled_.reset();
  awaiting_fill_ = false;
  pending_ = PendingSnapshot{};  // a last one never filled
  if (config_.overlap && !wait && !overlap_off_ && !deferred.empty()) {
    // See Note [Overlapped snapshots].
    Staged staged = Stage(content, deferred);
    live_ = std::move(staged.live);
    pending_counters_ = content.counters;
    pending_stall_ = since_start();
    staged_ = std::move(staged.content);
    if (holes) {
      // Laid out here, so that the node's other workers may fill the holes
      // while this worker's own tensors are copied on the thread.
      const absl::StatusOr<WriteResult> laid =
          LayOutSnapshot(*region_, staged_, job_, persists_, &pending_);
      if (!laid.ok() || *laid != WriteResult::kWritten) {
        live_.clear();
        staged_ = Content{};
        HeldBack(laid, pending_, content.counters, since_start());
        return;
      }
      holes_ = HoleState::kLaidOut;
      awaiting_fill_ = true;
    }
    try {
      copier_ = std::thread([this, persist = persists_, holes] {
        if (holes) {
          CopySnapshot(pending_);
          copied_ = WriteResult::kWritten;
        } else {
          copied_ = BeginSnapshot(*region_, staged_, job_, persist, &pending_);
        }
      });
      copying_.store(true, std::memory_order_release);
      return;
    } catch (const std::system_error&) {
      live_.clear();  // no thread to be had: copied here
      staged_ = Content{};
      if (holes) {
        CopySnapshot(pending_);
        pending_stall_ = since_start();
        return;  // published by Filled
      }
    }
  }
  PendingSnapshot pending;
  absl::StatusOr<WriteResult> r;
  for (;;) {
    r = BeginSnapshot(*region_, content, job_, persists_, &pending);
    if (!wait || !r.ok() || *r != WriteResult::kSkippedBusy ||
        std::chrono::steady_clock::now() - start > std::chrono::minutes(5)) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (holes) {
    if (r.ok() && *r == WriteResult::kWritten) {
      pending_ = std::move(pending);
      pending_counters_ = content.counters;
      pending_stall_ = since_start();
      holes_ = HoleState::kLaidOut;
      awaiting_fill_ = true;
      return;  // published by Filled
    }
    if (persists_ && wait && r.ok()) {
      r = absl::UnavailableError(
          "the node's previous write still ran after 5 minutes, and this is "
          "the job's last checkpoint");
    }
    HeldBack(r, pending, content.counters, since_start());
    return;
  }
  // See Note [Writes from the worker].
  if (persists_ && !r.ok()) {
    WriteDirect(content, std::string(r.status().message()), since_start());
    return;
  }
  if (persists_ && wait && *r == WriteResult::kSkippedBusy) {
    WriteDirect(content,
                "the node's previous write still ran after 5 minutes, and "
                "this is the job's last checkpoint",
                since_start());
    return;
  }
  Finish(r, pending, {}, content.counters, since_start());
}

void Checkpointer::HeldBack(const absl::StatusOr<WriteResult>& r,
                            const PendingSnapshot& pending,
                            const Counters& counters, double stall) {
  if (r.ok()) {  // skipped: the persister holds the region
    holes_ = HoleState::kSkipped;
    Finish(r, pending, {}, counters, stall);
    return;
  }
  if (!persists_) {
    holes_ = HoleState::kSkipped;
    last_stall_ = stall;
    Warn(counters.step, std::string(r.status().message()));
    return;
  }
  // See Note [Writes from the worker]: WriteFilled writes it, holes filled.
  holes_ = HoleState::kFailed;
  held_why_ = std::string(r.status().message());
  held_stall_ = stall;
}

void Checkpointer::Filled(const absl::Status& filled) {
  if (!awaiting_fill_) return;
  filled_ = filled;
  if (copying_.load(std::memory_order_acquire)) return;  // at the Fence
  awaiting_fill_ = false;
  Finish(WriteResult::kWritten, pending_, {}, pending_counters_,
         pending_stall_);
  pending_ = PendingSnapshot{};  // its tensors, not kept past the snapshot
}

void Checkpointer::WriteFilled(const Content& content) {
  if (holes_ != HoleState::kFailed) return;
  holes_ = HoleState::kNone;
  WriteDirect(content, held_why_, held_stall_);
}

absl::StatusOr<Content> Checkpointer::LaidOut(int64_t step,
                                              int32_t writer_pid) {
  return ReadLaidOut(*region_, step, writer_pid);
}

void Checkpointer::WriteDirect(const Content& content, const std::string& why,
                               double stall) {
  WriteOptions options;
  options.keep = config_.keep;
  absl::StatusOr<WriteStats> written =
      WriteCheckpoint(content, config_.dir, job_, options);
  const Counters& k = content.counters;
  if (!written.ok()) {
    ReportFailure(k, absl::StrCat("the memory stage failed (", why,
                                  "), and so did the write from the worker: ",
                                  written.status().message()));
    return;
  }
  if (!direct_said_) {
    Log()->warn(
        "the memory stage failed ({}): checkpoint of step {} written to {} "
        "from this worker during its step ({:.2f} s); so are the next ones "
        "while it fails",
        why, k.step, written->path, written->seconds);
    direct_said_ = true;
  }
  last_error_.clear();
  last_stall_ = stall + written->seconds;
  PersistReport report = OwnReport(k);
  report.path = written->path;
  report.bytes = written->bytes;
  report.seconds = written->seconds;
  report.stall_seconds = last_stall_;
  Report(report);
  ++saved_;
  last_saved_ = k;
  if (on_saved_) on_saved_(k);
}

void Checkpointer::ReportFailure(const Counters& k, const std::string& error) {
  Warn(k.step, error);
  PersistReport report = OwnReport(k);
  report.error = error;
  Report(report);
}

PersistReport Checkpointer::OwnReport(const Counters& k) const {
  PersistReport report;
  report.job = job_;
  report.writer_pid = ::getpid();
  report.path = CheckpointStepPath(config_.dir, job_, k.step);
  report.step = k.step;
  report.epoch = k.epoch;
  report.samples = k.position;
  report.world_size = k.world_size;
  report.generation = k.generation;
  report.run = k.run;
  return report;
}

void Checkpointer::Report(const PersistReport& report) {
  std::function<void(const PersistReport&)> report_to;
  {
    std::lock_guard<std::mutex> lock(report_mu_);
    report_to = on_report_;
  }
  if (report_to) report_to(report);
}

void Checkpointer::Prepare(const Content& content) {
  if (!writes_memory_ || preparer_.joinable()) return;
  const size_t bytes = SnapshotBytes(content);
  Fence();  // no copy of its own in flight: the region is this thread's
  if (region_->mapped() >= bytes) return;
  try {
    preparer_ = std::thread([region = region_.get(), bytes] {
      if (absl::Status grown = region->Reserve(bytes); !grown.ok()) {
        Log()->debug("the snapshot region not grown ahead: {}",
                     std::string(grown.message()));
      }
    });
  } catch (const std::system_error&) {
    // No thread to be had: the first snapshot grows it.
  }
}

size_t Checkpointer::region_bytes() {
  if (preparer_.joinable()) preparer_.join();
  return region_->mapped();
}

void Checkpointer::Fence() {
  if (!copying_.load(std::memory_order_acquire)) return;
  const auto start = std::chrono::steady_clock::now();
  copier_.join();
  copying_.store(false, std::memory_order_release);
  const Versions live = std::move(live_);
  live_.clear();
  const Content staged = std::move(staged_);
  staged_ = Content{};
  const double stall =
      pending_stall_ +
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  if (!copied_.ok()) {
    // See Note [Writes from the worker]: written from here while its live
    // tensors are as staged; the next ones are copied during their steps.
    overlap_off_ = true;
    const std::string why(copied_.status().message());
    const bool unchanged = std::all_of(
        live.begin(), live.end(),
        [](const auto& t) { return t.first._version() == t.second; });
    if (persists_ && unchanged) {
      WriteDirect(staged, why, stall);
    } else if (persists_) {
      ReportFailure(pending_counters_,
                    absl::StrCat("the memory stage failed (", why,
                                 "), and a tensor was written before the "
                                 "worker could write it instead"));
    } else {
      Warn(pending_counters_.step, why);
    }
    return;
  }
  if (awaiting_fill_ && !filled_.has_value()) {
    filled_ = absl::AbortedError("its holes were never filled");
  }
  awaiting_fill_ = false;
  Finish(copied_, pending_, live, pending_counters_, stall);
  pending_ = PendingSnapshot{};  // its tensors, not kept past the snapshot
}

void Checkpointer::Finish(const absl::StatusOr<WriteResult>& copied,
                          const PendingSnapshot& pending, const Versions& live,
                          const Counters& counters, double stall) {
  last_stall_ = stall;
  if (!copied.ok()) {
    Warn(counters.step, std::string(copied.status().message()));
    return;
  }
  if (*copied == WriteResult::kSkippedBusy) {
    ++skipped_;
    Log()->debug(
        "checkpoint of step {} skipped: the last one is still being written",
        counters.step);
    return;
  }
  if (filled_.has_value() && !filled_->ok()) {
    // See Note [Holes]: a worker of the node did not fill its own.
    DropSnapshot(pending);
    Warn(counters.step, absl::StrCat("a shard was not copied into the node's "
                                     "snapshot: ",
                                     filled_->message()));
    filled_.reset();
    return;
  }
  filled_.reset();
  Complete(FinishSnapshot(pending, stall, live), counters);
}

void Checkpointer::Complete(const absl::StatusOr<int64_t>& finished,
                            const Counters& counters) {
  if (!finished.ok()) {
    if (absl::IsAborted(finished.status())) {
      overlap_off_ = true;
      Log()->warn(
          "checkpoint of step {} dropped: {}; from now on every snapshot is "
          "copied during its step",
          counters.step, std::string(finished.status().message()));
      return;
    }
    Warn(counters.step, std::string(finished.status().message()));
    return;
  }
  ++saved_;
  last_saved_ = counters;
  if (direct_said_) {
    Log()->info("the memory stage works again (checkpoint of step {})",
                counters.step);
    direct_said_ = false;
  }
  if (on_saved_) on_saved_(counters);
}

void Checkpointer::Warn(int64_t step, const std::string& error) {
  if (error != last_error_) {
    Log()->warn("checkpoint of step {} not taken: {}", step, error);
  }
  last_error_ = error;
}

std::optional<Candidate> Checkpointer::FindCandidate(
    bool disk, const std::optional<Named>& named, int64_t only_run) {
  if (preparer_.joinable()) preparer_.join();
  Fence();  // this worker's own snapshot, complete
  // See Note [Runs] in coordinator/core/core.h: with --no-resume, this run's
  // own checkpoints alone.
  auto of_run = [only_run](int64_t run) {
    return only_run == 0 || run == only_run;
  };
  std::optional<Candidate> best;
  auto newer = [&best](const Counters& k) {
    return !best || Newer(k, best->content.counters);
  };
  absl::StatusOr<Content> memory = ReadSnapshot(*region_);
  if (memory.ok()) {
    const RegionHeader& h = region_->header();
    if (std::string(h.job, strnlen(h.job, sizeof(h.job))) == job_ &&
        of_run(memory->counters.run)) {
      best = Candidate{
          memory->counters.step,
          absl::StrCat("memory (",
                       config_.memory.empty() ? "this process" : config_.memory,
                       ")"),
          *std::move(memory)};
    }
  } else if (!absl::IsNotFound(memory.status())) {
    Log()->warn("the memory snapshot passed over: {}",
                std::string(memory.status().message()));
  }
  // Memory wins a tie: no file to read.
  // See Note [One job's checkpoints]: only this job's own folder is read.
  const bool this_run = named.has_value() && of_run(named->run);
  const bool ours =
      this_run &&
      named->path == CheckpointStepPath(config_.dir, job_, named->step);
  if (this_run && !ours) {
    Log()->warn(
        "the checkpoint the coordinator named, step {} at {}, is not this "
        "job's ({} expected); looking in {}",
        named->step, named->path,
        CheckpointStepPath(config_.dir, job_, named->step), config_.dir);
  }
  Counters named_at;
  if (named.has_value()) {
    named_at.step = named->step;
    named_at.run = named->run;
  }
  if (disk && ours && newer(named_at)) {
    absl::StatusOr<Content> content = LoadCheckpoint(named->path, job_);
    // A later run may have written its step again (see Note [Runs]).
    const bool same = content.ok() && content->counters.step == named->step &&
                      (named->run == 0 || content->counters.run == named->run);
    if (same) {
      best = Candidate{
          named->step,
          absl::StrCat("disk (", named->path, "), as the coordinator named"),
          *std::move(content)};
    } else {
      Log()->warn(
          "the checkpoint the coordinator named, step {} at {}, does not "
          "load here ({}); looking in {}",
          named->step, named->path,
          content.ok() ? absl::StrCat("it holds step ", content->counters.step,
                                      " of run ", content->counters.run)
                       : std::string(content.status().message()),
          config_.dir);
    }
  }
  // A newer complete one in the directory (written, but its report lost
  // with its writer) is taken over the named one.
  if (disk) {
    std::vector<CheckpointInfo> listed = ListCheckpoints(config_.dir, job_);
    listed.erase(
        std::remove_if(listed.begin(), listed.end(),
                       [&](const CheckpointInfo& i) { return !of_run(i.run); }),
        listed.end());
    Counters front;
    if (!listed.empty()) {
      front.step = listed.front().step;
      front.run = listed.front().run;
    }
    if (listed.empty() || !newer(front)) return best;
    absl::StatusOr<Loaded> loaded = LoadNewest(config_.dir, job_, only_run);
    if (loaded.ok() && newer(loaded->content.counters)) {
      best = Candidate{loaded->info.step,
                       absl::StrCat("disk (", loaded->info.path, ")"),
                       std::move(loaded->content)};
    }
  }
  return best;
}

}  // namespace concord::checkpoint
