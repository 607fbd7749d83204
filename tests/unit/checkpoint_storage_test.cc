// Durable checkpoints on disk (worker/checkpoint/): crashes at each stage of
// a write, damaged files, keep, writes that fail and direct writes, on real
// files in a directory of its own per test. The memory tier, the checkpointer
// and the persister: checkpoint_memory_test.cc.
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <zlib.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "checkpoint_fixture.h"
#include "worker/checkpoint/file_writer.h"
#include "worker/checkpoint/writer_lock.h"

namespace concord::checkpoint {
namespace {

using namespace concord::checkpoint::ckpt_test;  // NOLINT  (fs, optim, json,
                                                 // matchers)

// ---- crashes
// -----------------------------------------------------------------

// Step 10 complete, step 20 stopped at `fault` as a crash would stop it.
void WriteTenThenCrashAtTwenty(const TempDir& dir, WriteFault fault) {
  ASSERT_TRUE(Write(SampleContent(10), dir).ok());
  WriteOptions options;
  options.fault = fault;
  absl::StatusOr<WriteStats> crashed = Write(SampleContent(20), dir, options);
  ASSERT_TRUE(absl::IsAborted(crashed.status())) << crashed.status();
}

// A later write of step 30 cleans up what crashed writers left for older
// steps (its own and another process's), not a newer step's staging.
void ExpectStepThirtyCleansUp(const TempDir& dir,
                              const std::vector<std::string>& step_dirs) {
  const std::string other_old = JobDir(dir) + "/.staging-step-25-1";
  const std::string other_new = JobDir(dir) + "/.staging-step-35-1";
  fs::create_directory(other_old);
  fs::create_directory(other_new);
  WriteText(JobDir(dir) + "/.latest-1", "ste");
  ASSERT_TRUE(Write(SampleContent(30), dir).ok());
  std::vector<std::string> expected = {".staging-step-35-1", "latest"};
  expected.insert(expected.end(), step_dirs.begin(), step_dirs.end());
  EXPECT_EQ(Entries(JobDir(dir)), expected);
  EXPECT_EQ(ReadText(JobDir(dir) + "/latest"), "step-30\n");
  absl::StatusOr<Loaded> loaded = LoadNewest(dir.path(), kJob);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->info.step, 30);
}

TEST(CheckpointCrashTest, BeforeTheManifestLeavesTheOlderOne) {
  TempDir dir;
  WriteTenThenCrashAtTwenty(dir, WriteFault::kBeforeManifest);
  EXPECT_TRUE(fs::is_directory(StagingDir(dir, 20)));
  EXPECT_FALSE(fs::exists(fs::path(StagingDir(dir, 20)) / "manifest.json"));
  EXPECT_FALSE(fs::exists(StepDir(dir, 20)));
  EXPECT_EQ(ReadText(JobDir(dir) + "/latest"), "step-10\n");
  absl::StatusOr<Loaded> loaded = LoadNewest(dir.path(), kJob);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->info.step, 10);
  ExpectSameContent(loaded->content, SampleContent(10));
  ExpectStepThirtyCleansUp(dir, {"step-10", "step-30"});
}

TEST(CheckpointCrashTest, BeforeTheRenameLeavesTheOlderOne) {
  TempDir dir;
  WriteTenThenCrashAtTwenty(dir, WriteFault::kBeforeRename);
  // Complete but staged: never loaded.
  EXPECT_TRUE(fs::exists(fs::path(StagingDir(dir, 20)) / "manifest.json"));
  EXPECT_FALSE(fs::exists(StepDir(dir, 20)));
  EXPECT_EQ(ReadText(JobDir(dir) + "/latest"), "step-10\n");
  absl::StatusOr<Loaded> loaded = LoadNewest(dir.path(), kJob);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->info.step, 10);
  EXPECT_EQ(ListCheckpoints(dir.path(), kJob).size(), 1u);
  ExpectStepThirtyCleansUp(dir, {"step-10", "step-30"});
}

// Renamed into place, `latest` not replaced yet: the loader goes by the
// step-N directories (see Note [Checkpoint directories]), so step 20 is what
// loads, while `latest` still names step 10.
TEST(CheckpointCrashTest, DuringLatestLosesNothing) {
  TempDir dir;
  WriteTenThenCrashAtTwenty(dir, WriteFault::kDuringLatest);
  EXPECT_FALSE(fs::exists(StagingDir(dir, 20)));
  ASSERT_TRUE(fs::is_directory(StepDir(dir, 20)));
  EXPECT_EQ(ReadText(JobDir(dir) + "/latest"), "step-10\n");
  absl::StatusOr<Content> twenty = LoadCheckpoint(StepDir(dir, 20), kJob);
  ASSERT_TRUE(twenty.ok()) << twenty.status();
  ExpectSameContent(*twenty, SampleContent(20));
  absl::StatusOr<Loaded> loaded = LoadNewest(dir.path(), kJob);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->info.step, 20);
  EXPECT_TRUE(LoadCheckpoint(StepDir(dir, 10), kJob).ok());
  ExpectStepThirtyCleansUp(dir, {"step-10", "step-20", "step-30"});
}

