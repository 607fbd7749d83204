// The coordinator core as a plain state machine, driven by a fake clock.

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <spdlog/spdlog.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "coordinator/core/core.h"
#include "coordinator/core/core_validation.h"
#include "coordinator_requests.h"

namespace concord::coordinator {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

using testing::JoinReq;
using testing::kJob;
using testing::Secret;
using testing::Spec;
using testing::Worker;

class CoordinatorCoreTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { spdlog::set_level(spdlog::level::warn); }

  // Joins w0..w{n-1} into a job of max_workers n; returns the generation.
  int64_t FormGeneration(int n, const std::vector<int64_t>& steps = {}) {
    const v1::JobSpec spec = Spec(n);
    for (int i = 0; i < n; ++i) {
      const int64_t step = i < static_cast<int>(steps.size()) ? steps[i] : 0;
      if (i > 0) clock_.Advance(absl::Milliseconds(10));
      EXPECT_TRUE(core_.Join(JoinReq(spec, Worker(i), step)).ok());
    }
    EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
    return core_.CurrentGeneration(kJob);
  }

  Assignment AssignmentOf(const std::string& worker) {
    auto a = core_.GetAssignment(kJob, worker);
    EXPECT_TRUE(a.ok()) << a.status();
    EXPECT_TRUE(a.ok() && a->has_value());
    return a.ok() && a->has_value() ? **a : Assignment{};
  }

  absl::StatusCode HeartbeatCode(const std::string& worker, int64_t gen,
                                 int64_t step = 0) {
    v1::HeartbeatRequest r;
    r.set_job_id(kJob);
    r.set_worker_id(worker);
    r.set_worker_secret(Secret(worker));
    r.set_generation(gen);
    r.set_step(step);
    return core_.Heartbeat(r).status().code();
  }

  absl::StatusOr<v1::LeaveResponse> Leave(const std::string& worker,
                                          int64_t gen, v1::LeaveReason reason) {
    v1::LeaveRequest r;
    r.set_job_id(kJob);
    r.set_worker_id(worker);
    r.set_worker_secret(Secret(worker));
    r.set_generation(gen);
    r.set_reason(reason);
    return core_.Leave(r);
  }

  absl::Status KvSet(int64_t gen, const std::string& key,
                     const std::string& value,
                     const std::string& worker = Worker(0)) {
    v1::KvSetRequest r;
    r.set_job_id(kJob);
    r.set_worker_id(worker);
    r.set_worker_secret(Secret(worker));
    r.set_generation(gen);
    r.set_key(key);
    r.set_value(value);
    return core_.KvSet(r);
  }

  absl::StatusOr<std::optional<std::vector<std::string>>> KvGet(
      int64_t gen, const std::vector<std::string>& keys) {
    v1::KvGetRequest r;
    r.set_job_id(kJob);
    r.set_worker_id(Worker(0));
    r.set_worker_secret(Secret(Worker(0)));
    r.set_generation(gen);
    for (const auto& k : keys) r.add_keys(k);
    return core_.KvGet(r);
  }

  std::vector<std::string> EventKinds() {
    std::vector<std::string> kinds;
    for (const Event& e : core_.Events(kJob)) kinds.push_back(e.kind);
    return kinds;
  }

  FakeClock clock_;
  Core core_{&clock_};
};

class CoordinatorRendezvousTest : public CoordinatorCoreTest,
                                  public ::testing::WithParamInterface<int> {};

