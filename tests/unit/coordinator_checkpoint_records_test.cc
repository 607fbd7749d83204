// CheckpointRecords alone, on a fake clock (checkpoint_records.h): the run,
// the kept checkpoints and totals, the memory snapshots, the checkpoint a
// generation resumes from, and the record they persist (see Note [Resume
// source], see Note [One job's checkpoints] and see Note [Runs] in
// coordinator/core/core.h). Through the whole core:
// coordinator_checkpoint_test.cc.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/job_defaults.h"
#include "coordinator/core/checkpoint_records.h"

namespace concord::coordinator {
namespace {

using ::testing::HasSubstr;
using ::testing::IsEmpty;

constexpr char kJobId[] = "job";
constexpr char kDir[] = "/ckpt";

v1::JobSpec Spec(int max_workers = 4) {
  v1::JobSpec spec;
  spec.set_job_id(kJobId);
  spec.set_max_workers(max_workers);
  spec.set_checkpoint_dir(kDir);
  return spec;
}

// A written checkpoint of `step` at its path in the job's folder.
v1::CheckpointReport Written(int64_t step, const std::string& node = "node-a") {
  v1::CheckpointReport r;
  r.set_step(step);
  r.set_path(CheckpointStepPath(kDir, kJobId, step));
  r.set_bytes(1000);
  r.set_write_seconds(0.5);
  r.set_node(node);
  return r;
}

v1::CheckpointReport Failed(int64_t step) {
  v1::CheckpointReport r = Written(step);
  r.set_error("disk full");
  return r;
}

v1::CheckpointReport Memory(int64_t step, const std::string& node) {
  v1::CheckpointReport r;
  r.set_step(step);
  r.set_memory(true);
  r.set_node(node);
  return r;
}

class CheckpointRecordsTest : public ::testing::Test {
 protected:
  CheckpointRecordsTest() { records_.BeginRun(clock_.Now()); }

  // Records `r` as a node agent's report; its event ("" for none).
  std::string Record(const v1::CheckpointReport& r,
                     const std::string& writer = "") {
    absl::StatusOr<std::string> event = records_.Record(spec_, r, writer);
    EXPECT_TRUE(event.ok()) << event.status();
    return event.ok() ? *event : "";
  }