// ---- damaged checkpoints
// -------------------------------------------------------

// Steps 10 and 20, then `damage` to step 20: LoadCheckpoint names `file`,
// LoadNewest falls back to step 10.
void ExpectDamageFallsBack(
    const std::function<void(const std::string& step_dir)>& damage,
    const std::string& file, absl::StatusCode code) {
  TempDir dir;
  ASSERT_TRUE(Write(SampleContent(10), dir).ok());
  ASSERT_TRUE(Write(SampleContent(20), dir).ok());
  ASSERT_TRUE(LoadCheckpoint(StepDir(dir, 20), kJob).ok());
  damage(StepDir(dir, 20));
  absl::StatusOr<Content> bad = LoadCheckpoint(StepDir(dir, 20), kJob);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), code) << bad.status();
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr(file));
  absl::StatusOr<Loaded> loaded = LoadNewest(dir.path(), kJob);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->info.step, 10);
  EXPECT_EQ(loaded->info.path, StepDir(dir, 10));
  ExpectSameContent(loaded->content, SampleContent(10));
}

TEST(CheckpointDamageTest, AFlippedByteInTheModelFallsBack) {
  ExpectDamageFallsBack(
      [](const std::string& step_dir) {
        const std::string path = step_dir + "/model.pt";
        std::string bytes = ReadText(path);
        ASSERT_GT(bytes.size(), 100u);
        bytes[bytes.size() / 2] ^= 0x01;
        WriteText(path, bytes);
      },
      "model.pt", absl::StatusCode::kDataLoss);
}

// A digit of the epoch or the sample position flipped in the manifest: it
// still parses, but its fields' CRC-32 no longer matches.
TEST(CheckpointDamageTest, AFlippedDigitInTheManifestFallsBack) {
  TempDir dir;
  ASSERT_TRUE(Write(SampleContent(10), dir).ok());
  ASSERT_TRUE(Write(SampleContent(20), dir).ok());
  const std::string path = StepDir(dir, 20) + "/manifest.json";
  json manifest = json::parse(ReadText(path));
  ASSERT_TRUE(manifest.contains("manifest_crc32"));
  manifest["samples"] = manifest["samples"].get<int64_t>() + 1;
  WriteText(path, manifest.dump(2));
  absl::StatusOr<Loaded> loaded = LoadNewest(dir.path(), kJob);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->info.step, 10);
  // One written before the field: taken as it is.
  const std::string older = StepDir(dir, 10) + "/manifest.json";
  json plain = json::parse(ReadText(older));
  plain.erase("manifest_crc32");
  WriteText(older, plain.dump(2));
  loaded = LoadNewest(dir.path(), kJob);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->info.step, 10);
}

TEST(CheckpointDamageTest, ATruncatedManifestFallsBack) {
  ExpectDamageFallsBack(
      [](const std::string& step_dir) {
        const std::string path = step_dir + "/manifest.json";
        const std::string text = ReadText(path);
        WriteText(path, text.substr(0, text.size() / 2));
      },
      "manifest.json", absl::StatusCode::kInvalidArgument);
}

TEST(CheckpointDamageTest, AMissingOptimizerFileFallsBack) {
  ExpectDamageFallsBack(
      [](const std::string& step_dir) {
        ASSERT_TRUE(fs::remove(step_dir + "/optimizer.pt"));
      },
      "optimizer.pt", absl::StatusCode::kInvalidArgument);
}

TEST(CheckpointDamageTest, AManifestOfAnotherJobFallsBack) {
  ExpectDamageFallsBack(
      [](const std::string& step_dir) {
        const std::string path = step_dir + "/manifest.json";
        std::ifstream in(path);
        json m = json::parse(in);
        in.close();
        m["job"] = "job-b";
        WriteText(path, m.dump(2));
      },
      "manifest.json", absl::StatusCode::kInvalidArgument);
}

TEST(CheckpointDamageTest, NothingLoadableIsNotFound) {
  TempDir dir;
  EXPECT_TRUE(absl::IsNotFound(LoadNewest(dir.path(), kJob).status()));
  ASSERT_TRUE(Write(SampleContent(10), dir).ok());
  ASSERT_TRUE(fs::remove(StepDir(dir, 10) + "/state.pt"));
  EXPECT_TRUE(absl::IsNotFound(LoadNewest(dir.path(), kJob).status()));
}

