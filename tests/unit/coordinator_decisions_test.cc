// The coordinator core's newer decisions, driven by a fake clock: request
// validation, worker binding, min_workers formation, the end-of-data
// agreement, drain/stop, operator views and export/restore.

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "coordinator/core/core.h"
#include "coordinator_core_fixture.h"
#include "coordinator_requests.h"

namespace concord::coordinator {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

using testing::CoordinatorDecisionsTest;
using testing::CoordinatorReformTest;
using testing::HeartbeatReq;
using testing::JoinReq;
using testing::kJob;
using testing::LeaveReq;
using testing::RejoinReq;
using testing::SameRecord;
using testing::Secret;
using testing::Spec;
using testing::Worker;

TEST_F(CoordinatorDecisionsTest,
       BadRequestsAreInvalidArgumentAndChangeNothing) {
  const int64_t gen = FormGeneration(2);
  const uint64_t version = core_.version();
  const std::string before = Snapshot();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  std::vector<std::pair<std::string, absl::Status>> results;
  auto join = [&](std::function<void(v1::JoinRequest&)> f) {
    v1::JoinRequest r = JoinReq(Spec(2), "new");
    f(r);
    return core_.Join(r);
  };
  auto hb = [&](std::function<void(v1::HeartbeatRequest&)> f) {
    v1::HeartbeatRequest r = HeartbeatReq(Worker(0), gen);
    f(r);
    return core_.Heartbeat(r).status();
  };
  results = {
      {"job id charset",
       join([](auto& r) { r.mutable_spec()->set_job_id("a/b"); })},
      {"job id dot", join([](auto& r) { r.mutable_spec()->set_job_id(".."); })},
      {"long worker id",
       join([](auto& r) { r.set_worker_id(std::string(129, 'x')); })},
      {"short secret", join([](auto& r) { r.set_worker_secret("short"); })},
      {"negative step", join([](auto& r) { r.set_committed_step(-1); })},
      {"long host", join([](auto& r) { r.set_host(std::string(300, 'h')); })},
      {"wait too long",
       join([](auto& r) { r.set_wait_timeout_ms(1LL << 40); })},
      {"settle >= rendezvous",
       join([](auto& r) { r.mutable_spec()->set_settle_ms(300000); })},
      {"negative settle",
       join([](auto& r) { r.mutable_spec()->set_settle_ms(-1); })},
      {"hb nan rate", hb([&](auto& r) { r.set_samples_per_second(nan); })},
      {"hb negative step", hb([](auto& r) { r.set_step(-3); })},
      {"hb negative generation", hb([](auto& r) { r.set_generation(-1); })},
      {"hb negative ddp",
       hb([](auto& r) { r.mutable_ddp()->set_forward_ms(-1); })},
      {"hb missing secret", hb([](auto& r) { r.clear_worker_secret(); })},
  };
  v1::LeaveRequest leave;
  leave.set_job_id(kJob);
  leave.set_worker_id(Worker(0));
  leave.set_worker_secret(Secret(Worker(0)));
  leave.set_generation(gen);
  leave.set_reason(static_cast<v1::LeaveReason>(99));
  results.emplace_back("leave reason", core_.Leave(leave).status());
  v1::KvSetRequest kv;
  kv.set_job_id(kJob);
  kv.set_worker_id(Worker(0));
  kv.set_worker_secret(Secret(Worker(0)));
  kv.set_generation(gen);
  kv.set_key(std::string(2000, 'k'));
  results.emplace_back("long key", core_.KvSet(kv));
  kv.set_key("k");
  kv.set_value(std::string((4 << 20) + 1, 'v'));
  results.emplace_back("big value", core_.KvSet(kv));
  v1::KvGetRequest get;
  get.set_job_id(kJob);
  get.set_worker_id(Worker(0));
  get.set_worker_secret(Secret(Worker(0)));
  get.set_generation(gen);
  results.emplace_back("no keys", core_.KvGet(get).status());
  v1::ListEventsRequest events;
  events.set_job_id(kJob);
  events.set_limit(5000);
  results.emplace_back("events limit", core_.ListEvents(events).status());
  v1::DrainWorkerRequest drain;
  drain.set_job_id(kJob);
  results.emplace_back("drain no worker", core_.DrainWorker(drain).status());
  v1::StopJobRequest stop;
  stop.set_job_id("bad id!");
  results.emplace_back("stop bad id", core_.StopJob(stop).status());

  for (const auto& [name, status] : results) {
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_FALSE(status.message().empty()) << name;
  }
  EXPECT_EQ(core_.version(), version);
  EXPECT_EQ(Snapshot(), before);
  EXPECT_EQ(core_.job_count(), 1u);
}

TEST_F(CoordinatorDecisionsTest, AWorkerIdIsBoundToItsProcess) {
  const int64_t gen = FormGeneration(2);
  v1::HeartbeatRequest forged = HeartbeatReq(Worker(0), gen);
  forged.set_worker_secret(Secret("impostor"));
  EXPECT_EQ(core_.Heartbeat(forged).status().code(),
            absl::StatusCode::kPermissionDenied);
  v1::JoinRequest steal = JoinReq(Spec(2), Worker(1));
  steal.set_worker_secret(Secret("impostor"));
  EXPECT_EQ(core_.Join(steal).code(), absl::StatusCode::kPermissionDenied);

  // A worker of another job cannot act in this one under its own name
  // (not a member) nor under a member's name (wrong secret).
  v1::JobSpec other = Spec(1);
  other.set_job_id("other");
  ASSERT_TRUE(core_.Join(JoinReq(other, "x")).ok());
  v1::KvSetRequest kv;
  kv.set_job_id(kJob);
  kv.set_generation(gen);
  kv.set_key("gloo/0");
  kv.set_worker_id("x");
  kv.set_worker_secret(Secret("x"));
  EXPECT_EQ(core_.KvSet(kv).code(), absl::StatusCode::kNotFound);
  kv.set_worker_id(Worker(0));
  EXPECT_EQ(core_.KvSet(kv).code(), absl::StatusCode::kPermissionDenied);

  // After w1 is declared failed its id is free for a new process.
  for (int t = 0; t < 11; ++t) {
    clock_.Advance(absl::Seconds(1));
    ASSERT_TRUE(core_.Heartbeat(HeartbeatReq(Worker(0), gen)).ok());
    core_.Tick();
  }
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  EXPECT_TRUE(core_.Join(steal).ok());
}

TEST_F(CoordinatorDecisionsTest, MinWorkersFormAfterTheSettlePeriod) {
  const v1::JobSpec spec = Spec(4, 2);  // settle: the 2 s default
  ASSERT_TRUE(core_.Join(JoinReq(spec, "a")).ok());
  clock_.Advance(absl::Seconds(5));
  core_.Tick();
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);  // 1 < min
  ASSERT_TRUE(core_.Join(JoinReq(spec, "b")).ok());
  clock_.Advance(absl::Milliseconds(1500));
  core_.Tick();
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);  // settling
  ASSERT_TRUE(core_.Join(JoinReq(spec, "c")).ok());        // restarts it
  clock_.Advance(absl::Milliseconds(1999));
  core_.Tick();
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  clock_.Advance(absl::Milliseconds(1));
  core_.Tick();
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
  auto a = core_.GetAssignment(kJob, "c");
  ASSERT_TRUE(a.ok() && a->has_value());
  EXPECT_EQ((*a)->world_size, 3);
  EXPECT_EQ((*a)->rank, 2);
}