  FakeClock clock_{absl::FromUnixSeconds(1700000000)};
  v1::JobSpec spec_ = Spec();
  CheckpointRecords records_;
};

// See Note [Runs]: a run is the time in microseconds, always past the last.
TEST_F(CheckpointRecordsTest, RunsMoveForwardWithTheClockAndNeverBack) {
  const int64_t first = records_.run();
  EXPECT_EQ(first, absl::ToUnixMicros(clock_.Now()));
  records_.BeginRun(clock_.Now());  // the same microsecond
  EXPECT_EQ(records_.run(), first + 1);
  clock_.Advance(absl::Seconds(5));
  records_.BeginRun(clock_.Now());
  EXPECT_EQ(records_.run(), absl::ToUnixMicros(clock_.Now()));
  EXPECT_EQ(CheckpointRecords::RunAfter(clock_.Now() - absl::Hours(1), 7000),
            absl::ToUnixMicros(clock_.Now() - absl::Hours(1)));
  EXPECT_EQ(CheckpointRecords::RunAfter(absl::UnixEpoch(), 7000), 7001);
}

TEST_F(CheckpointRecordsTest, TheNewestAreKeptAndTheSamePathIsReplaced) {
  for (int64_t step = 10; step <= 150; step += 10) {
    EXPECT_THAT(Record(Written(step)),
                HasSubstr(absl::StrCat("checkpoint of step ", step,
                                       " written to /ckpt/job/step-")));
  }
  ASSERT_EQ(records_.kept().size(), CheckpointRecords::kKept);
  EXPECT_EQ(records_.kept().front().step(), 60);
  EXPECT_EQ(records_.kept().back().step(), 150);
  EXPECT_EQ(records_.kept().back().run(), records_.run());  // stamped
  EXPECT_EQ(records_.totals().written(), 15);
  // The same step again replaces the one at its path.
  Record(Written(150, "node-b"));
  ASSERT_EQ(records_.kept().size(), CheckpointRecords::kKept);
  EXPECT_EQ(records_.kept().back().node(), "node-b");
  EXPECT_EQ(records_.kept()[8].step(), 140);
}

// See Note [Runs]: one of another run changes nothing; one without a run is
// this run's.
TEST_F(CheckpointRecordsTest, AnotherRunsReportIsRefused) {
  v1::CheckpointReport old = Written(500);
  old.set_run(records_.run() - 1);
  EXPECT_EQ(records_.Record(spec_, old, "").status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(records_.kept(), IsEmpty());
  EXPECT_THAT(records_.memory_snapshots(), IsEmpty());
  EXPECT_EQ(records_.totals().written(), 0);
  v1::CheckpointReport own = Written(20);
  own.set_run(records_.run());
  Record(own);
  Record(Written(10));
  ASSERT_EQ(records_.kept().size(), 2u);
  EXPECT_EQ(records_.kept()[0].run(), records_.run());
  EXPECT_EQ(records_.kept()[0].step(), 10);
}

// See Note [Runs]: ordered by run, then step: a run started afresh is never
// overtaken by an earlier run's higher steps.
TEST_F(CheckpointRecordsTest, ALaterRunsLowerStepIsNewer) {
  Record(Written(900));
  Record(Memory(900, "node-a"));
  clock_.Advance(absl::Minutes(1));
  records_.BeginRun(clock_.Now());
  // The kept checkpoints and the totals stay; the memory is gone.
  ASSERT_EQ(records_.kept().size(), 1u);
  EXPECT_EQ(records_.totals().written(), 1);
  EXPECT_THAT(records_.memory_snapshots(), IsEmpty());
  Record(Written(100, "node-b"));
  ASSERT_EQ(records_.kept().size(), 2u);
  EXPECT_EQ(records_.kept().back().step(), 100);
  EXPECT_EQ(records_.kept().back().run(), records_.run());
  ASSERT_TRUE(records_.NameResume(spec_, /*held=*/false) != "");
  EXPECT_EQ(records_.resume_from()->step(), 100);
}

// A failure is an event once until a write succeeds.
TEST_F(CheckpointRecordsTest, FailuresAreCountedAndSaidOnce) {
  EXPECT_THAT(Record(Failed(10)),
              HasSubstr("checkpoint of step 10 not written to "
                        "/ckpt/job/step-10 (node-a): disk full"));
  EXPECT_EQ(Record(Failed(20)), "");
  EXPECT_EQ(records_.totals().failed(), 2);
  EXPECT_EQ(records_.totals().failing().step(), 20);
  EXPECT_THAT(records_.kept(), IsEmpty());
  v1::CheckpointReport skipping = Written(30);
  skipping.set_skipped(3);
  EXPECT_THAT(Record(skipping, "w1"),
              HasSubstr("(node-a, by worker w1 itself), after failed writes"));
  EXPECT_FALSE(records_.totals().has_failing());
  EXPECT_EQ(records_.totals().written(), 1);
  EXPECT_EQ(records_.totals().skipped(), 3);
  EXPECT_THAT(Record(Failed(40)), HasSubstr("not written"));
}

// See Note [Resume source]: a node agent's write is in its node's memory; a
// worker's own write is not; memory-only reports make no event and no
// totals; a snapshot older than the newest checkpoint is dropped.
TEST_F(CheckpointRecordsTest, MemorySnapshotsFollowTheAgentsReports) {
  EXPECT_EQ(Record(Memory(5, "node-c")), "");
  EXPECT_EQ(records_.totals().written(), 0);
  Record(Written(10, "node-a"));
  // node-c's (5) is older than step 10 on disk.
  ASSERT_EQ(records_.memory_snapshots().size(), 1u);
  const v1::CheckpointReport& held = records_.memory_snapshots().at("node-a");
  EXPECT_EQ(held.step(), 10);
  EXPECT_TRUE(held.memory());
  EXPECT_TRUE(held.path().empty());
  EXPECT_EQ(held.write_seconds(), 0);
  // Not in node-b's memory; node-a's (10) is older than step 20 on disk.
  Record(Written(20, "node-b"), /*writer=*/"w1");
  EXPECT_EQ(records_.totals().written(), 2);
  EXPECT_THAT(records_.memory_snapshots(), IsEmpty());
  Record(Memory(30, "node-a"));
  Record(Memory(25, "node-c"));
  ASSERT_EQ(records_.memory_snapshots().size(), 2u);
  EXPECT_EQ(records_.memory_snapshots().at("node-a").step(), 30);
}

// See Note [One job's checkpoints]: the memory of at most MaxMemoryNodes
// nodes; the oldest makes room, a memory report older than all is refused,
// a written one older than all is kept on disk only.
TEST_F(CheckpointRecordsTest, MemorySnapshotsAreKeptForBoundedNodes) {
  const size_t nodes = CheckpointRecords::MaxMemoryNodes(spec_);
  EXPECT_EQ(nodes, 16u);
  EXPECT_EQ(CheckpointRecords::MaxMemoryNodes(Spec(20)), 40u);
  for (size_t i = 0; i < nodes; ++i) {
    Record(Memory(100 + static_cast<int64_t>(i), absl::StrCat("node-", i)));
  }
  EXPECT_EQ(records_.Record(spec_, Memory(50, "node-x"), "").status().code(),
            absl::StatusCode::kResourceExhausted);
  Record(Written(60, "node-x"));
  EXPECT_EQ(records_.kept().size(), 1u);
  EXPECT_EQ(records_.memory_snapshots().count("node-x"), 0u);
  Record(Memory(200, "node-y"));
  EXPECT_EQ(records_.memory_snapshots().size(), nodes);
  EXPECT_EQ(records_.memory_snapshots().count("node-0"), 0u);
  EXPECT_EQ(records_.memory_snapshots().at("node-y").step(), 200);
}

// See Note [Resume source] and see Note [One job's checkpoints] in core.h: the
// newest kept checkpoint at its step's path, and memory at least as new
// (memory wins a tie); nothing when a member holds a committed step.
TEST_F(CheckpointRecordsTest, AGenerationIsToldWhereToResume) {
  EXPECT_EQ(records_.NameResume(spec_, /*held=*/false), "");
  EXPECT_FALSE(records_.resume_from().has_value());
  Record(Written(10, "node-a"));
  Record(Written(20, "node-b"), "w1");  // not in node-b's memory
  EXPECT_THAT(records_.NameResume(spec_, /*held=*/false),
              HasSubstr("step 20 of the checkpoint /ckpt/job/step-20 "
                        "(node-b)"));
  EXPECT_EQ(records_.resume_from()->step(), 20);
  EXPECT_FALSE(records_.resume_memory().has_value());
  Record(Memory(20, "node-c"));
  EXPECT_THAT(records_.NameResume(spec_, /*held=*/false),
              HasSubstr("step 20 in the memory of node-c (or, without it, "
                        "step 20 of /ckpt/job/step-20)"));
  EXPECT_EQ(records_.resume_memory()->node(), "node-c");
  EXPECT_EQ(records_.NameResume(spec_, /*held=*/true), "");
  EXPECT_FALSE(records_.resume_from().has_value());
  EXPECT_FALSE(records_.resume_memory().has_value());
  // A job whose folder names another place: the records kept are passed
  // over (the memory is still named).
  v1::JobSpec moved = spec_;
  moved.set_checkpoint_dir("/elsewhere");
  EXPECT_THAT(records_.NameResume(moved, /*held=*/false),
              HasSubstr("in the memory of node-c"));
  EXPECT_FALSE(records_.resume_from().has_value());
  moved.clear_checkpoint_dir();
  records_.NameResume(moved, /*held=*/false);
  EXPECT_FALSE(records_.resume_from().has_value());
}

// See Note [Persistence] in core.h: what is exported comes back; an
// inconsistent record is refused by Check.
TEST_F(CheckpointRecordsTest, RecordsSurviveExportAndRestore) {
  Record(Written(10));
  Record(Failed(20));
  Record(Memory(30, "node-b"));
  records_.NameResume(spec_, /*held=*/false);
  v1::JobRecord record;
  records_.Export(record);
  EXPECT_EQ(record.run(), records_.run());
  EXPECT_EQ(record.checkpoints_size(), 1);
  EXPECT_EQ(record.memory_snapshots_size(), 2);
  EXPECT_TRUE(record.has_resume_from() && record.has_resume_memory());

  clock_.Advance(absl::Hours(1));
  CheckpointRecords restored;
  restored.Restore(record, clock_.Now());
  ASSERT_TRUE(restored.Check(kJobId).ok());
  EXPECT_EQ(restored.run(), records_.run());
  EXPECT_EQ(restored.totals().failing().step(), 20);
  EXPECT_EQ(restored.resume_memory()->step(), 30);
  v1::JobRecord again;
  restored.Export(again);
  EXPECT_EQ(again.SerializeAsString(), record.SerializeAsString());

  // A record of a coordinator before runs begins one.
  record.clear_run();
  restored.Restore(record, clock_.Now());
  EXPECT_EQ(restored.run(), absl::ToUnixMicros(clock_.Now()));

  v1::JobRecord bad = record;
  bad.mutable_checkpoint_totals()->set_written(-1);
  restored.Restore(bad, clock_.Now());
  EXPECT_EQ(restored.Check(kJobId).code(), absl::StatusCode::kInvalidArgument);
  bad = record;
  bad.mutable_memory_snapshots(0)->set_memory(false);
  bad.mutable_memory_snapshots(0)->set_path("/ckpt/job/step-20");
  restored.Restore(bad, clock_.Now());
  EXPECT_THAT(restored.Check(kJobId).message(),
              HasSubstr("not a memory snapshot"));
  bad = record;
  for (size_t i = 0; i < CheckpointRecords::kKept; ++i) {
    *bad.add_checkpoints() = Written(100 + static_cast<int64_t>(i));
  }
  restored.Restore(bad, clock_.Now());
  EXPECT_THAT(restored.Check(kJobId).message(),
              HasSubstr("more checkpoints than are kept"));
}

}  // namespace
}  // namespace concord::coordinator