// ---- keep
// ----------------------------------------------------------------------

// See Note [Archive writer]: the manifest's CRC-32 of a file, which the
// archive writer combines from its pieces' (big records written in place),
// is zlib's over the file's bytes.
TEST(CheckpointDiskTest, TheManifestsCrcIsZlibsOverTheFile) {
  TempDir dir;
  ASSERT_TRUE(Write(SampleContent(10, 1 << 20), dir).ok());
  const std::string step = StepDir(dir, 10);
  const json manifest = json::parse(ReadText(step + "/manifest.json"));
  int checked = 0;
  for (const auto& [file, entry] : manifest.at("files").items()) {
    const std::string bytes = ReadText(step + "/" + file);
    EXPECT_EQ(entry.at("size").get<uint64_t>(), bytes.size()) << file;
    EXPECT_EQ(
        entry.at("crc32").get<uint32_t>(),
        crc32_z(0, reinterpret_cast<const Bytef*>(bytes.data()), bytes.size()))
        << file;
    ++checked;
  }
  EXPECT_GE(checked, 3);
}

// Pruning keeps `keep` checkpoints that can load: one whose file is
// truncated (or missing) is not counted, so an older complete one stays.
TEST(CheckpointDiskTest, PruningCountsOnlyCheckpointsWhoseFilesAreThere) {
  TempDir dir;
  for (int64_t step : {10, 20, 30}) {
    ASSERT_TRUE(Write(SampleContent(step), dir).ok());
  }
  const std::string model = StepDir(dir, 30) + "/model.pt";
  const std::string bytes = ReadText(model);
  WriteText(model, bytes.substr(0, bytes.size() / 2));
  ASSERT_TRUE(Write(SampleContent(40), dir).ok());
  // 40, 20 and 10 load: all three kept; the damaged 30 is left for a person
  // until three newer complete ones exist.
  EXPECT_THAT(Entries(JobDir(dir)), ElementsAre("latest", "step-10", "step-20",
                                                "step-30", "step-40"));
  ASSERT_TRUE(fs::remove(StepDir(dir, 40) + "/optimizer.pt"));
  absl::StatusOr<Loaded> loaded = LoadNewest(dir.path(), kJob);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->info.step, 20);
}

TEST(CheckpointDiskTest, KeepsTheNewestThree) {
  TempDir dir;
  WriteOptions options;
  options.keep = 3;
  for (int64_t step = 10; step <= 60; step += 10) {
    absl::StatusOr<WriteStats> w = Write(SampleContent(step), dir, options);
    ASSERT_TRUE(w.ok()) << w.status();
  }
  EXPECT_THAT(Entries(JobDir(dir)),
              ElementsAre("latest", "step-40", "step-50", "step-60"));
  const std::vector<CheckpointInfo> list = ListCheckpoints(dir.path(), kJob);
  ASSERT_EQ(list.size(), 3u);
  EXPECT_EQ(list[0].step, 60);
  EXPECT_EQ(list[1].step, 50);
  EXPECT_EQ(list[2].step, 40);
}

// A damaged checkpoint stays while it is among the newest three (for a
// person to look at), and goes once three complete newer ones exist.
TEST(CheckpointDiskTest, ADamagedOneGoesOnceKeepNewerOnesAreComplete) {
  TempDir dir;
  WriteOptions options;
  options.keep = 3;
  for (int64_t step = 10; step <= 20; step += 10) {
    ASSERT_TRUE(Write(SampleContent(step), dir, options).ok());
  }
  ASSERT_TRUE(fs::remove(StepDir(dir, 20) + "/manifest.json"));
  for (int64_t step = 30; step <= 40; step += 10) {
    ASSERT_TRUE(Write(SampleContent(step), dir, options).ok());
  }
  EXPECT_THAT(Entries(JobDir(dir)), ElementsAre("latest", "step-10", "step-20",
                                                "step-30", "step-40"));
  ASSERT_TRUE(Write(SampleContent(50), dir, options).ok());
  EXPECT_THAT(Entries(JobDir(dir)),
              ElementsAre("latest", "step-30", "step-40", "step-50"));
}

// ---- writes that fail
// ------------------------------------------------------------

bool CanCreate(const std::string& path) {
  std::ofstream probe(path);
  const bool ok = probe.good();
  probe.close();
  if (ok) fs::remove(path);
  return ok;
}

// After a failed write of step 20: no staging directory, step 10 loads.
void ExpectOnlyStepTen(const TempDir& dir) {
  EXPECT_THAT(Entries(JobDir(dir)), ElementsAre("latest", "step-10"));
  EXPECT_EQ(ReadText(JobDir(dir) + "/latest"), "step-10\n");
  absl::StatusOr<Loaded> loaded = LoadNewest(dir.path(), kJob);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->info.step, 10);
}

