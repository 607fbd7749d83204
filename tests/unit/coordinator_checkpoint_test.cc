// The coordinator's checkpoint records: what is kept, persisted, refused and
// named (see Note [Checkpoints] in worker/checkpoint/checkpointer.h; see Note
// [Resume source], see Note [One job's checkpoints] and see Note [Runs] in
// coordinator/core/core.h), with the job's workers taken out by their node
// agents' exit reports (coordinator_exit_test.cc).

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "common/job_defaults.h"
#include "coordinator/core/core.h"
#include "coordinator_core_fixture.h"
#include "coordinator_requests.h"

namespace concord::coordinator {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

using testing::CoordinatorExitTest;
using testing::JoinReq;
using testing::kJob;
using testing::RejoinReq;
using testing::Secret;
using testing::Spec;
using testing::Worker;

v1::CheckpointReport Checkpoint(int64_t step) {
  v1::CheckpointReport r;
  r.set_step(step);
  r.set_epoch(step / 17);
  r.set_samples(step % 17 * 12);
  r.set_world_size(3);
  r.set_generation(1);
  r.set_path(absl::StrCat("/ckpt/job/step-", step));
  r.set_bytes(1000 + static_cast<uint64_t>(step));
  r.set_write_seconds(0.25);
  r.set_written_unix_ms(1700000000000 + step);
  r.set_node("node-a");
  return r;
}

TEST_F(CoordinatorExitTest, TheNewestCheckpointsAreKeptAndPersisted) {
  FormLong(3);
  (void)core_.TakeDirtyJobs();
  for (int64_t step = 10; step <= 150; step += 10) {
    ASSERT_TRUE(core_.CheckpointReported(kJob, Checkpoint(step)).ok());
  }
  // The same step again replaces it; an older one goes in its place.
  v1::CheckpointReport again = Checkpoint(150);
  again.set_node("node-b");
  ASSERT_TRUE(core_.CheckpointReported(kJob, again).ok());
  EXPECT_THAT(core_.TakeDirtyJobs(), ElementsAre(kJob));
  const v1::JobStatus status = Status();
  ASSERT_EQ(status.checkpoints_size(),
            static_cast<int>(Core::kKeptCheckpoints));
  EXPECT_EQ(status.checkpoints(0).step(), 60);
  EXPECT_EQ(status.checkpoints(9).step(), 150);
  EXPECT_EQ(status.checkpoints(9).node(), "node-b");
  bool said = false;
  for (const auto& e : status.recent_events()) {
    said = said || (e.kind() == "checkpoint" &&
                    absl::StrContains(e.message(), "step 150"));
  }
  EXPECT_TRUE(said);
  auto record = core_.ExportJob(kJob);
  ASSERT_TRUE(record.has_value());
  FakeClock later(clock_.Now() + absl::Hours(1));
  Core restored(&later);
  ASSERT_TRUE(restored.RestoreJob(*record).ok());
  v1::GetJobRequest get;
  get.set_job_id(kJob);
  auto after = restored.GetJob(get);
  ASSERT_TRUE(after.ok());
  ASSERT_EQ(after->checkpoints_size(), status.checkpoints_size());
  EXPECT_EQ(after->checkpoints(9).path(), "/ckpt/job/step-150");
}

TEST_F(CoordinatorExitTest, ABadCheckpointReportChangesNothing) {
  FormLong(2);
  ASSERT_TRUE(core_.CheckpointReported(kJob, Checkpoint(10)).ok());
  (void)core_.TakeDirtyJobs();
  v1::CheckpointReport no_step = Checkpoint(20);
  no_step.set_step(0);
  v1::CheckpointReport no_path = Checkpoint(20);
  no_path.clear_path();
  v1::CheckpointReport bad_time = Checkpoint(20);
  bad_time.set_write_seconds(-1);
  v1::CheckpointReport bad_stall = Checkpoint(20);
  bad_stall.set_stall_seconds(std::numeric_limits<double>::quiet_NaN());
  v1::CheckpointReport bad_skipped = Checkpoint(20);
  bad_skipped.set_skipped(-2);
  for (const auto& bad : {no_step, no_path, bad_time, bad_stall, bad_skipped}) {
    EXPECT_EQ(core_.CheckpointReported(kJob, bad).code(),
              absl::StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(core_.CheckpointReported("no-such-job", Checkpoint(20)).code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(core_.TakeDirtyJobs().empty());
  const v1::JobStatus status = Status();
  ASSERT_EQ(status.checkpoints_size(), 1);
  EXPECT_EQ(status.checkpoints(0).step(), 10);
  EXPECT_EQ(status.checkpoint_totals().written(), 1);
  EXPECT_EQ(status.checkpoint_totals().skipped(), 0);
}

// See Note [One job's checkpoints]: a checkpoint is kept only at its step's
// path in the job's folder; anything else is refused and changes nothing.
// A job without a folder keeps no disk checkpoint.
TEST_F(CoordinatorExitTest, CheckpointsOutsideTheJobsFolderAreRefused) {
  FormLong(2);
  ASSERT_TRUE(core_.CheckpointReported(kJob, Checkpoint(10)).ok());
  (void)core_.TakeDirtyJobs();
  for (const char* path :
       {"/etc/job/step-20", "/ckpt/other-job/step-20", "/ckpt/job/step-21",
        "/ckpt/job/../job/step-20", "/ckpt//job/step-20", "ckpt/job/step-20",
        "/ckpt/job/step-20/model.pt"}) {
    v1::CheckpointReport outside = Checkpoint(20);
    outside.set_path(path);
    const absl::Status s = core_.CheckpointReported(kJob, outside);
    EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << path;
    EXPECT_THAT(std::string(s.message()),
                HasSubstr("can only be /ckpt/job/step-20"))
        << path;
    outside.set_error("disk full");  // a failure names its path too
    EXPECT_EQ(core_.CheckpointReported(kJob, outside).code(),
              absl::StatusCode::kPermissionDenied)
        << path;
  }
  EXPECT_TRUE(core_.TakeDirtyJobs().empty());
  const v1::JobStatus status = Status();
  ASSERT_EQ(status.checkpoints_size(), 1);
  EXPECT_EQ(status.checkpoint_totals().written(), 1);
  EXPECT_EQ(status.checkpoint_totals().failed(), 0);

  v1::JobSpec none = Spec(1);
  none.set_job_id("no-folder");
  none.clear_checkpoint_dir();
  ASSERT_TRUE(core_.Join(JoinReq(none, "x0")).ok());
  v1::CheckpointReport c = Checkpoint(5);
  c.set_path("/ckpt/no-folder/step-5");
  const absl::Status s = core_.CheckpointReported("no-folder", c);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(s.message()), HasSubstr("gave no checkpoint folder"));
  // Memory snapshots have no path: kept without a folder.
  v1::CheckpointReport memory;
  memory.set_step(5);
  memory.set_memory(true);
  memory.set_node("node-a");
  EXPECT_TRUE(core_.CheckpointReported("no-folder", memory).ok());
}

// The folder is part of the job's spec: absolute and normal, the same for
// every worker; a bad one joins nothing.
TEST_F(CoordinatorExitTest, AJobsCheckpointFolderIsCheckedAndShared) {
  FormLong(2);
  for (const char* dir :
       {"ckpt", "/ckpt/", "/ckpt/../x", "/ckpt/./x", "/ckpt//x", "/ck\xffpt"}) {
    v1::JobSpec bad = spec_;
    bad.set_job_id("other");
    bad.set_checkpoint_dir(dir);
    const absl::Status s = core_.Join(JoinReq(bad, "y0"));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << dir;
    EXPECT_THAT(std::string(s.message()), HasSubstr("checkpoint_dir")) << dir;
  }
  EXPECT_FALSE(core_.State("other").has_value());
  v1::JobSpec elsewhere = spec_;
  elsewhere.set_checkpoint_dir("/elsewhere");
  const absl::Status s = core_.Join(JoinReq(elsewhere, "w9"));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("spec.checkpoint_dir differs"));
  EXPECT_EQ(CheckpointDirProblem("/"), "");
  EXPECT_EQ(CheckpointStepPath("/", "j", 3), "/j/step-3");
  EXPECT_EQ(CheckpointStepPath("/a/b", "j", 3), "/a/b/j/step-3");
}

// A record kept before the folder was checked (a coordinator's older
// state): a checkpoint at another path is never named for a resume; the
// newest one at its own path is.
TEST_F(CoordinatorExitTest, OnlyACheckpointAtItsOwnPathIsNamed) {
  FormLong(2);
  ASSERT_TRUE(core_.CheckpointReported(kJob, Checkpoint(10)).ok());
  ASSERT_TRUE(core_.CheckpointReported(kJob, Checkpoint(20)).ok());
  ASSERT_TRUE(Exited(Worker(0)).ok());
  ASSERT_TRUE(Exited(Worker(1)).ok());
  auto record = core_.ExportJob(kJob);
  ASSERT_TRUE(record.has_value());
  record->mutable_checkpoints(1)->set_path("/etc/passwd");
  Core restored(&clock_);
  ASSERT_TRUE(restored.RestoreJob(*record).ok());
  ASSERT_TRUE(restored.Join(JoinReq(spec_, "n0")).ok());
  ASSERT_TRUE(restored.Join(JoinReq(spec_, "n1")).ok());
  ASSERT_EQ(restored.State(kJob), v1::JOB_STATE_RUNNING);
  auto a = restored.GetAssignment(kJob, "n0");
  ASSERT_TRUE(a.ok() && a->has_value());
  ASSERT_TRUE((*a)->resume_from.has_value());
  EXPECT_EQ((*a)->resume_from->step(), 10);
  EXPECT_EQ((*a)->resume_from->path(), "/ckpt/job/step-10");
}

// Memory snapshots are kept for at most MaxMemoryNodes nodes: a new node's
// takes the oldest's place; one older than all is refused.
TEST_F(CoordinatorExitTest, MemorySnapshotsAreKeptForBoundedNodes) {
  FormLong(2);
  const size_t nodes = Core::MaxMemoryNodes(spec_);
  ASSERT_EQ(nodes, 16u);
  auto memory = [](int64_t step, const std::string& node) {
    v1::CheckpointReport r;
    r.set_step(step);
    r.set_memory(true);
    r.set_node(node);
    return r;
  };
  for (size_t i = 0; i < nodes; ++i) {
    ASSERT_TRUE(
        core_
            .CheckpointReported(kJob, memory(100 + static_cast<int64_t>(i),
                                             absl::StrCat("node-", i)))
            .ok());
  }
  (void)core_.TakeDirtyJobs();
  EXPECT_EQ(core_.CheckpointReported(kJob, memory(50, "node-x")).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(core_.TakeDirtyJobs().empty());
  ASSERT_TRUE(core_.CheckpointReported(kJob, memory(200, "node-y")).ok());
  auto record = core_.ExportJob(kJob);
  ASSERT_TRUE(record.has_value());
  ASSERT_EQ(static_cast<size_t>(record->memory_snapshots_size()), nodes);
  for (const auto& m : record->memory_snapshots()) {
    EXPECT_NE(m.node(), "node-0");  // the oldest (step 100) made room
    EXPECT_NE(m.node(), "node-x");
  }
}

// See Note [Writes from the worker] in worker/checkpoint/checkpointer.h: a
// worker's report of its own write is kept with its credential only, as an
// agent's is, but not as in its node's memory; a failure is counted.
TEST_F(CoordinatorExitTest, AWorkersOwnWriteIsKeptWithItsCredentialOnly) {
  FormLong(2);
  auto from = [](const std::string& worker, const v1::CheckpointReport& c) {
    v1::ReportCheckpointRequest r;
    r.set_job_id(kJob);
    r.set_worker_id(worker);
    r.set_worker_secret(Secret(worker));
    *r.mutable_report() = c;
    return r;
  };
  (void)core_.TakeDirtyJobs();
  v1::ReportCheckpointRequest wrong_secret = from(Worker(0), Checkpoint(20));
  wrong_secret.set_worker_secret(Secret(Worker(1)));
  v1::ReportCheckpointRequest outside = from(Worker(0), Checkpoint(20));
  outside.mutable_report()->set_path("/tmp/job/step-20");
  v1::ReportCheckpointRequest memory = from(Worker(0), Checkpoint(20));
  memory.mutable_report()->clear_path();
  memory.mutable_report()->set_memory(true);
  v1::ReportCheckpointRequest other_job = from(Worker(0), Checkpoint(20));
  other_job.set_job_id("other");
  const std::vector<std::pair<v1::ReportCheckpointRequest, absl::StatusCode>>
      refused = {
          {wrong_secret, absl::StatusCode::kPermissionDenied},
          {from("stranger", Checkpoint(20)),
           absl::StatusCode::kPermissionDenied},
          {outside, absl::StatusCode::kPermissionDenied},
          {memory, absl::StatusCode::kInvalidArgument},
          {other_job, absl::StatusCode::kNotFound},
      };
  for (const auto& [request, code] : refused) {
    EXPECT_EQ(core_.WorkerCheckpointReported(request).code(), code)
        << request.ShortDebugString();
  }
  EXPECT_TRUE(core_.TakeDirtyJobs().empty());

  ASSERT_TRUE(
      core_.WorkerCheckpointReported(from(Worker(0), Checkpoint(20))).ok());
  v1::CheckpointReport failed = Checkpoint(30);
  failed.set_error("the memory stage failed (no space), and so did ...");
  ASSERT_TRUE(core_.WorkerCheckpointReported(from(Worker(0), failed)).ok());
  const v1::JobStatus status = Status();
  ASSERT_EQ(status.checkpoints_size(), 1);
  EXPECT_EQ(status.checkpoints(0).step(), 20);
  EXPECT_EQ(status.checkpoint_totals().written(), 1);
  EXPECT_EQ(status.checkpoint_totals().failed(), 1);
  EXPECT_EQ(status.checkpoint_totals().failing().error(), failed.error());
  bool said = false;
  for (const auto& e : status.recent_events()) {
    said = said || absl::StrContains(e.message(), "by worker w0 itself");
  }
  EXPECT_TRUE(said);
  auto record = core_.ExportJob(kJob);
  ASSERT_TRUE(record.has_value());
  EXPECT_EQ(record->memory_snapshots_size(), 0);  // not in its node's memory
  // A worker taken out is bound no more.
  ASSERT_TRUE(Exited(Worker(1)).ok());
  EXPECT_EQ(
      core_.WorkerCheckpointReported(from(Worker(1), Checkpoint(40))).code(),
      absl::StatusCode::kPermissionDenied);
}

// A failed write is counted and shown (status, one event until a write
// succeeds again, metrics), never listed as a checkpoint; the next write
// clears it; the totals are persisted with the job.
TEST_F(CoordinatorExitTest, FailedCheckpointWritesAreCountedAndShownOnce) {
  FormLong(2);
  ASSERT_TRUE(core_.CheckpointReported(kJob, Checkpoint(10)).ok());
  for (int64_t step : {20, 30, 40}) {
    v1::CheckpointReport failed = Checkpoint(step);
    failed.set_bytes(0);
    failed.set_skipped(1);
    failed.set_error("no space left on device");
    ASSERT_TRUE(core_.CheckpointReported(kJob, failed).ok());
  }
  auto count_failure_events = [](const v1::JobStatus& s) {
    int n = 0;
    for (const auto& e : s.recent_events()) {
      n += e.kind() == "checkpoint" &&
           absl::StrContains(e.message(), "not written") &&
           absl::StrContains(e.message(), "no space left on device");
    }
    return n;
  };
  v1::JobStatus status = Status();
  ASSERT_EQ(status.checkpoints_size(), 1);  // failures are not checkpoints
  EXPECT_EQ(status.checkpoint_totals().written(), 1);
  EXPECT_EQ(status.checkpoint_totals().failed(), 3);
  EXPECT_EQ(status.checkpoint_totals().skipped(), 3);
  ASSERT_TRUE(status.checkpoint_totals().has_failing());
  EXPECT_EQ(status.checkpoint_totals().failing().step(), 40);
  EXPECT_EQ(count_failure_events(status), 1);
  auto samples = core_.MetricsSamples(absl::Hours(1));
  ASSERT_EQ(samples.size(), 1u);
  EXPECT_EQ(samples[0].checkpoint_totals.failed(), 3);
  EXPECT_TRUE(samples[0].checkpoint_totals.has_failing());
  EXPECT_EQ(samples[0].last_checkpoint.step(), 10);

  // Persisted: a coordinator that restores the record shows the same.
  auto record = core_.ExportJob(kJob);
  ASSERT_TRUE(record.has_value());
  Core restored(&clock_);
  ASSERT_TRUE(restored.RestoreJob(*record).ok());
  v1::GetJobRequest get;
  get.set_job_id(kJob);
  auto after = restored.GetJob(get);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->checkpoint_totals().failed(), 3);
  EXPECT_EQ(after->checkpoint_totals().failing().error(),
            "no space left on device");

  v1::CheckpointReport ok = Checkpoint(50);
  ok.set_stall_seconds(0.012);
  ASSERT_TRUE(core_.CheckpointReported(kJob, ok).ok());
  status = Status();
  EXPECT_FALSE(status.checkpoint_totals().has_failing());
  EXPECT_EQ(status.checkpoint_totals().written(), 2);
  EXPECT_EQ(status.checkpoint_totals().failed(), 3);
  EXPECT_EQ(status.checkpoints(1).stall_seconds(), 0.012);
  EXPECT_EQ(count_failure_events(status), 1);
  // A new failure after a success is an event again.
  v1::CheckpointReport again = Checkpoint(60);
  again.set_error("read-only file system");
  ASSERT_TRUE(core_.CheckpointReported(kJob, again).ok());
  status = Status();
  bool said = false;
  for (const auto& e : status.recent_events()) {
    said = said || absl::StrContains(e.message(), "read-only file system");
  }
  EXPECT_TRUE(said);
}

// See Note [Starting again] and see Note [Resume source]: a stopped job that
// new worker processes join runs again, from the newest checkpoint it had; its
// old processes are refused; it all survives a coordinator restart.
TEST_F(CoordinatorExitTest, AStoppedJobStartsAgainFromItsNewestCheckpoint) {
  const int64_t gen = FormLong(2);
  ASSERT_TRUE(core_.CheckpointReported(kJob, Checkpoint(10)).ok());
  ASSERT_TRUE(core_.CheckpointReported(kJob, Checkpoint(20)).ok());
  {
    auto a = core_.GetAssignment(kJob, Worker(0));
    ASSERT_TRUE(a.ok() && a->has_value());
    EXPECT_FALSE((*a)->resume_from.has_value());  // formed before any
  }
  v1::StopJobRequest stop;
  stop.set_job_id(kJob);
  ASSERT_TRUE(core_.StopJob(stop).ok());
  ASSERT_EQ(core_.State(kJob), v1::JOB_STATE_STOPPED);
  // Processes of the run that was stopped, re-joining or joining afresh with
  // their binding, do not start it again.
  for (const v1::JoinRequest& old :
       {RejoinReq(spec_, Worker(0), gen, 25), JoinReq(spec_, Worker(1))}) {
    const absl::Status s = core_.Join(old);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_STOPPED);
  }
  // The same command run again: new processes, new ids.
  ASSERT_TRUE(core_.Join(JoinReq(spec_, "n0")).ok());
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  ASSERT_TRUE(core_.Join(JoinReq(spec_, "n1")).ok());
  ASSERT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(core_.CurrentGeneration(kJob), gen + 1);
  for (const std::string w : {"n0", "n1"}) {
    auto a = core_.GetAssignment(kJob, w);
    ASSERT_TRUE(a.ok() && a->has_value()) << w;
    ASSERT_TRUE((*a)->resume_from.has_value()) << w;
    EXPECT_FALSE((*a)->rank_change.has_value()) << w;  // a new run
    EXPECT_EQ((*a)->resume_from->step(), 20);
    EXPECT_EQ((*a)->resume_from->path(), "/ckpt/job/step-20");
  }
  v1::JobStatus status = Status();
  EXPECT_EQ(status.checkpoints_size(), 2);
  bool again = false, named = false;
  for (const auto& e : status.recent_events()) {
    again = again || (e.kind() == "job" &&
                      absl::StrContains(e.message(), "job started again") &&
                      absl::StrContains(e.message(), "stopped by an operator"));
    named =
        named || (e.kind() == "generation" &&
                  absl::StrContains(e.message(), "step 20 of the checkpoint"));
  }
  EXPECT_TRUE(again);
  EXPECT_TRUE(named);
  // The stopped run's process, still bound to its old secret, is refused.
  const absl::Status old = core_.Join(RejoinReq(spec_, Worker(0), gen, 25));
  EXPECT_EQ(old.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(old.message()), HasSubstr("started again"));
  // A coordinator restarted from the record names the same source and still
  // refuses the old process.
  auto record = core_.ExportJob(kJob);
  ASSERT_TRUE(record.has_value());
  Core restored(&clock_);
  ASSERT_TRUE(restored.RestoreJob(*record).ok());
  auto a = restored.GetAssignment(kJob, "n0");
  ASSERT_TRUE(a.ok() && a->has_value());
  ASSERT_TRUE((*a)->resume_from.has_value());
  EXPECT_EQ((*a)->resume_from->step(), 20);
  EXPECT_EQ(restored.Join(JoinReq(spec_, Worker(1))).code(),
            absl::StatusCode::kFailedPrecondition);
}

v1::CheckpointReport OfRun(v1::CheckpointReport r, int64_t run) {
  r.set_run(run);
  return r;
}

// See Note [Runs]: a job's run is set when its record is made, carried by
// every assignment, shown and persisted; starting the job again begins a
// later one. Checkpoints are ordered by run, then step: the new run's step
// 50 is named over the earlier run's 500, a step written again replaces the
// earlier run's at its path, and a report of another run changes nothing.
TEST_F(CoordinatorExitTest,
       RunsOrderCheckpointsAndAnEarlierRunsReportsAreRefused) {
  FormLong(2);
  auto run_of = [this](Core& core, const std::string& worker) -> int64_t {
    auto a = core.GetAssignment(kJob, worker);
    return a.ok() && a->has_value() ? (*a)->run : -1;
  };
  const int64_t first = run_of(core_, Worker(0));
  // The record's start (this fake clock's is the Unix epoch: 1 µs after).
  EXPECT_EQ(first, std::max<int64_t>(absl::ToUnixMicros(clock_.Now()), 1));
  EXPECT_EQ(run_of(core_, Worker(1)), first);
  EXPECT_EQ(Status().run(), first);
  ASSERT_TRUE(
      core_.CheckpointReported(kJob, OfRun(Checkpoint(400), first)).ok());
  // Without a run (an older writer): taken as this run's.
  ASSERT_TRUE(core_.CheckpointReported(kJob, Checkpoint(500)).ok());
  ASSERT_EQ(Status().checkpoints_size(), 2);
  EXPECT_EQ(Status().checkpoints(1).run(), first);
  (void)core_.TakeDirtyJobs();
  const absl::Status later =
      core_.CheckpointReported(kJob, OfRun(Checkpoint(600), first + 1));
  EXPECT_EQ(later.code(), absl::StatusCode::kFailedPrecondition) << later;
  EXPECT_TRUE(core_.TakeDirtyJobs().empty());
  // Persisted with the record, and restored.
  auto record = core_.ExportJob(kJob);
  ASSERT_TRUE(record.has_value());
  EXPECT_EQ(record->run(), first);
  {
    Core restored(&clock_);
    ASSERT_TRUE(restored.RestoreJob(*record).ok());
    EXPECT_EQ(run_of(restored, Worker(0)), first);
    record->set_run(-1);
    EXPECT_EQ(Core(&clock_).RestoreJob(*record).code(),
              absl::StatusCode::kInvalidArgument);
  }
  // Started again (afresh: --no-resume): a later run.
  clock_.Advance(absl::Seconds(5));
  v1::StopJobRequest stop;
  stop.set_job_id(kJob);
  ASSERT_TRUE(core_.StopJob(stop).ok());
  ASSERT_TRUE(core_.Join(JoinReq(spec_, "n0")).ok());
  ASSERT_TRUE(core_.Join(JoinReq(spec_, "n1")).ok());
  const int64_t second = run_of(core_, "n0");
  EXPECT_EQ(second, absl::ToUnixMicros(clock_.Now()));
  EXPECT_GT(second, first);
  EXPECT_EQ(Status().run(), second);
  // The earlier run's writer, still reporting, is refused.
  EXPECT_EQ(
      core_.CheckpointReported(kJob, OfRun(Checkpoint(700), first)).code(),
      absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(
      core_.CheckpointReported(kJob, OfRun(Checkpoint(50), second)).ok());
  // Its step 400 written again: the earlier run's record at that path goes.
  ASSERT_TRUE(
      core_.CheckpointReported(kJob, OfRun(Checkpoint(400), second)).ok());
  v1::JobStatus status = Status();
  ASSERT_EQ(status.checkpoints_size(), 3);  // oldest first
  EXPECT_EQ(
      std::make_pair(status.checkpoints(0).run(), status.checkpoints(0).step()),
      std::make_pair(first, int64_t{500}));
  EXPECT_EQ(
      std::make_pair(status.checkpoints(1).run(), status.checkpoints(1).step()),
      std::make_pair(second, int64_t{50}));
  EXPECT_EQ(
      std::make_pair(status.checkpoints(2).run(), status.checkpoints(2).step()),
      std::make_pair(second, int64_t{400}));
  // Everyone lost: the next generation is told this run's newest.
  ASSERT_TRUE(Exited("n0").ok());
  ASSERT_TRUE(Exited("n1").ok());
  ASSERT_TRUE(core_.Join(JoinReq(spec_, "m0")).ok());
  ASSERT_TRUE(core_.Join(JoinReq(spec_, "m1")).ok());
  auto a = core_.GetAssignment(kJob, "m0");
  ASSERT_TRUE(a.ok() && a->has_value());
  ASSERT_TRUE((*a)->resume_from.has_value());
  EXPECT_EQ((*a)->resume_from->step(), 400);
  EXPECT_EQ((*a)->resume_from->run(), second);
  EXPECT_EQ((*a)->run, second);  // the same run goes on
}

v1::CheckpointReport Memory(int64_t step, const std::string& node) {
  v1::CheckpointReport r;
  r.set_step(step);
  r.set_bytes(4096);
  r.set_memory(true);
  r.set_node(node);
  return r;
}

// See Note [Resume source]: the node agents' memory snapshots. Every worker
// dies; new ones join: the coordinator names the newest disk checkpoint and
// the newest memory snapshot at least as new (node-b's; node-c's older one
// is not), in the assignment, the event and the persisted record. Memory
// reports that do not say what they are change nothing.
TEST_F(CoordinatorExitTest, TheNewestMemorySnapshotIsNamedWithTheDisks) {
  FormLong(2);
  ASSERT_TRUE(core_.CheckpointReported(kJob, Checkpoint(20)).ok());  // node-a
  ASSERT_TRUE(core_.CheckpointReported(kJob, Memory(30, "node-b")).ok());
  ASSERT_TRUE(core_.CheckpointReported(kJob, Memory(10, "node-c")).ok());
  (void)core_.TakeDirtyJobs();
  v1::CheckpointReport with_path = Memory(40, "node-b");
  with_path.set_path("/ckpt/job/step-40");
  v1::CheckpointReport no_node = Memory(40, "");
  v1::CheckpointReport with_error = Memory(40, "node-b");
  with_error.set_error("disk full");
  for (const auto& bad : {with_path, no_node, with_error}) {
    EXPECT_EQ(core_.CheckpointReported(kJob, bad).code(),
              absl::StatusCode::kInvalidArgument);
  }
  EXPECT_TRUE(core_.TakeDirtyJobs().empty());
  const v1::JobStatus before = Status();
  EXPECT_EQ(before.checkpoints_size(), 1);  // memory is no checkpoint written
  EXPECT_EQ(before.checkpoint_totals().written(), 1);
  ASSERT_TRUE(Exited(Worker(0)).ok());
  ASSERT_TRUE(Exited(Worker(1)).ok());
  ASSERT_TRUE(core_.Join(JoinReq(spec_, "n0")).ok());
  ASSERT_TRUE(core_.Join(JoinReq(spec_, "n1")).ok());
  ASSERT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
  auto expect_named = [](Core& core) {
    auto a = core.GetAssignment(kJob, "n1");
    ASSERT_TRUE(a.ok() && a->has_value());
    ASSERT_TRUE((*a)->resume_from.has_value());
    EXPECT_EQ((*a)->resume_from->step(), 20);
    ASSERT_TRUE((*a)->resume_memory.has_value());
    EXPECT_EQ((*a)->resume_memory->step(), 30);
    EXPECT_EQ((*a)->resume_memory->node(), "node-b");
    EXPECT_TRUE((*a)->resume_memory->memory());
  };
  expect_named(core_);
  bool named = false;
  const v1::JobStatus after = Status();
  for (const auto& e : after.recent_events()) {
    named = named ||
            (e.kind() == "generation" &&
             absl::StrContains(e.message(), "step 30 in the memory of node-b"));
  }
  EXPECT_TRUE(named);
  auto record = core_.ExportJob(kJob);
  ASSERT_TRUE(record.has_value());
  // node-a's (from its write) and node-b's; node-c's, older than the disk's
  // checkpoint, was dropped.
  EXPECT_EQ(record->memory_snapshots_size(), 2);
  Core restored(&clock_);
  ASSERT_TRUE(restored.RestoreJob(*record).ok());
  expect_named(restored);
  // A newer checkpoint on disk: memory older than it can never be named.
  ASSERT_TRUE(core_.CheckpointReported(kJob, Checkpoint(40)).ok());
  record = core_.ExportJob(kJob);
  ASSERT_TRUE(record.has_value());
  ASSERT_EQ(record->memory_snapshots_size(), 1);
  EXPECT_EQ(record->memory_snapshots(0).step(), 40);  // node-a's, written
}

// A generation with a member that holds a committed step goes on from it:
// the coordinator names no checkpoint.
TEST_F(CoordinatorExitTest, ASurvivorsStateIsNotReplacedByACheckpoint) {
  const int64_t gen = FormLong(2);
  ASSERT_TRUE(core_.CheckpointReported(kJob, Checkpoint(10)).ok());
  ASSERT_TRUE(Exited(Worker(1)).ok());
  // The survivor is back with step 14: the next generation forms with it.
  ASSERT_TRUE(core_.Join(RejoinReq(spec_, Worker(0), gen, 14)).ok());
  ASSERT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
  auto a = core_.GetAssignment(kJob, Worker(0));
  ASSERT_TRUE(a.ok() && a->has_value());
  EXPECT_FALSE((*a)->resume_from.has_value());
}

}  // namespace
}  // namespace concord::coordinator
