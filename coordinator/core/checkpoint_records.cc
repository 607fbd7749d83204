#include "coordinator/core/checkpoint_records.h"

#include <iterator>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/job_defaults.h"
#include "coordinator/core/core_validation.h"

namespace concord::coordinator {

int64_t CheckpointRecords::RunAfter(absl::Time now, int64_t previous) {
  return std::max(absl::ToUnixMicros(now), previous + 1);
}

void CheckpointRecords::BeginRun(absl::Time now) {
  resume_from_.reset();
  resume_memory_.reset();
  memory_snapshots_.clear();
  run_ = RunAfter(now, run_);
}

absl::StatusOr<std::string> CheckpointRecords::Record(
    const v1::JobSpec& spec, const v1::CheckpointReport& given,
    const std::string& writer) {
  const std::string& job_id = spec.job_id();
  // See Note [Runs] in core.h: this run's only; one without a run is taken as
  // this run's.
  if (given.run() != 0 && given.run() != run_) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "the checkpoint of step %d is of run %d of job %s, whose run is %d "
        "(a writer of an earlier run still reporting?)",
        given.step(), given.run(), job_id, run_));
  }
  v1::CheckpointReport report = given;
  report.set_run(run_);
  // See Note [Resume source] in core.h: what the node's memory holds now (a
  // write, done or failed, was of the snapshot there). See Note [One job's
  // checkpoints] in core.h: the oldest snapshot makes room.
  auto& snapshots = memory_snapshots_;
  // A worker's own write is not in its node's memory.
  bool in_memory = !report.node().empty() && writer.empty();
  const size_t max_nodes = MaxMemoryNodes(spec);
  if (in_memory && snapshots.count(report.node()) == 0 &&
      snapshots.size() >= max_nodes) {
    auto oldest = std::min_element(snapshots.begin(), snapshots.end(),
                                   [](const auto& a, const auto& b) {
                                     return OlderCheckpoint(a.second, b.second);
                                   });
    if (!OlderCheckpoint(report, oldest->second)) {
      snapshots.erase(oldest);
    } else if (report.memory()) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "job %s keeps the memory snapshots of %d nodes, all newer than "
          "step %d of %s",
          job_id, snapshots.size(), report.step(), report.node()));
    } else {
      in_memory = false;
    }
  }
  if (in_memory) {
    v1::CheckpointReport& held = snapshots[report.node()];
    held = report;
    held.set_memory(true);
    held.clear_path();
    held.clear_error();
    held.clear_write_seconds();
    held.clear_skipped();
  }
  if (report.memory()) {
    PruneMemory();
    return std::string();
  }
  totals_.set_skipped(totals_.skipped() + report.skipped());
  const std::string node =
      (report.node().empty() ? std::string("a node agent") : report.node()) +
      (writer.empty() ? "" : ", by worker " + writer + " itself");
  if (!report.error().empty()) {
    totals_.set_failed(totals_.failed() + 1);
    std::string event;
    if (!totals_.has_failing()) {
      event = absl::StrFormat(
          "checkpoint of step %d not written to %s (%s): "
          "%s; training goes on",
          report.step(), report.path(), node, report.error());
    }
    *totals_.mutable_failing() = report;
    return event;
  }
  const bool recovered = totals_.has_failing();
  totals_.set_written(totals_.written() + 1);
  totals_.clear_failing();
  // A step written again (by a later run: see Note [Runs] in core.h) replaces
  // the one at its path.
  kept_.erase(std::remove_if(kept_.begin(), kept_.end(),
                             [&](const v1::CheckpointReport& r) {
                               return r.path() == report.path();
                             }),
              kept_.end());
  kept_.insert(
      std::upper_bound(kept_.begin(), kept_.end(), report, OlderCheckpoint),
      report);
  if (kept_.size() > kKept) {
    kept_.erase(kept_.begin(), kept_.end() - kKept);
  }
  PruneMemory();
  return absl::StrFormat("checkpoint of step %d written to %s (%s)%s",
                         report.step(), report.path(), node,
                         recovered ? ", after failed writes" : "");
}

void CheckpointRecords::PruneMemory() {
  if (kept_.empty()) return;
  const v1::CheckpointReport& disk = kept_.back();
  for (auto it = memory_snapshots_.begin(); it != memory_snapshots_.end();) {
    it = OlderCheckpoint(it->second, disk) ? memory_snapshots_.erase(it)
                                           : std::next(it);
  }
}

