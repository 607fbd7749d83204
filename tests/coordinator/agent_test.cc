// The node agent (agent/node_agent.h) between real workers' calls and a real
// coordinator on loopback (the workers' side reaches it over a unix socket).
// Its heartbeat batching as a policy: heartbeat_batcher_test.cc.

#include <gmock/gmock.h>
#include <google/protobuf/message.h>
#include <grpcpp/generic/generic_stub.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "agent/node_agent.h"
#include "common/grpc_auth.h"
#include "concord/v1/agent.grpc.pb.h"
#include "tests/coordinator/test_util.h"

namespace concord::agent {
namespace {

using coordinator::Core;
using coordinator::Event;
using coordinator::Server;
using coordinator::testing::Channel;
using coordinator::testing::Ctx;
using coordinator::testing::JoinReq;
using coordinator::testing::kWorkerToken;
using coordinator::testing::Options;
using coordinator::testing::Secret;
using ::testing::HasSubstr;

std::string W(int i) { return "w" + std::to_string(i); }

// A coordinator on loopback and an agent on a unix socket in a temporary
// directory; "workers" are WorkerService clients of the agent.
class NodeAgentTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto started = Server::Start(Options());
    ASSERT_TRUE(started.ok()) << started.status();
    server_ = *std::move(started);
    char dir[] = "/tmp/concord-agent-test-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
    agent_ = StartAgent(absl::Seconds(2));
    ASSERT_NE(agent_, nullptr);
    stub_ = v1::WorkerService::NewStub(Channel(agent_->address()));
  }
  void TearDown() override {
    stub_.reset();
    if (agent_) agent_->Shutdown();
    agent_.reset();
    server_.reset();
    unlink((dir_ + "/agent.sock").c_str());
    rmdir(dir_.c_str());
  }

  std::unique_ptr<NodeAgent> StartAgent(absl::Duration max_delay) {
    NodeAgentOptions o;
    o.coordinator = server_->address();
    o.token = kWorkerToken;
    o.listen = "unix:" + dir_ + "/agent.sock";
    o.batch.max_delay = max_delay;
    auto agent = NodeAgent::Start(o);
    EXPECT_TRUE(agent.ok()) << agent.status();
    return agent.ok() ? *std::move(agent) : nullptr;
  }

  // Joins `n` workers of `job` through the agent at once.
  std::vector<v1::JoinResponse> JoinAll(const std::string& job, int n,
                                        v1::WorkerService::Stub* stub) {
    std::vector<v1::JoinResponse> out(n);
    std::vector<grpc::Status> status(n);
    std::vector<std::thread> threads;
    for (int i = 0; i < n; ++i) {
      threads.emplace_back([&, i] {
        v1::JoinRequest q = JoinReq(job, n, n, W(i));
        status[i] = stub->Join(Ctx(kWorkerToken).get(), q, &out[i]);
      });
    }
    for (auto& t : threads) t.join();
    for (int i = 0; i < n; ++i) {
      EXPECT_TRUE(status[i].ok()) << W(i) << ": " << status[i].error_message();
    }
    return out;
  }

  static v1::HeartbeatRequest Beat(const std::string& job,
                                   const std::string& worker,
                                   int64_t generation, int64_t step) {
    v1::HeartbeatRequest h;
    h.set_job_id(job);
    h.set_worker_id(worker);
    h.set_worker_secret(Secret(worker));
    h.set_generation(generation);
    h.set_step(step);
    return h;
  }

  // Heartbeats of workers 0..n-1 at once; their statuses.
  std::vector<grpc::Status> BeatAll(const std::string& job, int n,
                                    int64_t generation, int64_t step) {
    std::vector<grpc::Status> status(n);
    std::vector<std::thread> threads;
    for (int i = 0; i < n; ++i) {
      threads.emplace_back([&, i] {
        v1::HeartbeatResponse r;
        status[i] = stub_->Heartbeat(Ctx(kWorkerToken).get(),
                                     Beat(job, W(i), generation, step), &r);
      });
    }
    for (auto& t : threads) t.join();
    return status;
  }

  // On a raw Node stream of job "job" (3 workers), w0 and w1 join; w2
  // joins directly, not on it. Returns once both joins on the stream are
  // answered (each accepted). `checkpoint_dir`: the job's folder.
  void JoinTwoOnStreamOneDirectly(
      grpc::ClientReaderWriter<v1::NodeRequest, v1::NodeUpdate>* stream,
      const std::string& checkpoint_dir = "") {
    auto join = [&](const std::string& worker) {
      v1::JoinRequest q = JoinReq("job", 3, 3, worker);
      q.mutable_spec()->set_checkpoint_dir(checkpoint_dir);
      return q;
    };
    v1::NodeRequest first;
    first.set_job_id("job");
    for (int i = 0; i < 2; ++i) {
      v1::NodeJoin* j = first.add_joins();
      j->set_id(static_cast<uint64_t>(i + 1));
      *j->mutable_request() = join(W(i));
    }
    ASSERT_TRUE(stream->Write(first));
    auto direct = v1::WorkerService::NewStub(Channel(server_->address()));
    v1::JoinResponse w2;
    ASSERT_TRUE(direct->Join(Ctx(kWorkerToken).get(), join(W(2)), &w2).ok());
    int joined = 0;
    v1::NodeUpdate update;
    while (joined < 2 && stream->Read(&update)) {
      for (const v1::JoinResult& r : update.joins()) {
        EXPECT_EQ(r.code(), 0) << r.message();
        ++joined;
      }
    }
    ASSERT_EQ(joined, 2);
  }
  std::vector<Event> Events(const std::string& job) {
    return server_->host().Read(
        [&](const Core& core) { return core.Events(job); });
  }

