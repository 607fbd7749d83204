// A real coordinator server on a free loopback port, called through real gRPC
// stubs from several threads.

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/auth.h"
#include "common/clock.h"
#include "common/grpc_auth.h"
#include "concord/v1/worker.grpc.pb.h"
#include "coordinator/rpc/service.h"
#include "coordinator/server.h"

namespace concord::coordinator {
namespace {

using ::testing::HasSubstr;

// Every call is bounded so that a bug shows as a failure, not a hang.
constexpr auto kCallDeadline = std::chrono::seconds(20);
constexpr char kWorkerToken[] = "worker-token-0123456789";
constexpr char kOperatorToken[] = "operator-token-0123456789";

ServerOptions Options() {
  ServerOptions options;
  options.worker_token = kWorkerToken;
  options.operator_token = kOperatorToken;
  return options;
}

std::string Secret(const std::string& worker) {
  return absl::StrCat(worker, "-secret-0123456789");
}

v1::JoinRequest JoinReq(const std::string& job, int max_workers,
                        const std::string& worker, int64_t wait_ms = 10000) {
  v1::JoinRequest r;
  r.mutable_spec()->set_job_id(job);
  r.mutable_spec()->set_min_workers(1);
  r.mutable_spec()->set_max_workers(max_workers);
  r.set_worker_id(worker);
  r.set_worker_secret(Secret(worker));
  r.set_host("127.0.0.1");
  r.set_wait_timeout_ms(wait_ms);
  r.set_include_members(true);
  return r;
}

class CoordinatorServiceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { spdlog::set_level(spdlog::level::warn); }

  void SetUp() override {
    auto server = Server::Start(Options());
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    ASSERT_GT(server_->port(), 0);
    EXPECT_EQ(server_->address(), absl::StrCat("127.0.0.1:", server_->port()));
  }

  // A fresh channel per stub, as separate worker processes would have.
  std::unique_ptr<v1::WorkerService::Stub> NewStub() {
    return v1::WorkerService::NewStub(grpc::CreateChannel(
        server_->address(), grpc::InsecureChannelCredentials()));
  }

  static void Bound(grpc::ClientContext& context) {
    context.set_deadline(std::chrono::system_clock::now() + kCallDeadline);
    AddBearerToken(context, kWorkerToken);
  }

  grpc::Status Join(const v1::JoinRequest& request,
                    v1::JoinResponse* response) {
    grpc::ClientContext context;
    Bound(context);
    return NewStub()->Join(&context, request, response);
  }

