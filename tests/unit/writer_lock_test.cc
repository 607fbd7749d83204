// See Note [One writer per folder] in worker/checkpoint/writer_lock.h: one
// run writes a job's folder at a time, held by flock(2) across processes.

#include "worker/checkpoint/writer_lock.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "common/host.h"

namespace concord::checkpoint {
namespace {

namespace fs = std::filesystem;

class WriterLockTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/concord-writer-lock-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string LockLine() const {
    std::ifstream in(dir_ + "/.writer");
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }

  std::string dir_;
};

TEST_F(WriterLockTest, WritersOfOneRunShareTheFolder) {
  WriterLock a, b;
  ASSERT_TRUE(a.Hold(dir_, 7).ok());
  absl::Status second = b.Hold(dir_, 7);
  EXPECT_TRUE(second.ok()) << second;
  absl::StatusOr<WriterIdentity> line = ParseWriterIdentity(LockLine());
  ASSERT_TRUE(line.ok()) << line.status();
  EXPECT_EQ(line->run, 7);
  EXPECT_EQ(line->pid, ::getpid());
  EXPECT_EQ(line->host, HostName());
  // Held already: at once, nothing rewritten.
  const std::string before = LockLine();
  EXPECT_TRUE(a.Hold(dir_, 7).ok());
  EXPECT_EQ(LockLine(), before);
}

TEST_F(WriterLockTest, AnotherRunIsRefusedWhileAWriterOfTheFirstLives) {
  WriterLock first, second, other;
  ASSERT_TRUE(first.Hold(dir_, 7).ok());
  ASSERT_TRUE(second.Hold(dir_, 7).ok());
  const std::string before = LockLine();
  absl::Status refused = other.Hold(dir_, 8);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_NE(refused.message().find("is written by run 7 (host " + HostName() +
                                   ", pid " + std::to_string(::getpid())),
            std::string::npos)
      << refused;
  EXPECT_NE(refused.message().find("run 8 of the job may not write there"),
            std::string::npos)
      << refused;
  EXPECT_FALSE(other.held());
  EXPECT_EQ(LockLine(), before);  // nothing changed
  // One writer of run 7 gone is not enough: the other still writes.
  first.Release();
  EXPECT_EQ(other.Hold(dir_, 8).code(), absl::StatusCode::kFailedPrecondition);
  // Both gone: run 8 takes the folder.
  second.Release();
  absl::Status taken = other.Hold(dir_, 8);
  EXPECT_TRUE(taken.ok()) << taken;
  EXPECT_EQ(ParseWriterIdentity(LockLine())->run, 8);
  // And now run 7 is the one refused.
  EXPECT_EQ(first.Hold(dir_, 7).code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(WriterLockTest, AnEarlierRunsLineWithNobodyHoldingItIsTakenOver) {
  // A run killed whole: its line stays, its processes (and locks) are gone.
  std::ofstream(dir_ + "/.writer")
      << R"({"run":3,"host":"gone","pid":1,"since_unix_ms":0})"
      << "\n";
  WriterLock next;
  ASSERT_TRUE(next.Hold(dir_, 4).ok());
  EXPECT_EQ(ParseWriterIdentity(LockLine())->run, 4);
  // A damaged line, nobody holding it, likewise.
  next.Release();
  std::ofstream(dir_ + "/.writer") << "{not json";
  ASSERT_TRUE(next.Hold(dir_, 5).ok());
  EXPECT_EQ(ParseWriterIdentity(LockLine())->run, 5);
}

TEST_F(WriterLockTest, ALockFileThatIsALinkIsRefused) {
  const std::string target = dir_ + "/elsewhere";
  std::ofstream(target) << "";
  fs::create_symlink(target, dir_ + "/.writer");
  WriterLock lock;
  absl::Status s = lock.Hold(dir_, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find(".writer"), std::string::npos) << s;
}

TEST_F(WriterLockTest, AWriterInAnotherProcessHoldsItUntilItExits) {
  int ready[2], go[2];
  ASSERT_EQ(::pipe(ready), 0);
  ASSERT_EQ(::pipe(go), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    WriterLock lock;
    const char ok = lock.Hold(dir_, 11).ok() ? 'y' : 'n';
    (void)!::write(ready[1], &ok, 1);
    char c;
    (void)!::read(go[0], &c, 1);  // until the parent says
    ::_exit(0);
  }
  char ok = 0;
  ASSERT_EQ(::read(ready[0], &ok, 1), 1);
  ASSERT_EQ(ok, 'y');
  WriterLock mine;
  absl::Status refused = mine.Hold(dir_, 12);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_NE(refused.message().find("pid " + std::to_string(child)),
            std::string::npos)
      << refused;
  // The child exits (as a killed run's processes do): its lock goes with it.
  ASSERT_EQ(::write(go[1], "x", 1), 1);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  absl::Status taken = mine.Hold(dir_, 12);
  EXPECT_TRUE(taken.ok()) << taken;
  for (int fd : {ready[0], ready[1], go[0], go[1]}) ::close(fd);
}

TEST_F(WriterLockTest, TwoRunsTakingAFolderAtOnceEndWithOneWriter) {
  for (int round = 0; round < 20; ++round) {
    fs::remove(dir_ + "/.writer");
    WriterLock a, b;
    absl::Status sa, sb;
    std::atomic<bool> start{false};
    std::thread ta([&] {
      while (!start) {
      }
      sa = a.Hold(dir_, 100 + round);
    });
    std::thread tb([&] {
      while (!start) {
      }
      sb = b.Hold(dir_, 200 + round);
    });
    start = true;
    ta.join();
    tb.join();
    ASSERT_NE(sa.ok(), sb.ok())
        << "round " << round << ": " << sa << " / " << sb;
    const int64_t winner = sa.ok() ? 100 + round : 200 + round;
    EXPECT_EQ(ParseWriterIdentity(LockLine())->run, winner);
    const absl::Status& lost = sa.ok() ? sb : sa;
    EXPECT_EQ(lost.code(), absl::StatusCode::kFailedPrecondition) << lost;
    EXPECT_NE(lost.message().find("run " + std::to_string(winner)),
              std::string::npos)
        << lost;
  }
}

TEST(WriterIdentityTest, ParsesItsLineAndRefusesOthers) {
  auto id = ParseWriterIdentity(
      R"({"run":9,"host":"h","pid":42,"since_unix_ms":1796000000000})");
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(id->Describe(),
            "run 9 (host h, pid 42, since 2026-11-30 00:53:20 UTC)");
  for (const char* bad : {"", "{}", "[1]", R"({"run":"x","host":"h","pid":1,
        "since_unix_ms":0})",
                          "{\"run\":1"}) {
    EXPECT_EQ(ParseWriterIdentity(bad).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
}

}  // namespace
}  // namespace concord::checkpoint