TEST_P(CoordinatorRendezvousTest, FormsGenerationOneWithRanksInJoinOrder) {
  const int n = GetParam();
  const v1::JobSpec spec = Spec(n);
  for (int i = 0; i < n; ++i) {
    ASSERT_TRUE(core_.Join(JoinReq(spec, Worker(i))).ok());
    if (i + 1 < n) {
      // Still open: nobody has an assignment yet.
      EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
      auto a = core_.GetAssignment(kJob, Worker(0));
      ASSERT_TRUE(a.ok());
      EXPECT_FALSE(a->has_value());
    }
    clock_.Advance(absl::Milliseconds(5));
  }
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(core_.CurrentGeneration(kJob), 1);
  for (int i = 0; i < n; ++i) {
    const Assignment a = AssignmentOf(Worker(i));
    EXPECT_EQ(a.generation, 1);
    EXPECT_EQ(a.rank, i);
    EXPECT_EQ(a.world_size, n);
    EXPECT_EQ(a.authoritative_rank, 0);
    EXPECT_EQ(a.heartbeat_interval, absl::Seconds(1));
    ASSERT_EQ(a.members->size(), static_cast<size_t>(n));
    for (int r = 0; r < n; ++r) {
      EXPECT_EQ((*a.members)[r].rank(), r);
      EXPECT_EQ((*a.members)[r].worker_id(), Worker(r));
      EXPECT_EQ((*a.members)[r].host(), Worker(r) + ".local");
    }
  }
  const std::vector<Event> events = core_.Events(kJob);
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back().kind, "generation");
  EXPECT_EQ(events.back().message,
            absl::StrCat("generation 1 formed with ", n,
                         " members, authoritative rank 0"));
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, CoordinatorRendezvousTest,
                         ::testing::Values(1, 2, 3, 4));

TEST_F(CoordinatorCoreTest, RejoinWhileWaitingIsIdempotent) {
  const v1::JobSpec spec = Spec(2);
  ASSERT_TRUE(core_.Join(JoinReq(spec, "a", 1)).ok());
  ASSERT_TRUE(core_.Join(JoinReq(spec, "a", 7)).ok());
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  ASSERT_TRUE(core_.Join(JoinReq(spec, "b", 3)).ok());
  EXPECT_EQ(AssignmentOf("a").rank, 0);
  EXPECT_EQ((*AssignmentOf("a").members)[0].committed_step(), 7);
  EXPECT_EQ(AssignmentOf("b").rank, 1);
  // A member of the running generation cannot join it again.
  EXPECT_EQ(core_.Join(JoinReq(spec, "a")).code(),
            absl::StatusCode::kAlreadyExists);
}

// A Join whose client went away withdraws its worker, unless the worker
// joined again since (the later call owns the place) or was placed.
TEST_F(CoordinatorCoreTest, ACancelledJoinWithdrawsItsWaitingWorker) {
  const v1::JobSpec spec = Spec(3);
  uint64_t a1 = 0, a2 = 0, b = 0;
  ASSERT_TRUE(core_.Join(JoinReq(spec, "a"), &a1).ok());
  ASSERT_TRUE(core_.Join(JoinReq(spec, "a"), &a2).ok());  // a retry
  ASSERT_TRUE(core_.Join(JoinReq(spec, "b"), &b).ok());
  EXPECT_NE(a1, a2);
  EXPECT_FALSE(core_.CancelJoin(kJob, "a", a1));  // the retry owns it
  EXPECT_FALSE(core_.CancelJoin(kJob, "nobody", b));
  EXPECT_FALSE(core_.CancelJoin("no-such-job", "b", b));
  EXPECT_TRUE(core_.CancelJoin(kJob, "b", b));
  EXPECT_FALSE(core_.CancelJoin(kJob, "b", b));  // once
  const std::vector<Event> events = core_.Events(kJob);
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back().kind, "leave");
  EXPECT_THAT(events.back().message, HasSubstr("Join was cancelled"));
  // The generation forms without b: a and c.
  ASSERT_TRUE(core_.Join(JoinReq(spec, "c")).ok());
  clock_.Advance(absl::Seconds(3));  // the default settle of 2 s
  core_.Tick();
  ASSERT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(AssignmentOf("a").world_size, 2);
  EXPECT_EQ(core_.GetAssignment(kJob, "b").status().code(),
            absl::StatusCode::kNotFound);
  // A placed worker's cancelled call changes nothing.
  EXPECT_FALSE(core_.CancelJoin(kJob, "a", a2));
  EXPECT_EQ(AssignmentOf("a").world_size, 2);
}

TEST_F(CoordinatorCoreTest, AuthoritativeRankIsHighestCommittedStep) {
  FormGeneration(4, {3, 9, 2, 9});
  EXPECT_EQ(AssignmentOf(Worker(0)).authoritative_rank, 1);
  EXPECT_THAT(core_.Events(kJob).back().message,
              HasSubstr("authoritative rank 1"));
}

TEST_F(CoordinatorCoreTest, AuthoritativeRankTiesGoToEarliestJoined) {
  FormGeneration(3, {5, 5, 5});
  EXPECT_EQ(AssignmentOf(Worker(2)).authoritative_rank, 0);
}

