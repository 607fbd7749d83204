#pragma once
// The fast level of the public API's tests: a real coordinator (the
// concord-coordinator binary, on a free loopback port) and N workers as
// threads of the test process, each with its own concord::Job over real
// Gloo — what Gloo's thread harness and PyTorch's multi-threaded test case
// do. (The coordinator runs as a process because libconcord.so carries its
// own copy of the generated protobuf code.) Process-level tests stay where
// the boundary matters: kills, the launcher.

#include <concord/concord.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <regex>
#include <string>
#include <thread>
#include <vector>

namespace concord::testing {

constexpr char kWorkerToken[] = "worker-token-0123456789";
constexpr char kOperatorToken[] = "operator-token-0123456789";

class CoordinatorProcess {
 public:
  // Starts `binary` on 127.0.0.1:0 with fresh tokens under `dir` and waits
  // (at most 20 s) for its "listening on" line.
  CoordinatorProcess(const std::string& binary, const std::string& dir) {
    const std::string worker = dir + "/worker.token";
    const std::string op = dir + "/operator.token";
    std::ofstream(worker) << kWorkerToken;
    std::ofstream(op) << kOperatorToken;
    int fds[2];
    if (pipe(fds) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      dup2(fds[1], STDERR_FILENO);
      dup2(fds[1], STDOUT_FILENO);
      close(fds[0]);
      execl(binary.c_str(), binary.c_str(), "--listen", "127.0.0.1:0",
            "--worker-token-file", worker.c_str(), "--operator-token-file",
            op.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    close(fds[1]);
    out_ = fdopen(fds[0], "r");
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::seconds(20);
    const std::regex listening("listening on (127\\.0\\.0\\.1:[0-9]+)");
    char line[4096];
    while (std::chrono::steady_clock::now() < deadline &&
           fgets(line, sizeof(line), out_) != nullptr) {
      std::cmatch m;
      if (std::regex_search(line, m, listening)) {
        address_ = m[1];
        break;
      }
    }
    // Keep draining its output so that it never blocks on a full pipe.
    drain_ = std::thread([f = out_] {
      char buf[4096];
      while (fgets(buf, sizeof(buf), f) != nullptr) {
      }
    });
  }
  ~CoordinatorProcess() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (drain_.joinable()) drain_.join();
    if (out_ != nullptr) fclose(out_);
  }
  const std::string& address() const { return address_; }

 private:
  pid_t pid_ = -1;
  FILE* out_ = nullptr;
  std::thread drain_;
  std::string address_;
};

// Options of worker `i` of an N-worker job `job_id` on `address` that
// goes on with `min` workers (default: all n), with fast failure detection.
inline JobOptions WorkerOptions(const std::string& address,
                                const std::string& job_id, int i, int n,
                                int min = 0, int max = 0) {
  using std::chrono::milliseconds;
  return JobOptions()
      .coordinator(address)
      .token(kWorkerToken)
      .job_id(job_id)
      .worker_id("w" + std::to_string(i))
      .min_workers(min > 0 ? min : n)
      .max_workers(max > 0 ? max : n)
      .timeouts(Timeouts()
                    .rendezvous(milliseconds(20000))
                    .collective(milliseconds(20000))
                    .heartbeat_interval(milliseconds(200))
                    .heartbeat_timeout(milliseconds(2000)));
}

// Runs `body(i, job)` on n threads, each joining as worker i of a job that
// goes on with `min` of them and admits `max` (default: n); a body that
// throws fails the test (with its message).
inline void RunJobThreads(const std::string& address, const std::string& job_id,
                          int n, const std::function<void(int, Job&)>& body,
                          int min = 0, int max = 0) {
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      try {
        Job job(WorkerOptions(address, job_id, i, n, min, max));
        body(i, job);
      } catch (const std::exception& e) {
        ADD_FAILURE() << "worker " << i << ": " << e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
}

// A real coordinator process for each test (CONCORD_COORDINATOR_BIN) and a
// scratch folder.
class JobThreadsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/concord-api-threads-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    coordinator_ =
        std::make_unique<CoordinatorProcess>(CONCORD_COORDINATOR_BIN, dir_);
    ASSERT_FALSE(coordinator_->address().empty())
        << "the coordinator did not start";
  }
  void TearDown() override {
    coordinator_.reset();
    std::system(("rm -rf " + dir_).c_str());
  }
  const std::string& address() const { return coordinator_->address(); }

  std::string dir_;
  std::unique_ptr<CoordinatorProcess> coordinator_;
};

}  // namespace concord::testing
