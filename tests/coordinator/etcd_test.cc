// The etcd store against a real etcd (Debian's etcd-server) on loopback:
// records round-trip, one leader at a time, a deposed leader cannot write
// (fencing), resigning hands over at once, a leader that cannot reach etcd
// steps down before its lease could expire, and bad records or endpoints are
// clear errors. See Note [etcd leadership] in coordinator/store/etcd_store.h.

#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "coordinator/store/etcd_store.h"

namespace concord::coordinator {
namespace {

// A free loopback port (bound and released; good enough on a test machine).
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

// One etcd for the suite; each test uses its own key prefix.
class EtcdTest : public ::testing::Test {
 protected:
  // A failure here would show as every test SKIPPED (gtest 1.12, and the
  // ctest skip pattern): it is kept and fails each test in SetUp instead.
  static void SetUpTestSuite() {
    spdlog::set_level(spdlog::level::warn);
    setup_error_ = new std::string();
    char tmpl[] = "/tmp/concord-etcd-test-XXXXXX";
    if (mkdtemp(tmpl) == nullptr) {
      *setup_error_ = absl::StrCat("mkdtemp: ", std::strerror(errno));
      dir_ = new std::string();
      return;
    }
    dir_ = new std::string(tmpl);
    const int client = FreePort(), peer = FreePort();
    endpoint_ = new std::string(absl::StrCat("http://127.0.0.1:", client));
    const std::string peer_url = absl::StrCat("http://127.0.0.1:", peer);
    std::vector<std::string> args = {"etcd",
                                     "--name",
                                     "test",
                                     "--data-dir",
                                     *dir_ + "/data",
                                     "--listen-client-urls",
                                     *endpoint_,
                                     "--advertise-client-urls",
                                     *endpoint_,
                                     "--listen-peer-urls",
                                     peer_url,
                                     "--initial-advertise-peer-urls",
                                     peer_url,
                                     "--initial-cluster",
                                     "test=" + peer_url,
                                     "--log-level",
                                     "error"};
    pid_ = fork();
    if (pid_ == 0) {
      const int log = open((*dir_ + "/etcd.log").c_str(),
                           O_WRONLY | O_CREAT | O_TRUNC, 0600);
      dup2(log, 1);
      dup2(log, 2);
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execvp(argv[0], argv.data());
      _exit(127);
    }
    // Up when a Range answers. A fresh client per try: a gRPC channel that
    // failed to connect takes seconds to retry (see Note [Fresh channels] in
    // common/coordinator_channel.h).
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (absl::Now() < deadline) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = 0;
        *setup_error_ = absl::StrCat(
            "etcd exited at startup (is Debian's etcd-server installed? "
            "scripts/install-deps.sh installs it); log in ",
            *dir_);
        return;
      }
      etcdserverpb::RangeRequest request;
      request.set_key("probe");
      if (NewClient()->Range(request).ok()) return;
      absl::SleepFor(absl::Milliseconds(100));
    }
    *setup_error_ = "etcd did not answer within 20 s";
  }

  void SetUp() override {
    if (!setup_error_->empty()) FAIL() << *setup_error_;
  }