TEST(CheckpointWriteFailureTest, AReadOnlyDirectoryIsUnavailable) {
  TempDir dir;
  ASSERT_TRUE(Write(SampleContent(10), dir).ok());
  ASSERT_EQ(::chmod(JobDir(dir).c_str(), 0555), 0);
  if (CanCreate(JobDir(dir) + "/probe")) {
    ::chmod(JobDir(dir).c_str(), 0755);
    GTEST_SKIP() << "chmod does not stop this process (root)";
  }
  absl::StatusOr<WriteStats> w = Write(SampleContent(20), dir);
  EXPECT_TRUE(absl::IsUnavailable(w.status())) << w.status();
  EXPECT_THAT(std::string(w.status().message()), HasSubstr(JobDir(dir)));
  ExpectOnlyStepTen(dir);
  ASSERT_EQ(::chmod(JobDir(dir).c_str(), 0755), 0);
}

// The same as another user where this runs as root (chmod does not stop
// root): the write in a child process that gave up root.
TEST(CheckpointWriteFailureTest, AReadOnlyDirectoryIsUnavailableToAnotherUser) {
  if (::geteuid() != 0) GTEST_SKIP() << "not root: the test above covers it";
  TempDir dir;
  ASSERT_TRUE(Write(SampleContent(10), dir).ok());
  ASSERT_EQ(::chmod(dir.path().c_str(), 0755), 0);
  ASSERT_EQ(::chmod(JobDir(dir).c_str(), 0555), 0);
  const Content twenty = SampleContent(20);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0) << std::strerror(errno);
  if (pid == 0) {
    constexpr uid_t kNobody = 65534;
    if (::setgroups(0, nullptr) != 0 || ::setgid(kNobody) != 0 ||
        ::setuid(kNobody) != 0) {
      ::_exit(10);
    }
    absl::StatusOr<WriteStats> w =
        WriteCheckpoint(twenty, dir.path(), kJob, {});
    ::_exit(w.ok() ? 1 : absl::IsUnavailable(w.status()) ? 0 : 2);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << status;
  if (WEXITSTATUS(status) == 10) {
    GTEST_SKIP() << "cannot become another user";
  }
  EXPECT_EQ(WEXITSTATUS(status), 0)
      << "1: the write succeeded, 2: another error than UNAVAILABLE";
  ExpectOnlyStepTen(dir);
}

TEST(CheckpointWriteFailureTest, ADirectoryThatIsAFileIsUnavailable) {
  TempDir dir;
  const std::string file = dir / "a-file";
  WriteText(file, "not a directory");
  absl::StatusOr<WriteStats> w =
      WriteCheckpoint(SampleContent(10), file, kJob, {});
  EXPECT_TRUE(absl::IsUnavailable(w.status())) << w.status();
  EXPECT_THAT(std::string(w.status().message()), HasSubstr(file));
  EXPECT_EQ(ReadText(file), "not a directory");
  EXPECT_THAT(Entries(dir.path()), ElementsAre("a-file"));

  // The job's directory a file, next to another job's checkpoints.
  ASSERT_TRUE(WriteCheckpoint(SampleContent(10), dir.path(), "job-b", {}).ok());
  WriteText(JobDir(dir), "not a directory");
  w = Write(SampleContent(20), dir);
  EXPECT_TRUE(absl::IsUnavailable(w.status())) << w.status();
  EXPECT_EQ(ReadText(JobDir(dir)), "not a directory");
  EXPECT_TRUE(LoadNewest(dir.path(), "job-b").ok());
}

// `latest` names the newest step there is: an older step written after a
// newer one (another writer's, a step written again) does not move it back.
TEST(CheckpointDiskTest, LatestNeverMovesBackwards) {
  TempDir dir;
  ASSERT_TRUE(Write(SampleContent(20), dir).ok());
  ASSERT_TRUE(Write(SampleContent(10), dir).ok());
  EXPECT_EQ(ReadText(JobDir(dir) + "/latest"), "step-20\n");
  ASSERT_TRUE(Write(SampleContent(30), dir).ok());
  EXPECT_EQ(ReadText(JobDir(dir) + "/latest"), "step-30\n");
  // What it names is gone (removed by hand): an older one may take it.
  fs::remove_all(JobDir(dir) + "/step-30");
  ASSERT_TRUE(Write(SampleContent(25), dir).ok());
  EXPECT_EQ(ReadText(JobDir(dir) + "/latest"), "step-25\n");
}

