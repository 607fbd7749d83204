// Exited workers (see Note [Exited workers] in coordinator/core/core.h): a node
// agent's report that a worker process exited takes it out at once, as its
// failed Leave or its heartbeat timeout would, and a bad report changes
// nothing.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <limits>
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
using ::testing::IsEmpty;

using testing::CoordinatorReformTest;
using testing::JoinReq;
using testing::kJob;
using testing::LeaveReq;
using testing::RejoinReq;
using testing::Secret;
using testing::Spec;
using testing::Worker;

constexpr char kKilled[] = "killed by signal 9 (SIGKILL)";

class CoordinatorExitTest : public CoordinatorReformTest {
 protected:
  // A job of `n` workers with a 60 s heartbeat timeout (nothing but the
  // report can take a worker out within the test), generation 1 running.
  int64_t FormLong(int n, int min_workers = 1) {
    spec_ = Spec(n, min_workers);
    spec_.set_heartbeat_timeout_ms(60000);
    for (int i = 0; i < n; ++i) {
      EXPECT_TRUE(core_.Join(JoinReq(spec_, Worker(i))).ok());
    }
    EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
    return core_.CurrentGeneration(kJob);
  }

  absl::StatusOr<bool> Exited(const std::string& worker,
                              const std::string& how = kKilled) {
    return core_.WorkerExited(kJob, worker, Secret(worker), how);
  }

  v1::JobSpec spec_;
};

TEST_F(CoordinatorExitTest, AMemberThatExitedEndsItsGenerationAtOnce) {
  const int64_t gen = FormLong(3);
  (void)core_.TakeDirtyJobs();
  const JobEpochs epochs = core_.Epochs(kJob);
  clock_.Advance(absl::Milliseconds(5));
  auto changed = Exited(Worker(2));
  ASSERT_TRUE(changed.ok()) << changed.status();
  EXPECT_TRUE(*changed);
  // Ended without waiting for a tick, let alone the 60 s timeout; the
  // others are expected back, and the change is to be saved and seen.
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  EXPECT_THAT(Expected(), ElementsAre(Worker(0), Worker(1)));
  EXPECT_THAT(core_.TakeDirtyJobs(), ElementsAre(kJob));
  EXPECT_GT(core_.Epochs(kJob).placement, epochs.placement);
  EXPECT_GT(core_.Epochs(kJob).view, epochs.view);
  const std::vector<Event> failures = EventsOf("failure");
  ASSERT_EQ(failures.size(), 1u);
  EXPECT_EQ(failures[0].worker_id, Worker(2));
  EXPECT_EQ(failures[0].message,
            "its process exited (killed by signal 9 (SIGKILL); reported by "
            "its node agent)");
  bool ended = false;
  for (const Event& e : EventsOf("generation")) {
    if (e.generation == gen && absl::StrContains(e.message, "ended")) {
      EXPECT_THAT(e.message, HasSubstr("worker w2 exited (killed by signal"));
      ended = true;
    }
  }
  EXPECT_TRUE(ended);
  // The survivors come back: the next generation forms with them at once.
  ASSERT_TRUE(core_.Join(RejoinReq(spec_, Worker(0), gen, 7)).ok());
  ASSERT_TRUE(core_.Join(RejoinReq(spec_, Worker(1), gen, 7)).ok());
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(core_.CurrentGeneration(kJob), gen + 1);
  EXPECT_THAT(Ranks(), ElementsAre(Worker(0), Worker(1)));
  // Its binding is released: a restarted process may take the id.
  v1::JoinRequest restarted = JoinReq(spec_, Worker(2));
  restarted.set_worker_secret(Secret("w2-restarted"));
  EXPECT_TRUE(core_.Join(restarted).ok());
  // A second report of the same process changes nothing.
  const uint64_t version = core_.version();
  changed = Exited(Worker(2));
  EXPECT_EQ(changed.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(core_.version(), version);
}

// The usual order after a SIGKILL: the survivors' collectives fail first and
// they ask for the next generation; the dead one is an expected survivor,
// and the report drops it without the lost-watch grace.
TEST_F(CoordinatorExitTest, AnExpectedSurvivorThatExitedIsDroppedAtOnce) {
  const int64_t gen = FormLong(3);
  for (int i = 0; i < 3; ++i) core_.WatchOpened(kJob, Worker(i));
  core_.WatchClosed(kJob, Worker(1), /*lost=*/true);
  ASSERT_TRUE(
      core_.Join(RejoinReq(spec_, Worker(0), gen, 4, "peer w1 gone")).ok());
  ASSERT_TRUE(core_.Join(RejoinReq(spec_, Worker(2), gen, 4)).ok());
  EXPECT_THAT(Expected(), ElementsAre(Worker(1)));
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  auto changed = Exited(Worker(1), "exit status 3");
  ASSERT_TRUE(changed.ok()) << changed.status();
  EXPECT_TRUE(*changed);
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(core_.CurrentGeneration(kJob), gen + 1);
  EXPECT_THAT(Ranks(), ElementsAre(Worker(0), Worker(2)));
  const std::vector<Event> failures = EventsOf("failure");
  ASSERT_EQ(failures.size(), 1u);
  EXPECT_EQ(failures[0].message,
            "did not join again after generation 1 ended: its process exited "
            "(exit status 3; reported by its node agent)");
}

TEST_F(CoordinatorExitTest, AWaitingWorkerThatExitedWithdraws) {
  // Two of three wanted are waiting (settle 2 s, min 2): one dies, the
  // other keeps waiting alone and no generation forms with the dead one.
  v1::JobSpec spec = Spec(3, 2);
  ASSERT_TRUE(core_.Join(JoinReq(spec, Worker(0))).ok());
  ASSERT_TRUE(core_.Join(JoinReq(spec, Worker(1))).ok());
  auto changed = Exited(Worker(1));
  ASSERT_TRUE(changed.ok()) << changed.status();
  EXPECT_TRUE(*changed);
  EXPECT_THAT(Waiting(), ElementsAre(Worker(0)));
  clock_.Advance(absl::Seconds(3));
  core_.Tick();
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  ASSERT_EQ(EventsOf("failure").size(), 1u);
  EXPECT_THAT(EventsOf("failure")[0].message,
              HasSubstr("while waiting for a generation"));
  // A survivor already back that dies is withdrawn from both lists.
  ASSERT_TRUE(core_.Join(JoinReq(spec, Worker(2))).ok());
  clock_.Advance(absl::Seconds(3));
  core_.Tick();
  const int64_t gen = core_.CurrentGeneration(kJob);
  ASSERT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(0), gen, 1, "r")).ok());
  changed = Exited(Worker(0));
  ASSERT_TRUE(changed.ok()) << changed.status();
  EXPECT_THAT(Waiting(), IsEmpty());
  EXPECT_THAT(Expected(), ElementsAre(Worker(2)));
}