  std::unique_ptr<Server> server_;
};

TEST_F(CoordinatorServiceTest, ConcurrentJoinsFormOneGeneration) {
  constexpr int kWorkers = 4;
  std::vector<grpc::Status> statuses(kWorkers);
  std::vector<v1::JoinResponse> responses(kWorkers);
  std::vector<std::thread> threads;
  for (int i = 0; i < kWorkers; ++i) {
    threads.emplace_back([&, i] {
      statuses[i] =
          Join(JoinReq("job", kWorkers, absl::StrCat("w", i)), &responses[i]);
    });
  }
  for (auto& t : threads) t.join();

  std::set<int> ranks;
  for (int i = 0; i < kWorkers; ++i) {
    ASSERT_TRUE(statuses[i].ok()) << statuses[i].error_message();
    EXPECT_EQ(responses[i].generation(), 1);
    EXPECT_EQ(responses[i].world_size(), kWorkers);
    EXPECT_EQ(responses[i].heartbeat_interval_ms(), 1000);
    ASSERT_EQ(responses[i].members_size(), kWorkers);
    EXPECT_EQ(responses[i].members(responses[i].rank()).worker_id(),
              absl::StrCat("w", i));
    EXPECT_EQ(responses[i].members(2).worker_id(),
              responses[0].members(2).worker_id());
    ranks.insert(responses[i].rank());
  }
  EXPECT_EQ(ranks, (std::set<int>{0, 1, 2, 3}));
  EXPECT_EQ(
      server_->host().Read([](const Core& core) { return core.State("job"); }),
      v1::JOB_STATE_RUNNING);

  // The generation is live over the wire too.
  v1::HeartbeatRequest hb;
  hb.set_job_id("job");
  hb.set_worker_id("w0");
  hb.set_worker_secret(Secret("w0"));
  hb.set_generation(1);
  v1::HeartbeatResponse hb_response;
  grpc::ClientContext ok_context;
  Bound(ok_context);
  ASSERT_TRUE(NewStub()->Heartbeat(&ok_context, hb, &hb_response).ok());
  EXPECT_EQ(hb_response.current_generation(), 1);
  hb.set_generation(0);
  grpc::ClientContext stale_context;
  Bound(stale_context);
  EXPECT_EQ(NewStub()->Heartbeat(&stale_context, hb, &hb_response).error_code(),
            grpc::StatusCode::ABORTED);
}

// Re-forming over the wire (see Note [Re-forming]): a watcher sees a waiting
// worker, and the member's re-form request lets it in at once.
TEST_F(CoordinatorServiceTest, WatchersSeeWaitingWorkersAndAReformAdmitsThem) {
  auto join_req = [](const std::string& worker) {
    v1::JoinRequest r = JoinReq("elastic", 2, worker);
    r.mutable_spec()->set_settle_ms(100);
    return r;
  };
  v1::JoinResponse first;
  ASSERT_TRUE(Join(join_req("w0"), &first).ok());
  ASSERT_EQ(first.generation(), 1);
  ASSERT_EQ(first.world_size(), 1);

  grpc::ClientContext watch_context;
  Bound(watch_context);
  v1::WatchMembershipRequest watch;
  watch.set_job_id("elastic");
  watch.set_worker_id("w0");
  watch.set_worker_secret(Secret("w0"));
  auto watch_stub = NewStub();
  auto reader = watch_stub->WatchMembership(&watch_context, watch);
  // Reads updates until one satisfies `done`.
  auto read_until = [&](auto done) {
    v1::MembershipUpdate update;
    while (reader->Read(&update)) {
      if (done(update)) return update;
    }
    ADD_FAILURE() << "the membership stream ended";
    return update;
  };
  v1::MembershipUpdate update =
      read_until([](const v1::MembershipUpdate&) { return true; });
  EXPECT_EQ(update.generation(), 1);
  EXPECT_TRUE(update.is_member());
  EXPECT_EQ(update.waiting_workers(), 0);

  grpc::Status joined_status;
  v1::JoinResponse joined;
  std::thread joiner([&] { joined_status = Join(join_req("w1"), &joined); });
  update = read_until(
      [](const v1::MembershipUpdate& u) { return u.waiting_workers() > 0; });
  EXPECT_EQ(update.generation(), 1);
  EXPECT_EQ(update.waiting_workers(), 1);

  v1::JoinRequest reform = join_req("w0");
  reform.set_previous_generation(1);
  reform.set_reform_reason("admit a waiting worker");
  v1::JoinResponse reformed;
  const grpc::Status reform_status = Join(reform, &reformed);
  joiner.join();
  ASSERT_TRUE(reform_status.ok()) << reform_status.error_message();
  ASSERT_TRUE(joined_status.ok()) << joined_status.error_message();
  EXPECT_EQ(reformed.generation(), 2);
  EXPECT_EQ(reformed.world_size(), 2);
  EXPECT_EQ(reformed.rank(), 0);
  EXPECT_EQ(joined.generation(), 2);
  EXPECT_EQ(joined.rank(), 1);
  update = read_until([](const v1::MembershipUpdate& u) {
    return u.generation() == 2 && u.is_member();
  });
  EXPECT_EQ(update.world_size(), 2);
  EXPECT_EQ(update.waiting_workers(), 0);
  watch_context.TryCancel();
  (void)reader->Finish();

  // A previous generation ahead of the job's is refused.
  reform.set_previous_generation(7);
  EXPECT_EQ(Join(reform, &reformed).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
}

// Re-forming over the wire (see Note [Re-forming]): a member's watch stream
// goes away (its process was killed), and once the generation ends that
// expected survivor is dropped after the grace (here 100 ms), long before the
// heartbeat timeout (20 s), so the next generation forms with the rest.
TEST_F(CoordinatorServiceTest, ASurvivorWhoseWatchWentAwayIsDroppedQuickly) {
  auto join_req = [](const std::string& worker) {
    v1::JoinRequest r = JoinReq("killed", 2, worker);
    r.mutable_spec()->set_heartbeat_interval_ms(100);
    r.mutable_spec()->set_heartbeat_timeout_ms(20000);
    return r;
  };
  grpc::Status first_status;
  v1::JoinResponse first;
  std::thread other([&] { first_status = Join(join_req("w0"), &first); });
  v1::JoinResponse second;
  ASSERT_TRUE(Join(join_req("w1"), &second).ok());
  other.join();
  ASSERT_TRUE(first_status.ok()) << first_status.error_message();
  ASSERT_EQ(second.generation(), 1);
  ASSERT_EQ(second.world_size(), 2);

  {
    grpc::ClientContext watch_context;
    Bound(watch_context);
    v1::WatchMembershipRequest watch;
    watch.set_job_id("killed");
    watch.set_worker_id("w1");
    watch.set_worker_secret(Secret("w1"));
    auto stub = NewStub();
    auto reader = stub->WatchMembership(&watch_context, watch);
    v1::MembershipUpdate update;
    ASSERT_TRUE(reader->Read(&update));
    EXPECT_TRUE(update.is_member());
    // The open stream is one waiter, holding no thread.
    EXPECT_EQ(server_->host().waiter_count(), 1u);
    // w1 dies: its stream goes away, and so does its waiter.
    watch_context.TryCancel();
    (void)reader->Finish();
  }
  for (int i = 0; i < 1000 && server_->host().waiter_count() > 0; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(server_->host().waiter_count(), 0u);

  // w0's communicator failed: it asks to re-form and waits for w1, which
  // never comes back.
  v1::JoinRequest reform = join_req("w0");
  reform.set_previous_generation(1);
  reform.set_reform_reason("peer w1 gone");
  const absl::Time start = absl::Now();
  v1::JoinResponse reformed;
  const grpc::Status status = Join(reform, &reformed);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  EXPECT_EQ(reformed.generation(), 2);
  EXPECT_EQ(reformed.world_size(), 1);
  const std::vector<Event> events = server_->host().Read(
      [](const Core& core) { return core.Events("killed"); });
  std::vector<std::string> failures;
  for (const Event& e : events) {
    if (e.kind == "failure") failures.push_back(e.worker_id + ": " + e.message);
  }
  ASSERT_EQ(failures.size(), 1u);
  EXPECT_THAT(failures[0],
              HasSubstr("w1: did not join again after generation 1 ended: its "
                        "connection to the coordinator broke"));
}

TEST_F(CoordinatorServiceTest, KvGetBlocksUntilAnotherThreadSets) {
  v1::JoinResponse joined;
  ASSERT_TRUE(Join(JoinReq("kv", 1, "solo"), &joined).ok());
  ASSERT_EQ(joined.generation(), 1);

  grpc::Status get_status;
  v1::KvGetResponse got;
  absl::Time returned;
  std::thread getter([&] {
    v1::KvGetRequest get;
    get.set_job_id("kv");
    get.set_worker_id("solo");
    get.set_worker_secret(Secret("solo"));
    get.set_generation(1);
    get.add_keys("a");
    get.add_keys("b");
    get.set_wait_timeout_ms(10000);
    grpc::ClientContext context;
    Bound(context);
    get_status = NewStub()->KvGet(&context, get, &got);
    returned = absl::Now();
  });

  auto stub = NewStub();
  for (const char* key : {"b", "a"}) {
    absl::SleepFor(absl::Milliseconds(150));
    v1::KvSetRequest set;
    set.set_job_id("kv");
    set.set_worker_id("solo");
    set.set_worker_secret(Secret("solo"));
    set.set_generation(1);
    set.set_key(key);
    set.set_value(absl::StrCat("value-", key));
    v1::KvSetResponse unused;
    grpc::ClientContext context;
    Bound(context);
    ASSERT_TRUE(stub->KvSet(&context, set, &unused).ok());
  }
  const absl::Time last_set = absl::Now();
  getter.join();
  ASSERT_TRUE(get_status.ok()) << get_status.error_message();
  ASSERT_EQ(got.values_size(), 2);
  EXPECT_EQ(got.values(0), "value-a");
  EXPECT_EQ(got.values(1), "value-b");
  EXPECT_GE(returned, last_set - absl::Milliseconds(50));
}

TEST_F(CoordinatorServiceTest, KvGetTimesOut) {
  v1::JoinResponse joined;
  ASSERT_TRUE(Join(JoinReq("kv", 1, "solo"), &joined).ok());
  v1::KvGetRequest get;
  get.set_job_id("kv");
  get.set_worker_id("solo");
  get.set_worker_secret(Secret("solo"));
  get.set_generation(joined.generation());
  get.add_keys("never");
  get.set_wait_timeout_ms(300);
  v1::KvGetResponse got;
  grpc::ClientContext context;
  Bound(context);
  const absl::Time start = absl::Now();
  const grpc::Status s = NewStub()->KvGet(&context, get, &got);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(250));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

TEST_F(CoordinatorServiceTest, JoinWithBadFieldIsInvalidArgument) {
  v1::JoinResponse response;
  EXPECT_EQ(Join(JoinReq("bad", 0, "w"), &response).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Join(JoinReq("", 1, "w"), &response).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Join(JoinReq("bad", 1, "w", -1), &response).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  v1::JoinRequest slow = JoinReq("bad", 1, "w");
  slow.mutable_spec()->set_heartbeat_interval_ms(20000);
  const grpc::Status s = Join(slow, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("heartbeat_timeout_ms"));
}

TEST_F(CoordinatorServiceTest, JoinTimesOutWhileTheRendezvousIsOpen) {
  v1::JoinResponse response;
  const absl::Time start = absl::Now();
  EXPECT_EQ(Join(JoinReq("pair", 2, "alone", 300), &response).error_code(),
            grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

TEST_F(CoordinatorServiceTest, ShutdownEndsBlockedJoins) {
  grpc::Status status;
  std::thread waiter([&] {
    v1::JoinResponse response;
    status = Join(JoinReq("pair", 2, "alone", 60000), &response);
  });
  absl::SleepFor(absl::Milliseconds(200));
  const absl::Time start = absl::Now();
  server_->Shutdown();
  server_->Shutdown();  // idempotent
  server_->Wait();
  waiter.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE)
      << status.error_message();
}

// Joins sent at once through one channel with gRPC's asynchronous client:
// the test itself holds no thread per call either.
class AsyncJoins {
 public:
  AsyncJoins(const std::string& address, const std::string& job, int n,
             int max_workers)
      : stub_(v1::WorkerService::NewStub(
            grpc::CreateChannel(address, grpc::InsecureChannelCredentials()))),
        calls_(static_cast<size_t>(n)) {
    for (int i = 0; i < n; ++i) {
      Call& call = calls_[static_cast<size_t>(i)];
      call.context.set_deadline(std::chrono::system_clock::now() +
                                kCallDeadline);
      AddBearerToken(call.context, kWorkerToken);
      call.rpc = stub_->AsyncJoin(
          &call.context,
          JoinReq(job, max_workers, absl::StrCat("w", i), /*wait_ms=*/30000),
          &cq_);
      call.rpc->Finish(&call.response, &call.status, &call);
    }
  }
  ~AsyncJoins() {
    for (Call& call : calls_) call.context.TryCancel();
    while (answered_ < calls_.size()) {
      void* tag = nullptr;
      bool ok = false;
      if (!cq_.Next(&tag, &ok)) break;
      ++answered_;
    }
    cq_.Shutdown();
    void* tag = nullptr;
    bool ok = false;
    while (cq_.Next(&tag, &ok)) {
    }
  }
  void CancelAll() {
    for (Call& call : calls_) call.context.TryCancel();
  }
  // Waits for every answer (bounded by the calls' deadlines); returns the
  // codes seen.
  std::multiset<grpc::StatusCode> AwaitAll() {
    std::multiset<grpc::StatusCode> codes;
    while (answered_ < calls_.size()) {
      void* tag = nullptr;
      bool ok = false;
      if (!cq_.Next(&tag, &ok)) break;
      ++answered_;
      codes.insert(static_cast<Call*>(tag)->status.error_code());
    }
    return codes;
  }
  const v1::JoinResponse& response(size_t i) const {
    return calls_[i].response;
  }

 private:
  struct Call {
    grpc::ClientContext context;
    v1::JoinResponse response;
    grpc::Status status;
    std::unique_ptr<grpc::ClientAsyncResponseReader<v1::JoinResponse>> rpc;
  };
  std::unique_ptr<v1::WorkerService::Stub> stub_;
  grpc::CompletionQueue cq_;
  std::vector<Call> calls_;
  size_t answered_ = 0;
};

int ThreadsOfThisProcess() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
  }
  return -1;
}

// Polls `done` until it holds or 10 s pass.
template <typename Fn>
bool Eventually(Fn done) {
  const absl::Time end = absl::Now() + absl::Seconds(10);
  while (!done()) {
    if (absl::Now() > end) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return true;
}

// See Note [Asynchronous waits]: a pending Join holds no server thread, and one
// formed generation answers all of them.
TEST_F(CoordinatorServiceTest,
       PendingJoinsHoldNoThreadAndOneFormationAnswersAll) {
  constexpr int kWorkers = 400;
  const int threads_before = ThreadsOfThisProcess();
  AsyncJoins first(server_->address(), "big", kWorkers - 1, kWorkers);
  ASSERT_TRUE(Eventually([&] {
    return server_->host().waiter_count() == kWorkers - 1;
  })) << server_->host().waiter_count();
  // A thread per pending call (gRPC's synchronous server) would be hundreds.
  EXPECT_LT(ThreadsOfThisProcess() - threads_before, 40);
  v1::JoinResponse last;
  ASSERT_TRUE(Join(JoinReq("big", kWorkers, "last"), &last).ok());
  EXPECT_EQ(last.world_size(), kWorkers);
  const std::multiset<grpc::StatusCode> codes = first.AwaitAll();
  EXPECT_EQ(codes.count(grpc::StatusCode::OK), kWorkers - 1u);
  std::set<int> ranks{last.rank()};
  for (size_t i = 0; i + 1 < kWorkers; ++i) {
    EXPECT_EQ(first.response(i).generation(), 1);
    ranks.insert(first.response(i).rank());
  }
  EXPECT_EQ(ranks.size(), static_cast<size_t>(kWorkers));
  EXPECT_EQ(server_->host().waiter_count(), 0u);
}

// A client that goes away mid-Join frees what its call held: the waiter is
// gone at once, and the worker is still registered (a retried Join keeps its
// place, see Note [Formation]).
TEST_F(CoordinatorServiceTest, ACancelledJoinFreesItsWaiter) {
  constexpr int kWorkers = 50;
  {
    AsyncJoins joins(server_->address(), "gone", kWorkers, kWorkers + 1);
    ASSERT_TRUE(
        Eventually([&] { return server_->host().waiter_count() == kWorkers; }));
    joins.CancelAll();
    const std::multiset<grpc::StatusCode> codes = joins.AwaitAll();
    EXPECT_EQ(codes.count(grpc::StatusCode::CANCELLED), size_t{kWorkers});
  }
  EXPECT_TRUE(Eventually([&] { return server_->host().waiter_count() == 0; }))
      << server_->host().waiter_count();
  // A client whose channel closes (its process died) is the same.
  {
    AsyncJoins joins(server_->address(), "gone", 1, kWorkers + 1);
    ASSERT_TRUE(
        Eventually([&] { return server_->host().waiter_count() == 1; }));
  }
  EXPECT_TRUE(Eventually([&] { return server_->host().waiter_count() == 0; }));
  // Each withdrew with its call: none is left waiting to be placed in a
  // generation it would never hear of.
  const std::vector<Event> events = server_->host().Read(
      [](const Core& core) { return core.Events("gone"); });
  const auto count = [&events](const std::string& kind) {
    return std::count_if(events.begin(), events.end(), [&](const Event& e) {
      return e.kind == kind &&
             (kind != "leave" || absl::StrContains(e.message, "cancelled"));
    });
  };
  EXPECT_EQ(count("join"), kWorkers + 1);  // w0 joined twice
  EXPECT_EQ(count("leave"), kWorkers + 1);
  // The next worker forms a generation of its own (min 1, after settling);
  // a cancelled worker may join again with its secret.
  v1::JoinResponse last;
  ASSERT_TRUE(Join(JoinReq("gone", kWorkers + 1, "last"), &last).ok());
  EXPECT_EQ(last.world_size(), 1);
  EXPECT_EQ(last.generation(), 1);
}

// A store that refuses every save while `failing`.
class FlakyStore final : public Store {
 public:
  absl::Status Save(const v1::JobRecord& record) override {
    if (failing.load()) return absl::UnavailableError("the store is down");
    return memory_.Save(record);
  }
  absl::StatusOr<std::vector<v1::JobRecord>> LoadAll() override {
    return memory_.LoadAll();
  }
  std::atomic<bool> failing{false};

 private:
  MemoryStore memory_;
};

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Persistence when the store fails (see Note [Persistence]): a formed
// generation that could not be saved is told to nobody (a successor loading the
// store would not know it) and is not in the history (see Note [Coordinator
// history]); once a retried save succeeds, the waiting Joins are answered and
// the history has it, with its members by rank.
TEST(CoordinatorStoreFailureTest, NothingUnsavedIsAnswered) {
  spdlog::set_level(spdlog::level::off);
  FlakyStore store;
  ServerOptions options = Options();
  options.store = &store;
  options.history_file = ::testing::TempDir() + "/held.history";
  std::remove(options.history_file.c_str());
  auto server = Server::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  store.failing = true;
  {
    AsyncJoins joins((*server)->address(), "held", 2, 2);
    ASSERT_TRUE(Eventually([&] {
      return (*server)->host().Read([](const Core& core) {
        return core.State("held") == v1::JOB_STATE_RUNNING;
      });
    }));
    absl::SleepFor(absl::Milliseconds(500));  // five retried saves
    EXPECT_EQ((*server)->host().waiter_count(), 2u);
    EXPECT_THAT(ReadAll(options.history_file),
                ::testing::Not(HasSubstr("\"generation\"")));
    store.failing = false;
    const std::multiset<grpc::StatusCode> codes = joins.AwaitAll();
    EXPECT_EQ(codes.count(grpc::StatusCode::OK), 2u);
    EXPECT_EQ(joins.response(0).generation(), 1);
    const std::string history = ReadAll(options.history_file);
    const std::string members =
        joins.response(0).rank() == 0 ? R"(["w0","w1"])" : R"(["w1","w0"])";
    EXPECT_THAT(history,
                HasSubstr(absl::StrCat(
                    R"("generation":1,"job":"held","members":)", members)));
    EXPECT_THAT(history, HasSubstr(R"("event":"join")"));
  }
  spdlog::set_level(spdlog::level::warn);
}

// See Note [Unreachable peers]: a newcomer's members_if_running gets the member
// table only where the job was running before (a rank_change), never at the
// job's first rendezvous.
TEST(JoinAnswerTest, MembersIfRunningOnlyForARunningJob) {
  RealClock clock;
  Core core(&clock);
  auto join = [&](const std::string& w, int64_t previous) {
    v1::JoinRequest r = JoinReq("j", 2, w);
    r.set_include_members(false);
    r.set_members_if_running(true);
    r.set_previous_generation(previous);
    r.set_probe_port(5000);
    return r;
  };
  ASSERT_TRUE(core.Join(join("w0", 0)).ok());
  ASSERT_TRUE(core.Join(join("w1", 0)).ok());
  v1::JoinResponse first;
  ASSERT_EQ(JoinAnswer(core, join("w0", 0), &first), absl::OkStatus());
  EXPECT_EQ(first.generation(), 1);
  EXPECT_EQ(first.members_size(), 0);
  // w1 asks to re-form; both join generation 2, which continues the job.
  ASSERT_TRUE(core.Join(join("w1", 1)).ok());
  ASSERT_TRUE(core.Join(join("w0", 1)).ok());
  v1::JoinResponse second;
  ASSERT_EQ(JoinAnswer(core, join("w0", 1), &second), absl::OkStatus());
  EXPECT_EQ(second.generation(), 2);
  ASSERT_EQ(second.members_size(), 2);
  EXPECT_EQ(second.members(0).probe_port(), 5000);
}

TEST(CoordinatorServerTest, BadHistoryFile) {
  ServerOptions options = Options();
  options.history_file = "/nonexistent-dir/history";
  const auto server = Server::Start(options);
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(server.status().message(), HasSubstr("/nonexistent-dir/history"));
}

TEST(CoordinatorServerTest, BadAddresses) {
  ServerOptions no_port = Options();
  no_port.listen_address = "127.0.0.1";
  EXPECT_EQ(Server::Start(no_port).status().code(),
            absl::StatusCode::kInvalidArgument);

  ServerOptions no_tokens;
  EXPECT_EQ(Server::Start(no_tokens).status().code(),
            absl::StatusCode::kInvalidArgument);
  ServerOptions same = Options();
  same.operator_token = same.worker_token;
  EXPECT_EQ(Server::Start(same).status().code(),
            absl::StatusCode::kInvalidArgument);

  auto first = Server::Start(Options());
  ASSERT_TRUE(first.ok()) << first.status();
  ServerOptions taken = Options();
  taken.listen_address = (*first)->address();
  EXPECT_EQ(Server::Start(taken).status().code(),
            absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace concord::coordinator