TEST_F(CoordinatorCoreTest, SpecMismatchIsFailedPreconditionAndChangesNothing) {
  ASSERT_TRUE(core_.Join(JoinReq(Spec(3), "a")).ok());
  const uint64_t version = core_.version();
  const size_t events = core_.Events(kJob).size();

  v1::JobSpec other = Spec(3);
  other.set_heartbeat_timeout_ms(20000);
  const absl::Status s = core_.Join(JoinReq(other, "b"));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("heartbeat_timeout_ms"));
  EXPECT_EQ(core_.Join(JoinReq(Spec(4), "b")).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(core_.version(), version);
  EXPECT_EQ(core_.Events(kJob).size(), events);
  EXPECT_EQ(core_.GetAssignment(kJob, "b").status().code(),
            absl::StatusCode::kNotFound);

  // Explicit defaults equal the zero values.
  v1::JobSpec same = Spec(3);
  same.set_heartbeat_interval_ms(1000);
  same.set_heartbeat_timeout_ms(10000);
  same.set_rendezvous_timeout_ms(300000);
  EXPECT_TRUE(core_.Join(JoinReq(same, "b")).ok());
}

TEST_F(CoordinatorCoreTest, InvalidSpecsAreInvalidArgument) {
  struct Case {
    const char* name;
    std::function<void(v1::JoinRequest&)> mutate;
  };
  const std::vector<Case> cases = {
      {"empty job", [](auto& r) { r.mutable_spec()->set_job_id(""); }},
      {"empty worker", [](auto& r) { r.set_worker_id(""); }},
      {"min 0", [](auto& r) { r.mutable_spec()->set_min_workers(0); }},
      {"min > max", [](auto& r) { r.mutable_spec()->set_min_workers(3); }},
      {"max too big",
       [](auto& r) {
         r.mutable_spec()->set_max_workers(kMaxWorkersPerJob + 1);
       }},
      {"interval < 0",
       [](auto& r) { r.mutable_spec()->set_heartbeat_interval_ms(-1); }},
      {"timeout <= interval",
       [](auto& r) { r.mutable_spec()->set_heartbeat_timeout_ms(1000); }},
      {"timeout <= default interval",
       [](auto& r) { r.mutable_spec()->set_heartbeat_timeout_ms(500); }},
      {"rendezvous < 0",
       [](auto& r) { r.mutable_spec()->set_rendezvous_timeout_ms(-5); }},
  };
  for (const Case& c : cases) {
    v1::JoinRequest r = JoinReq(Spec(2), "a");
    c.mutate(r);
    EXPECT_EQ(core_.Join(r).code(), absl::StatusCode::kInvalidArgument)
        << c.name;
  }
  EXPECT_EQ(core_.version(), 0u);
  EXPECT_FALSE(core_.State(kJob).has_value());
  v1::JoinRequest biggest = JoinReq(Spec(kMaxWorkersPerJob), "a");
  EXPECT_TRUE(core_.Join(biggest).ok());
}

TEST_F(CoordinatorCoreTest, HeartbeatChecksJobWorkerAndGeneration) {
  const int64_t gen = FormGeneration(2);
  EXPECT_EQ(HeartbeatCode(Worker(0), gen, 4), absl::StatusCode::kOk);
  EXPECT_EQ(HeartbeatCode("stranger", gen), absl::StatusCode::kNotFound);
  v1::HeartbeatRequest unknown_job;
  unknown_job.set_job_id("nope");
  unknown_job.set_worker_id(Worker(0));
  unknown_job.set_worker_secret(Secret(Worker(0)));
  unknown_job.set_generation(gen);
  EXPECT_EQ(core_.Heartbeat(unknown_job).status().code(),
            absl::StatusCode::kNotFound);

  v1::HeartbeatRequest stale;
  stale.set_job_id(kJob);
  stale.set_worker_id(Worker(0));
  stale.set_worker_secret(Secret(Worker(0)));
  stale.set_generation(gen + 1);
  const auto s = core_.Heartbeat(stale);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(s.status().message(), "generation 2 is stale; current is 1");

  v1::HeartbeatRequest ok = stale;
  ok.set_generation(gen);
  auto r = core_.Heartbeat(ok);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->current_generation(), gen);
  EXPECT_EQ(r->state(), v1::JOB_STATE_RUNNING);
}