// A checkpoint folder that is not there yet is made, each new level's entry
// synced into its parent (not observable here: the write works through
// several new levels and loads).
TEST(CheckpointDiskTest, AFolderNotThereYetIsMadeLevelByLevel) {
  TempDir dir;
  const std::string deep = dir.path() + "/a/b/c";
  WriteOptions options;
  ASSERT_TRUE(WriteCheckpoint(SampleContent(10), deep, kJob, options).ok());
  absl::StatusOr<Loaded> loaded = LoadNewest(deep, kJob);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->info.step, 10);
}

// ---- runs (see Note [Runs] in coordinator/core/core.h)

Content OfRun(int64_t step, int64_t run) {
  Content c = SampleContent(step);
  c.counters.run = run;
  return c;
}

// A run started afresh (--no-resume) at step 0 is newer than an earlier
// run's higher steps: loaded first, named by `latest`, and the earlier run's
// are pruned first.
TEST(CheckpointRunsTest, ALaterRunIsNewerWhateverItsSteps) {
  TempDir dir;
  WriteOptions options;
  options.keep = 3;
  for (int64_t step : {400, 500}) {
    ASSERT_TRUE(Write(OfRun(step, 1), dir, options).ok());
  }
  ASSERT_TRUE(Write(OfRun(50, 2), dir, options).ok());
  EXPECT_EQ(ReadText(JobDir(dir) + "/latest"), "step-50\n");
  const std::vector<CheckpointInfo> list = ListCheckpoints(dir.path(), kJob);
  ASSERT_EQ(list.size(), 3u);
  EXPECT_EQ(std::make_pair(list[0].run, list[0].step), std::make_pair(2L, 50L));
  EXPECT_EQ(std::make_pair(list[1].run, list[1].step),
            std::make_pair(1L, 500L));
  EXPECT_EQ(std::make_pair(list[2].run, list[2].step),
            std::make_pair(1L, 400L));
  absl::StatusOr<Loaded> newest = LoadNewest(dir.path(), kJob);
  ASSERT_TRUE(newest.ok()) << newest.status();
  EXPECT_EQ(newest->content.counters.step, 50);
  EXPECT_EQ(newest->content.counters.run, 2);
  // One run's alone: --no-resume's view.
  absl::StatusOr<Loaded> first = LoadNewest(dir.path(), kJob, /*only_run=*/1);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->info.step, 500);
  EXPECT_TRUE(absl::IsNotFound(LoadNewest(dir.path(), kJob, 3).status()));
  // Two more of run 2: the keep of 3 prunes run 1's, though their steps are
  // higher.
  for (int64_t step : {60, 70}) {
    ASSERT_TRUE(Write(OfRun(step, 2), dir, options).ok());
  }
  EXPECT_THAT(Entries(JobDir(dir)),
              ElementsAre("latest", "step-50", "step-60", "step-70"));
  EXPECT_EQ(ReadText(JobDir(dir) + "/latest"), "step-70\n");
  // An earlier run's write (a writer of run 1 still going) moves nothing
  // back and prunes nothing newer.
  ASSERT_TRUE(Write(OfRun(600, 1), dir, options).ok());
  EXPECT_EQ(ReadText(JobDir(dir) + "/latest"), "step-70\n");
  EXPECT_EQ(LoadNewest(dir.path(), kJob)->info.step, 70);
}

// A later run's checkpoint of a step an earlier run wrote replaces it.
TEST(CheckpointRunsTest, AStepWrittenAgainByALaterRunReplacesIt) {
  TempDir dir;
  ASSERT_TRUE(Write(OfRun(100, 1), dir).ok());
  ASSERT_TRUE(Write(OfRun(100, 2), dir).ok());
  EXPECT_THAT(Entries(JobDir(dir)), ElementsAre("latest", "step-100"));
  EXPECT_EQ(LoadNewest(dir.path(), kJob)->content.counters.run, 2);
  EXPECT_TRUE(absl::IsNotFound(LoadNewest(dir.path(), kJob, 1).status()));
}

// See Note [One writer per folder] in worker/checkpoint/writer_lock.h: while
// a writer of another run holds the folder, a write is refused and changes
// nothing; once it is gone, the write takes the folder.
TEST(CheckpointRunsTest, AWriteIsRefusedWhileAnotherRunHoldsTheFolder) {
  TempDir dir;
  ASSERT_TRUE(Write(OfRun(10, 31), dir).ok());
  // Another writer of run 31 (a node agent of that run, say) holds it too.
  WriterLock keeper;
  ASSERT_TRUE(keeper.Hold(JobDir(dir), 31).ok());
  const std::vector<std::string> before = Entries(JobDir(dir));
  absl::StatusOr<WriteStats> refused = Write(OfRun(20, 32), dir);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition)
      << refused.status();
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("is written by run 31"));
  EXPECT_EQ(Entries(JobDir(dir)), before);  // no staging, nothing pruned
  EXPECT_EQ(LoadNewest(dir.path(), kJob)->info.step, 10);
  // That writer gone (its run ended), run 32 writes.
  keeper.Release();
  ASSERT_TRUE(Write(OfRun(20, 32), dir).ok());
  EXPECT_EQ(LoadNewest(dir.path(), kJob)->info.step, 20);
}

