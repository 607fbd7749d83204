// Durable checkpoints in memory (worker/checkpoint/): the snapshot region,
// overlapped snapshots, the checkpointer's resume candidates and the disk
// tier's persister thread, on real regions and files in a directory of their
// own per test. The disk format's crashes and damage:
// checkpoint_storage_test.cc.
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "checkpoint_fixture.h"
#include "common/status_macros.h"
#include "worker/checkpoint/checkpointer.h"
#include "worker/checkpoint/persister.h"

namespace concord::checkpoint {
namespace {

using namespace concord::checkpoint::ckpt_test;  // NOLINT  (fs, optim, json,
                                                 // matchers)
using ::testing::Not;
// ---- the memory tier --------------------------------------------------------

void ExpectSnapshotRoundTrip(Region& region) {
  EXPECT_TRUE(absl::IsNotFound(ReadSnapshot(region).status()));
  const Content small = SampleContent(5);
  absl::StatusOr<WriteResult> w = WriteSnapshot(region, small, kJob, false);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(*w, WriteResult::kWritten);
  EXPECT_EQ(region.header().state.load(), RegionHeader::kReady);
  EXPECT_EQ(region.header().step, 5);
  EXPECT_EQ(region.header().sequence.load(), 1u);
  EXPECT_STREQ(region.header().job, kJob);
  {
    absl::StatusOr<Content> read = ReadSnapshot(region);
    ASSERT_TRUE(read.ok()) << read.status();
    ExpectSameContent(*read, small);
  }
  const size_t mapped = region.mapped();

  // Larger: the region grows.
  const Content large = SampleContent(6, 1 << 18);
  w = WriteSnapshot(region, large, kJob, true);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(*w, WriteResult::kWritten);
  EXPECT_GT(region.mapped(), mapped);
  EXPECT_EQ(region.header().sequence.load(), 2u);
  EXPECT_EQ(region.header().persist, 1u);
  {
    absl::StatusOr<Content> read = ReadSnapshot(region);
    ASSERT_TRUE(read.ok()) << read.status();
    ExpectSameContent(*read, large);
  }

  // Smaller again: the region stays, the snapshot is the new one.
  w = WriteSnapshot(region, small, kJob, false);
  ASSERT_TRUE(w.ok()) << w.status();
  {
    absl::StatusOr<Content> read = ReadSnapshot(region);
    ASSERT_TRUE(read.ok()) << read.status();
    ExpectSameContent(*read, small);
  }

  // Being persisted: the next one is skipped, the last one stays.
  region.header().state.store(RegionHeader::kPersisting);
  w = WriteSnapshot(region, SampleContent(7), kJob, false);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(*w, WriteResult::kSkippedBusy);
  EXPECT_EQ(region.header().state.load(), RegionHeader::kPersisting);
  EXPECT_EQ(region.header().sequence.load(), 3u);
  {
    absl::StatusOr<Content> read = ReadSnapshot(region);
    ASSERT_TRUE(read.ok()) << read.status();
    ExpectSameContent(*read, small);
  }

  // Torn by a writer that died: never read.
  region.header().state.store(RegionHeader::kWriting);
  EXPECT_TRUE(absl::IsNotFound(ReadSnapshot(region).status()));
  // The next writer takes it over.
  w = WriteSnapshot(region, SampleContent(8), kJob, false);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(*w, WriteResult::kWritten);
  absl::StatusOr<Content> read = ReadSnapshot(region);
  ASSERT_TRUE(read.ok()) << read.status();
  ExpectSameContent(*read, SampleContent(8));
}

TEST(CheckpointMemoryTest, AnonymousRegionRoundTrips) {
  absl::StatusOr<std::unique_ptr<Region>> region = Region::Open("");
  ASSERT_TRUE(region.ok()) << region.status();
  ExpectSnapshotRoundTrip(**region);
}

TEST(CheckpointMemoryTest, FileRegionRoundTrips) {
  TempDir dir;
  absl::StatusOr<std::unique_ptr<Region>> region = Region::Open(dir / "shm");
  ASSERT_TRUE(region.ok()) << region.status();
  ExpectSnapshotRoundTrip(**region);
  EXPECT_GE(fs::file_size(dir / "shm"), (*region)->header().bytes);
}

// concord-run's agent opens the file the workers write.
TEST(CheckpointMemoryTest, AnotherOpeningOfTheFileSeesTheSnapshot) {
  TempDir dir;
  const std::string path = dir / "shm";
  absl::StatusOr<std::unique_ptr<Region>> writer = Region::Open(path);
  ASSERT_TRUE(writer.ok()) << writer.status();
  absl::StatusOr<std::unique_ptr<Region>> early = Region::Open(path);
  ASSERT_TRUE(early.ok()) << early.status();
  EXPECT_TRUE(absl::IsNotFound(ReadSnapshot(**early).status()));

  const Content large = SampleContent(12, 1 << 16);
  ASSERT_TRUE(WriteSnapshot(**writer, large, kJob, true).ok());
  // Opened before the region grew: it maps the rest when reading.
  EXPECT_LT((*early)->mapped(), (*writer)->mapped());
  {
    absl::StatusOr<Content> read = ReadSnapshot(**early);
    ASSERT_TRUE(read.ok()) << read.status();
    ExpectSameContent(*read, large);
  }
  absl::StatusOr<std::unique_ptr<Region>> late = Region::Open(path);
  ASSERT_TRUE(late.ok()) << late.status();
  EXPECT_EQ((*late)->header().sequence.load(), 1u);
  EXPECT_EQ((*late)->header().step, 12);
  EXPECT_EQ((*late)->header().persist, 1u);
  EXPECT_STREQ((*late)->header().job, kJob);
  absl::StatusOr<Content> read = ReadSnapshot(**late);
  ASSERT_TRUE(read.ok()) << read.status();
  ExpectSameContent(*read, large);

  // A state another opening sets is this one's too.
  (*late)->header().state.store(RegionHeader::kPersisting);
  absl::StatusOr<WriteResult> w =
      WriteSnapshot(**writer, SampleContent(13), kJob, true);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(*w, WriteResult::kSkippedBusy);
}

// A region that cannot grow to the next snapshot fails that write; the
// last complete snapshot, untouched, stays readable.
// The owner's region is made by its call alone, and nobody follows a link
// planted at a region's (predictable) path.
TEST(CheckpointMemoryTest, TheOwnersRegionIsNewAndLinksAreRefused) {
  TempDir dir;
  const std::string path = dir / "shm";
  absl::StatusOr<std::unique_ptr<Region>> owner = Region::Create(path);
  ASSERT_TRUE(owner.ok()) << owner.status();
  EXPECT_TRUE(Region::Open(path).ok());  // a worker's
  const absl::Status again = Region::Create(path).status();
  EXPECT_TRUE(absl::IsUnavailable(again)) << again;
  EXPECT_THAT(std::string(again.message()), HasSubstr(path));
  const std::string link = dir / "link";
  fs::create_symlink(dir / "elsewhere", link);
  EXPECT_TRUE(absl::IsUnavailable(Region::Create(link).status()));
  EXPECT_TRUE(absl::IsUnavailable(Region::Open(link).status()));
  EXPECT_FALSE(fs::exists(dir / "elsewhere"));
}

TEST(CheckpointMemoryTest, ASnapshotThatCannotFitKeepsTheLastOne) {
  absl::StatusOr<std::unique_ptr<Region>> region = Region::Open("");
  ASSERT_TRUE(region.ok()) << region.status();
  const Content small = SampleContent(5);
  ASSERT_TRUE(WriteSnapshot(**region, small, kJob, false).ok());
  Content huge = SampleContent(6);
  // 4 PiB that take no memory: no region maps that much.
  huge.extra.emplace_back("values/huge",
                          torch::zeros({1}).expand({int64_t{1} << 50}));
  absl::StatusOr<WriteResult> w = WriteSnapshot(**region, huge, kJob, false);
  EXPECT_TRUE(absl::IsUnavailable(w.status())) << w.status();
  absl::StatusOr<Content> read = ReadSnapshot(**region);
  ASSERT_TRUE(read.ok()) << read.status();
  ExpectSameContent(*read, small);
}

// A checkpointer of job kJob writing into `dir`, its region its own (no node
// agent) or the file `memory` (a node agent's).
std::unique_ptr<Checkpointer> MakeCheckpointer(const TempDir& dir,
                                               bool overlap = false,
                                               const std::string& memory = "") {
  Config config;
  config.dir = dir.path();
  config.memory = memory;
  config.every = 10;
  config.overlap = overlap;
  absl::StatusOr<std::unique_ptr<Checkpointer>> c =
      Checkpointer::Create(config, kJob);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

// See Note [One job's checkpoints] in coordinator/core/core.h: the checkpoint
// the coordinator names is loaded only at this job's own path for its step,
// and only when its manifest is this job's; otherwise the worker looks in its
// folder as if nothing were named.
TEST(CheckpointerResumeTest, ANamedCheckpointLoadsOnlyFromThisJobsFolder) {
  TempDir dir, other;
  ASSERT_TRUE(Write(SampleContent(10), dir).ok());
  ASSERT_TRUE(
      WriteCheckpoint(SampleContent(30), other.path(), "job-b", {}).ok());
  // Job b's step 30, copied into this job's folder as step 40.
  fs::copy(fs::path(other.path()) / "job-b" / "step-30", StepDir(dir, 40));
  std::unique_ptr<Checkpointer> c = MakeCheckpointer(dir);
  ASSERT_NE(c, nullptr);
  for (const Checkpointer::Named& named :
       {Checkpointer::Named{
            30, (fs::path(other.path()) / "job-b" / "step-30").string()},
        Checkpointer::Named{40, StepDir(dir, 40)},
        Checkpointer::Named{30, StepDir(dir, 40)}}) {
    std::optional<Candidate> got = c->FindCandidate(/*disk=*/true, named);
    ASSERT_TRUE(got.has_value()) << named.path;
    EXPECT_EQ(got->step, 10) << named.path;
    EXPECT_THAT(got->source, HasSubstr(StepDir(dir, 10))) << named.path;
  }
  // A path in another spelling of the same folder is not the job's path.
  const std::string dotted =
      (fs::path(dir.path()) / "." / kJob / "step-10").string();
  std::optional<Candidate> got =
      c->FindCandidate(true, Checkpointer::Named{10, dotted});
  ASSERT_TRUE(got.has_value());
  EXPECT_THAT(got->source, Not(HasSubstr("as the coordinator named")));
  got = c->FindCandidate(true, Checkpointer::Named{10, StepDir(dir, 10)});
  ASSERT_TRUE(got.has_value());
  EXPECT_THAT(got->source, HasSubstr("as the coordinator named"));
}

// ---- overlapped snapshots (see Note [Overlapped snapshots]) -----------------

// The tensors of `content` that Stage may leave live: the module's float
// parameter and the optimizer's moments.
std::vector<at::Tensor> Deferrable(const Content& content) {
  return {content.modules[0].second[0].second,
          content.optimizers[0].state[0].second[1].second,
          content.optimizers[0].state[0].second[2].second};
}

// Stage clones everything but the deferred tensors; BeginSnapshot copies
// into the region and leaves it unreadable until FinishSnapshot publishes it.
TEST(CheckpointOverlapTest, StagedThenPublishedAtTheFinish) {
  absl::StatusOr<std::unique_ptr<Region>> region = Region::Open("");
  ASSERT_TRUE(region.ok()) << region.status();
  const Content content = SampleContent(5, 1 << 12);
  const std::vector<at::Tensor> deferred = Deferrable(content);
  Staged staged = Stage(content, deferred);
  ASSERT_EQ(staged.live.size(), 3u);
  EXPECT_TRUE(staged.content.modules[0].second[0].second.is_same(deferred[0]));
  EXPECT_TRUE(staged.content.optimizers[0].state[0].second[2].second.is_same(
      deferred[2]));
  // The rest are copies: the step may write the live ones.
  EXPECT_FALSE(staged.content.modules[0].second[2].second.is_same(
      content.modules[0].second[2].second));
  EXPECT_FALSE(staged.content.extra[0].second.is_same(content.extra[0].second));
  ExpectSameContent(staged.content, content);

  PendingSnapshot pending;
  absl::StatusOr<WriteResult> w =
      BeginSnapshot(**region, staged.content, kJob, true, &pending);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(*w, WriteResult::kWritten);
  EXPECT_EQ((*region)->header().state.load(), RegionHeader::kWriting);
  EXPECT_TRUE(absl::IsNotFound(ReadSnapshot(**region).status()));
  absl::StatusOr<int64_t> step = FinishSnapshot(pending, 0.002, staged.live);
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(*step, 5);
  EXPECT_EQ((*region)->header().stall_ns, 2000000u);
  absl::StatusOr<Content> read = ReadSnapshot(**region);
  ASSERT_TRUE(read.ok()) << read.status();
  ExpectSameContent(*read, content);
}

// A live tensor written in place before the finish: the snapshot may be
// torn, and it is dropped, never published.
TEST(CheckpointOverlapTest, ALiveTensorWrittenBeforeTheFinishDropsIt) {
  absl::StatusOr<std::unique_ptr<Region>> region = Region::Open("");
  ASSERT_TRUE(region.ok()) << region.status();
  ASSERT_TRUE(WriteSnapshot(**region, SampleContent(4), kJob, false).ok());
  Content content = SampleContent(5, 1 << 12);
  Staged staged = Stage(content, Deferrable(content));
  PendingSnapshot pending;
  ASSERT_TRUE(
      BeginSnapshot(**region, staged.content, kJob, true, &pending).ok());
  content.optimizers[0].state[0].second[1].second.add_(1.0);
  absl::StatusOr<int64_t> step = FinishSnapshot(pending, 0.001, staged.live);
  EXPECT_TRUE(absl::IsAborted(step.status())) << step.status();
  EXPECT_THAT(std::string(step.status().message()),
              HasSubstr("written in place"));
  EXPECT_EQ((*region)->header().state.load(), RegionHeader::kEmpty);
  EXPECT_TRUE(absl::IsNotFound(ReadSnapshot(**region).status()));
}

// The checkpointer with Config::overlap: a snapshot is complete at its
// Fence; one whose live tensor was written is dropped and overlapping stops
// (later ones are complete when Save returns).
TEST(CheckpointOverlapTest, TheCheckpointerCompletesAtTheFence) {
  TempDir dir;
  std::unique_ptr<Checkpointer> c = MakeCheckpointer(dir, /*overlap=*/true);
  ASSERT_NE(c, nullptr);
  c->SetRole(/*writes_memory=*/true, /*persists=*/false);
  std::vector<int64_t> completed;
  c->OnSaved([&](const Counters& k) { completed.push_back(k.step); });

  Content content = SampleContent(5, 1 << 16);
  c->Save(content, false, Deferrable(content));
  EXPECT_EQ(c->saved(), 0);
  EXPECT_TRUE(completed.empty());
  c->Fence();
  EXPECT_EQ(c->saved(), 1);
  EXPECT_EQ(completed, std::vector<int64_t>({5}));
  std::optional<Candidate> got = c->FindCandidate(false);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->step, 5);
  ExpectSameContent(got->content, content);

  content = SampleContent(6, 1 << 16);
  c->Save(content, false, Deferrable(content));
  content.modules[0].second[0].second.mul_(2.0);  // before the backward
  c->Fence();
  EXPECT_EQ(c->saved(), 1);
  EXPECT_FALSE(c->FindCandidate(false).has_value());

  content = SampleContent(7, 1 << 16);
  c->Save(content, false, Deferrable(content));
  EXPECT_EQ(c->saved(), 2);  // copied during the step
  EXPECT_EQ(completed, std::vector<int64_t>({5, 7}));
}

// Prepare grows the region ahead of the first snapshot, on the worker that
// writes it only.
TEST(CheckpointOverlapTest, PrepareMakesTheRegionAhead) {
  TempDir dir;
  std::unique_ptr<Checkpointer> c = MakeCheckpointer(dir);
  ASSERT_NE(c, nullptr);
  const Content content = SampleContent(5, 1 << 18);
  const size_t needed = SnapshotBytes(content);
  ASSERT_LT(c->region_bytes(), needed);
  c->Prepare(content);  // not this node's writer: nothing
  EXPECT_LT(c->region_bytes(), needed);
  c->SetRole(/*writes_memory=*/true, /*persists=*/false);
  c->Prepare(content);
  EXPECT_GE(c->region_bytes(), needed);
  c->Save(content);
  EXPECT_EQ(c->saved(), 1);
  std::optional<Candidate> got = c->FindCandidate(false);
  ASSERT_TRUE(got.has_value());
  ExpectSameContent(got->content, content);
}

// ---- holes (see Note [Holes] in worker/checkpoint/memory.h) ----------------

// Two workers of one node on the node's region (config.memory).
std::unique_ptr<Checkpointer> NodeCheckpointer(const TempDir& dir,
                                               bool overlap = false) {
  return MakeCheckpointer(dir, overlap, dir / "shm");
}

// `full` with the optimizer's state as holes: meta tensors of its shapes.
Content Holed(const Content& full) {
  Content c = full;
  c.optimizers[0] = Cloned(full.optimizers[0]);
  for (auto& [index, tensors] : c.optimizers[0].state) {
    for (auto& [key, t] : tensors) t = at::empty_like(t, at::kMeta);
  }
  return c;
}

// What another worker of the node does: its state copied into the laid-out
// snapshot's holes.
absl::Status Fill(Checkpointer& peer, const Content& full) {
  CONCORD_ASSIGN_OR_RETURN(Content laid,
                           peer.LaidOut(full.counters.step, ::getpid()));
  const auto& from = full.optimizers[0].state;
  const auto& to = laid.optimizers[0].state;
  for (size_t i = 0; i < from.size(); ++i) {
    for (size_t k = 0; k < from[i].second.size(); ++k) {
      to[i].second[k].second.copy_(from[i].second[k].second);
    }
  }
  return absl::OkStatus();
}

// The writer lays out a content with holes and publishes it only when the
// node's other worker said it filled them; unfilled, it is dropped.
TEST(CheckpointHolesTest, PublishedOnceTheNodesOtherWorkerFilledThem) {
  for (const bool overlap : {false, true}) {
    SCOPED_TRACE(overlap ? "overlapped" : "during the step");
    TempDir dir;
    std::unique_ptr<Checkpointer> writer = NodeCheckpointer(dir, overlap);
    std::unique_ptr<Checkpointer> peer = NodeCheckpointer(dir, overlap);
    ASSERT_NE(writer, nullptr);
    ASSERT_NE(peer, nullptr);
    writer->SetRole(/*writes_memory=*/true, /*persists=*/false);
    const Content full = SampleContent(5, 1 << 16);
    const Content holed = Holed(full);
    EXPECT_TRUE(HasHoles(holed));
    EXPECT_FALSE(HasHoles(full));
    writer->Save(holed, false, Deferrable(full));
    EXPECT_EQ(writer->holes(), Checkpointer::HoleState::kLaidOut);
    EXPECT_EQ(writer->saved(), 0);
    EXPECT_FALSE(peer->FindCandidate(false).has_value());
    // Another step's or another writer's snapshot is not this one.
    EXPECT_TRUE(
        absl::IsFailedPrecondition(peer->LaidOut(6, ::getpid()).status()));
    EXPECT_TRUE(
        absl::IsFailedPrecondition(peer->LaidOut(5, ::getpid() + 1).status()));
    ASSERT_TRUE(Fill(*peer, full).ok());
    writer->Filled(absl::OkStatus());
    writer->Fence();
    EXPECT_EQ(writer->saved(), 1);
    std::optional<Candidate> got = peer->FindCandidate(false);
    ASSERT_TRUE(got.has_value());
    ExpectSameContent(got->content, full);

    // A worker that could not fill its holes: the snapshot is dropped.
    const Content next = SampleContent(6, 1 << 16);
    writer->Save(Holed(next), false, Deferrable(next));
    ASSERT_EQ(writer->holes(), Checkpointer::HoleState::kLaidOut);
    writer->Filled(absl::InternalError("rank 1: no place"));
    writer->Fence();
    EXPECT_EQ(writer->saved(), 1);
    EXPECT_FALSE(peer->FindCandidate(false).has_value());
    // Nobody said anything by the Fence: dropped too.
    writer->Save(Holed(next), false, Deferrable(next));
    writer->Fence();
    EXPECT_EQ(writer->saved(), 1);
    // And a complete one after.
    writer->Save(Holed(next), false, Deferrable(next));
    ASSERT_TRUE(Fill(*peer, next).ok());
    writer->Filled(absl::OkStatus());
    writer->Fence();
    EXPECT_EQ(writer->saved(), 2);
    got = peer->FindCandidate(false);
    ASSERT_TRUE(got.has_value());
    ExpectSameContent(got->content, next);
  }
}

// The disk tier's writer whose memory stage fails never writes its holes
// to disk: it waits for the content with them filled (WriteFilled).
TEST(CheckpointHolesTest, AFailedMemoryStageWritesTheFilledContent) {
  TempDir dir;
  std::unique_ptr<Checkpointer> writer = NodeCheckpointer(dir);
  ASSERT_NE(writer, nullptr);
  writer->SetRole(/*writes_memory=*/true, /*persists=*/true);
  const Content full = SampleContent(10);
  Content holed = Holed(full);
  // A hole of 4 PiB: no region maps that much.
  holed.optimizers[0].state[0].second[1].second =
      at::empty({int64_t{1} << 50}, at::TensorOptions().device(at::kMeta));
  writer->Save(holed);
  EXPECT_EQ(writer->holes(), Checkpointer::HoleState::kFailed);
  EXPECT_FALSE(fs::exists(StepDir(dir, 10)));
  writer->WriteFilled(full);
  EXPECT_EQ(writer->saved(), 1);
  absl::StatusOr<Loaded> loaded = LoadNewest(dir.path(), kJob);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->info.step, 10);
  ExpectSameOptimizer(loaded->content.optimizers[0], full.optimizers[0]);
}

// ---- the resume source (see Note [Resume source] in coordinator/core/core.h)
// ------------------------------------------------------------

// The checkpoint the coordinator names is offered; a newer complete one in
// the directory (its report lost with its writer) is offered instead; one
// that does not load falls back to the directory's newest.
TEST(CheckpointCandidateTest, TheNamedCheckpointOrANewerOne) {
  TempDir dir;
  WriteOptions options;
  options.keep = 10;
  ASSERT_TRUE(
      WriteCheckpoint(SampleContent(10), dir.path(), kJob, options).ok());
  ASSERT_TRUE(
      WriteCheckpoint(SampleContent(30), dir.path(), kJob, options).ok());
  std::unique_ptr<Checkpointer> c = MakeCheckpointer(dir);
  ASSERT_NE(c, nullptr);
  const std::string named_path = StepDir(dir, 30);
  // Named (on the node that wrote it, at the job's path for its step):
  // taken.
  std::optional<Candidate> got =
      c->FindCandidate(true, Checkpointer::Named{30, named_path});
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->step, 30);
  EXPECT_THAT(got->source, HasSubstr("as the coordinator named"));
  // Not the rank that offers the disk's: nothing (no memory snapshot).
  EXPECT_FALSE(
      c->FindCandidate(false, Checkpointer::Named{30, named_path}).has_value());
  // A newer one in the directory wins over the named one.
  ASSERT_TRUE(
      WriteCheckpoint(SampleContent(40), dir.path(), kJob, options).ok());
  got = c->FindCandidate(true, Checkpointer::Named{30, named_path});
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->step, 40);
  EXPECT_THAT(got->source, Not(HasSubstr("named")));
  // A named one that does not load (another step there, or gone): the
  // directory's newest.
  got = c->FindCandidate(true, Checkpointer::Named{35, named_path});
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->step, 40);
  fs::remove_all(named_path);
  got = c->FindCandidate(true, Checkpointer::Named{30, named_path});
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->step, 40);
}

