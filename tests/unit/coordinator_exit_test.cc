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

using testing::CoordinatorExitTest;
using testing::JoinReq;
using testing::kJob;
using testing::kKilled;
using testing::LeaveReq;
using testing::RejoinReq;
using testing::Secret;
using testing::Spec;
using testing::Worker;

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
}  // namespace
}  // namespace concord::coordinator