TEST_F(CoordinatorCoreTest,
       HeartbeatTimeoutEndsGenerationAndGenerationsOnlyGrow) {
  const int64_t gen = FormGeneration(3);
  ASSERT_EQ(gen, 1);
  // w0 and w1 keep heartbeating; w2 goes silent.
  for (int t = 0; t < 10; ++t) {
    clock_.Advance(absl::Seconds(1));
    EXPECT_EQ(HeartbeatCode(Worker(0), gen, t), absl::StatusCode::kOk);
    EXPECT_EQ(HeartbeatCode(Worker(1), gen, t), absl::StatusCode::kOk);
    core_.Tick();
    EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
  }
  clock_.Advance(absl::Milliseconds(200));
  core_.Tick();
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  EXPECT_EQ(core_.CurrentGeneration(kJob), 1);

  std::vector<Event> failures;
  for (const Event& e : core_.Events(kJob)) {
    if (e.kind == "failure") failures.push_back(e);
  }
  ASSERT_EQ(failures.size(), 1u);
  EXPECT_EQ(failures[0].worker_id, Worker(2));
  EXPECT_EQ(failures[0].message, "no heartbeat for 10.2s (timeout 10s)");

  // The survivors learn with ABORTED, and are not members any more.
  EXPECT_EQ(HeartbeatCode(Worker(0), gen), absl::StatusCode::kAborted);
  EXPECT_EQ(core_.GetAssignment(kJob, Worker(0)).status().code(),
            absl::StatusCode::kNotFound);

  // They re-join, and a new worker joins; the next generation is 2. The
  // survivors keep their order ahead of the newcomer, and the authoritative
  // rank is the survivor with the most progress.
  const v1::JobSpec spec = Spec(3);
  ASSERT_TRUE(core_.Join(JoinReq(spec, "fresh", 0)).ok());
  ASSERT_TRUE(core_.Join(JoinReq(spec, Worker(1), 9)).ok());
  ASSERT_TRUE(core_.Join(JoinReq(spec, Worker(0), 8)).ok());
  EXPECT_EQ(core_.CurrentGeneration(kJob), 2);
  EXPECT_EQ(AssignmentOf(Worker(0)).rank, 0);
  EXPECT_EQ(AssignmentOf(Worker(1)).rank, 1);
  EXPECT_EQ(AssignmentOf("fresh").rank, 2);
  EXPECT_EQ(AssignmentOf(Worker(0)).authoritative_rank, 1);
  EXPECT_EQ(HeartbeatCode(Worker(0), 1), absl::StatusCode::kAborted);
  EXPECT_EQ(HeartbeatCode(Worker(0), 2), absl::StatusCode::kOk);

  // An error Leave ends generation 2; the next one is 3, never lower. Even
  // max_workers newcomers wait for the survivors, who hold the model.
  ASSERT_TRUE(Leave("fresh", 2, v1::LEAVE_REASON_ERROR).ok());
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  EXPECT_EQ(core_.CurrentGeneration(kJob), 2);
  for (const char* w : {"x", "y", "z"}) {
    ASSERT_TRUE(core_.Join(JoinReq(spec, w)).ok());
  }
  EXPECT_EQ(core_.CurrentGeneration(kJob), 2);
  ASSERT_TRUE(core_.Join(JoinReq(spec, Worker(1), 12)).ok());
  ASSERT_TRUE(core_.Join(JoinReq(spec, Worker(0), 12)).ok());
  EXPECT_EQ(core_.CurrentGeneration(kJob), 3);
  EXPECT_EQ(AssignmentOf(Worker(0)).rank, 0);
  EXPECT_EQ(AssignmentOf(Worker(1)).rank, 1);
  EXPECT_EQ(AssignmentOf("x").rank, 2);
  auto y = core_.GetAssignment(kJob, "y");  // still waiting
  ASSERT_TRUE(y.ok());
  EXPECT_FALSE(y->has_value());
  EXPECT_THAT(EventKinds(), ::testing::Contains("leave"));
}

TEST_F(CoordinatorCoreTest, SilentCompletedMembersAreNotFailed) {
  const int64_t gen = FormGeneration(2);
  ASSERT_TRUE(Leave(Worker(0), gen, v1::LEAVE_REASON_COMPLETED).ok());
  for (int t = 0; t < 12; ++t) {
    clock_.Advance(absl::Seconds(1));
    EXPECT_EQ(HeartbeatCode(Worker(1), gen), absl::StatusCode::kOk);
    core_.Tick();
  }
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
}