// ---- the persister
// ------------------------------------------------------------

TEST(CheckpointPersisterTest, FlushWritesAPersistedSnapshotOnce) {
  TempDir dir;
  absl::StatusOr<std::unique_ptr<Region>> region = Region::Open("");
  ASSERT_TRUE(region.ok()) << region.status();
  const Content content = SampleContent(40, 1000);
  ASSERT_TRUE(WriteSnapshot(**region, content, kJob, true).ok());
  {
    Persister persister(region->get(), dir.path(), 3);
    persister.Flush();
    PersisterStats stats = persister.stats();
    EXPECT_EQ(stats.written, 1);
    EXPECT_EQ(stats.failed, 0);
    EXPECT_EQ(stats.last_step, 40);
    EXPECT_GT(stats.last_bytes, 0u);
    EXPECT_EQ((*region)->header().state.load(), RegionHeader::kReady);
    EXPECT_EQ((*region)->header().persisted.load(),
              (*region)->header().sequence.load());
    persister.Flush();
    EXPECT_FALSE(persister.PersistOnce());
    EXPECT_EQ(persister.stats().written, 1);
  }
  EXPECT_THAT(Entries(JobDir(dir)), ElementsAre("latest", "step-40"));
  absl::StatusOr<Loaded> loaded = LoadNewest(dir.path(), kJob);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->info.step, 40);
  ExpectSameContent(loaded->content, content);
}