  static void TearDownTestSuite() {
    if (pid_ > 0) {
      kill(pid_, SIGCONT);
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (!dir_->empty()) {
      (void)!std::system(("rm -rf '" + *dir_ + "'").c_str());
    }
  }

  static std::unique_ptr<EtcdClient> NewClient(
      const std::string& endpoint = *endpoint_) {
    auto client =
        EtcdClient::Create({endpoint}, TlsMaterial{}, absl::Milliseconds(500));
    EXPECT_TRUE(client.ok()) << client.status();
    return *std::move(client);
  }

  // A store under this test's prefix, lease TTL 2 s.
  std::unique_ptr<EtcdStore> NewStore() {
    EtcdStoreOptions options;
    options.prefix = Prefix();
    options.lease_ttl = 2;
    options.poll_interval = absl::Milliseconds(50);
    auto store = EtcdStore::Create(NewClient(), options);
    EXPECT_TRUE(store.ok()) << store.status();
    return *std::move(store);
  }

  static std::string Prefix() {
    return absl::StrCat(
        "/test/",
        ::testing::UnitTest::GetInstance()->current_test_info()->name(), "/");
  }

  // Campaigns (must win at once, nobody else leads).
  static void Lead(EtcdStore& store, const std::string& identity) {
    ASSERT_TRUE(
        store
            .Campaign(
                identity, [] { return false; }, nullptr, absl::Seconds(10))
            .ok());
    ASSERT_TRUE(store.leading());
  }

  static v1::JobRecord Record(const std::string& job, int64_t generation) {
    v1::JobRecord r;
    r.mutable_spec()->set_job_id(job);
    r.mutable_spec()->set_min_workers(1);
    r.mutable_spec()->set_max_workers(4);
    r.set_generation(generation);
    return r;
  }

  static int64_t GenerationOf(EtcdStore& store, const std::string& job) {
    auto records = store.LoadAll();
    EXPECT_TRUE(records.ok()) << records.status();
    if (!records.ok()) return -1;
    for (const v1::JobRecord& r : *records) {
      if (r.spec().job_id() == job) return r.generation();
    }
    return -1;
  }

  // Raw put, outside any store (a corrupt record, an operator's mistake).
  static void RawPut(const std::string& key, const std::string& value) {
    etcdserverpb::TxnRequest txn;
    etcdserverpb::PutRequest* put = txn.add_success()->mutable_request_put();
    put->set_key(key);
    put->set_value(value);
    ASSERT_TRUE(NewClient()->Txn(txn).ok());
  }

  static std::string* dir_;
  static std::string* setup_error_;
  static std::string* endpoint_;
  static pid_t pid_;
};

std::string* EtcdTest::dir_ = nullptr;
std::string* EtcdTest::setup_error_ = nullptr;
std::string* EtcdTest::endpoint_ = nullptr;
pid_t EtcdTest::pid_ = 0;

TEST_F(EtcdTest, RecordsRoundTripWhileLeading) {
  auto store = NewStore();
  // Not leading yet: nothing is written.
  absl::Status before = store->Save(Record("a", 1));
  EXPECT_EQ(before.code(), absl::StatusCode::kFailedPrecondition) << before;
  Lead(*store, "replica-1");
  EXPECT_EQ(*store->Leader(), "replica-1");
  ASSERT_TRUE(store->Save(Record("a", 1)).ok());
  ASSERT_TRUE(store->Save(Record("b", 7)).ok());
  ASSERT_TRUE(store->Save(Record("a", 3)).ok());  // replaces a's record
  auto records = store->LoadAll();
  ASSERT_TRUE(records.ok()) << records.status();
  ASSERT_EQ(records->size(), 2u);
  EXPECT_EQ(GenerationOf(*store, "a"), 3);
  EXPECT_EQ(GenerationOf(*store, "b"), 7);
  store->Resign();
}

TEST_F(EtcdTest, OneLeaderAtATimeAndResignHandsOverAtOnce) {
  auto first = NewStore();
  auto second = NewStore();
  Lead(*first, "replica-1");
  ASSERT_TRUE(first->Save(Record("job", 4)).ok());

  std::atomic<bool> stop{false};
  std::vector<std::string> seen;
  absl::Status campaign;
  std::thread standby([&] {
    campaign = second->Campaign(
        "replica-2", [&] { return stop.load(); },
        [&](const std::string& leader) { seen.push_back(leader); });
  });
  // A lease TTL and more: the second still stands by while the first renews.
  absl::SleepFor(absl::Seconds(3));
  EXPECT_TRUE(first->leading());
  EXPECT_FALSE(second->leading());
  EXPECT_EQ(*first->Leader(), "replica-1");

  const absl::Time resigned = absl::Now();
  first->Resign();
  standby.join();
  const absl::Duration handover = absl::Now() - resigned;
  ASSERT_TRUE(campaign.ok()) << campaign;
  EXPECT_TRUE(second->leading());
  EXPECT_LT(handover, absl::Seconds(1)) << "resigning revokes the lease";
  EXPECT_EQ(seen, std::vector<std::string>{"replica-1"});
  EXPECT_EQ(*second->Leader(), "replica-2");
  // The new leader sees what the old one saved, and writes on.
  EXPECT_EQ(GenerationOf(*second, "job"), 4);
  ASSERT_TRUE(second->Save(Record("job", 5)).ok());
  // The old one may not.
  absl::Status old = first->Save(Record("job", 9));
  EXPECT_EQ(old.code(), absl::StatusCode::kFailedPrecondition) << old;
  EXPECT_EQ(GenerationOf(*second, "job"), 5);
  second->Resign();
}

// A leader whose lease ended without its knowing (its key deleted behind its
// back, as when etcd expired the lease during a long pause): its next Save
// is refused by the fence, it reports leadership lost, and the record is the
// successor's.
TEST_F(EtcdTest, DeposedLeaderCannotOverwriteItsSuccessor) {
  auto first = NewStore();
  auto second = NewStore();
  Lead(*first, "replica-1");
  ASSERT_TRUE(first->Save(Record("job", 2)).ok());
  // The first replica's leader key goes away (raw delete), the second wins.
  etcdserverpb::TxnRequest txn;
  txn.add_success()->mutable_request_delete_range()->set_key(Prefix() +
                                                             "leader");
  ASSERT_TRUE(NewClient()->Txn(txn).ok());
  Lead(*second, "replica-2");
  ASSERT_TRUE(second->Save(Record("job", 3)).ok());

  absl::Status stale = first->Save(Record("job", 99));
  EXPECT_EQ(stale.code(), absl::StatusCode::kFailedPrecondition) << stale;
  EXPECT_FALSE(first->leading());
  EXPECT_NE(first->WaitLost(absl::ZeroDuration()).find("another coordinator"),
            std::string::npos);
  EXPECT_EQ(GenerationOf(*second, "job"), 3);
  second->Resign();
}

// etcd unreachable (its process stopped): the leader steps down within 2/3
// of the TTL after its last renewal, before etcd could expire its lease;
// Save fails UNAVAILABLE meanwhile. A second replica takes over once etcd is
// back and the lease has expired.
TEST_F(EtcdTest, LeaderThatCannotRenewStepsDownBeforeItsLeaseExpires) {
  auto first = NewStore();
  Lead(*first, "replica-1");
  const absl::Time stopped = absl::Now();
  ASSERT_EQ(kill(pid_, SIGSTOP), 0);
  const std::string why = first->WaitLost(absl::Seconds(5));
  const absl::Duration after = absl::Now() - stopped;
  absl::Status save = first->Save(Record("job", 1));
  ASSERT_EQ(kill(pid_, SIGCONT), 0);
  EXPECT_NE(why.find("could not renew"), std::string::npos) << why;
  // TTL 2 s: renewals every 0.5 s, step-down 1.33 s after the last good one.
  EXPECT_LT(after, absl::Seconds(2)) << why;
  EXPECT_EQ(save.code(), absl::StatusCode::kFailedPrecondition) << save;

  auto second = NewStore();
  const absl::Time campaign_start = absl::Now();
  ASSERT_TRUE(
      second
          ->Campaign(
              "replica-2", [] { return false; }, nullptr, absl::Seconds(20))
          .ok());
  EXPECT_LT(absl::Now() - campaign_start, absl::Seconds(6));
  second->Resign();
}

TEST_F(EtcdTest, CorruptOrMisplacedRecordIsDataLoss) {
  auto store = NewStore();
  RawPut(Prefix() + "jobs/x", "not a protobuf \xff\xff\xff");
  auto loaded = store->LoadAll();
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(loaded.status().message().find("jobs/x"), std::string::npos);

  auto other = NewStore();
  std::string data;
  ASSERT_TRUE(Record("y", 1).SerializeToString(&data));
  RawPut(Prefix() + "jobs/x", data);  // job y under x's key
  loaded = other->LoadAll();
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kDataLoss);
}