  std::unique_ptr<Server> server_;
  std::string dir_;
  std::unique_ptr<NodeAgent> agent_;
  std::unique_ptr<v1::WorkerService::Stub> stub_;
};

template <typename Pred>
bool Eventually(Pred pred, absl::Duration within = absl::Seconds(10)) {
  const absl::Time end = absl::Now() + within;
  while (absl::Now() < end) {
    if (pred()) return true;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return pred();
}

TEST_F(NodeAgentTest, WorkersJoinAndHeartbeatThroughTheAgentInBatches) {
  constexpr int kWorkers = 8;
  const auto joined = JoinAll("job", kWorkers, stub_.get());
  std::vector<int> ranks;
  for (const auto& r : joined) {
    EXPECT_EQ(r.generation(), 1);
    EXPECT_EQ(r.world_size(), kWorkers);
    ranks.push_back(r.rank());
  }
  std::sort(ranks.begin(), ranks.end());
  for (int i = 0; i < kWorkers; ++i) EXPECT_EQ(ranks[i], i);
  EXPECT_EQ(agent_->counters().forwarded, kWorkers);
  EXPECT_EQ(agent_->counters().node_streams, 1);  // the joins went on it

  // The first round teaches the agent who is on the node; the next ones go
  // out as one batch each, every worker answered as the coordinator would.
  for (const grpc::Status& s : BeatAll("job", kWorkers, 1, 0)) {
    EXPECT_TRUE(s.ok()) << s.error_message();
  }
  const int64_t before = agent_->counters().heartbeat_batches;
  for (int round = 1; round <= 3; ++round) {
    for (const grpc::Status& s : BeatAll("job", kWorkers, 1, round)) {
      EXPECT_TRUE(s.ok()) << s.error_message();
    }
  }
  const NodeAgent::Counters c = agent_->counters();
  EXPECT_EQ(c.heartbeats, 4 * kWorkers);
  // 3 rounds; a round split by the 2 s limit on a loaded machine is two.
  EXPECT_GE(c.heartbeat_batches - before, 3);
  EXPECT_LE(c.heartbeat_batches - before, 6);
  // The coordinator saw the progress of each.
  auto steps = server_->host().Read([](const Core& core) {
    v1::GetJobRequest q;
    q.set_job_id("job");
    return core.GetJob(q);
  });
  ASSERT_TRUE(steps.ok()) << steps.status();
  for (const v1::MemberStatus& m : steps->members()) {
    EXPECT_EQ(m.committed_step(), 3) << m.worker_id();
  }

  // The rendezvous store, passed on as bytes (see Note [Passing calls on] in
  // agent/node_agent_impl.h): a
  // value set through the agent is read back through it.
  const int64_t forwarded = agent_->counters().forwarded;
  v1::KvSetRequest set;
  set.set_job_id("job");
  set.set_generation(1);
  set.set_key("address/0");
  set.set_value("10.0.0.1:1234");
  set.set_worker_id(W(0));
  set.set_worker_secret(Secret(W(0)));
  v1::KvSetResponse set_response;
  const grpc::Status set_status =
      stub_->KvSet(Ctx(kWorkerToken).get(), set, &set_response);
  ASSERT_TRUE(set_status.ok()) << set_status.error_message();
  v1::KvGetRequest get;
  get.set_job_id("job");
  get.set_generation(1);
  get.add_keys("address/0");
  get.set_wait_timeout_ms(5000);
  get.set_worker_id(W(1));
  get.set_worker_secret(Secret(W(1)));
  v1::KvGetResponse got;
  const grpc::Status get_status =
      stub_->KvGet(Ctx(kWorkerToken).get(), get, &got);
  ASSERT_TRUE(get_status.ok()) << get_status.error_message();
  ASSERT_EQ(got.values_size(), 1);
  EXPECT_EQ(got.values(0), "10.0.0.1:1234");
  EXPECT_EQ(agent_->counters().forwarded, forwarded + 2);

  // Each heartbeat keeps its own answer: a stale generation and a forged
  // secret are refused for that worker alone.
  std::vector<grpc::Status> mixed(3);
  std::thread stale([&] {
    v1::HeartbeatResponse r;
    mixed[0] =
        stub_->Heartbeat(Ctx(kWorkerToken).get(), Beat("job", W(0), 7, 3), &r);
  });
  std::thread forged([&] {
    v1::HeartbeatRequest h = Beat("job", W(1), 1, 3);
    h.set_worker_secret(Secret("intruder"));
    v1::HeartbeatResponse r;
    mixed[1] = stub_->Heartbeat(Ctx(kWorkerToken).get(), h, &r);
  });
  std::thread fine([&] {
    v1::HeartbeatResponse r;
    mixed[2] =
        stub_->Heartbeat(Ctx(kWorkerToken).get(), Beat("job", W(2), 1, 3), &r);
  });
  stale.join();
  forged.join();
  fine.join();
  EXPECT_EQ(mixed[0].error_code(), grpc::StatusCode::ABORTED)
      << mixed[0].error_message();
  EXPECT_EQ(mixed[1].error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(mixed[1].error_message(), HasSubstr("bound to another"));
  EXPECT_TRUE(mixed[2].ok()) << mixed[2].error_message();
}

TEST_F(NodeAgentTest, RefusesCallersWithoutTheWorkerTokenOrAJob) {
  v1::HeartbeatResponse r;
  const grpc::Status none =
      stub_->Heartbeat(Ctx("").get(), Beat("job", "w0", 1, 0), &r);
  EXPECT_EQ(none.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  v1::JoinResponse j;
  const grpc::Status wrong = stub_->Join(
      Ctx("not-the-worker-token-at-all").get(), JoinReq("job", 1, 1, "w0"), &j);
  EXPECT_EQ(wrong.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  // The same for a method passed on as bytes (see Note [Passing calls on] in
  // agent/node_agent_impl.h).
  v1::KvSetRequest set;
  set.set_job_id("job");
  v1::KvSetResponse set_response;
  const grpc::Status bytes = stub_->KvSet(
      Ctx("not-the-worker-token-at-all").get(), set, &set_response);
  EXPECT_EQ(bytes.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  // A call that names no job has no node stream to go on.
  const grpc::Status nameless =
      stub_->Heartbeat(Ctx(kWorkerToken).get(), Beat("", "w0", 1, 0), &r);
  EXPECT_EQ(nameless.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(agent_->counters().node_streams, 0);
  EXPECT_TRUE(Events("job").empty());  // nothing reached the coordinator
}

TEST_F(NodeAgentTest, ANodesWatchesShareOneStream) {
  constexpr int kWorkers = 4;
  JoinAll("job", kWorkers, stub_.get());
  struct Watch {
    std::unique_ptr<grpc::ClientContext> context;
    std::unique_ptr<grpc::ClientReader<v1::MembershipUpdate>> reader;
  };
  std::vector<Watch> watches;
  for (int i = 0; i < kWorkers; ++i) {
    v1::WatchMembershipRequest q;
    q.set_job_id("job");
    q.set_worker_id(W(i));
    q.set_worker_secret(Secret(W(i)));
    Watch w{Ctx(kWorkerToken), nullptr};
    w.reader = stub_->WatchMembership(w.context.get(), q);
    watches.push_back(std::move(w));
  }
  std::vector<int> ranks;
  for (auto& w : watches) {
    v1::MembershipUpdate u;
    ASSERT_TRUE(w.reader->Read(&u));
    EXPECT_TRUE(u.is_member());
    EXPECT_EQ(u.generation(), 1);
    EXPECT_EQ(u.world_size(), kWorkers);
    ranks.push_back(u.rank());
  }
  std::sort(ranks.begin(), ranks.end());
  EXPECT_EQ(ranks, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(agent_->counters().node_streams, 1);

  // w3 fails: every other watcher sees generation 1 end and waits.
  v1::LeaveRequest leave;
  leave.set_job_id("job");
  leave.set_worker_id(W(3));
  leave.set_worker_secret(Secret(W(3)));
  leave.set_generation(1);
  leave.set_reason(v1::LEAVE_REASON_ERROR);
  v1::LeaveResponse left;
  ASSERT_TRUE(stub_->Leave(Ctx(kWorkerToken).get(), leave, &left).ok());
  for (int i = 0; i < 3; ++i) {
    v1::MembershipUpdate u;
    ASSERT_TRUE(watches[i].reader->Read(&u));
    EXPECT_FALSE(u.is_member()) << W(i);
  }
  // A watcher that goes away is removed from the node stream; the others
  // keep theirs.
  watches[0].context->TryCancel();
  EXPECT_EQ(watches[0].reader->Finish().error_code(),
            grpc::StatusCode::CANCELLED);
  EXPECT_EQ(agent_->counters().node_streams, 1);
  // A terminal state ends each remaining watch with its last view.
  v1::StopJobRequest stop;
  stop.set_job_id("job");
  stop.set_reason("test over");
  ASSERT_TRUE(server_->host()
                  .Mutate([&](Core& core) { return core.StopJob(stop); })
                  .ok());
  for (int i = 1; i < kWorkers; ++i) {
    v1::MembershipUpdate u;
    while (watches[i].reader->Read(&u)) {
    }
    EXPECT_EQ(u.state(), v1::JOB_STATE_STOPPED) << W(i);
    const grpc::Status end = watches[i].reader->Finish();
    EXPECT_TRUE(end.ok()) << W(i) << ": " << end.error_message();
  }
}

// An agent that dies takes its workers' watches with it: as expected
// survivors they are dropped at once, not after the heartbeat timeout.
TEST_F(NodeAgentTest, AnAgentThatDiesDropsItsWorkersAtOnce) {
  constexpr int kJob = 3;
  // w0 and w1 through the agent, w2 on its own; heartbeats would take a
  // minute to notice anything.
  v1::JobSpec spec;
  std::vector<v1::JoinResponse> out(kJob);
  std::vector<std::thread> threads;
  auto direct = v1::WorkerService::NewStub(Channel(server_->address()));
  for (int i = 0; i < kJob; ++i) {
    threads.emplace_back([&, i] {
      v1::JoinRequest q = JoinReq("job", 1, kJob, W(i));
      q.mutable_spec()->set_heartbeat_timeout_ms(60000);
      auto* stub = i < 2 ? stub_.get() : direct.get();
      ASSERT_TRUE(stub->Join(Ctx(kWorkerToken).get(), q, &out[i]).ok());
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_EQ(out[2].world_size(), kJob);
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<grpc::ClientReader<v1::MembershipUpdate>>>
      readers;
  for (int i = 0; i < 2; ++i) {
    v1::WatchMembershipRequest q;
    q.set_job_id("job");
    q.set_worker_id(W(i));
    q.set_worker_secret(Secret(W(i)));
    contexts.push_back(Ctx(kWorkerToken));
    readers.push_back(stub_->WatchMembership(contexts.back().get(), q));
    v1::MembershipUpdate u;
    ASSERT_TRUE(readers.back()->Read(&u));
  }
  // w2's communicator failed: it asks for the next generation, in which w0
  // and w1 are expected back. Their agent dies instead.
  const absl::Time start = absl::Now();
  v1::JoinResponse next;
  grpc::Status rejoined;
  std::thread w2([&] {
    v1::JoinRequest q = JoinReq("job", 1, kJob, W(2));
    q.mutable_spec()->set_heartbeat_timeout_ms(60000);
    q.set_previous_generation(1);
    q.set_reform_reason("peer lost");
    rejoined = direct->Join(Ctx(kWorkerToken).get(), q, &next);
  });
  ASSERT_TRUE(Eventually([&] {
    for (const Event& e : Events("job")) {
      if (absl::StrContains(e.message, "peer lost")) return true;
    }
    return false;
  }));
  agent_->Shutdown();
  w2.join();
  ASSERT_TRUE(rejoined.ok()) << rejoined.error_message();
  EXPECT_EQ(next.generation(), 2);
  EXPECT_EQ(next.world_size(), 1);
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
  int broke = 0;
  for (const Event& e : Events("job")) {
    if (e.kind == "failure" && absl::StrContains(e.message, "connection"))
      ++broke;
  }
  EXPECT_EQ(broke, 2);
  for (auto& r : readers) {
    v1::MembershipUpdate u;
    while (r->Read(&u)) {
    }
    EXPECT_FALSE(r->Finish().ok());
  }
}

// A worker whose Join is cancelled at the agent (its process died) is
// withdrawn at the coordinator, as without the agent.
TEST_F(NodeAgentTest, ACancelledJoinThroughTheAgentWithdrawsTheWorker) {
  grpc::ClientContext context;
  AddBearerToken(context, kWorkerToken);
  v1::JoinResponse r;
  grpc::Status status;
  std::thread waiting(
      [&] { status = stub_->Join(&context, JoinReq("job", 2, 2, "w0"), &r); });
  // Registered at the coordinator, waiting for a second worker.
  ASSERT_TRUE(Eventually([&] {
    for (const Event& e : Events("job")) {
      if (e.kind == "join" && e.worker_id == "w0") return true;
    }
    return false;
  }));
  context.TryCancel();
  waiting.join();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(Eventually([&] {
    for (const Event& e : Events("job")) {
      if (e.kind == "leave" && absl::StrContains(e.message, "cancelled"))
        return true;
    }
    return false;
  }));
}

v1::LeaveRequest LeaveReq(const std::string& job, const std::string& worker,
                          int64_t generation, v1::LeaveReason reason) {
  v1::LeaveRequest leave;
  leave.set_job_id(job);
  leave.set_worker_id(worker);
  leave.set_worker_secret(Secret(worker));
  leave.set_generation(generation);
  leave.set_reason(reason);
  return leave;
}

// See Note [Exited workers]: the launcher reports a worker's exit through its
// agent and the job re-forms without it at once, not after the heartbeat
// timeout (a minute here).
TEST_F(NodeAgentTest, AWorkerThatExitedIsTakenOutAtOnce) {
  constexpr int kWorkers = 3;
  std::vector<v1::JoinResponse> out(kWorkers);
  std::vector<std::thread> threads;
  for (int i = 0; i < kWorkers; ++i) {
    threads.emplace_back([&, i] {
      v1::JoinRequest q = JoinReq("job", 1, kWorkers, W(i));
      q.mutable_spec()->set_heartbeat_timeout_ms(60000);
      ASSERT_TRUE(stub_->Join(Ctx(kWorkerToken).get(), q, &out[i]).ok());
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_EQ(out[0].world_size(), kWorkers);
  // A worker that never joined through the agent has nothing to report.
  EXPECT_FALSE(agent_->WorkerExited("w9", "exit status 1"));
  const absl::Time start = absl::Now();
  EXPECT_TRUE(agent_->WorkerExited(W(2), "killed by signal 9 (SIGKILL)"));
  EXPECT_TRUE(agent_->AwaitExitReports(absl::Seconds(10)));
  EXPECT_EQ(agent_->counters().exits, 1);
  // Its answer told the agent where the job stands.
  EXPECT_EQ(agent_->job_news("job").state, v1::JOB_STATE_RENDEZVOUS);
  bool failed = false;
  for (const Event& e : Events("job")) {
    failed = failed || (e.kind == "failure" && e.worker_id == W(2) &&
                        e.message ==
                            "its process exited (killed by signal 9 (SIGKILL); "
                            "reported by its node agent)");
  }
  EXPECT_TRUE(failed);
  // The survivors join again and the next generation forms with them.
  threads.clear();
  std::vector<v1::JoinResponse> next(2);
  for (int i = 0; i < 2; ++i) {
    threads.emplace_back([&, i] {
      v1::JoinRequest q = JoinReq("job", 1, kWorkers, W(i));
      q.mutable_spec()->set_heartbeat_timeout_ms(60000);
      q.set_previous_generation(1);
      ASSERT_TRUE(stub_->Join(Ctx(kWorkerToken).get(), q, &next[i]).ok());
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(next[0].generation(), 2);
  EXPECT_EQ(next[0].world_size(), 2);
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
  // Reported once: the agent forgot the worker.
  EXPECT_FALSE(agent_->WorkerExited(W(2), "killed by signal 9 (SIGKILL)"));
}

// The coordinator's side of the report: only a worker the stream carried,
// with its own secret; anything else is refused alone and changes nothing.
TEST_F(NodeAgentTest, ExitReportsOfForeignOrMalformedWorkersAreRefused) {
  auto stub = v1::AgentService::NewStub(Channel(server_->address()));
  auto context = Ctx(kWorkerToken);
  auto stream = stub->Node(context.get());
  JoinTwoOnStreamOneDirectly(stream.get());
  if (HasFatalFailure()) return;
  v1::NodeUpdate update;
  const size_t events = Events("job").size();

  struct Case {
    std::string worker, secret;
    grpc::StatusCode code;
    std::string says;
  };
  const std::vector<Case> cases = {
      {W(2), Secret(W(2)), grpc::StatusCode::PERMISSION_DENIED,
       "has no calls on this node stream"},
      {"w7", Secret("w7"), grpc::StatusCode::PERMISSION_DENIED,
       "has no calls on this node stream"},
      {"", Secret("w7"), grpc::StatusCode::INVALID_ARGUMENT, "worker_id"},
      {"bad id!", Secret("w7"), grpc::StatusCode::INVALID_ARGUMENT,
       "worker_id"},
      {W(1), Secret(W(0)), grpc::StatusCode::PERMISSION_DENIED,
       "bound to another"},
      {W(0), "short", grpc::StatusCode::INVALID_ARGUMENT, "worker_secret"},
  };
  v1::NodeRequest bad;
  for (size_t i = 0; i < cases.size(); ++i) {
    v1::ExitedWorker* e = bad.add_exited();
    e->set_id(100 + i);
    e->set_worker_id(cases[i].worker);
    e->set_worker_secret(cases[i].secret);
    e->set_how("exit status 1");
  }
  ASSERT_TRUE(stream->Write(bad));
  std::map<uint64_t, v1::ExitResult> results;
  while (results.size() < cases.size() && stream->Read(&update)) {
    for (const v1::ExitResult& r : update.exited()) results[r.id()] = r;
  }
  ASSERT_EQ(results.size(), cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    const v1::ExitResult& r = results[100 + i];
    EXPECT_EQ(r.code(), static_cast<int>(cases[i].code)) << i << r.message();
    EXPECT_THAT(r.message(), HasSubstr(cases[i].says)) << i;
    EXPECT_EQ(r.state(), v1::JOB_STATE_RUNNING) << i;
  }
  // Nothing changed, and the stream goes on: w1's own report is taken.
  EXPECT_EQ(Events("job").size(), events);
  EXPECT_EQ(server_->host().Read(
                [](const Core& core) { return core.CurrentGeneration("job"); }),
            1);
  v1::NodeRequest good;
  v1::ExitedWorker* e = good.add_exited();
  e->set_id(200);
  e->set_worker_id(W(1));
  e->set_worker_secret(Secret(W(1)));
  e->set_how("exit status 1");
  ASSERT_TRUE(stream->Write(good));
  bool answered = false;
  while (!answered && stream->Read(&update)) {
    for (const v1::ExitResult& r : update.exited()) {
      ASSERT_EQ(r.id(), 200u);
      EXPECT_EQ(r.code(), 0) << r.message();
      EXPECT_EQ(r.state(), v1::JOB_STATE_RENDEZVOUS);
      answered = true;
    }
  }
  EXPECT_TRUE(answered);
  context->TryCancel();
  (void)stream->Finish();
}

// See Note [One job's checkpoints] in coordinator/core/core.h: a Node
// stream's checkpoint reports are taken only with the credential of a worker
// whose calls it carried, for its one node, at the job's own path; a stream
// that carried nobody, or another job's, changes nothing. Reports have no
// answer: each refusal is followed by a good report, and only the good ones
// are in the job's record.
TEST_F(NodeAgentTest, CheckpointReportsNeedACarriedWorkerItsNodeAndItsFolder) {
  auto stub = v1::AgentService::NewStub(Channel(server_->address()));
  auto context = Ctx(kWorkerToken);
  auto stream = stub->Node(context.get());
  JoinTwoOnStreamOneDirectly(stream.get(), "/ckpt");
  if (HasFatalFailure()) return;

  auto report = [](const std::string& worker, const std::string& secret,
                   int64_t step, const std::string& node,
                   const std::string& path) {
    v1::NodeCheckpoint c;
    c.set_worker_id(worker);
    c.set_worker_secret(secret);
    c.mutable_report()->set_step(step);
    c.mutable_report()->set_node(node);
    c.mutable_report()->set_path(path);
    c.mutable_report()->set_bytes(100);
    return c;
  };
  auto steps = [&] {
    return server_->host().Read([](const Core& core) {
      v1::GetJobRequest get;
      get.set_job_id("job");
      std::vector<int64_t> out;
      auto status = core.GetJob(get);
      if (status.ok()) {
        for (const auto& c : status->checkpoints()) out.push_back(c.step());
      }
      return out;
    });
  };
  // Sends `bad` then a good report of step `good` on `s`; waits for the good
  // one, which came after.
  auto refused_then =
      [&](grpc::ClientReaderWriter<v1::NodeRequest, v1::NodeUpdate>* s,
          v1::NodeRequest bad, int64_t good) {
        *bad.add_reports() = report(W(0), Secret(W(0)), good, "node-a",
                                    absl::StrCat("/ckpt/job/step-", good));
        ASSERT_TRUE(s->Write(bad));
        ASSERT_TRUE(Eventually([&] {
          const auto kept = steps();
          return !kept.empty() && kept.back() == good;
        }));
      };
  v1::NodeRequest bad;
  // w2's calls came directly; w7 never joined; w1 with w0's secret.
  *bad.add_reports() =
      report(W(2), Secret(W(2)), 50, "node-a", "/ckpt/job/step-50");
  *bad.add_reports() =
      report("w7", Secret("w7"), 50, "node-a", "/ckpt/job/step-50");
  *bad.add_reports() =
      report(W(1), Secret(W(0)), 50, "node-a", "/ckpt/job/step-50");
  // Outside the job's folder, or not its step's path there.
  for (const char* path :
       {"/etc/job/step-50", "/ckpt/other/step-50", "/ckpt/job/../other/step-50",
        "/ckpt/job/step-49", "/ckpt/job/step-50/"}) {
    *bad.add_reports() = report(W(1), Secret(W(1)), 50, "node-a", path);
  }
  // A report without a credential (an older agent's).
  bad.add_checkpoints()->CopyFrom(
      report(W(0), Secret(W(0)), 50, "node-a", "/ckpt/job/step-50").report());
  refused_then(stream.get(), bad, 10);
  EXPECT_THAT(steps(), ::testing::ElementsAre(10));
  // One stream, one node: its first report named node-a.
  v1::NodeRequest other_node;
  *other_node.add_reports() =
      report(W(1), Secret(W(1)), 60, "node-b", "/ckpt/job/step-60");
  refused_then(stream.get(), other_node, 20);
  EXPECT_THAT(steps(), ::testing::ElementsAre(10, 20));

  // A stream that carried no worker of the job, and one of another job that
  // names this job's worker, change nothing.
  for (const char* job : {"job", "other"}) {
    auto c = Ctx(kWorkerToken);
    auto s = stub->Node(c.get());
    v1::NodeRequest foreign;
    foreign.set_job_id(job);
    *foreign.add_reports() =
        report(W(0), Secret(W(0)), 90, "node-x", "/ckpt/job/step-90");
    ASSERT_TRUE(s->Write(foreign));
    ASSERT_TRUE(s->WritesDone());
    (void)s->Finish();
  }
  refused_then(stream.get(), v1::NodeRequest(), 30);
  EXPECT_THAT(steps(), ::testing::ElementsAre(10, 20, 30));
  context->TryCancel();
  (void)stream->Finish();
}

// What concord-run decides its exit status from (see Note [Exit status] in
// tools/launcher.h): the coordinator's answers to the workers' calls.
TEST_F(NodeAgentTest, TheAgentHearsWhetherTheJobCompleted) {
  JoinAll("job", 2, stub_.get());
  EXPECT_EQ(agent_->job_news("job").state, v1::JOB_STATE_UNSPECIFIED);
  for (const grpc::Status& s : BeatAll("job", 2, 1, 5)) {
    EXPECT_TRUE(s.ok()) << s.error_message();
  }
  EXPECT_EQ(agent_->job_news("job").state, v1::JOB_STATE_RUNNING);
  EXPECT_FALSE(agent_->job_news("job").completed);
  v1::LeaveResponse left;
  ASSERT_TRUE(stub_
                  ->Leave(Ctx(kWorkerToken).get(),
                          LeaveReq("job", W(0), 1, v1::LEAVE_REASON_COMPLETED),
                          &left)
                  .ok());
  // w0's training finished with the rest of the job's: completed, although
  // the job has not succeeded yet (w1 has not left).
  EXPECT_TRUE(agent_->job_news("job").completed);
  EXPECT_EQ(agent_->job_news("job").state, v1::JOB_STATE_RUNNING);
  ASSERT_TRUE(agent_->WorkerExited(W(0), "exit status 0"));
  ASSERT_TRUE(stub_
                  ->Leave(Ctx(kWorkerToken).get(),
                          LeaveReq("job", W(1), 1, v1::LEAVE_REASON_COMPLETED),
                          &left)
                  .ok());
  EXPECT_EQ(agent_->job_news("job").state, v1::JOB_STATE_SUCCEEDED);
  EXPECT_TRUE(agent_->AwaitExitReports(absl::Seconds(10)));
  // A late answer cannot take a terminal state back.
  EXPECT_EQ(agent_->job_news("job").state, v1::JOB_STATE_SUCCEEDED);
  // Another job's news are its own.
  EXPECT_EQ(agent_->job_news("other").state, v1::JOB_STATE_UNSPECIFIED);
}

// See Note [What the agent sees] in agent/process_view.h: a real process of
// the node, whose pid its heartbeats carry; stopped, it sends nothing, and
// the agent goes on reporting it, stopped.
TEST_F(NodeAgentTest, TheAgentShowsAStoppedWorkersProcess) {
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    for (;;) pause();
  }
  std::vector<v1::JoinResponse> out(2);
  std::vector<std::thread> threads;
  for (int i = 0; i < 2; ++i) {
    threads.emplace_back([&, i] {
      v1::JoinRequest q = JoinReq("job", 2, 2, W(i));
      q.mutable_spec()->set_heartbeat_timeout_ms(60000);
      q.mutable_spec()->set_hang_timeout_ms(-1);
      EXPECT_TRUE(stub_->Join(Ctx(kWorkerToken).get(), q, &out[i]).ok());
    });
  }
  for (auto& t : threads) t.join();
  const int64_t gen = out[0].generation();
  auto beat = [&](int i, pid_t pid) {
    v1::HeartbeatRequest h = Beat("job", W(i), gen, 3);
    h.mutable_progress()->set_generation(gen);
    h.mutable_progress()->set_pid(pid);
    v1::HeartbeatResponse r;
    return stub_->Heartbeat(Ctx(kWorkerToken).get(), h, &r);
  };
  auto member = [&](int i) {
    return server_->host().Read([&](const Core& core) {
      v1::GetJobRequest q;
      q.set_job_id("job");
      auto status = core.GetJob(q);
      if (status.ok()) {
        for (const v1::MemberStatus& m : status->members()) {
          if (m.worker_id() == W(i)) return m;
        }
      }
      return v1::MemberStatus();
    });
  };
  std::thread w0([&] {
    for (int k = 0; k < 6; ++k) EXPECT_TRUE(beat(0, getpid()).ok());
  });
  ASSERT_TRUE(beat(1, child).ok());
  EXPECT_EQ(member(1).process().state(), "sleeping");
  EXPECT_FALSE(member(1).process().has_gpu_percent());  // no NVML here
  EXPECT_TRUE(Eventually([&] { return member(0).has_process(); }));
  ASSERT_EQ(kill(child, SIGSTOP), 0);
  // Its heartbeats stop with it (as a stopped worker's do): the agent reports
  // what it sees once they are late.
  EXPECT_TRUE(Eventually([&] { return member(1).health() == "stopped"; }));
  EXPECT_EQ(member(1).process().state(), "stopped");
  EXPECT_LT(member(1).process_age_ms(), 3000);
  w0.join();
  // Continued, it heartbeats again, and is seen as it is.
  ASSERT_EQ(kill(child, SIGCONT), 0);
  ASSERT_TRUE(beat(1, child).ok());
  EXPECT_EQ(member(1).process().state(), "sleeping");
  EXPECT_EQ(member(1).health(), "");
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
}

// The agent handles four WorkerService methods itself and passes every other
// one on as bytes (see Note [Passing calls on] in agent/node_agent_impl.h): a
// method it did not serve would answer UNIMPLEMENTED only under the
// launcher. Every
// method of the service's descriptor, called through the agent and on the
// coordinator with a request for a job that does not exist, must be served
// by both (not UNIMPLEMENTED) with the same answer; a method the service
// does not have is UNIMPLEMENTED through the agent, so the check can fail.
// A unary call by its path, with `bytes` as the request.
grpc::Status UnaryByPath(grpc::GenericStub& stub, const std::string& path,
                         const std::string& bytes) {
  std::unique_ptr<grpc::ClientContext> ctx = Ctx(kWorkerToken);
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  grpc::Slice slice(bytes);
  grpc::ByteBuffer in(&slice, 1), out;
  std::mutex mu;
  std::condition_variable cv;
  std::optional<grpc::Status> done;
  stub.UnaryCall(ctx.get(), path, grpc::StubOptions(), &in, &out,
                 [&](grpc::Status s) {
                   std::lock_guard<std::mutex> lock(mu);
                   done = s;
                   cv.notify_all();
                 });
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return done.has_value(); });
  return *done;
}

grpc::Status CallByName(grpc::GenericStub& stub,
                        const google::protobuf::MethodDescriptor& method,
                        const google::protobuf::Message& request) {
  const std::string path =
      absl::StrCat("/", method.service()->full_name(), "/", method.name());
  std::unique_ptr<grpc::ClientContext> ctx = Ctx(kWorkerToken);
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  grpc::Slice slice(request.SerializeAsString());
  grpc::ByteBuffer in(&slice, 1), out;
  if (method.server_streaming()) {
    // A server stream: its first message or its end is the answer.
    grpc::CompletionQueue cq;
    auto call = stub.PrepareCall(ctx.get(), path, &cq);
    void* tag = nullptr;
    bool ok = false;
    call->StartCall(reinterpret_cast<void*>(1));
    cq.Next(&tag, &ok);
    call->Write(in, reinterpret_cast<void*>(2));
    cq.Next(&tag, &ok);
    call->WritesDone(reinterpret_cast<void*>(3));
    cq.Next(&tag, &ok);
    call->Read(&out, reinterpret_cast<void*>(4));
    cq.Next(&tag, &ok);
    if (ok) ctx->TryCancel();  // it answered with a message: served
    grpc::Status status;
    call->Finish(&status, reinterpret_cast<void*>(5));
    cq.Next(&tag, &ok);
    cq.Shutdown();
    while (cq.Next(&tag, &ok)) {
    }
    return ok && status.error_code() == grpc::StatusCode::CANCELLED
               ? grpc::Status::OK
               : status;
  }
  return UnaryByPath(stub, path, request.SerializeAsString());
}

TEST_F(NodeAgentTest, TheAgentServesEveryWorkerServiceMethod) {
  const google::protobuf::ServiceDescriptor* service =
      google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(
          "concord.v1.WorkerService");
  ASSERT_NE(service, nullptr);
  grpc::GenericStub through_agent(Channel(agent_->address()));
  grpc::GenericStub direct(Channel(server_->address()));
  ASSERT_GT(service->method_count(), 0);
  for (int i = 0; i < service->method_count(); ++i) {
    const google::protobuf::MethodDescriptor& m = *service->method(i);
    std::unique_ptr<google::protobuf::Message> request(
        google::protobuf::MessageFactory::generated_factory()
            ->GetPrototype(m.input_type())
            ->New());
    const google::protobuf::Reflection* r = request->GetReflection();
    for (const auto& [field, value] :
         {std::pair<const char*, std::string>{"job_id", "not-a-job"},
          {"worker_id", "w0"},
          {"worker_secret", Secret("w0")}}) {
      if (const auto* f = m.input_type()->FindFieldByName(field)) {
        r->SetString(request.get(), f, value);
      }
    }
    if (const auto* f = m.input_type()->FindFieldByName("spec")) {
      // A Join: a job spec that is refused (max below min), creating nothing.
      auto* spec =
          static_cast<v1::JobSpec*>(r->MutableMessage(request.get(), f));
      spec->set_job_id("not-a-job");
      spec->set_min_workers(2);
      spec->set_max_workers(1);
    }
    const grpc::Status agent = CallByName(through_agent, m, *request);
    const grpc::Status coordinator = CallByName(direct, m, *request);
    EXPECT_NE(coordinator.error_code(), grpc::StatusCode::UNIMPLEMENTED)
        << m.full_name() << ": " << coordinator.error_message();
    EXPECT_NE(agent.error_code(), grpc::StatusCode::UNIMPLEMENTED)
        << m.full_name()
        << " is not forwarded by the agent: " << agent.error_message();
    // Forwarded: the coordinator's own answer (here its refusal: a bad
    // field or the unknown job), code and words.
    EXPECT_EQ(agent.error_code(), coordinator.error_code()) << m.full_name();
    EXPECT_EQ(agent.error_message(), coordinator.error_message())
        << m.full_name();
  }
  // The controls: a method WorkerService does not have, and another
  // service's method, which the agent must not pass on with its token.
  for (const char* path : {"/concord.v1.WorkerService/NoSuchMethod",
                           "/concord.v1.OperatorService/ListJobs"}) {
    EXPECT_EQ(UnaryByPath(through_agent, path, "").error_code(),
              grpc::StatusCode::UNIMPLEMENTED)
        << path;
  }
  EXPECT_TRUE(Events("not-a-job").empty());  // no job was made
}

TEST(NodeAgentStartTest, BadOptions) {
  NodeAgentOptions o;
  o.token = kWorkerToken;
  o.listen = "unix:/tmp/unused.sock";
  EXPECT_EQ(NodeAgent::Start(o).status().code(),
            absl::StatusCode::kInvalidArgument);
  o.coordinator = "127.0.0.1:1";
  o.token = "short";
  EXPECT_EQ(NodeAgent::Start(o).status().code(),
            absl::StatusCode::kInvalidArgument);
  o.token = kWorkerToken;
  o.listen = "unix:/no/such/directory/agent.sock";
  EXPECT_EQ(NodeAgent::Start(o).status().code(),
            absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace concord::agent