// One limit for job ids (common/job_defaults.h): the longest the
// coordinator accepts goes through the region whole, so the persister
// writes and reports under the job's own id.
TEST(CheckpointPersisterTest, TheLongestJobIdGoesThroughWhole) {
  TempDir dir;
  absl::StatusOr<std::unique_ptr<Region>> region = Region::Open("");
  ASSERT_TRUE(region.ok()) << region.status();
  const std::string job(kMaxIdLength, 'j');
  const Content content = SampleContent(20, 100);
  ASSERT_TRUE(WriteSnapshot(**region, content, job, true).ok());
  std::vector<PersistReport> reports;
  {
    Persister persister(region->get(), dir.path(), 3, {},
                        [&](const PersistReport& r) { reports.push_back(r); });
    persister.Flush();
  }
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports[0].job, job);
  EXPECT_TRUE(reports[0].error.empty()) << reports[0].error;
  absl::StatusOr<Loaded> loaded = LoadNewest(dir.path(), job);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->info.step, 20);
}

TEST(CheckpointPersisterTest, ASnapshotNotForTheDiskTierIsNotWritten) {
  TempDir dir;
  absl::StatusOr<std::unique_ptr<Region>> region = Region::Open("");
  ASSERT_TRUE(region.ok()) << region.status();
  ASSERT_TRUE(WriteSnapshot(**region, SampleContent(40), kJob, false).ok());
  {
    Persister persister(region->get(), dir.path(), 3);
    persister.Flush();
    const PersisterStats stats = persister.stats();
    EXPECT_EQ(stats.written, 0);
    EXPECT_EQ(stats.failed, 0);
    EXPECT_EQ(stats.last_step, -1);
    EXPECT_EQ((*region)->header().state.load(), RegionHeader::kReady);
  }
  EXPECT_FALSE(fs::exists(JobDir(dir)));
  EXPECT_TRUE(ListCheckpoints(dir.path(), kJob).empty());
  // The snapshot stays for the memory tier.
  EXPECT_TRUE(ReadSnapshot(**region).ok());
}