std::string CheckpointRecords::NameResume(const v1::JobSpec& spec, bool held) {
  resume_from_.reset();
  resume_memory_.reset();
  if (held) return "";
  // See Note [One job's checkpoints] in core.h: a record kept before the
  // job's folder was checked is named only at its step's path there.
  for (auto it = kept_.rbegin(); it != kept_.rend(); ++it) {
    if (!spec.checkpoint_dir().empty() &&
        it->path() == CheckpointStepPath(spec.checkpoint_dir(), spec.job_id(),
                                         it->step())) {
      resume_from_ = *it;
      break;
    }
  }
  // See Note [Runs] in core.h: a memory snapshot is of this run, the disk's
  // may be of an earlier one.
  const v1::CheckpointReport disk =
      resume_from_.value_or(v1::CheckpointReport());
  for (const auto& [node, snapshot] : memory_snapshots_) {
    if (!OlderCheckpoint(snapshot, disk) &&
        (!resume_memory_ || OlderCheckpoint(*resume_memory_, snapshot))) {
      resume_memory_ = snapshot;
    }
  }
  std::string source;
  if (resume_memory_) {
    source = absl::StrFormat(
        "; no member holds a committed step: its state comes from step %d "
        "in the memory of %s",
        resume_memory_->step(), resume_memory_->node());
    if (resume_from_) {
      absl::StrAppendFormat(&source, " (or, without it, step %d of %s)",
                            resume_from_->step(), resume_from_->path());
    }
  } else if (resume_from_) {
    source = absl::StrFormat(
        "; no member holds a committed step: its state comes from step %d "
        "of the checkpoint %s (%s)",
        resume_from_->step(), resume_from_->path(), resume_from_->node());
  }
  return source;
}

void CheckpointRecords::Export(v1::JobRecord& record) const {
  for (const v1::CheckpointReport& c : kept_) *record.add_checkpoints() = c;
  *record.mutable_checkpoint_totals() = totals_;
  record.set_run(run_);
  if (resume_from_.has_value()) *record.mutable_resume_from() = *resume_from_;
  if (resume_memory_.has_value()) {
    *record.mutable_resume_memory() = *resume_memory_;
  }
  for (const auto& [node, snapshot] : memory_snapshots_) {
    *record.add_memory_snapshots() = snapshot;
  }
}

void CheckpointRecords::Restore(const v1::JobRecord& record, absl::Time now) {
  kept_.assign(record.checkpoints().begin(), record.checkpoints().end());
  std::sort(kept_.begin(), kept_.end(), OlderCheckpoint);
  // See Note [Runs] in core.h: a record of a coordinator before runs begins
  // one.
  run_ = record.run() > 0 ? record.run() : RunAfter(now, 0);
  totals_ = record.checkpoint_totals();
  resume_from_.reset();
  resume_memory_.reset();
  if (record.has_resume_from()) resume_from_ = record.resume_from();
  if (record.has_resume_memory()) resume_memory_ = record.resume_memory();
  memory_snapshots_.clear();
  for (const v1::CheckpointReport& snapshot : record.memory_snapshots()) {
    memory_snapshots_[snapshot.node()] = snapshot;
  }
}

absl::Status CheckpointRecords::Check(const std::string& job_id) const {
  auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(
        absl::StrCat("job record ", job_id, ": ", what));
  };
  if (kept_.size() > kKept) return bad("more checkpoints than are kept");
  for (const v1::CheckpointReport& c : kept_) {
    if (absl::Status s = ValidateCheckpoint(job_id, c); !s.ok()) {
      return bad(absl::StrCat("checkpoint: ", s.message()));
    }
  }
  if (totals_.written() < 0 || totals_.skipped() < 0 || totals_.failed() < 0) {
    return bad("negative checkpoint totals");
  }
  if (totals_.has_failing()) {
    if (absl::Status s = ValidateCheckpoint(job_id, totals_.failing());
        !s.ok()) {
      return bad(absl::StrCat("failing checkpoint: ", s.message()));
    }
  }
  if (resume_from_.has_value()) {
    if (absl::Status s = ValidateCheckpoint(job_id, *resume_from_); !s.ok()) {
      return bad(absl::StrCat("resume_from: ", s.message()));
    }
  }
  if (resume_memory_.has_value()) {
    if (absl::Status s = ValidateCheckpoint(job_id, *resume_memory_);
        !s.ok() || !resume_memory_->memory()) {
      return bad(absl::StrCat("resume_memory: ",
                              s.ok() ? "not a memory snapshot" : s.message()));
    }
  }
  for (const auto& [node, snapshot] : memory_snapshots_) {
    if (absl::Status s = ValidateCheckpoint(job_id, snapshot);
        !s.ok() || !snapshot.memory() || snapshot.node() != node) {
      return bad(absl::StrCat("memory snapshot of ", node, ": ",
                              s.ok() ? "not a memory snapshot" : s.message()));
    }
  }
  return absl::OkStatus();
}

}  // namespace concord::coordinator