// Once renamed into place the checkpoint is complete and loads: a failure
// to replace `latest` after that is a warning, not a failed checkpoint.
TEST(CheckpointWriteFailureTest, ALatestThatCannotBeReplacedIsAWarning) {
  TempDir dir;
  ASSERT_TRUE(Write(SampleContent(10), dir).ok());
  fs::remove(JobDir(dir) + "/latest");
  fs::create_directories(JobDir(dir) + "/latest/in-the-way");
  absl::StatusOr<WriteStats> w = Write(SampleContent(20), dir);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_THAT(w->warning, HasSubstr("'latest' not updated"));
  absl::StatusOr<Loaded> loaded = LoadNewest(dir.path(), kJob);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->info.step, 20);
}

TEST(CheckpointWriteFailureTest, ANameThatCannotBeAFileRemovesTheStaging) {
  TempDir dir;
  ASSERT_TRUE(Write(SampleContent(10), dir).ok());
  for (const std::string name : {"state", "../model", ""}) {
    Content content = SampleContent(20);
    content.modules.emplace_back(name, NamedTensors{{"x", torch::ones({2})}});
    absl::StatusOr<WriteStats> w = Write(content, dir);
    EXPECT_TRUE(absl::IsInvalidArgument(w.status())) << name << w.status();
    ExpectOnlyStepTen(dir);
  }
  Content twice = SampleContent(20);
  twice.optimizers[0].name = "model";  // a module's name already
  EXPECT_TRUE(absl::IsInvalidArgument(Write(twice, dir).status()));
  ExpectOnlyStepTen(dir);
}

// ---- direct writes (see Note [Direct writes])
// ------------------------------------------------------------

// Where the file writer's tests write: the test's directory (O_DIRECT where
// its filesystem has it) and, where one can be made, a directory in
// /dev/shm (tmpfs, which may refuse it), removed with the object.
struct WriterPlaces {
  TempDir dir;
  std::string shm = "/dev/shm/concord-file-writer-XXXXXX";
  std::vector<std::string> all = {dir.path()};
  WriterPlaces() {
    if (::mkdtemp(shm.data()) != nullptr) all.push_back(shm);
  }
  ~WriterPlaces() {
    if (all.size() > 1) fs::remove_all(shm);
  }
};

// Every size around the block and the buffer, appended in odd pieces, reads
// back byte for byte with its exact size: on the test's directory (O_DIRECT
// where its filesystem has it) and in /dev/shm (tmpfs, which may refuse it).
TEST(CheckpointFileWriterTest, WritesEveryByteAtItsSize) {
  const WriterPlaces places;
  constexpr size_t kBuffer = 3 * FileWriter::kAlign;
  std::mt19937 rng(7);
  for (const std::string& place : places.all) {
    for (size_t size :
         {size_t{0}, size_t{1}, FileWriter::kAlign - 1, FileWriter::kAlign,
          FileWriter::kAlign + 1, kBuffer, 5 * kBuffer + 123}) {
      std::string bytes(size, '\0');
      for (char& c : bytes) c = static_cast<char>(rng());
      const std::string path =
          (fs::path(place) / absl::StrCat("f", size)).string();
      absl::StatusOr<std::unique_ptr<FileWriter>> w = FileWriter::Create(
          path, std::make_shared<WriteBuffers>(kBuffer, 2 * kBuffer));
      ASSERT_TRUE(w.ok()) << w.status();
      for (size_t at = 0; at < size; at += 1000) {
        ASSERT_TRUE(
            (*w)->Append(bytes.data() + at, std::min<size_t>(1000, size - at)));
      }
      const bool direct = (*w)->direct();
      ASSERT_TRUE((*w)->Finish().ok()) << path;
      std::ifstream in(path, std::ios::binary);
      const std::string back((std::istreambuf_iterator<char>(in)),
                             std::istreambuf_iterator<char>());
      EXPECT_EQ(back.size(), size) << path << (direct ? " (direct)" : "");
      EXPECT_TRUE(back == bytes) << path << (direct ? " (direct)" : "");
    }
  }
}

