#include "worker/checkpoint/persister.h"

#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "worker/checkpoint/disk.h"
#include "worker/checkpoint/memory.h"

namespace concord::checkpoint {

Persister::Persister(Region* region, std::string dir, int keep, TestCrash crash,
                     std::function<void(const PersistReport&)> on_report,
                     std::chrono::milliseconds poll)
    : region_(region),
      dir_(std::move(dir)),
      keep_(keep),
      crash_(crash),
      on_report_(std::move(on_report)),
      poll_(poll) {
  thread_ = std::thread([this] { Loop(); });
}

Persister::~Persister() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  {
    std::lock_guard<std::mutex> write_lock(write_mu_);
    region_->Ring();
  }
  thread_.join();
  PersistOnce();  // what became ready while stopping
}

void Persister::Flush() {
  while (PersistOnce()) {
  }
}

PersisterStats Persister::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void Persister::Loop() {
  // See Note [Persister priority]: below the training threads.
  ::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), kNice);
  for (;;) {
    // Read before looking: a ring after this read ends the wait below.
    // Under write_mu_: a Flush on another thread may be remapping.
    uint32_t seen = 0;
    {
      std::lock_guard<std::mutex> write_lock(write_mu_);
      seen = region_->header().doorbell.load(std::memory_order_acquire);
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
    }
    PersistOnce();
    region_->WaitForRing(seen, poll_);
  }
}

bool Persister::PersistOnce() {
  std::lock_guard<std::mutex> write_lock(write_mu_);
  RegionHeader& h = region_->header();
  uint32_t expected = RegionHeader::kReady;
  const uint64_t sequence = h.sequence.load(std::memory_order_acquire);
  const uint64_t persisted = h.persisted.load(std::memory_order_acquire);
  if (sequence == persisted ||
      !h.state.compare_exchange_strong(expected, RegionHeader::kPersisting,
                                       std::memory_order_acq_rel)) {
    return false;
  }
  // The region is ours until it is kReady again.
  const uint64_t now = h.sequence.load(std::memory_order_acquire);
  const bool persist = h.persist == 1;
  const std::string job(h.job, strnlen(h.job, sizeof(h.job)));
  absl::StatusOr<WriteStats> written =
      absl::FailedPreconditionError("not for the disk tier");
  int64_t step = h.step;
  const uint64_t snapshot_bytes = h.bytes;
  PersistReport report;
  report.job = job;
  report.writer_pid = h.writer_pid;
  report.step = step;
  report.stall_seconds = static_cast<double>(h.stall_ns) / 1e9;
  if (persist) {
    absl::StatusOr<Content> content = ReadSnapshot(*region_);
    if (content.ok()) {
      report.epoch = content->counters.epoch;
      report.samples = content->counters.position;
      report.world_size = content->counters.world_size;
      report.generation = content->counters.generation;
      report.run = content->counters.run;
      WriteOptions options;
      options.keep = keep_;
      options.buffers = buffers_;
      if (++attempts_ == crash_.nth) options.fault = crash_.stage;
      written = WriteCheckpoint(*content, dir_, job, options);
      if (options.fault != WriteFault::kNone) {
        Log()->warn("CONCORD_TEST_CHECKPOINT_FAULT: dying while writing {}",
                    step);
        ::kill(::getpid(), SIGKILL);
      }
    } else {
      written = content.status();
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (persist && persisted != 0 && now > persisted + 1) {
      stats_.superseded += static_cast<int64_t>(now - persisted - 1);
    }
    if (!persist) {
      // Another node's writer persists: nothing to count.
    } else if (written.ok()) {
      ++stats_.written;
      stats_.last_step = step;
      stats_.last_bytes = written->bytes;
      stats_.last_seconds = written->seconds;
      if (failing_ > 0) {
        Log()->warn("checkpoints written again, after {} that failed",
                    failing_);
      }
      failing_ = 0;
      stats_.failing_step = -1;
      if (!written->warning.empty()) {
        Log()->warn("checkpoint of step {}: {}", step, written->warning);
      }
      Log()->info(
          "checkpoint of step {} written to {} ({:.1f} MB in {:.2f} s; the "
          "training step's stall {:.1f} ms)",
          step, written->path, written->bytes / 1e6, written->seconds,
          report.stall_seconds * 1e3);
    } else {
      ++stats_.failed;
      stats_.last_error = std::string(written.status().message());
      stats_.failing_step = step;
      // Once in the log until one is written again; training goes on.
      if (failing_++ == 0) {
        Log()->warn(
            "checkpoint of step {} not written ({}); training goes on, the "
            "last complete checkpoint stays, and failures until one is "
            "written again are not logged",
            step, stats_.last_error);
      } else {
        Log()->debug("checkpoint of step {} not written: {}", step,
                     stats_.last_error);
      }
    }
  }
  // ReadSnapshot may have mapped the region again: `h` may dangle.
  RegionHeader& after = region_->header();
  after.persisted.store(now, std::memory_order_release);
  after.state.store(RegionHeader::kReady, std::memory_order_release);
  // Reported once the region is free again: the next snapshot may come.
  if (!persist && on_report_) {
    report.memory = true;
    report.bytes = snapshot_bytes;
    on_report_(report);
  }
  if (persist && on_report_) {
    const int64_t skips =
        stats().superseded +
        static_cast<int64_t>(after.skipped.load(std::memory_order_relaxed));
    report.skipped = skips - reported_skips_;
    reported_skips_ = skips;
    if (written.ok()) {
      report.path = written->path;
      report.bytes = written->bytes;
      report.seconds = written->seconds;
    } else {
      report.path = absl::StrCat(dir_, "/", job, "/step-", step);
      report.error = std::string(written.status().message());
    }
    on_report_(report);
  }
  return true;
}

v1::CheckpointReport ReportOf(const PersistReport& w, const std::string& node) {
  v1::CheckpointReport r;
  r.set_step(w.step);
  r.set_epoch(w.epoch);
  r.set_samples(w.samples);
  r.set_world_size(static_cast<int32_t>(w.world_size));
  r.set_generation(w.generation);
  r.set_run(w.run);
  r.set_path(w.path);
  r.set_bytes(w.bytes);
  r.set_write_seconds(w.seconds);
  r.set_stall_seconds(w.stall_seconds);
  r.set_skipped(w.skipped);
  r.set_error(w.error);
  r.set_memory(w.memory);
  r.set_written_unix_ms(absl::ToUnixMillis(absl::Now()));
  r.set_node(node);
  return r;
}

}  // namespace concord::checkpoint
