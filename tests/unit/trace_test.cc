// The timeline recorder, WorkTracer and the merge of trace files (see Note
// [Trace files] in worker/trace/recorder.h), on real files.

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "worker/comm/work.h"
#include "worker/trace/merge.h"
#include "worker/trace/recorder.h"
#include "worker/trace/work_tracer.h"

namespace concord::trace {
namespace {

class TraceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/concord-trace-test-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
  }
  void TearDown() override {
    std::string cmd = "rm -rf '" + dir_ + "'";
    ASSERT_EQ(std::system(cmd.c_str()), 0);
  }
  std::string Path(const std::string& name) { return dir_ + "/" + name; }
  static std::string Read(const std::string& path) {
    std::ifstream in(path);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }
  std::string dir_;
};

// Events named `name` in a parsed trace.
std::vector<nlohmann::json> Named(const nlohmann::json& events,
                                  const std::string& name) {
  std::vector<nlohmann::json> out;
  for (const auto& e : events) {
    if (e.value("name", "") == name) out.push_back(e);
  }
  return out;
}

TEST_F(TraceTest, ClosedFileIsOneJsonArrayWithTracksPerRank) {
  const std::string path = Path("w.json");
  {
    auto r = Recorder::Create(path, "worker-a");
    ASSERT_TRUE(r.ok()) << r.status();
    (*r)->SetGeneration(1, 1, 2);
    (*r)->SetStep(7);
    (*r)->Complete("forward", Recorder::kTrainThread, 100, 250);
    (*r)->Complete("odd", Recorder::kTrainThread, 300, 200);  // clamped
    (*r)->SetGeneration(2, 0, 1);
    (*r)->Instant("mark", {{"step", 3}});
  }
  const auto events = nlohmann::json::parse(Read(path));
  ASSERT_TRUE(events.is_array());
  for (const auto& e : events) {
    for (const char* key : {"ph", "ts", "pid", "tid", "name"}) {
      EXPECT_TRUE(e.contains(key)) << key << " missing in " << e.dump();
    }
  }
  const auto forward = Named(events, "forward");
  ASSERT_EQ(forward.size(), 1u);
  EXPECT_EQ(forward[0]["ph"], "X");
  EXPECT_EQ(forward[0]["pid"], 1);
  EXPECT_EQ(forward[0]["dur"], 150);
  EXPECT_EQ(forward[0]["args"]["step"], 7);
  EXPECT_EQ(Named(events, "odd")[0]["dur"], 0);
  // Both ranks' tracks are named; the generations are global instants.
  int named = 0;
  for (const auto& e : Named(events, "process_name")) {
    EXPECT_EQ(e["args"]["name"], "rank " + std::to_string(e["pid"].get<int>()));
    ++named;
  }
  EXPECT_EQ(named, 2);
  const auto g2 = Named(events, "generation 2");
  ASSERT_EQ(g2.size(), 1u);
  EXPECT_EQ(g2[0]["ph"], "i");
  EXPECT_EQ(g2[0]["s"], "g");
  EXPECT_EQ(g2[0]["pid"], 0);
  EXPECT_EQ(g2[0]["args"]["world_size"], 1);
  EXPECT_EQ(Named(events, "mark")[0]["args"]["step"], 3);
}

TEST_F(TraceTest, CreateRefusesAPathThatCannotBeWritten) {
  auto r = Recorder::Create(Path("no/such/dir/t.json"), "w");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("no/such/dir/t.json"), std::string::npos);
}

TEST_F(TraceTest, ConcurrentWritersKeepWholeLines) {
  const std::string path = Path("threads.json");
  {
    auto r = Recorder::Create(path, "w");
    ASSERT_TRUE(r.ok());
    (*r)->SetGeneration(1, 0, 1);
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&, t] {
        for (int i = 0; i < 500; ++i) {
          (*r)->Complete("e", t + 1, i, i + 1, {{"i", i}});
        }
      });
    }
    for (auto& t : threads) t.join();
  }
  const auto events = nlohmann::json::parse(Read(path));
  EXPECT_EQ(Named(events, "e").size(), 2000u);
}