// A writer rings the region's doorbell: the persister (its own view of the
// memory, as in a worker without an agent) writes each snapshot at once,
// though it would look on its own only every minute; each report says the
// snapshot's stall, and the one after a skipped snapshot counts it.
TEST(CheckpointPersisterTest, TheWriterWakesThePersister) {
  TempDir dir;
  absl::StatusOr<std::unique_ptr<Region>> region = Region::Open("");
  ASSERT_TRUE(region.ok()) << region.status();
  absl::StatusOr<std::unique_ptr<Region>> view = (*region)->Share();
  ASSERT_TRUE(view.ok()) << view.status();
  std::mutex mu;
  std::condition_variable cv;
  std::vector<PersistReport> reports;
  Persister persister(
      view->get(), dir.path(), 10, {},
      [&](const PersistReport& r) {
        std::lock_guard<std::mutex> lock(mu);
        reports.push_back(r);
        cv.notify_all();
      },
      std::chrono::minutes(1));
  auto wait_for = [&](size_t n) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, std::chrono::seconds(20),
                       [&] { return reports.size() >= n; });
  };
  for (int64_t step : {10, 20, 30}) {
    // Each larger than the last: the writer grows (remaps) its view while
    // the persister maps its own.
    absl::StatusOr<WriteResult> w =
        WriteSnapshot(**region, SampleContent(step, 100 * step), kJob, true);
    ASSERT_TRUE(w.ok()) << w.status();
    ASSERT_EQ(*w, WriteResult::kWritten);
    ASSERT_TRUE(wait_for(static_cast<size_t>(step / 10)))
        << "no write of step " << step << " within 20 s";
  }
  // The persister holds the region: a due snapshot is skipped.
  RegionHeader& h = (*region)->header();
  uint32_t ready = RegionHeader::kReady;
  ASSERT_TRUE(
      h.state.compare_exchange_strong(ready, RegionHeader::kPersisting));
  absl::StatusOr<WriteResult> busy =
      WriteSnapshot(**region, SampleContent(40), kJob, true);
  ASSERT_TRUE(busy.ok()) << busy.status();
  EXPECT_EQ(*busy, WriteResult::kSkippedBusy);
  h.state.store(RegionHeader::kReady);
  ASSERT_TRUE(WriteSnapshot(**region, SampleContent(50), kJob, true).ok());
  ASSERT_TRUE(wait_for(4)) << "no write of step 50 within 20 s";
  std::lock_guard<std::mutex> lock(mu);
  ASSERT_EQ(reports.size(), 4u);
  std::vector<int64_t> steps, skipped;
  for (const PersistReport& r : reports) {
    steps.push_back(r.step);
    skipped.push_back(r.skipped);
    EXPECT_TRUE(r.error.empty()) << r.error;
    EXPECT_GT(r.stall_seconds, 0);
    EXPECT_EQ(r.path,
              (fs::path(JobDir(dir)) / absl::StrCat("step-", r.step)).string());
  }
  EXPECT_THAT(steps, ElementsAre(10, 20, 30, 50));
  EXPECT_THAT(skipped, ElementsAre(0, 0, 0, 1));
}

