// The CONCORD_* table (common/environment.h) against its readers: every
// variable in it changes what the worker (or concord-train's test hooks)
// reads, and the worker reads none that is not in it. docs/cli.md is
// checked against `concord-run --env` by ctest's cli_reference test.

#include "common/environment.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdio>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "tools/fault_injection.h"
#include "worker/session.h"

namespace concord::worker {
namespace {

// Sets variables for one scope and removes every CONCORD_* one (and
// LOCAL_RANK) around it, so that the test sees only what it set.
class ScopedEnvironment {
 public:
  ScopedEnvironment() { Clear(); }
  ~ScopedEnvironment() { Clear(); }
  void Set(const env::Variable& v, const std::string& value) {
    setenv(std::string(v.name).c_str(), value.c_str(), 1);
  }

 private:
  static void Clear() {
    for (const env::Variable* v : env::All()) {
      unsetenv(std::string(v->name).c_str());
    }
    unsetenv("LOCAL_RANK");
  }
};

WorkerOptions Read() {
  absl::StatusOr<WorkerOptions> o = WorkerOptions::FromEnvironment();
  EXPECT_TRUE(o.ok()) << o.status();
  return o.ok() ? *std::move(o) : WorkerOptions{};
}

// The worker's error for the environment as set: it must name `v`.
void ExpectRefused(const env::Variable& v) {
  absl::StatusOr<WorkerOptions> o = WorkerOptions::FromEnvironment();
  ASSERT_FALSE(o.ok()) << v.name << " was accepted";
  EXPECT_TRUE(absl::StrContains(o.status().message(), v.name)) << o.status();
}

std::string TokenFile() {
  const std::string path =
      ::testing::TempDir() + "/environment_test_" + std::to_string(getpid());
  FILE* f = std::fopen(path.c_str(), "w");
  std::fputs("a-worker-token-of-enough-length-0123456789", f);
  std::fclose(f);
  return path;
}

TEST(EnvironmentTest, TheTableIsWellFormed) {
  std::set<absl::string_view> names;
  for (const env::Variable* v : env::All()) {
    EXPECT_TRUE(absl::StartsWith(v->name, "CONCORD_")) << v->name;
    EXPECT_TRUE(names.insert(v->name).second) << v->name << " twice";
    EXPECT_EQ(env::Find(v->name), v);
    EXPECT_FALSE(v->meaning.empty()) << v->name;
    if (v->integer && v->default_text.empty()) {
      EXPECT_GE(v->int_default, v->int_min) << v->name;
      EXPECT_LE(v->int_default, v->int_max) << v->name;
    }
    EXPECT_TRUE(absl::StrContains(env::Table(), absl::StrCat(v->name, "\n")));
  }
  EXPECT_EQ(env::Find("CONCORD_NO_SUCH"), nullptr);
  // concord-run passes the user's and the tests' on, never its own.
  EXPECT_TRUE(env::PassedOn("CONCORD_DEVICE=cuda"));
  EXPECT_TRUE(env::PassedOn("CONCORD_TEST_KILL=0:3:forward"));
  EXPECT_FALSE(env::PassedOn("CONCORD_JOB_ID=mine"));
  EXPECT_FALSE(env::PassedOn("CONCORD_TOKEN=secret"));
  EXPECT_FALSE(env::PassedOn("CONCORD_NO_SUCH=1"));
}

// For each variable in the table, a check that setting it changes what is
// read (and, for an integer, that a bad value is refused naming it). The
// test fails when the table has a variable without a check here, so a new
// variable cannot go unread.
TEST(EnvironmentTest, EveryVariableOfTheTableIsRead) {
  using namespace env;  // NOLINT: the table's names, in this test only
  const std::string token = TokenFile();
  const auto with_coordinator = [&](ScopedEnvironment& e) {
    e.Set(kCoordinator, "127.0.0.1:1");
    e.Set(kTokenFile, token);
  };
  std::map<absl::string_view, std::function<void(ScopedEnvironment&)>> checks =
      {
          {kCoordinator.name,
           [&](ScopedEnvironment& e) {
             with_coordinator(e);
             EXPECT_EQ(Read().coordinator, "127.0.0.1:1");
           }},
          {kJobId.name,
           [](ScopedEnvironment& e) {
             EXPECT_EQ(Read().spec.job_id(), "default");
             e.Set(kJobId, "mine");
             EXPECT_EQ(Read().spec.job_id(), "mine");
           }},
          {kMinWorkers.name,
           [](ScopedEnvironment& e) {
             e.Set(kMinWorkers, "3");
             EXPECT_EQ(Read().spec.min_workers(), 3);
             EXPECT_EQ(Read().spec.max_workers(), 3);
             e.Set(kMinWorkers, "0");
             ExpectRefused(kMinWorkers);
           }},
          {kMaxWorkers.name,
           [](ScopedEnvironment& e) {
             e.Set(kMaxWorkers, "5");
             EXPECT_EQ(Read().spec.max_workers(), 5);
             e.Set(kMinWorkers, "6");
             ExpectRefused(kMaxWorkers);
           }},
          {kSettleMs.name,
           [](ScopedEnvironment& e) {
             e.Set(kSettleMs, "7");
             EXPECT_EQ(Read().spec.settle_ms(), 7);
             e.Set(kSettleMs, "x");
             ExpectRefused(kSettleMs);
           }},
          {kHangTimeoutMs.name,
           [](ScopedEnvironment& e) {
             EXPECT_EQ(Read().spec.hang_timeout_ms(), 0);  // derived
             e.Set(kHangTimeoutMs, "2500");
             EXPECT_EQ(Read().spec.hang_timeout_ms(), 2500);
             e.Set(kHangTimeoutMs, "-1");
             EXPECT_EQ(Read().spec.hang_timeout_ms(), -1);  // off
             e.Set(kHangTimeoutMs, "-2");
             ExpectRefused(kHangTimeoutMs);
           }},
          {kStragglers.name,
           [](ScopedEnvironment& e) {
             EXPECT_EQ(Read().spec.stragglers(), "report");
             e.Set(kStragglers, "evict");
             EXPECT_EQ(Read().spec.stragglers(), "evict");
             e.Set(kStragglers, "kick");
             ExpectRefused(kStragglers);
           }},
          {kStragglerCooldownMs.name,
           [](ScopedEnvironment& e) {
             EXPECT_EQ(Read().spec.straggler_cooldown_ms(),
                       kDefaultStragglerCooldownMs);
             e.Set(kStragglerCooldownMs, "5000");
             EXPECT_EQ(Read().spec.straggler_cooldown_ms(), 5000);
             e.Set(kStragglerCooldownMs, "0");
             ExpectRefused(kStragglerCooldownMs);
           }},
          {kHeartbeatIntervalMs.name,
           [](ScopedEnvironment& e) {
             EXPECT_EQ(Read().spec.heartbeat_interval_ms(),
                       kDefaultHeartbeatIntervalMs);
             e.Set(kHeartbeatIntervalMs, "500");
             EXPECT_EQ(Read().spec.heartbeat_interval_ms(), 500);
             e.Set(kHeartbeatIntervalMs, "0");
             ExpectRefused(kHeartbeatIntervalMs);
           }},
          {kHeartbeatTimeoutMs.name,
           [](ScopedEnvironment& e) {
             EXPECT_EQ(Read().spec.heartbeat_timeout_ms(),
                       kDefaultHeartbeatTimeoutMs);
             e.Set(kHeartbeatTimeoutMs, "20000");
             EXPECT_EQ(Read().spec.heartbeat_timeout_ms(), 20000);
           }},
          {kRendezvousTimeoutMs.name,
           [](ScopedEnvironment& e) {
             e.Set(kRendezvousTimeoutMs, "1234");
             EXPECT_EQ(Read().join_timeout, absl::Milliseconds(1234));
             EXPECT_EQ(Read().spec.rendezvous_timeout_ms(), 1234);
           }},
          {kCollectiveTimeoutMs.name,
           [](ScopedEnvironment& e) {
             EXPECT_EQ(Read().collective_timeout,
                       absl::Milliseconds(kDefaultCollectiveTimeoutMs));
             e.Set(kCollectiveTimeoutMs, "4321");
             EXPECT_EQ(Read().collective_timeout, absl::Milliseconds(4321));
           }},
          {kWorkerId.name,
           [](ScopedEnvironment& e) {
             e.Set(kWorkerId, "w-1");
             EXPECT_EQ(Read().worker_id, "w-1");
           }},
          {kNodeId.name,
           [](ScopedEnvironment& e) {
             e.Set(kNodeId, "node-a");
             EXPECT_EQ(Read().node_id, "node-a");
           }},
          {kLocalRank.name,
           [](ScopedEnvironment& e) {
             EXPECT_EQ(Read().local_rank, -1);
             setenv("LOCAL_RANK", "1", 1);  // torchrun's, below Concord's
             EXPECT_EQ(Read().local_rank, 1);
             e.Set(kLocalRank, "2");
             EXPECT_EQ(Read().local_rank, 2);
             e.Set(kLocalRank, "-3");
             ExpectRefused(kLocalRank);
           }},
          {kRestartCount.name,
           [](ScopedEnvironment& e) {
             e.Set(kTestFault, "0:4:forward:net:1");
             e.Set(kLocalRank, "0");
             EXPECT_EQ(Read().test_faults.size(), 1u);
             e.Set(kRestartCount, "1");  // a restarted worker does not die
             EXPECT_TRUE(Read().test_faults.empty());
           }},
          {kCommHost.name,
           [](ScopedEnvironment& e) {
             e.Set(kCommHost, "10.0.0.7");
             EXPECT_EQ(Read().comm_host, "10.0.0.7");
           }},
          {kTokenFile.name,
           [&](ScopedEnvironment& e) {
             with_coordinator(e);
             EXPECT_EQ(Read().token,
                       "a-worker-token-of-enough-length-0123456789");
             e.Set(kTokenFile, token + ".missing");
             ExpectRefused(kTokenFile);
           }},
          {kToken.name,
           [](ScopedEnvironment& e) {
             e.Set(kCoordinator, "127.0.0.1:1");
             ExpectRefused(kTokenFile);  // neither is set
             e.Set(kToken, "another-worker-token-of-enough-length-0123");
             EXPECT_EQ(Read().token,
                       "another-worker-token-of-enough-length-0123");
           }},
          {kTlsCa.name,
           [&](ScopedEnvironment& e) {
             with_coordinator(e);
             e.Set(kTlsCa, "/nonexistent/ca.pem");
             ExpectRefused(kTlsCa);
           }},
          {kTlsCert.name,
           [&](ScopedEnvironment& e) {
             with_coordinator(e);
             e.Set(kTlsCert, "/nonexistent/cert.pem");
             ExpectRefused(kTlsCert);
           }},
          {kTlsKey.name,
           [&](ScopedEnvironment& e) {
             with_coordinator(e);
             e.Set(kTlsKey, "/nonexistent/key.pem");
             ExpectRefused(kTlsKey);
           }},
          {kTraceFile.name,
           [](ScopedEnvironment& e) {
             e.Set(kTraceFile, "/tmp/t.json");
             EXPECT_EQ(Read().trace_file, "/tmp/t.json");
           }},
          {kHistoryFile.name,
           [](ScopedEnvironment& e) {
             e.Set(kHistoryFile, "/tmp/w.history");
             EXPECT_EQ(Read().history_file, "/tmp/w.history");
           }},
          {kDevice.name,
           [](ScopedEnvironment& e) {
             e.Set(kDevice, "cuda:1");
             EXPECT_EQ(Read().device.ToString(), "cuda:1");
             e.Set(kDevice, "gpu");
             ExpectRefused(kDevice);
           }},
          {kBackend.name,
           [](ScopedEnvironment& e) {
             e.Set(kBackend, "gloo");
             EXPECT_EQ(Read().backend, BackendRequest::kGloo);
             e.Set(kBackend, "mpi");
             ExpectRefused(kBackend);
           }},
          {kSharedMemory.name,
           [](ScopedEnvironment& e) {
             EXPECT_TRUE(Read().shared_memory);
             e.Set(kSharedMemory, "0");
             EXPECT_FALSE(Read().shared_memory);
             e.Set(kSharedMemory, "2");
             ExpectRefused(kSharedMemory);
           }},
          {kLogLevel.name,
           [](ScopedEnvironment& e) {
             e.Set(kLogLevel, "warn");
             EXPECT_EQ(Read().log_level, "warn");
             e.Set(kLogLevel, "loud");
             ExpectRefused(kLogLevel);
           }},
          {kCheckpointDir.name,
           [](ScopedEnvironment& e) {
             e.Set(kCheckpointDir, "/ckpt");
             ExpectRefused(kCheckpointEvery);  // a dir needs an interval
             e.Set(kCheckpointEvery, "5");
             EXPECT_EQ(Read().checkpoint.dir, "/ckpt");
           }},
          {kCheckpointEvery.name,
           [](ScopedEnvironment& e) {
             e.Set(kCheckpointDir, "/ckpt");
             e.Set(kCheckpointEvery, "5");
             EXPECT_EQ(Read().checkpoint.every, 5);
             e.Set(kCheckpointEvery, "-1");
             ExpectRefused(kCheckpointEvery);
           }},
          {kCheckpointKeep.name,
           [](ScopedEnvironment& e) {
             EXPECT_EQ(Read().checkpoint.keep, kDefaultCheckpointKeep);
             e.Set(kCheckpointKeep, "4");
             EXPECT_EQ(Read().checkpoint.keep, 4);
             e.Set(kCheckpointKeep, "0");
             ExpectRefused(kCheckpointKeep);
           }},
          {kCheckpointResume.name,
           [](ScopedEnvironment& e) {
             EXPECT_TRUE(Read().checkpoint.resume);
             e.Set(kCheckpointResume, "0");
             EXPECT_FALSE(Read().checkpoint.resume);
             e.Set(kCheckpointResume, "2");
             ExpectRefused(kCheckpointResume);
           }},
          {kCheckpointOverlap.name,
           [](ScopedEnvironment& e) {
             EXPECT_FALSE(Read().checkpoint.overlap);
             e.Set(kCheckpointOverlap, "1");
             EXPECT_TRUE(Read().checkpoint.overlap);
             e.Set(kCheckpointOverlap, "yes");
             ExpectRefused(kCheckpointOverlap);
           }},
          {kCheckpointMemory.name,
           [](ScopedEnvironment& e) {
             e.Set(kCheckpointMemory, "/dev/shm/node");
             EXPECT_EQ(Read().checkpoint.memory, "/dev/shm/node");
           }},
          {kTestFault.name,
           [](ScopedEnvironment& e) {
             e.Set(kLocalRank, "0");
             e.Set(kTestFault, "0:4:backward:net:2");
             const std::vector<TestFault> faults = Read().test_faults;
             ASSERT_EQ(faults.size(), 1u);
             EXPECT_EQ(faults[0].step, 4);
             EXPECT_EQ(faults[0].occurrence, 2);
             e.Set(kTestFault, "nonsense");
             ExpectRefused(kTestFault);
           }},
          {kTestCheckpointFault.name,
           [](ScopedEnvironment& e) {
             e.Set(kTestCheckpointFault, "before-rename:2");
             EXPECT_EQ(Read().checkpoint.test_crash.stage,
                       checkpoint::WriteFault::kBeforeRename);
             EXPECT_EQ(Read().checkpoint.test_crash.nth, 2);
             e.Set(kTestCheckpointFault, "after-all:1");
             ExpectRefused(kTestCheckpointFault);
           }},
          // concord-train's (tools/fault_injection.h).
          {kTestKill.name,
           [](ScopedEnvironment& e) {
             e.Set(kLocalRank, "1");
             e.Set(kTestKill, "1:6:optimizer,0:2:forward");
             const train::FaultInjection f =
                 train::FaultInjection::FromEnvironment();
             ASSERT_EQ(f.faults.size(), 1u);
             EXPECT_EQ(f.faults[0].first, 6);
             EXPECT_EQ(f.faults[0].second, "optimizer");
           }},
          // concord-run's, read with env::GetInt; what it does is checked
          // by integration_elastic_join (see Note [Where gRPC objects end]
          // in agent/node_agent_impl.h).
          {kTestAgentLingerMs.name,
           [](ScopedEnvironment& e) {
             int64_t ms = -1;
             ASSERT_TRUE(env::GetInt(kTestAgentLingerMs, &ms).ok());
             EXPECT_EQ(ms, 0);
             e.Set(kTestAgentLingerMs, "50");
             ASSERT_TRUE(env::GetInt(kTestAgentLingerMs, &ms).ok());
             EXPECT_EQ(ms, 50);
             e.Set(kTestAgentLingerMs, "10001");
             EXPECT_FALSE(env::GetInt(kTestAgentLingerMs, &ms).ok());
           }},
          {kTestBusy.name,
           [](ScopedEnvironment& e) {
             e.Set(kLocalRank, "1");
             e.Set(kTestBusy, "1:10:2.5");
             const train::FaultInjection f =
                 train::FaultInjection::FromEnvironment();
             EXPECT_EQ(f.busy_step, 10);
             EXPECT_DOUBLE_EQ(f.busy_seconds, 2.5);
             e.Set(kTestBusy, "0:10:2.5");  // another worker's
             EXPECT_EQ(train::FaultInjection::FromEnvironment().busy_step, -1);
           }},
          // The elastic state's, read with env::GetInt; what it does is
          // ShardPlacement::Over's `as_bytes` (ShardPlacementTest).
          {kTestShardsAsBytes.name,
           [](ScopedEnvironment& e) {
             int64_t v = -1;
             ASSERT_TRUE(env::GetInt(kTestShardsAsBytes, &v).ok());
             EXPECT_EQ(v, 0);
             e.Set(kTestShardsAsBytes, "1");
             ASSERT_TRUE(env::GetInt(kTestShardsAsBytes, &v).ok());
             EXPECT_EQ(v, 1);
             e.Set(kTestShardsAsBytes, "2");
             EXPECT_FALSE(env::GetInt(kTestShardsAsBytes, &v).ok());
           }},
          // save_checkpoint's, read with env::GetInt; what it does is
          // checked by reference_zero_w3_adam and _w3_adam_groups (see
          // Note [Shards written where they are] in
          // worker/checkpoint/disk.h).
          {kTestCheckpointHoles.name,
           [](ScopedEnvironment& e) {
             int64_t v = -1;
             ASSERT_TRUE(env::GetInt(kTestCheckpointHoles, &v).ok());
             EXPECT_EQ(v, 0);
             e.Set(kTestCheckpointHoles, "2");
             ASSERT_TRUE(env::GetInt(kTestCheckpointHoles, &v).ok());
             EXPECT_EQ(v, 2);
             e.Set(kTestCheckpointHoles, "3");
             EXPECT_FALSE(env::GetInt(kTestCheckpointHoles, &v).ok());
           }},
          {kTestMinStepMs.name,
           [](ScopedEnvironment& e) {
             e.Set(kTestMinStepMs, "9");
             EXPECT_EQ(train::FaultInjection::FromEnvironment().min_step,
                       std::chrono::milliseconds(9));
           }},
      };
  for (const env::Variable* v : env::All()) {
    auto check = checks.find(v->name);
    if (check == checks.end()) {
      ADD_FAILURE() << v->name << " is in the table but nothing here checks "
                    << "that it is read";
      continue;
    }
    SCOPED_TRACE(std::string(v->name));
    ScopedEnvironment e;
    check->second(e);
    checks.erase(check);
  }
  for (const auto& [name, check] : checks) {
    ADD_FAILURE() << name << " is checked here but not in the table";
  }
  std::remove(token.c_str());
}

}  // namespace
}  // namespace concord::worker
