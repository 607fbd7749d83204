// See Note [Re-forming NCCL]: the members' agreement and the plan's execution,
// driven on CPU by a test communicator that derives like NCCL's (shrink and
// split connect a new Gloo communicator over the members that stay) and
// records what it was asked to do.

#include "worker/comm/next_communicator.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "worker/comm/gloo/gloo_communicator.h"
#include "worker/comm/store.h"

namespace concord::comm {
namespace {

constexpr int kNccl228 = 22809;
constexpr int kNccl222 = 22203;

// What the test communicators were asked to do, by old rank.
struct Log {
  std::mutex mu;
  std::map<int, std::string> calls;
  std::atomic<int> connects{0};
  void Add(int rank, std::string call) {
    std::lock_guard<std::mutex> lock(mu);
    calls[rank] = std::move(call);
  }
};

// A DerivableCommunicator over Gloo: collectives go to `inner`; Shrink and
// Split connect a new Gloo communicator of the staying members through
// `store` (what NCCL does through its parent's connections).
class TestDerivable final : public DerivableCommunicator {
 public:
  TestDerivable(std::unique_ptr<Communicator> inner, Store* store, Log* log)
      : inner_(std::move(inner)), store_(store), log_(log) {}
  // The derived communicators' rendezvous reads at most this many keys at
  // once (the store's limit).
  void set_keys_per_get(int n) { keys_per_get_ = n; }

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  int64_t generation() const override { return inner_->generation(); }
  std::shared_ptr<Work> AllreduceSum(at::Tensor t,
                                     const CollectiveOptions& o) override {
    return inner_->AllreduceSum(t, o);
  }
  std::shared_ptr<Work> Broadcast(at::Tensor t, int root,
                                  const CollectiveOptions& o) override {
    return inner_->Broadcast(t, root, o);
  }
  std::shared_ptr<Work> Allgather(at::Tensor out, at::Tensor in,
                                  const CollectiveOptions& o) override {
    return inner_->Allgather(out, in, o);
  }
  std::shared_ptr<Work> ReduceSum(at::Tensor t, int root,
                                  const CollectiveOptions& o) override {
    return inner_->ReduceSum(t, root, o);
  }
  std::shared_ptr<Work> Exchange(at::Tensor send, std::vector<int> to,
                                 std::vector<at::Tensor> recv,
                                 std::vector<int> from,
                                 const CollectiveOptions& o) override {
    return inner_->Exchange(send, to, recv, from, o);
  }
  void Abort() override {
    aborted_ = true;
    inner_->Abort();
  }
  bool usable() const override { return !aborted_; }
  bool failed() const override { return failed_; }
  void set_failed() { failed_ = true; }

  absl::StatusOr<std::unique_ptr<Communicator>> Shrink(
      const std::vector<int>& excluded, bool abort_in_flight,
      int64_t generation, absl::Duration timeout) override {
    // As ncclCommShrink: at least one rank is left out.
    if (excluded.empty()) {
      return absl::InvalidArgumentError("shrink: no rank to leave out");
    }
    std::string call = abort_in_flight ? "shrink abort" : "shrink";
    for (int r : excluded) absl::StrAppend(&call, " -", r);
    log_->Add(rank(), call);
    const int below = static_cast<int>(std::count_if(
        excluded.begin(), excluded.end(), [&](int r) { return r < rank(); }));
    return Derive(rank() - below, size() - static_cast<int>(excluded.size()),
                  generation, timeout);
  }
  absl::StatusOr<std::unique_ptr<Communicator>> Split(
      int color, int key, int64_t generation, absl::Duration timeout) override {
    log_->Add(rank(), absl::StrCat("split ", color, " ", key));
    return Derive(key, size(), generation, timeout);
  }