TEST_F(CoordinatorDecisionsTest, TooFewWorkersFailTheJobWithAClearReason) {
  v1::JobSpec spec = Spec(4, 3);
  spec.set_rendezvous_timeout_ms(30000);
  ASSERT_TRUE(core_.Join(JoinReq(spec, "a")).ok());
  ASSERT_TRUE(core_.Join(JoinReq(spec, "b")).ok());
  clock_.Advance(absl::Seconds(31));
  core_.Tick();
  v1::GetJobRequest get;
  get.set_job_id(kJob);
  auto status = core_.GetJob(get);
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(status->failure(),
            "rendezvous timed out after 30s with 2 worker(s) waiting; "
            "min_workers is 3");
}

TEST_F(CoordinatorDecisionsTest, DrainEndsTheGenerationAndStopEndsTheJob) {
  const int64_t gen = FormGeneration(3);
  v1::DrainWorkerRequest drain;
  drain.set_job_id(kJob);
  drain.set_worker_id(Worker(1));
  drain.set_reason("maintenance");
  auto drained = core_.DrainWorker(drain);
  ASSERT_TRUE(drained.ok()) << drained.status();
  EXPECT_EQ(drained->ended_generation(), gen);
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  EXPECT_EQ(core_.Join(JoinReq(Spec(3), Worker(1))).code(),
            absl::StatusCode::kFailedPrecondition);
  drain.set_worker_id("nobody");
  EXPECT_EQ(core_.DrainWorker(drain).status().code(),
            absl::StatusCode::kNotFound);

  v1::StopJobRequest stop;
  stop.set_job_id(kJob);
  stop.set_reason("bad data");
  auto stopped = core_.StopJob(stop);
  ASSERT_TRUE(stopped.ok());
  EXPECT_EQ(stopped->state(), v1::JOB_STATE_STOPPED);
  const absl::Status join = core_.Join(JoinReq(Spec(3), Worker(0)));
  EXPECT_EQ(join.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(join.message(), HasSubstr("stopped by an operator: bad data"));
  EXPECT_TRUE(core_.StopJob(stop).ok());  // idempotent

  v1::ListEventsRequest events;
  events.set_job_id(kJob);
  auto all = core_.ListEvents(events);
  ASSERT_TRUE(all.ok());
  ASSERT_GE(all->events_size(), 3);
  EXPECT_EQ(all->events(0).seq(), 1);
  std::vector<std::string> kinds;
  for (const auto& e : all->events()) kinds.push_back(e.kind());
  EXPECT_THAT(kinds, ::testing::Contains("drain"));
  EXPECT_EQ(kinds.back(), "stop");
  events.set_after_seq(all->events(all->events_size() - 2).seq());
  auto tail = core_.ListEvents(events);
  ASSERT_TRUE(tail.ok());
  ASSERT_EQ(tail->events_size(), 1);
  EXPECT_EQ(tail->events(0).kind(), "stop");
}

TEST_F(CoordinatorDecisionsTest, GetJobShowsMembersAndHealth) {
  const int64_t gen = FormGeneration(2);
  clock_.Advance(absl::Seconds(3));
  v1::HeartbeatRequest hb = HeartbeatReq(Worker(1), gen, 42);
  hb.set_samples_per_second(123.5);
  hb.mutable_ddp()->set_allreduce_wait_ms(2.5);
  ASSERT_TRUE(core_.Heartbeat(hb).ok());
  clock_.Advance(absl::Milliseconds(500));
  v1::GetJobRequest get;
  get.set_job_id(kJob);
  auto status = core_.GetJob(get);
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->generation(), gen);
  ASSERT_EQ(status->members_size(), 2);
  EXPECT_EQ(status->members(0).last_heartbeat_age_ms(), 3500);
  EXPECT_EQ(status->members(1).last_heartbeat_age_ms(), 500);
  EXPECT_EQ(status->members(1).committed_step(), 42);
  EXPECT_EQ(status->members(1).samples_per_second(), 123.5);
  EXPECT_EQ(status->members(1).ddp().allreduce_wait_ms(), 2.5);
  EXPECT_EQ(status->authoritative_rank(), 0);
  EXPECT_FALSE(status->recent_events().empty());
  get.set_job_id("missing");
  EXPECT_EQ(core_.GetJob(get).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(core_.ListJobs().jobs_size(), 1);
}

TEST_F(CoordinatorDecisionsTest, ExportAndRestoreKeepEverything) {
  const int64_t gen = FormGeneration(2);
  ASSERT_TRUE(core_.Heartbeat(HeartbeatReq(Worker(0), gen, 8)).ok());
  // A node agent's memory snapshot (see Note [Resume source]) is kept too.
  v1::CheckpointReport memory;
  memory.set_step(8);
  memory.set_bytes(4096);
  memory.set_memory(true);
  memory.set_node("node-a");
  ASSERT_TRUE(core_.CheckpointReported(kJob, memory).ok());
  EXPECT_THAT(core_.TakeDirtyJobs(), ElementsAre(kJob));
  EXPECT_TRUE(core_.TakeDirtyJobs().empty());
  auto record = core_.ExportJob(kJob);
  ASSERT_TRUE(record.has_value());

  FakeClock later(clock_.Now() + absl::Hours(1));
  Core restored(&later);
  ASSERT_TRUE(restored.RestoreJob(*record).ok());
  EXPECT_TRUE(SameRecord(*restored.ExportJob(kJob), *record));
  EXPECT_EQ(restored.CurrentGeneration(kJob), gen);
  EXPECT_EQ(restored.State(kJob), v1::JOB_STATE_RUNNING);
  // Members get a full timeout to reconnect, and keep their binding.
  restored.Tick();
  EXPECT_EQ(restored.State(kJob), v1::JOB_STATE_RUNNING);
  v1::HeartbeatRequest forged = HeartbeatReq(Worker(0), gen);
  forged.set_worker_secret(Secret("impostor"));
  EXPECT_EQ(restored.Heartbeat(forged).status().code(),
            absl::StatusCode::kPermissionDenied);
  auto hb = restored.Heartbeat(HeartbeatReq(Worker(0), gen, 9));
  ASSERT_TRUE(hb.ok());
  EXPECT_EQ(restored.ExportJob(kJob)->memory_snapshots_size(), 1);
  // New events continue the sequence.
  ASSERT_TRUE(restored
                  .Leave([&] {
                    v1::LeaveRequest r;
                    r.set_job_id(kJob);
                    r.set_worker_id(Worker(0));
                    r.set_worker_secret(Secret(Worker(0)));
                    r.set_generation(gen);
                    r.set_reason(v1::LEAVE_REASON_ERROR);
                    return r;
                  }())
                  .ok());
  const auto events = restored.Events(kJob);
  for (size_t i = 1; i < events.size(); ++i) {
    EXPECT_EQ(events[i].seq, events[i - 1].seq + 1);
  }
  // A record behind the current generation is refused.
  ASSERT_TRUE(restored.Join(JoinReq(Spec(2), Worker(0))).ok());
  ASSERT_TRUE(restored.Join(JoinReq(Spec(2), "w9")).ok());
  ASSERT_TRUE(restored.Join(JoinReq(Spec(2), Worker(1))).ok());
  EXPECT_EQ(restored.CurrentGeneration(kJob), gen + 1);
  EXPECT_EQ(restored.RestoreJob(*record).code(),
            absl::StatusCode::kFailedPrecondition);
}

// See Note [Unreachable peers]: survivors of a generation that report each
// other unreachable: the one that joined the job last is taken out (drained, an
// event, its Join refused), the others form the next generation at once.
TEST_F(CoordinatorReformTest, WorkersThatCannotReachEachOtherLoseOneSide) {
  const int64_t gen = FormSettled(3, 3);  // w0, w1, w2 in join order
  const v1::JobSpec spec = Spec(3);
  auto rejoin = [&](int i, std::vector<int> unreachable) {
    v1::JoinRequest r = RejoinReq(spec, Worker(i), gen, 4, "timed out");
    r.set_probe_port(4000 + i);
    for (int u : unreachable) r.add_unreachable(Worker(u));
    return core_.Join(r);
  };
  ASSERT_TRUE(rejoin(0, {1}).ok());
  ASSERT_TRUE(rejoin(2, {}).ok());
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);  // w1 not back yet
  ASSERT_TRUE(rejoin(1, {0}).ok());
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(core_.CurrentGeneration(kJob), gen + 1);
  EXPECT_THAT(Ranks(), ElementsAre(Worker(0), Worker(2)));
  const std::vector<Event> drained = EventsOf("drain");
  ASSERT_EQ(drained.size(), 1u);
  EXPECT_EQ(drained[0].worker_id, Worker(1));
  EXPECT_THAT(drained[0].message, HasSubstr("unreachable from w0"));
  // Its probe port is in the member table the others asked for.
  auto a = core_.GetAssignment(kJob, Worker(2));
  ASSERT_TRUE(a.ok() && a->has_value());
  ASSERT_EQ((*a)->members->size(), 2u);
  EXPECT_EQ((*a)->members->at(1).probe_port(), 4002);
  // The one taken out hears so, and cannot come back under its id.
  EXPECT_EQ(core_.GetAssignment(kJob, Worker(1)).status().code(),
            absl::StatusCode::kNotFound);
  const absl::Status again = core_.Join(JoinReq(spec, Worker(1), 4));
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(again.message(), HasSubstr("taken out of job"));
  // The drain is persisted like an operator's.
  auto record = core_.ExportJob(kJob);
  ASSERT_TRUE(record.has_value());
  EXPECT_THAT(record->drained(), ElementsAre(Worker(1)));
}