// Bytes the caller keeps (AppendLasting) go to the file from where they lie
// when the file is written with O_DIRECT and both they and the file's size
// are page-aligned: only their last partial page, and what is not aligned,
// is copied into blocks. Everything reads back byte for byte, O_DIRECT or
// not (/dev/shm).
TEST(CheckpointFileWriterTest, LastingBytesAreWrittenFromWhereTheyLie) {
  const WriterPlaces places;
  constexpr size_t kPage = FileWriter::kAlign;
  constexpr size_t kBlock = 3 * kPage;
  constexpr size_t kLasting = 40 * kPage + 123;  // more than the whole pool
  std::unique_ptr<char, decltype(&std::free)> lasting(
      static_cast<char*>(std::aligned_alloc(kPage, kLasting + kPage)),
      &std::free);
  std::mt19937 rng(5);
  for (size_t i = 0; i < kLasting + kPage; ++i) {
    lasting.get()[i] = static_cast<char>(rng());
  }
  const std::string head(kPage, 'h');
  // Brings the file's size back to a whole page after the two lasting
  // pieces.
  const std::string tail(kPage - (kLasting + 2 * kPage) % kPage, 't');
  for (const std::string& place : places.all) {
    const std::string path = (fs::path(place) / "lasting").string();
    absl::StatusOr<std::unique_ptr<FileWriter>> w = FileWriter::Create(
        path, std::make_shared<WriteBuffers>(kBlock, 2 * kBlock));
    ASSERT_TRUE(w.ok()) << w.status();
    // Aligned (after one page), then at an odd file size, then from an
    // odd address at an aligned size: only the first goes in place.
    ASSERT_TRUE((*w)->Append(head.data(), head.size()));
    ASSERT_TRUE((*w)->AppendLasting(lasting.get(), kLasting));
    ASSERT_TRUE((*w)->AppendLasting(lasting.get(), 2 * kPage));
    ASSERT_TRUE((*w)->Append(tail.data(), tail.size()));
    ASSERT_TRUE((*w)->AppendLasting(lasting.get() + 1, 2 * kPage));
    const bool direct = (*w)->direct();
    const uint64_t copied = (*w)->copied();
    const uint64_t size = (*w)->size();
    ASSERT_TRUE((*w)->Finish().ok()) << path;
    std::string expected = head;
    expected.append(lasting.get(), kLasting);
    expected.append(lasting.get(), 2 * kPage);
    expected += tail;
    expected.append(lasting.get() + 1, 2 * kPage);
    EXPECT_EQ(size, expected.size());
    EXPECT_EQ(copied, direct ? expected.size() - kLasting / kPage * kPage
                             : expected.size())
        << path << (direct ? " (direct)" : "");
    std::ifstream in(path, std::ios::binary);
    const std::string back((std::istreambuf_iterator<char>(in)),
                           std::istreambuf_iterator<char>());
    EXPECT_TRUE(back == expected) << path << (direct ? " (direct)" : "");
  }
}

// Skip (a hole another process fills, see Note [Shards written where they
// are] in worker/checkpoint/disk.h): zeros read back, the file has its
// size also when it ends in a hole, and the whole pages of a hole are
// neither copied nor written (on the test's directory, a sparse file).
TEST(CheckpointFileWriterTest, SkippedBytesReadBackAsZerosAndAreNotWritten) {
  const WriterPlaces places;
  constexpr size_t kPage = FileWriter::kAlign;
  constexpr size_t kBlock = 3 * kPage;
  constexpr size_t kHole = 64 * kPage + 5;  // more than the whole pool
  const std::string head(kPage + 17, 'h'), middle(300, 'm');
  for (const std::string& place : places.all) {
    const std::string path = (fs::path(place) / "skipped").string();
    absl::StatusOr<std::unique_ptr<FileWriter>> w = FileWriter::Create(
        path, std::make_shared<WriteBuffers>(kBlock, 2 * kBlock));
    ASSERT_TRUE(w.ok()) << w.status();
    // From an odd size, then from a whole page, then at the end.
    ASSERT_TRUE((*w)->Append(head.data(), head.size()));
    ASSERT_TRUE((*w)->Skip(kHole));
    ASSERT_TRUE((*w)->Append(middle.data(), middle.size()));
    ASSERT_TRUE(
        (*w)->Skip(kPage - (head.size() + kHole + middle.size()) % kPage));
    ASSERT_TRUE((*w)->Skip(2 * kPage));
    const uint64_t copied = (*w)->copied();
    const uint64_t size = (*w)->size();
    ASSERT_TRUE((*w)->Finish().ok()) << path;
    std::string expected = head + std::string(kHole, '\0') + middle;
    expected.resize(
        expected.size() + kPage - expected.size() % kPage + 2 * kPage, '\0');
    EXPECT_EQ(size, expected.size());
    // Only the bytes around the holes' whole pages went through blocks.
    EXPECT_LT(copied, 3 * kPage + head.size() + middle.size()) << path;
    std::ifstream in(path, std::ios::binary);
    const std::string back((std::istreambuf_iterator<char>(in)),
                           std::istreambuf_iterator<char>());
    EXPECT_EQ(back.size(), expected.size()) << path;
    EXPECT_TRUE(back == expected) << path;
    struct stat st {};
    ASSERT_EQ(::stat(path.c_str(), &st), 0);
    EXPECT_LT(static_cast<uint64_t>(st.st_blocks) * 512, expected.size())
        << path;
  }
}