 private:
  absl::StatusOr<std::unique_ptr<Communicator>> Derive(int rank, int size,
                                                       int64_t generation,
                                                       absl::Duration timeout) {
    if (aborted_) return absl::FailedPreconditionError("aborted");
    GlooOptions o;
    o.rank = rank;
    o.size = size;
    o.generation = generation;
    o.connect_timeout = timeout;
    o.keys_per_get = keys_per_get_;
    PrefixStore derived(absl::StrCat("derived/", generation, "/"), store_);
    auto made = GlooCommunicator::Create(o, &derived);
    Abort();  // spent, as NCCL's parent is
    if (!made.ok()) return made.status();
    return std::unique_ptr<Communicator>(std::move(*made));
  }

  std::unique_ptr<Communicator> inner_;
  Store* store_;
  Log* log_;
  int keys_per_get_ = 1024;
  std::atomic<bool> aborted_{false};
  std::atomic<bool> failed_{false};
};

// A store that refuses to read more than `limit` keys at once, as the
// coordinator's KvGet refuses more than 4096.
class LimitedStore final : public Store {
 public:
  LimitedStore(Store* inner, size_t limit) : inner_(inner), limit_(limit) {}
  absl::Status Set(const std::string& key, const std::string& value) override {
    return inner_->Set(key, value);
  }
  absl::StatusOr<std::vector<std::string>> Get(
      const std::vector<std::string>& keys, absl::Duration timeout) override {
    if (keys.size() > limit_) {
      return absl::InvalidArgumentError(
          absl::StrCat(keys.size(), " keys in one read, at most ", limit_));
    }
    return inner_->Get(keys, timeout);
  }