// One side's report is enough (a one-way cut shows on one side only when
// the other's probe got through); of a worker unreachable from two others,
// that worker goes, whatever its age.
TEST_F(CoordinatorReformTest, TheWorkerInMostUnreachablePairsGoes) {
  const int64_t gen = FormGeneration(4);
  const v1::JobSpec spec = Spec(4);
  auto rejoin = [&](int i, std::vector<int> unreachable) {
    v1::JoinRequest r = RejoinReq(spec, Worker(i), gen, 4, "timed out");
    for (int u : unreachable) r.add_unreachable(Worker(u));
    return core_.Join(r);
  };
  ASSERT_TRUE(rejoin(0, {}).ok());
  ASSERT_TRUE(rejoin(1, {0}).ok());
  ASSERT_TRUE(rejoin(2, {0}).ok());
  ASSERT_TRUE(rejoin(3, {}).ok());
  EXPECT_THAT(Ranks(), ElementsAre(Worker(1), Worker(2), Worker(3)));
  EXPECT_EQ(EventsOf("drain").size(), 1u);
}

TEST_F(CoordinatorReformTest, BadUnreachableReportsAreRefused) {
  const v1::JobSpec spec = Spec(2);
  v1::JoinRequest self = JoinReq(spec, Worker(0));
  self.add_unreachable(Worker(0));
  EXPECT_EQ(core_.Join(self).code(), absl::StatusCode::kInvalidArgument);
  v1::JoinRequest empty = JoinReq(spec, Worker(0));
  empty.add_unreachable("");
  EXPECT_EQ(core_.Join(empty).code(), absl::StatusCode::kInvalidArgument);
  v1::JoinRequest many = JoinReq(spec, Worker(0));
  for (int i = 1; i <= 3; ++i) many.add_unreachable(Worker(i));
  EXPECT_EQ(core_.Join(many).code(), absl::StatusCode::kInvalidArgument);
  v1::JoinRequest port = JoinReq(spec, Worker(0));
  port.set_probe_port(70000);
  EXPECT_EQ(core_.Join(port).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(core_.job_count(), 0u);  // no state changed
}

}  // namespace
}  // namespace concord::coordinator