TEST_F(CoordinatorExitTest, LateReportsChangeNothing) {
  const int64_t gen = FormLong(3);
  // w0 completed; w1 ran out of data (finished); w2 is not in the job.
  ASSERT_TRUE(
      core_.Leave(LeaveReq(Worker(0), gen, v1::LEAVE_REASON_COMPLETED)).ok());
  (void)core_.TakeDirtyJobs();
  (void)core_.TakeWokenJobs();
  const uint64_t version = core_.version();
  const std::string before = Snapshot();
  for (const std::string& w : {Worker(0), std::string("stranger")}) {
    auto changed = Exited(w);
    ASSERT_TRUE(changed.ok()) << w << ": " << changed.status();
    EXPECT_FALSE(*changed) << w;
  }
  EXPECT_EQ(core_.version(), version);
  EXPECT_EQ(Snapshot(), before);
  EXPECT_THAT(core_.TakeDirtyJobs(), IsEmpty());
  ASSERT_TRUE(
      core_.Leave(LeaveReq(Worker(1), gen, v1::LEAVE_REASON_END_OF_DATA)).ok());
  auto changed = Exited(Worker(1));
  ASSERT_TRUE(changed.ok()) << changed.status();
  EXPECT_FALSE(*changed);
  // A job that has ended takes no more reports into account.
  v1::StopJobRequest stop;
  stop.set_job_id(kJob);
  stop.set_reason("test over");
  ASSERT_TRUE(core_.StopJob(stop).ok());
  changed = Exited(Worker(2));
  ASSERT_TRUE(changed.ok()) << changed.status();
  EXPECT_FALSE(*changed);
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_STOPPED);
  EXPECT_THAT(core_.Failure(kJob), HasSubstr("test over"));
}

TEST_F(CoordinatorExitTest, BadReportsAreRefusedAndChangeNothing) {
  FormLong(2);
  (void)core_.TakeDirtyJobs();
  (void)core_.TakeWokenJobs();
  const uint64_t version = core_.version();
  const std::string before = Snapshot();
  struct Case {
    std::string job, worker, secret, how;
    absl::StatusCode code;
  };
  const std::string long_how(5000, 'x');
  for (const Case& c : std::vector<Case>{
           {kJob, "", Secret(Worker(0)), kKilled,
            absl::StatusCode::kInvalidArgument},
           {kJob, "bad id!", Secret(Worker(0)), kKilled,
            absl::StatusCode::kInvalidArgument},
           {kJob, Worker(0), "short", kKilled,
            absl::StatusCode::kInvalidArgument},
           {kJob, Worker(0), Secret(Worker(0)), long_how,
            absl::StatusCode::kInvalidArgument},
           {"no-such-job", Worker(0), Secret(Worker(0)), kKilled,
            absl::StatusCode::kNotFound},
           {kJob, Worker(0), Secret(Worker(1)), kKilled,
            absl::StatusCode::kPermissionDenied},
       }) {
    SCOPED_TRACE(c.worker + " / " + c.job);
    auto changed = core_.WorkerExited(c.job, c.worker, c.secret, c.how);
    EXPECT_EQ(changed.status().code(), c.code) << changed.status();
  }
  EXPECT_EQ(core_.version(), version);
  EXPECT_EQ(Snapshot(), before);
  EXPECT_THAT(core_.TakeDirtyJobs(), IsEmpty());
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
  EXPECT_TRUE(EventsOf("failure").empty());
}

// The report's change is saved with the job: a restored coordinator has the
// generation ended and the worker unbound.
TEST_F(CoordinatorExitTest, TheChangeIsPersisted) {
  FormLong(2);
  ASSERT_TRUE(Exited(Worker(1)).ok());
  auto record = core_.ExportJob(kJob);
  ASSERT_TRUE(record.has_value());
  FakeClock clock;
  Core restored(&clock);
  ASSERT_TRUE(restored.RestoreJob(*record).ok());
  EXPECT_EQ(restored.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  bool saved = false;
  for (const Event& e : restored.Events(kJob)) {
    saved = saved || (e.kind == "failure" && e.worker_id == Worker(1) &&
                      absl::StrContains(e.message, "its process exited"));
  }
  EXPECT_TRUE(saved);
  v1::JoinRequest restarted = JoinReq(spec_, Worker(1));
  restarted.set_worker_secret(Secret("w1-restarted"));
  EXPECT_TRUE(restored.Join(restarted).ok());
}

// See Note [Checkpoints] in worker/checkpoint/checkpointer.h: the job keeps the
// newest reported checkpoints by step, in its record and its status; a bad
// report changes nothing.
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