// See Note [Write queue]: the pool grows to its limit and no further while
// the disk lags, and the next file reuses its blocks.
TEST(CheckpointFileWriterTest, TheQueueStaysWithinItsLimitAndIsReused) {
  TempDir dir;
  constexpr size_t kBlock = 16 * FileWriter::kAlign;
  auto pool = std::make_shared<WriteBuffers>(kBlock, 5 * kBlock);
  std::string bytes(40 * kBlock + 7, '\0');
  std::mt19937 rng(11);
  for (char& c : bytes) c = static_cast<char>(rng());
  for (const char* name : {"a", "b"}) {
    const std::string path = (fs::path(dir.path()) / name).string();
    absl::StatusOr<std::unique_ptr<FileWriter>> w =
        FileWriter::Create(path, pool);
    ASSERT_TRUE(w.ok()) << w.status();
    ASSERT_TRUE((*w)->Append(bytes.data(), bytes.size()));
    ASSERT_TRUE((*w)->Finish().ok());
    EXPECT_LE(pool->made(), 5u) << name;
    EXPECT_GE(pool->made(), 2u) << name;
    std::ifstream in(path, std::ios::binary);
    const std::string back((std::istreambuf_iterator<char>(in)),
                           std::istreambuf_iterator<char>());
    EXPECT_TRUE(back == bytes) << name;
  }
  // Every block came back: a third writer takes them all again.
  const size_t made = pool->made();
  bool no_memory = false;
  std::vector<char*> taken;
  for (size_t i = 0; i < made; ++i) taken.push_back(pool->TryTake(&no_memory));
  EXPECT_EQ(std::count(taken.begin(), taken.end(), nullptr), 0);
  for (char* b : taken) {
    if (b != nullptr) pool->Give(b);
  }
}

// A write that fails on the writing thread (here: past the file size limit,
// EFBIG) fails the file at Finish with the error, and the caller is never
// left waiting for a block.
TEST(CheckpointFileWriterTest, AFailedWriteIsReportedAndNothingWaits) {
  TempDir dir;
  constexpr size_t kBlock = 16 * FileWriter::kAlign;
  rlimit old;
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  ::signal(SIGXFSZ, SIG_IGN);
  rlimit small = old;
  small.rlim_cur = 4 * kBlock;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  const std::string path = (fs::path(dir.path()) / "big").string();
  absl::StatusOr<std::unique_ptr<FileWriter>> w = FileWriter::Create(
      path, std::make_shared<WriteBuffers>(kBlock, 3 * kBlock));
  ASSERT_TRUE(w.ok()) << w.status();
  const std::string chunk(kBlock, 'x');
  bool appended = true;
  for (int i = 0; i < 64 && appended; ++i) {
    appended = (*w)->Append(chunk.data(), chunk.size());
  }
  // A caller that goes on writing (miniz writes its directory at the end)
  // is refused, not crashed.
  EXPECT_FALSE((*w)->Append(chunk.data(), chunk.size()));
  const absl::Status finished = (*w)->Finish();
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &old), 0);
  EXPECT_FALSE(appended);
  EXPECT_TRUE(absl::IsUnavailable(finished)) << finished;
  EXPECT_THAT(std::string(finished.message()), HasSubstr(std::strerror(EFBIG)));
  // Which write failed, and where.
  EXPECT_THAT(
      std::string(finished.message()),
      testing::ContainsRegex("write of [0-9]+ bytes at offset [0-9]+: "));
}

TEST(CheckpointFileWriterTest, AnExistingFileIsNotOverwritten) {
  TempDir dir;
  const std::string path = (fs::path(dir.path()) / "there").string();
  { std::ofstream(path) << "kept"; }
  absl::StatusOr<std::unique_ptr<FileWriter>> w = FileWriter::Create(path);
  ASSERT_FALSE(w.ok());
  EXPECT_TRUE(absl::IsUnavailable(w.status())) << w.status();
  EXPECT_THAT(std::string(w.status().message()), HasSubstr("cannot create"));
  std::ifstream in(path);
  std::string text;
  in >> text;
  EXPECT_EQ(text, "kept");
}

}  // namespace
}  // namespace concord::checkpoint