TEST_F(TraceTest, MergeTakesKilledWritersFilesUpToTheirLastWholeLine) {
  const std::string a = Path("a.json"), b = Path("b.json");
  {
    auto r = Recorder::Create(a, "a");
    ASSERT_TRUE(r.ok());
    (*r)->SetGeneration(1, 0, 2);
    (*r)->Complete("forward", 0, 10, 20);
  }
  // A writer killed mid-line: no closing bracket, a cut-off last event.
  {
    auto r = Recorder::Create(b, "b");
    ASSERT_TRUE(r.ok());
    (*r)->SetGeneration(1, 1, 2);
    (*r)->Complete("forward", 0, 11, 21);
    (*r)->Complete("backward", 0, 21, 40);
  }
  std::string text = Read(b);
  text = text.substr(0, text.rfind("\n]"));  // no "]"
  text = text.substr(0, text.size() - 10);   // half of "backward"
  std::ofstream(b, std::ios::trunc) << text;
  EXPECT_FALSE(nlohmann::json::accept(text));

  const std::string out = Path("merged.json");
  auto merged = MergeTraceFiles({a, b, Path("never-written.json")}, out);
  ASSERT_TRUE(merged.ok()) << merged.status();
  EXPECT_EQ(merged->files, 2);
  EXPECT_EQ(merged->skipped_lines, 1);
  const auto events = nlohmann::json::parse(Read(out));
  EXPECT_EQ(static_cast<int64_t>(events.size()), merged->events);
  const auto forward = Named(events, "forward");
  ASSERT_EQ(forward.size(), 2u);
  EXPECT_EQ(forward[0]["pid"], 0);
  EXPECT_EQ(forward[1]["pid"], 1);
  EXPECT_TRUE(Named(events, "backward").empty());

  auto refused = MergeTraceFiles({a}, Path("no/such/dir/m.json"));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(TraceTest, WorkTracerTimesAWorkFromWatchToCompletion) {
  const std::string path = Path("work.json");
  {
    auto r = Recorder::Create(path, "w");
    ASSERT_TRUE(r.ok());
    (*r)->SetGeneration(1, 0, 1);
    (*r)->SetStep(4);
    auto ok = std::make_shared<comm::PromiseWork>();
    auto failed = std::make_shared<comm::PromiseWork>();
    WorkTracer tracer(*r);
    tracer.Watch(ok, "allreduce", Recorder::BucketThread(0), {{"bucket", 0}});
    tracer.Watch(failed, "allreduce", Recorder::BucketThread(1),
                 {{"bucket", 1}});
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    ok->MarkDone(absl::OkStatus());
    // A re-form moved this worker to rank 1 before the failure surfaced:
    // the work stays on the track of the rank that launched it.
    (*r)->SetGeneration(2, 1, 2);
    failed->MarkDone(absl::UnavailableError("peer gone"));
    // Never completes: the tracer's destructor must not wait for it.
    tracer.Watch(std::make_shared<comm::PromiseWork>(), "allreduce", 3, {});
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const auto events = nlohmann::json::parse(Read(path));
  const auto reduced = Named(events, "allreduce");
  ASSERT_EQ(reduced.size(), 2u);
  EXPECT_EQ(reduced[0]["tid"], 1);
  EXPECT_GE(reduced[0]["dur"].get<int64_t>(), 25000);
  EXPECT_EQ(reduced[0]["args"]["step"], 4);
  EXPECT_FALSE(reduced[0]["args"].contains("failed"));
  EXPECT_EQ(reduced[1]["tid"], 2);
  EXPECT_EQ(reduced[0]["pid"], 0);
  EXPECT_EQ(reduced[1]["pid"], 0);
  EXPECT_EQ(reduced[1]["args"]["failed"], 1);
}

// A job whose steps are shorter than the tracer's first wake-up (a world of
// one, a loaded machine) still has its collectives on the timeline: what
// ended before the tracer stops is recorded, what is still pending is not,
// and the stop does not wait for it.
TEST_F(TraceTest, WorkTracerRecordsWhatEndedBeforeItStopped) {
  const std::string path = Path("stopped.json");
  {
    auto r = Recorder::Create(path, "w");
    ASSERT_TRUE(r.ok());
    (*r)->SetGeneration(1, 0, 1);
    WorkTracer tracer(*r);
    for (int64_t b = 0; b < 3; ++b) {
      auto done = std::make_shared<comm::PromiseWork>();
      done->MarkDone(absl::OkStatus());
      tracer.Watch(done, "ended", Recorder::BucketThread(size_t(b)),
                   {{"bucket", b}});
    }
    tracer.Watch(std::make_shared<comm::PromiseWork>(), "pending", 9, {});
    auto last = std::make_shared<comm::PromiseWork>();
    last->MarkDone(absl::UnavailableError("peer gone"));
    tracer.Watch(last, "ended", 8, {});
  }  // at once: the tracer's thread may not have run yet
  const auto events = nlohmann::json::parse(Read(path));
  ASSERT_EQ(Named(events, "ended").size(), 4u);
  EXPECT_EQ(Named(events, "ended")[3]["args"]["failed"], 1);
  EXPECT_TRUE(Named(events, "pending").empty());
}

// The tracer waits for works in launch order: a work that ended while the
// tracer still waited for an earlier one ends at its own completion, not
// when the tracer got round to it (else the next step's collective on the
// same track would seem to start before this one ended).
TEST_F(TraceTest, WorkTracerEndsAWorkWhenItCompletedNotWhenNoticed) {
  const std::string path = Path("late.json");
  {
    auto r = Recorder::Create(path, "w");
    ASSERT_TRUE(r.ok());
    (*r)->SetGeneration(1, 0, 1);
    auto first = std::make_shared<comm::PromiseWork>();
    auto second = std::make_shared<comm::PromiseWork>();
    WorkTracer tracer(*r);
    tracer.Watch(first, "first", Recorder::BucketThread(0), {});
    tracer.Watch(second, "second", Recorder::BucketThread(1), {});
    second->MarkDone(absl::OkStatus());
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    first->MarkDone(absl::OkStatus());
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const auto events = nlohmann::json::parse(Read(path));
  const auto first = Named(events, "first");
  const auto second = Named(events, "second");
  ASSERT_EQ(first.size(), 1u);
  ASSERT_EQ(second.size(), 1u);
  EXPECT_GE(first[0]["dur"].get<int64_t>(), 190000);
  // Noticed ~200 ms late, but it ended at once.
  EXPECT_LT(second[0]["dur"].get<int64_t>(), 100000);
  EXPECT_LT(second[0]["ts"].get<int64_t>() + second[0]["dur"].get<int64_t>(),
            first[0]["ts"].get<int64_t>() + first[0]["dur"].get<int64_t>());
}

}  // namespace
}  // namespace concord::trace