// A write that fails is reported with its error and where it was going.
TEST(CheckpointPersisterTest, AFailedWriteIsReported) {
  TempDir dir;
  const std::string file = (fs::path(dir.path()) / "a-file").string();
  { std::ofstream(file) << "not a directory"; }
  absl::StatusOr<std::unique_ptr<Region>> region = Region::Open("");
  ASSERT_TRUE(region.ok()) << region.status();
  ASSERT_TRUE(WriteSnapshot(**region, SampleContent(40), kJob, true).ok());
  std::vector<PersistReport> reports;
  {
    Persister persister(
        region->get(), file, 3, {},
        [&](const PersistReport& r) { reports.push_back(r); },
        std::chrono::minutes(1));
    persister.Flush();
    EXPECT_EQ(persister.stats().failed, 1);
  }
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports[0].step, 40);
  EXPECT_EQ(reports[0].job, kJob);
  EXPECT_FALSE(reports[0].error.empty());
  EXPECT_EQ(reports[0].path, absl::StrCat(file, "/", kJob, "/step-40"));
  EXPECT_EQ(reports[0].bytes, 0u);
}

// See Note [Resume source]: a snapshot another node's writer persists is
// reported as memory only (step, the region's bytes, no path): nothing is
// written.
TEST(CheckpointPersisterTest, ASnapshotInMemoryOnlyIsReported) {
  TempDir dir;
  absl::StatusOr<std::unique_ptr<Region>> region = Region::Open("");
  ASSERT_TRUE(region.ok()) << region.status();
  ASSERT_TRUE(WriteSnapshot(**region, SampleContent(30), kJob, false).ok());
  std::vector<PersistReport> reports;
  {
    Persister persister(
        region->get(), dir.path(), 3, {},
        [&](const PersistReport& r) { reports.push_back(r); },
        std::chrono::minutes(1));
    persister.Flush();
    EXPECT_EQ(persister.stats().written, 0);
  }
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_TRUE(reports[0].memory);
  EXPECT_EQ(reports[0].step, 30);
  EXPECT_EQ(reports[0].job, kJob);
  EXPECT_TRUE(reports[0].path.empty());
  EXPECT_TRUE(reports[0].error.empty());
  EXPECT_EQ(reports[0].bytes, (*region)->header().bytes);
  EXPECT_FALSE(fs::exists(JobDir(dir)));
}

}  // namespace
}  // namespace concord::checkpoint
