// The real binaries: concord-coordinator's startup errors (exit 2), a
// coordinator killed with SIGKILL and restarted on the same state directory
// (same generations, members and events; generations keep growing), and
// concordctl's table/JSON output and errors.

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "tests/coordinator/test_util.h"

namespace concord::coordinator {
namespace {

using namespace ::concord::coordinator::testing;  // NOLINT
using ::testing::HasSubstr;

const std::string kBin = CONCORD_BIN_DIR;

struct Result {
  int exit_status = -1;
  std::string out;
  std::string err;
};

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

class ProcessTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { spdlog::set_level(spdlog::level::warn); }

  void SetUp() override {
    char tmpl[] = "/tmp/concord-process-test-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    worker_file_ = dir_ + "/worker-token";
    operator_file_ = dir_ + "/operator-token";
    ASSERT_TRUE(WriteTokenFile(worker_file_, kWorkerToken).ok());
    ASSERT_TRUE(WriteTokenFile(operator_file_, kOperatorToken).ok());
  }

  void TearDown() override {
    for (pid_t pid : pids_) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
    const std::string rm = "rm -rf '" + dir_ + "'";
    (void)!std::system(rm.c_str());
  }

  // Runs a binary to completion (bounded by `timeout` seconds, via
  // timeout(1)) and captures its output.
  Result Run(std::vector<std::string> args, int timeout = 30) {
    const std::string out = dir_ + "/out", err = dir_ + "/err";
    args.insert(args.begin(),
                {"timeout", "-s", "KILL", std::to_string(timeout)});
    const pid_t pid = fork();
    if (pid == 0) {
      const int o = open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      const int e = open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      dup2(o, 1);
      dup2(e, 2);
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execvp(argv[0], argv.data());
      _exit(127);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    Result r;
    r.exit_status = WIFEXITED(status) ? WEXITSTATUS(status) : 128;
    r.out = ReadFile(out);
    r.err = ReadFile(err);
    return r;
  }

  // Starts concord-coordinator on a free loopback port; returns its address
  // (from its "listening on" log line), or "" when it did not come up.
  std::string StartCoordinator(const std::string& state_dir, pid_t* pid_out) {
    int fds[2];
    EXPECT_EQ(pipe(fds), 0);
    const pid_t pid = fork();
    if (pid == 0) {
      dup2(fds[1], 2);
      close(fds[0]);
      const std::string bin = kBin + "/concord-coordinator";
      execl(bin.c_str(), bin.c_str(), "--listen", "127.0.0.1:0", "--state-dir",
            state_dir.c_str(), "--worker-token-file", worker_file_.c_str(),
            "--operator-token-file", operator_file_.c_str(),
            static_cast<char*>(nullptr));
      _exit(127);
    }
    close(fds[1]);
    pids_.push_back(pid);
    *pid_out = pid;
    std::string log;
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (absl::Now() < deadline) {
      pollfd p{fds[0], POLLIN, 0};
      if (poll(&p, 1, 200) <= 0) continue;
      char buf[4096];
      const ssize_t n = read(fds[0], buf, sizeof(buf));
      if (n <= 0) break;
      log.append(buf, static_cast<size_t>(n));
      const size_t at = log.find("listening on ");
      const size_t eol = at == std::string::npos ? at : log.find('\n', at);
      if (eol != std::string::npos) {
        // Keep draining the pipe so the coordinator never blocks on it.
        std::thread([fd = fds[0]] {
          char sink[4096];
          while (read(fd, sink, sizeof(sink)) > 0) {
          }
          close(fd);
        }).detach();
        return log.substr(at + 13, eol - at - 13);
      }
    }
    ADD_FAILURE() << "coordinator did not start: " << log;
    return "";
  }

  void Kill(pid_t pid) {
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    pids_.erase(std::remove(pids_.begin(), pids_.end(), pid), pids_.end());
  }

  std::string dir_, worker_file_, operator_file_;
  std::vector<pid_t> pids_;
};

TEST_F(ProcessTest, StartupErrorsAreOneLineAndExitTwo) {
  const std::string coord = kBin + "/concord-coordinator";
  std::vector<std::vector<std::string>> cases = {
      {coord, "--worker-token-file", dir_ + "/missing", "--operator-token-file",
       operator_file_},
      {coord, "--worker-token-file", worker_file_},  // operator file missing
      {coord, "--worker-token-file", worker_file_, "--operator-token-file",
       worker_file_, "--listen", "127.0.0.1:0"},  // same token twice
      {coord, "--worker-token-file", worker_file_, "--operator-token-file",
       operator_file_, "--listen", "127.0.0.1:0", "--state-dir",
       worker_file_ + "/sub"},  // not a directory
      {coord, "--bogus-flag"},
      {coord, "--worker-token-file", worker_file_, "--operator-token-file",
       operator_file_, "--listen", "127.0.0.1:0", "--history-file",
       dir_ + "/missing/history.jsonl"},  // no such directory
      // The etcd store: flags that do not fit together, malformed
      // endpoints, and an etcd that is not there (closed port; given up
      // after 10 s).
      {coord, "--worker-token-file", worker_file_, "--operator-token-file",
       operator_file_, "--store", "etcd"},
      {coord, "--worker-token-file", worker_file_, "--operator-token-file",
       operator_file_, "--store", "etcd", "--etcd-endpoints",
       "http://127.0.0.1:1", "--state-dir", dir_ + "/state"},
      {coord, "--worker-token-file", worker_file_, "--operator-token-file",
       operator_file_, "--etcd-endpoints", "http://127.0.0.1:1"},
      {coord, "--worker-token-file", worker_file_, "--operator-token-file",
       operator_file_, "--store", "etcd", "--etcd-endpoints", "ftp://x:1"},
      {coord, "--worker-token-file", worker_file_, "--operator-token-file",
       operator_file_, "--store", "etcd", "--etcd-endpoints",
       "https://127.0.0.1:1"},  // https without --etcd-ca
      {coord, "--worker-token-file", worker_file_, "--operator-token-file",
       operator_file_, "--store", "etcd", "--etcd-endpoints",
       "http://127.0.0.1:1", "--etcd-lease-ttl", "1"},
      {coord, "--worker-token-file", worker_file_, "--operator-token-file",
       operator_file_, "--store", "etcd", "--etcd-endpoints",
       "http://127.0.0.1:1", "--listen", "127.0.0.1:0"},
  };
  // An address in use.
  auto taken = Server::Start(Options());
  ASSERT_TRUE(taken.ok());
  cases.push_back({coord, "--worker-token-file", worker_file_,
                   "--operator-token-file", operator_file_, "--listen",
                   (*taken)->address()});
  for (const auto& args : cases) {
    const Result r = Run(args);
    EXPECT_EQ(r.exit_status, 2) << args.back() << ": " << r.err;
    const std::vector<std::string> lines =
        absl::StrSplit(r.err, '\n', absl::SkipEmpty());
    EXPECT_EQ(lines.size(), 1u) << r.err;
  }
}

TEST_F(ProcessTest, SigkillAndRestartResumeEveryJob) {
  const std::string state = dir_ + "/state";
  pid_t pid = 0;
  const std::string first = StartCoordinator(state, &pid);
  ASSERT_FALSE(first.empty());
  auto worker = v1::WorkerService::NewStub(Channel(first));
  // Job "a": generation 1 of {w0, w1}; w1 fails; generation 2 of {w0, w2}.
  auto join = [&](const std::string& address, const std::string& job, int n,
                  std::vector<std::string> ids) {
    auto stub = v1::WorkerService::NewStub(Channel(address));
    std::vector<std::thread> threads;
    std::vector<v1::JoinResponse> out(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      threads.emplace_back([&, i] {
        const grpc::Status s = stub->Join(Ctx(kWorkerToken).get(),
                                          JoinReq(job, n, n, ids[i]), &out[i]);
        EXPECT_TRUE(s.ok()) << s.error_message();
      });
    }
    for (auto& t : threads) t.join();
    return out;
  };
  ASSERT_EQ(join(first, "a", 2, {"w0", "w1"})[0].generation(), 1);
  v1::LeaveRequest leave;
  leave.set_job_id("a");
  leave.set_worker_id("w1");
  leave.set_worker_secret(Secret("w1"));
  leave.set_generation(1);
  leave.set_reason(v1::LEAVE_REASON_ERROR);
  v1::LeaveResponse left;
  ASSERT_TRUE(worker->Leave(Ctx(kWorkerToken).get(), leave, &left).ok());
  ASSERT_EQ(join(first, "a", 2, {"w0", "w2"})[0].generation(), 2);
  // Job "b": one worker waiting for three.
  std::thread waiter([&] {
    v1::JoinResponse r;
    worker->Join(Ctx(kWorkerToken).get(), JoinReq("b", 3, 3, "lonely", 1000),
                 &r);
  });
  waiter.join();

  auto status_json = [&](const std::string& address, const std::string& job) {
    const Result r =
        Run({kBin + "/concordctl", "--endpoint", address, "--token-file",
             operator_file_, "-o", "json", "status", job});
    EXPECT_EQ(r.exit_status, 0) << r.err;
    return nlohmann::json::parse(r.out, nullptr, false);
  };
  auto stable = [](nlohmann::json j) {
    // Ages move with time; everything else must survive the restart.
    for (auto& m : j["members"]) m.erase("last_heartbeat_age_ms");
    for (auto& m : j["waiting"]) m.erase("last_heartbeat_age_ms");
    return j;
  };
  const nlohmann::json a_before = status_json(first, "a");
  const nlohmann::json b_before = status_json(first, "b");
  ASSERT_FALSE(a_before.is_discarded());
  EXPECT_EQ(a_before["generation"], 2);
  EXPECT_EQ(a_before["state"], "RUNNING");
  ASSERT_EQ(a_before["members"].size(), 2u);
  EXPECT_EQ(b_before["waiting"].size(), 1u);

  Kill(pid);
  const std::string second = StartCoordinator(state, &pid);
  ASSERT_FALSE(second.empty());
  const nlohmann::json a_after = status_json(second, "a");
  const nlohmann::json b_after = status_json(second, "b");
  EXPECT_EQ(stable(a_after), stable(a_before));
  EXPECT_EQ(stable(b_after), stable(b_before));
  const Result events = Run({kBin + "/concordctl", "--endpoint", second,
                             "--token-file", operator_file_, "events", "a"});
  EXPECT_EQ(events.exit_status, 0);
  EXPECT_THAT(events.out, HasSubstr("generation 2 formed"));

  // The members keep their place and their binding; the next generation
  // is 3, never lower.
  auto stub = v1::WorkerService::NewStub(Channel(second));
  v1::HeartbeatRequest hb;
  hb.set_job_id("a");
  hb.set_worker_id("w0");
  hb.set_worker_secret(Secret("w0"));
  hb.set_generation(2);
  v1::HeartbeatResponse hb_response;
  ASSERT_TRUE(stub->Heartbeat(Ctx(kWorkerToken).get(), hb, &hb_response).ok());
  hb.set_worker_secret(Secret("intruder"));
  EXPECT_EQ(
      stub->Heartbeat(Ctx(kWorkerToken).get(), hb, &hb_response).error_code(),
      grpc::StatusCode::PERMISSION_DENIED);
  leave.set_worker_id("w2");
  leave.set_worker_secret(Secret("w2"));
  leave.set_generation(2);
  ASSERT_TRUE(stub->Leave(Ctx(kWorkerToken).get(), leave, &left).ok());
  EXPECT_EQ(join(second, "a", 2, {"w0", "w3"})[0].generation(), 3);

  // Two coordinators never share a state directory.
  pid_t unused = 0;
  const Result locked =
      Run({kBin + "/concord-coordinator", "--listen", "127.0.0.1:0",
           "--state-dir", state, "--worker-token-file", worker_file_,
           "--operator-token-file", operator_file_});
  EXPECT_EQ(locked.exit_status, 2);
  EXPECT_THAT(locked.err, HasSubstr("in use"));
  (void)unused;
}

TEST_F(ProcessTest, ConcordctlTablesJsonAndErrors) {
  auto server = Server::Start(Options());
  ASSERT_TRUE(server.ok());
  const std::string address = (*server)->address();
  auto worker = v1::WorkerService::NewStub(Channel(address));
  v1::JoinResponse joined;
  ASSERT_TRUE(
      worker->Join(Ctx(kWorkerToken).get(), JoinReq("j1", 1, 1, "w0"), &joined)
          .ok());
  const std::string ctl = kBin + "/concordctl";
  auto base = [&](std::vector<std::string> rest) {
    std::vector<std::string> args = {ctl, "--endpoint", address, "--token-file",
                                     operator_file_};
    args.insert(args.end(), rest.begin(), rest.end());
    return args;
  };
  Result jobs = Run(base({"jobs"}));
  EXPECT_EQ(jobs.exit_status, 0) << jobs.err;
  EXPECT_THAT(jobs.out, HasSubstr("JOB"));
  EXPECT_THAT(jobs.out, HasSubstr("j1"));
  EXPECT_THAT(jobs.out, HasSubstr("RUNNING"));
  Result jobs_json = Run(base({"-o", "json", "jobs"}));
  auto j = nlohmann::json::parse(jobs_json.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << jobs_json.out;
  EXPECT_EQ(j["jobs"][0]["job_id"], "j1");
  EXPECT_EQ(j["jobs"][0]["generation"], 1);
  // The documented spelling: the output flag after the subcommand.
  Result status_json = Run(base({"status", "j1", "-o", "json"}));
  EXPECT_EQ(status_json.exit_status, 0) << status_json.err;
  EXPECT_FALSE(
      nlohmann::json::parse(status_json.out, nullptr, false).is_discarded())
      << status_json.out;
  Result status = Run(base({"status", "j1"}));
  EXPECT_EQ(status.exit_status, 0);
  EXPECT_THAT(status.out, HasSubstr("authoritative"));
  EXPECT_THAT(status.out, HasSubstr("w0"));
  Result drain = Run(base({"-o", "json", "drain", "j1", "w0"}));
  EXPECT_EQ(drain.exit_status, 0) << drain.err;
  EXPECT_EQ(nlohmann::json::parse(drain.out)["ended_generation"], 1);
  Result stop = Run(base({"stop", "j1", "--reason", "done"}));
  EXPECT_EQ(stop.exit_status, 0);
  EXPECT_THAT(stop.out, HasSubstr("STOPPED"));

  // Refusals: exit 1, one line naming the code.
  Result missing = Run(base({"status", "nope"}));
  EXPECT_EQ(missing.exit_status, 1);
  EXPECT_THAT(missing.err, HasSubstr("NOT_FOUND"));
  Result wrong_role =
      Run({ctl, "--endpoint", address, "--token-file", worker_file_, "jobs"});
  EXPECT_EQ(wrong_role.exit_status, 1);
  EXPECT_THAT(wrong_role.err, HasSubstr("PERMISSION_DENIED"));
  // Bad flags: exit 2, one line.
  for (const auto& args : std::vector<std::vector<std::string>>{
           base({"-o", "yaml", "jobs"}),
           base({"frobnicate"}),
           base({"drain", "j1"}),
           {ctl, "--endpoint", address, "--token-file", dir_ + "/missing",
            "jobs"}}) {
    const Result r = Run(args);
    EXPECT_EQ(r.exit_status, 2) << r.err;
    const std::vector<std::string> lines =
        absl::StrSplit(r.err, '\n', absl::SkipEmpty());
    EXPECT_EQ(lines.size(), 1u) << r.err;
  }
}

}  // namespace
}  // namespace concord::coordinator