TEST_F(CoordinatorCoreTest, KvIsScopedToTheCurrentGeneration) {
  const int64_t gen = FormGeneration(2);
  EXPECT_TRUE(KvSet(gen, "addr/0", "10.0.0.1:1").ok());
  auto partial = KvGet(gen, {"addr/0", "addr/1"});
  ASSERT_TRUE(partial.ok());
  EXPECT_FALSE(partial->has_value());
  EXPECT_TRUE(KvSet(gen, "addr/1", "10.0.0.2:1").ok());
  auto both = KvGet(gen, {"addr/1", "addr/0"});
  ASSERT_TRUE(both.ok());
  ASSERT_TRUE(both->has_value());
  EXPECT_THAT(**both, ElementsAre("10.0.0.2:1", "10.0.0.1:1"));

  EXPECT_EQ(KvSet(gen, "", "v").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(KvGet(gen, {""}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(KvSet(gen + 1, "k", "v").code(), absl::StatusCode::kAborted);
  EXPECT_EQ(KvGet(gen - 1, {"addr/0"}).status().code(),
            absl::StatusCode::kAborted);
  v1::KvSetRequest unknown;
  unknown.set_job_id("nope");
  unknown.set_worker_id(Worker(0));
  unknown.set_worker_secret(Secret(Worker(0)));
  unknown.set_key("k");
  EXPECT_EQ(core_.KvSet(unknown).code(), absl::StatusCode::kNotFound);

  // A new generation starts with an empty store; the old one is refused.
  ASSERT_TRUE(Leave(Worker(1), gen, v1::LEAVE_REASON_ERROR).ok());
  EXPECT_EQ(KvGet(gen, {"addr/0"}).status().code(), absl::StatusCode::kAborted);
  ASSERT_TRUE(core_.Join(JoinReq(Spec(2), Worker(0))).ok());
  ASSERT_TRUE(core_.Join(JoinReq(Spec(2), Worker(1))).ok());
  const int64_t next = core_.CurrentGeneration(kJob);
  ASSERT_EQ(next, gen + 1);
  auto fresh = KvGet(next, {"addr/0"});
  ASSERT_TRUE(fresh.ok());
  EXPECT_FALSE(fresh->has_value());
  EXPECT_EQ(KvSet(gen, "addr/0", "old").code(), absl::StatusCode::kAborted);
}

// Found by the fuzz target: text that is not UTF-8 would be stored, and a
// persisted record holding it could not be parsed after a restart.
TEST_F(CoordinatorCoreTest, TextMustBeUtf8AndBytesNeedNot) {
  v1::JoinRequest bad_host = JoinReq(Spec(2), Worker(0));
  for (const std::string host :
       {"\xff", "a\xc3", "\xc0\xaf", "\xed\xa0\x80", "\xf4\x90\x80\x80"}) {
    bad_host.set_host(host);
    const absl::Status s = core_.Join(bad_host);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << host;
    EXPECT_THAT(std::string(s.message()), HasSubstr("host is not valid UTF-8"));
  }
  EXPECT_EQ(core_.version(), 0u);
  EXPECT_EQ(core_.job_count(), 0u);
  bad_host.set_host("h\xc3\xa9te-\xe2\x82\xac-\xf0\x9f\x98\x80");  // é € 😀
  EXPECT_TRUE(core_.Join(bad_host).ok());

  const int64_t gen = FormGeneration(2);
  EXPECT_EQ(KvSet(gen, "k\xff", "v").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(KvSet(gen, "k", std::string("\xff\x00\xfe", 3)).ok());
  v1::LeaveRequest leave;
  leave.set_job_id(kJob);
  leave.set_worker_id(Worker(1));
  leave.set_worker_secret(Secret(Worker(1)));
  leave.set_generation(gen);
  leave.set_reason(v1::LEAVE_REASON_ERROR);
  leave.set_message("cut \xe2\x82");
  EXPECT_EQ(core_.Leave(leave).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(core_.CurrentGeneration(kJob), gen);
}

TEST_F(CoordinatorCoreTest, AllCompletedSucceeds) {
  const int64_t gen = FormGeneration(3);
  for (int i = 0; i < 3; ++i) {
    auto r = Leave(Worker(i), gen, v1::LEAVE_REASON_COMPLETED);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->state(),
              i < 2 ? v1::JOB_STATE_RUNNING : v1::JOB_STATE_SUCCEEDED);
  }
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(core_.CurrentGeneration(kJob), gen);
  EXPECT_EQ(core_.Events(kJob).back().kind, "job");
  EXPECT_THAT(core_.Events(kJob).back().message, HasSubstr("succeeded"));
  EXPECT_EQ(core_.Join(JoinReq(Spec(3), "late")).code(),
            absl::StatusCode::kFailedPrecondition);
  // Timeouts no longer apply.
  clock_.Advance(absl::Hours(1));
  core_.Tick();
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_SUCCEEDED);
}

TEST_F(CoordinatorCoreTest, RendezvousTimeoutFailsTheJob) {
  const v1::JobSpec spec = Spec(3, 3);
  ASSERT_TRUE(core_.Join(JoinReq(spec, "a")).ok());
  ASSERT_TRUE(core_.Join(JoinReq(spec, "b")).ok());
  clock_.Advance(absl::Seconds(300));
  core_.Tick();
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  clock_.Advance(absl::Milliseconds(1));
  core_.Tick();
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_FAILED);

  const auto a = core_.GetAssignment(kJob, "a");
  EXPECT_EQ(a.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(a.status().message(),
              HasSubstr("rendezvous timed out after 300s with 2 worker(s) "
                        "waiting; min_workers is 3"));
  EXPECT_EQ(core_.Events(kJob).back().kind, "job");
  // A process of the run that failed does not start it again; a new one
  // does (see Note [Starting again]).
  EXPECT_EQ(core_.Join(JoinReq(spec, "a")).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_FAILED);
  ASSERT_TRUE(core_.Join(JoinReq(spec, "c")).ok());
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  bool again = false;
  for (const auto& e : core_.Events(kJob)) {
    again = again ||
            (e.kind == "job" && absl::StrContains(e.message,
                                                  "job started again (job "
                                                  "job failed: rendezvous"));
  }
  EXPECT_TRUE(again);
}

TEST_F(CoordinatorCoreTest, EveryMutationBumpsTheVersion) {
  uint64_t v = core_.version();
  ASSERT_TRUE(core_.Join(JoinReq(Spec(1), "a")).ok());
  EXPECT_GT(core_.version(), v);
  v = core_.version();
  EXPECT_TRUE(KvSet(1, "k", "v", "a").ok());
  EXPECT_GT(core_.version(), v);
  v = core_.version();
  EXPECT_EQ(HeartbeatCode("a", 1), absl::StatusCode::kOk);
  EXPECT_GT(core_.version(), v);
}

// See Note [Persistence]: arrivals are saved in a group (with the job's next
// other change or on a tick); the formation that answers them is saved at
// once, with them.
TEST_F(CoordinatorCoreTest, ArrivalsAreSavedInAGroupAndAFormationAtOnce) {
  const v1::JobSpec spec = Spec(3);
  ASSERT_TRUE(core_.Join(JoinReq(spec, "a")).ok());
  ASSERT_TRUE(core_.Join(JoinReq(spec, "b")).ok());
  EXPECT_TRUE(core_.TakeDirtyJobs(/*arrivals=*/false).empty());
  EXPECT_THAT(core_.TakeDirtyJobs(/*arrivals=*/true), ElementsAre(kJob));
  EXPECT_TRUE(core_.TakeDirtyJobs(/*arrivals=*/true).empty());
  // The third forms generation 1: saved at once.
  ASSERT_TRUE(core_.Join(JoinReq(spec, "c")).ok());
  EXPECT_THAT(core_.TakeDirtyJobs(/*arrivals=*/false), ElementsAre(kJob));
  EXPECT_TRUE(core_.TakeDirtyJobs(/*arrivals=*/true).empty());
  // Every other change is saved at once (a key of the generation's store).
  ASSERT_TRUE(KvSet(1, "k", "v", "a").ok());
  EXPECT_THAT(core_.TakeDirtyJobs(/*arrivals=*/false), ElementsAre(kJob));
}

}  // namespace
}  // namespace concord::coordinator