 private:
  Store* inner_;
  size_t limit_;
};

struct Member {
  std::string id;
  std::shared_ptr<TestDerivable> parent;  // null: a joiner
};

// Generation 1 over `previous` ids (test communicators), then every member
// of generation 2 (`next`) makes its communicator; `prepare(old rank,
// parent)` runs before. Returns the plans by new rank and checks that the
// new communicators sum correctly.
std::vector<ReformPlan> Reform(
    Backend backend, int nccl, const std::vector<std::string>& previous,
    const std::vector<std::string>& next, bool departed_cleanly, Log* log,
    const std::function<void(int, TestDerivable&)>& prepare = nullptr,
    int keys_per_get = 1024) {
  InMemoryStore old_store, backing;
  LimitedStore new_store(&backing, static_cast<size_t>(keys_per_get));
  std::vector<std::shared_ptr<TestDerivable>> parents(previous.size());
  {
    std::vector<std::thread> threads;
    for (size_t r = 0; r < previous.size(); ++r) {
      threads.emplace_back([&, r] {
        GlooOptions o;
        o.rank = static_cast<int>(r);
        o.size = static_cast<int>(previous.size());
        o.generation = 1;
        auto c = GlooCommunicator::Create(o, &old_store);
        ASSERT_TRUE(c.ok()) << c.status();
        parents[r] =
            std::make_shared<TestDerivable>(std::move(*c), &new_store, log);
        parents[r]->set_keys_per_get(keys_per_get);
      });
    }
    for (auto& t : threads) t.join();
  }
  for (size_t r = 0; r < parents.size(); ++r) {
    if (prepare) prepare(static_cast<int>(r), *parents[r]);
  }
  std::vector<ReformPlan> plans(next.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < next.size(); ++r) {
    threads.emplace_back([&, r] {
      NextCommunicatorRequest req;
      req.backend = backend;
      req.nccl_version = nccl;
      req.next = next;
      req.departed_cleanly = departed_cleanly;
      req.rank = static_cast<int>(r);
      req.generation = 2;
      req.timeout = absl::Seconds(30);
      req.keys_per_get = keys_per_get;
      std::shared_ptr<Communicator> parent;
      auto old = std::find(previous.begin(), previous.end(), next[r]);
      if (old != previous.end()) {
        req.previous = previous;
        parent = parents[static_cast<size_t>(old - previous.begin())];
      }
      auto made = MakeNextCommunicator(req, parent, &new_store, [&]() {
        log->connects++;
        GlooOptions o;
        o.rank = static_cast<int>(r);
        o.size = static_cast<int>(next.size());
        o.generation = 2;
        o.keys_per_get = keys_per_get;
        PrefixStore fresh("fresh/", &new_store);
        return absl::StatusOr<std::unique_ptr<Communicator>>(
            GlooCommunicator::Create(o, &fresh));
      });
      ASSERT_TRUE(made.ok()) << made.status();
      plans[r] = made->plan;
      Communicator& c = *made->communicator;
      EXPECT_EQ(c.rank(), static_cast<int>(r));
      EXPECT_EQ(c.size(), static_cast<int>(next.size()));
      EXPECT_EQ(c.generation(), 2);
      at::Tensor t = torch::full({4}, static_cast<double>(r + 1));
      ASSERT_TRUE(c.AllreduceSum(t, {})->Wait(absl::Seconds(30)).ok());
      const double n = static_cast<double>(next.size());
      EXPECT_EQ(t[0].item<double>(), n * (n + 1) / 2);
    });
  }
  for (auto& t : threads) t.join();
  // Every member's old communicator is spent (derived from, or aborted).
  for (size_t r = 0; r < previous.size(); ++r) {
    if (std::find(next.begin(), next.end(), previous[r]) != next.end()) {
      EXPECT_FALSE(parents[r]->usable()) << "rank " << r << "'s parent";
    }
  }
  return plans;
}

TEST(NextCommunicatorTest, CleanLeaveShrinksEveryMemberAlike) {
  Log log;
  auto plans = Reform(Backend::kNccl, kNccl228, {"a", "b", "c", "d"},
                      {"a", "c", "d"}, /*departed_cleanly=*/true, &log);
  for (const ReformPlan& p : plans) EXPECT_EQ(p.how, ReformPlan::How::kShrink);
  EXPECT_EQ(log.connects.load(), 0);
  EXPECT_EQ(log.calls[0], "shrink -1");
  EXPECT_EQ(log.calls[2], "shrink -1");
  EXPECT_EQ(log.calls[3], "shrink -1");
  EXPECT_EQ(log.calls.count(1), 0u);  // the leaver takes no part
}

TEST(NextCommunicatorTest, RankZeroReadsTheMembersInChunks) {
  // As with more members than the coordinator gives in one KvGet.
  Log log;
  auto plans = Reform(Backend::kNccl, kNccl228, {"a", "b", "c", "d", "e"},
                      {"a", "b", "d", "e"}, /*departed_cleanly=*/true, &log,
                      nullptr, /*keys_per_get=*/3);
  for (const ReformPlan& p : plans) EXPECT_EQ(p.how, ReformPlan::How::kShrink);
  EXPECT_EQ(log.calls[4], "shrink -2");
}

TEST(NextCommunicatorTest, OneMemberSawAFailureSoAllShrinkInAbortMode) {
  Log log;
  Reform(Backend::kNccl, kNccl228, {"a", "b", "c"}, {"b", "c"},
         /*departed_cleanly=*/false, &log, [](int rank, TestDerivable& p) {
           if (rank == 2) p.set_failed();
         });
  EXPECT_EQ(log.calls[1], "shrink abort -0");
  EXPECT_EQ(log.calls[2], "shrink abort -0");
}

TEST(NextCommunicatorTest, OneAbortedParentMeansEveryoneInitsAnew) {
  // The membership watcher aborted rank 1's communicator before it re-formed.
  Log log;
  auto plans =
      Reform(Backend::kNccl, kNccl228, {"a", "b", "c"}, {"a", "b"},
             /*departed_cleanly=*/true, &log, [](int rank, TestDerivable& p) {
               if (rank == 1) p.Abort();
             });
  for (const ReformPlan& p : plans) {
    EXPECT_EQ(p.how, ReformPlan::How::kNewInit);
  }
  EXPECT_EQ(log.connects.load(), 2);
  EXPECT_TRUE(log.calls.empty());
}

TEST(NextCommunicatorTest, AJoinerMeansANewInit) {
  Log log;
  auto plans = Reform(Backend::kNccl, kNccl228, {"a", "b"}, {"a", "b", "z"},
                      /*departed_cleanly=*/true, &log);
  for (const ReformPlan& p : plans) {
    EXPECT_EQ(p.how, ReformPlan::How::kNewInit);
  }
  EXPECT_EQ(log.connects.load(), 3);
}

TEST(NextCommunicatorTest, OlderNcclSplitsTheSameMembers) {
  Log log;
  auto plans = Reform(Backend::kNccl, kNccl222, {"a", "b", "c"},
                      {"a", "b", "c"}, /*departed_cleanly=*/true, &log);
  for (const ReformPlan& p : plans) EXPECT_EQ(p.how, ReformPlan::How::kSplit);
  EXPECT_EQ(log.calls[1], "split 0 1");
  // ... and inits anew when one left: it cannot take part.
  Log again;
  Reform(Backend::kNccl, kNccl222, {"a", "b", "c"}, {"a", "c"}, true, &again);
  EXPECT_EQ(again.connects.load(), 2);
}

TEST(NextCommunicatorTest, TheSameMembersSplitOrInitButNeverShrink) {
  // ncclCommShrink leaves at least one rank out (the test communicator
  // refuses an empty list, as NCCL 2.28 does): with shrink at hand, the same
  // members split when nothing failed ...
  Log log;
  auto plans = Reform(Backend::kNccl, kNccl228, {"a", "b"}, {"a", "b"},
                      /*departed_cleanly=*/true, &log);
  for (const ReformPlan& p : plans) EXPECT_EQ(p.how, ReformPlan::How::kSplit);
  EXPECT_EQ(log.calls[0], "split 0 0");
  EXPECT_EQ(log.calls[1], "split 0 1");
  // ... and init anew when one of them saw a collective fail.
  Log failed;
  auto after = Reform(Backend::kNccl, kNccl228, {"a", "b"}, {"a", "b"},
                      /*departed_cleanly=*/true, &failed,
                      [](int rank, TestDerivable& p) {
                        if (rank == 0) p.set_failed();
                      });
  for (const ReformPlan& p : after) {
    EXPECT_EQ(p.how, ReformPlan::How::kNewInit);
  }
  EXPECT_EQ(failed.connects.load(), 2);
  EXPECT_TRUE(failed.calls.empty());
}

TEST(NextCommunicatorTest, GlooConnectsAnewWithoutAgreeing) {
  Log log;
  auto plans =
      Reform(Backend::kGloo, 0, {"a", "b", "c"}, {"a", "c"}, true, &log);
  for (const ReformPlan& p : plans) {
    EXPECT_EQ(p.how, ReformPlan::How::kNewInit);
  }
  EXPECT_EQ(log.connects.load(), 2);
}

TEST(NextCommunicatorTest, AMemberThatNeverSaysFailsTheAgreementInTime) {
  InMemoryStore store;
  NextCommunicatorRequest req;
  req.backend = Backend::kNccl;
  req.nccl_version = kNccl228;
  req.previous = {"a", "b"};
  req.next = {"a", "b"};
  req.rank = 0;
  req.generation = 2;
  req.timeout = absl::Milliseconds(300);
  bool connected = false;
  const absl::Time start = absl::Now();
  auto made = MakeNextCommunicator(req, nullptr, &store, [&] {
    connected = true;
    return absl::StatusOr<std::unique_ptr<Communicator>>(
        absl::InternalError("not reached"));
  });
  EXPECT_FALSE(made.ok());
  EXPECT_FALSE(connected);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

}  // namespace
}  // namespace concord::comm