TEST_F(EtcdTest, BadEndpointsAndUnreachableEtcdAreClearErrors) {
  for (const char* bad : {"ftp://127.0.0.1:1", "127.0.0.1",
                          "http://127.0.0.1:", "http://h:1/path"}) {
    auto client = EtcdClient::Create({bad}, TlsMaterial{}, absl::Seconds(1));
    EXPECT_EQ(client.status().code(), absl::StatusCode::kInvalidArgument)
        << bad;
  }
  auto https = EtcdClient::Create({"https://127.0.0.1:1"}, TlsMaterial{},
                                  absl::Seconds(1));
  EXPECT_EQ(https.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(https.status().message().find("--etcd-ca"), std::string::npos);
  EXPECT_EQ(
      EtcdClient::Create({}, TlsMaterial{}, absl::Seconds(1)).status().code(),
      absl::StatusCode::kInvalidArgument);

  // A closed port, then the real etcd: the client moves on to the endpoint
  // that answers.
  const std::string closed = absl::StrCat("http://127.0.0.1:", FreePort());
  auto lone = NewClient(closed);
  etcdserverpb::RangeRequest request;
  request.set_key("k");
  EXPECT_EQ(lone->Range(request).status().code(),
            absl::StatusCode::kUnavailable);
  auto both =
      EtcdClient::Create({closed, *endpoint_}, TlsMaterial{}, absl::Seconds(1));
  ASSERT_TRUE(both.ok());
  EXPECT_TRUE((*both)->Range(request).ok());

  EtcdStoreOptions options;
  options.prefix = Prefix();
  auto store = EtcdStore::Create(NewClient(closed), options);
  ASSERT_TRUE(store.ok());
  absl::Status campaign = (*store)->Campaign(
      "x", [] { return false; }, nullptr, absl::Seconds(1));
  EXPECT_EQ(campaign.code(), absl::StatusCode::kUnavailable) << campaign;
  options.prefix = "";
  EXPECT_EQ(EtcdStore::Create(NewClient(), options).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(EtcdPrefixEndTest, IncrementsTheLastByte) {
  EXPECT_EQ(EtcdPrefixEnd("/a/"), "/a0");
  EXPECT_EQ(EtcdPrefixEnd(std::string("a\xff", 2)), "b");
  EXPECT_EQ(EtcdPrefixEnd(std::string("\xff", 1)), std::string(1, '\0'));
}

}  // namespace
}  // namespace concord::coordinator
