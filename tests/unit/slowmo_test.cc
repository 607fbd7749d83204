// SlowMo (worker/slowmo): each formula against a straightforward reference
// computed here, with ranks as threads over real Gloo. Every rank takes a
// fixed gradient per step, so each thread can compute every rank's
// trajectory by hand.
#include "worker/slowmo/slowmo.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <map>
#include <mutex>
#include <string>

#include "rank_threads.h"
#include "slowmo_fixture.h"
#include "worker/checkpoint/content.h"
#include "worker/tensor_ops.h"

namespace concord::slowmo {
namespace {

using concord::testing::NextGeneration;
using concord::testing::RunRanks;
using namespace concord::slowmo::fixture;  // NOLINT

// Runs `steps` updates on every rank and checks parameters (every step),
// u and x_old (the rank's slice) against the reference.
void RunAndCompare(int world, SlowMoOptions o, int64_t steps) {
  RunRanks(world, [&](int rank, std::shared_ptr<comm::Communicator> comm) {
    Model m = MakeModel(rank);
    auto s = SlowMo::Create(m.params, {}, comm, 0, o);
    ASSERT_TRUE(s.ok()) << s.status();
    Reference ref = Start(world);
    bool differed = false;
    for (int64_t n = 0; n < steps; ++n) {
      LocalStep(m, rank, n);
      ASSERT_TRUE((*s)->PerformSlowMo(*m.opt).ok());
      ReferenceUpdate(ref, n, o);
      ExpectClose(Flat(m), ref.x[rank],
                  "parameters after update " + std::to_string(n));
      differed |= world > 1 && !torch::equal(ref.x[0], ref.x[world - 1]);
      if ((*s)->slowmo_enabled()) {
        const int64_t a = (*s)->portion_start(), b = (*s)->portion_end();
        if (b > a) {
          ExpectClose((*s)->momentum_buffer(), ref.u.narrow(0, a, b - a), "u");
          ExpectClose((*s)->old_params(), ref.x_old.narrow(0, a, b - a),
                      "x_old");
        }
      }
    }
    // Between averages the ranks really drift apart (the test can fail).
    if (world > 1 && o.localsgd_frequency() > 1) {
      EXPECT_TRUE(differed);
    }
    EXPECT_EQ((*s)->num_updates(), steps);
  });
}

SlowMoOptions LocalSgd(int64_t tau) {
  SlowMoOptions o;
  o.base_algorithm(BaseAlgorithm::kLocalSgd);
  o.localsgd_frequency(tau);
  o.slowmo_lr(1.0);
  o.slowmo_momentum(0.0);  // fairscale: slow momentum off
  return o;
}

TEST(SlowMoTest, LocalSgdAveragesEveryTauUpdates) {
  for (int world : {1, 2, 3}) RunAndCompare(world, LocalSgd(3), 7);
}

TEST(SlowMoTest, SlowMomentumStepMatchesTheFormula) {
  SlowMoOptions o = LocalSgd(2);
  o.slowmo_momentum(0.5);
  o.slowmo_lr(0.7);
  o.slowmo_frequency(4);
  o.slowmo_memory_efficient(false);
  for (int world : {1, 3}) RunAndCompare(world, o, 12);
}

TEST(SlowMoTest, ShardedEqualsUnsharded) {
  SlowMoOptions o = LocalSgd(2);
  o.slowmo_momentum(0.6);
  o.slowmo_lr(1.2);
  o.slowmo_frequency(4);
  o.slowmo_memory_efficient(true);
  for (int shards : {1, 2, 3, 32}) {
    o.slowmo_num_shards(shards);
    RunAndCompare(3, o, 12);
  }
  // Shards cover the vector without overlap: 2 shards of ceil(12/2).
  o.slowmo_num_shards(2);
  RunRanks(3, [&](int rank, std::shared_ptr<comm::Communicator> comm) {
    Model m = MakeModel(rank);
    auto s = *SlowMo::Create(m.params, {}, comm, 0, o);
    LocalStep(m, rank, 0);
    ASSERT_TRUE(s->PerformSlowMo(*m.opt).ok());
    EXPECT_EQ(s->num_shards(), 2);
    EXPECT_EQ(s->portion_start(), rank < 2 ? rank * 6 : 0);
    EXPECT_EQ(s->portion_end(), rank < 2 ? rank * 6 + 6 : 0);
  });
}

// SGP with slowmo_sgp_average_params: a slow step replaces that update's
// gossip by the exact average (fairscale's _should_allreduce_params), so
// with a slow step every update SGP trains like LocalSGD averaging every
// update plus slow momentum.
TEST(SlowMoTest, SgpAveragesExactlyOnSlowStepsWhenAsked) {
  SlowMoOptions o;
  o.base_algorithm(BaseAlgorithm::kSgp);
  o.slowmo_sgp_average_params(true);
  o.slowmo_memory_efficient(false);
  o.slowmo_frequency(1);
  o.localsgd_frequency(1);  // the reference's "average every update"
  o.slowmo_momentum(0.4);
  RunAndCompare(3, o, 5);
}

// x_r' = (x_r + x_in) / 2 for numerators and weights, with the in-peer of
// round t written out by hand: r - offsets[t % offsets.size()] (fairscale's
// books: npeer-directed-exponential over 3 ranks is [r+1, r+2], directed
// exponential over 4 ranks is [r+1, r+3, r+2]).
void PushSumRounds(int world, GraphType graph, std::vector<int> offsets,
                   bool push_sum) {
  SlowMoOptions o;
  o.base_algorithm(BaseAlgorithm::kSgp);
  o.slowmo_lr(1.0);
  o.slowmo_momentum(0.0);
  o.sgp_graph(GraphTypeName(graph));
  o.push_sum(push_sum);
  RunRanks(world, [&](int rank, std::shared_ptr<comm::Communicator> comm) {
    Model m = MakeModel(rank, /*differ=*/true);
    auto s = *SlowMo::Create(m.params, {}, comm, 0, o);
    std::vector<torch::Tensor> x;
    torch::Tensor sum0 = torch::zeros({kTotal});
    for (int r = 0; r < world; ++r) {
      torch::Tensor v = torch::empty({kTotal});
      for (int64_t i = 0; i < kTotal; ++i) v[i] = Init(r, i);
      x.push_back(v);
      sum0 += v;
    }
    const double spread0 = (x[0] - x[world - 1]).abs().max().item<double>();
    for (int64_t t = 0; t < 7; ++t) {
      // No gradient: the gossip alone.
      ASSERT_TRUE(s->PrepareForward().ok());
      ASSERT_TRUE(s->AfterBackward().ok());
      ASSERT_TRUE(s->PerformSlowMo(*m.opt).ok());
      std::vector<torch::Tensor> next;
      for (int r = 0; r < world; ++r) {
        const int off = offsets[static_cast<size_t>(t) % offsets.size()];
        next.push_back((x[r] + x[(r + world - off) % world]).mul_(0.5f));
      }
      x = next;
      ExpectClose(Flat(m), x[rank], "numerators, round " + std::to_string(t));
      EXPECT_EQ(s->ps_weight(), 1.0);
      EXPECT_EQ(s->gossip_round(), t + 1);
    }
    // The network sum of numerators and of weights is kept.
    torch::Tensor total = Flat(m).clone();
    ASSERT_TRUE(comm->AllreduceSum(total, {})->Wait().ok());
    ExpectClose(total, sum0, "sum of numerators");
    torch::Tensor w = torch::tensor({s->ps_weight()}, torch::kDouble);
    ASSERT_TRUE(comm->AllreduceSum(w, {})->Wait().ok());
    EXPECT_DOUBLE_EQ(w.item<double>(), world);
    // De-biased estimates moved towards the average.
    ASSERT_TRUE(s->PrepareForward().ok());
    EXPECT_FALSE(s->is_ps_numerator());
    const double spread = (Flat(m) - sum0 / world).abs().max().item<double>();
    EXPECT_LT(spread, 0.5 * spread0);
  });
}

TEST(SlowMoTest, PushSumKeepsTheNetworkAverage) {
  PushSumRounds(3, GraphType::kNPeerDirectedExponential, {1, 2}, true);
  PushSumRounds(4, GraphType::kDirectedExponential, {1, 3, 2}, true);
  PushSumRounds(2, GraphType::kRing, {1}, true);
}

TEST(SlowMoTest, PushPullKeepsTheNetworkAverage) {
  PushSumRounds(3, GraphType::kNPeerDirectedExponential, {1, 2}, false);
  PushSumRounds(4, GraphType::kBipartiteLinear, {1, 3}, false);
}

// fairscale's forward pre-hook broadcasts the buffers (here from the
// authoritative rank); broadcast_buffers=false leaves them local.
TEST(SlowMoTest, BuffersFollowTheAuthoritativeRankBeforeEachForward) {
  for (bool broadcast : {true, false}) {
    SlowMoOptions o = LocalSgd(3);
    SlowMoInternals internals;
    internals.broadcast_buffers = broadcast;
    RunRanks(3, [&](int rank, std::shared_ptr<comm::Communicator> comm) {
      Model m = MakeModel(rank);
      torch::Tensor running = torch::full({4}, static_cast<float>(rank));
      auto s = *SlowMo::Create(m.params, {running}, comm, 2, o, internals);
      ASSERT_TRUE(s->PrepareForward().ok());
      EXPECT_TRUE(torch::equal(
          running,
          torch::full({4}, broadcast ? 2.0f : static_cast<float>(rank))));
    });
  }
}

SlowMoOptions ShardedSlowMo() {
  SlowMoOptions o = LocalSgd(2);
  o.slowmo_momentum(0.5);
  o.slowmo_lr(0.8);
  o.slowmo_frequency(4);
  o.slowmo_memory_efficient(true);
  o.slowmo_num_shards(3);
  return o;
}

// After a membership change to 2 ranks that both hold parameters `x`:
// updates 6 and 7 (the second a slow step) on `m` with `s`, each checked
// against the reference started from (`u`, `x_old`), which is returned.
Reference TrainOnAtTwo(Model& m, SlowMo& s, int rank, const SlowMoOptions& o,
                       const torch::Tensor& x, const torch::Tensor& u,
                       const torch::Tensor& x_old) {
  Reference ref;
  ref.x = {x.clone(), x.clone()};
  ref.u = u.clone();
  ref.x_old = x_old.clone();
  ref.initialized = true;
  for (int64_t n = 6; n < 8; ++n) {
    LocalStep(m, rank, n);
    EXPECT_TRUE(s.PerformSlowMo(*m.opt).ok());
    ReferenceUpdate(ref, n, o);
    ExpectClose(Flat(m), ref.x[rank],
                "parameters after update " + std::to_string(n));
  }
  return ref;
}

// `world` ranks train 6 updates (one slow step) with `shards` shards, then
// ranks >= 2 go away; ranks 0 and 1 form the next generation and SyncState
// re-shards u and x_old over 2 owners: every old slice comes from its owner
// or, when that is gone, from its replica on the next rank (see Note [Shard
// replicas]); the slices in `lost` (owner and replica gone) restart (u = 0,
// x_old = x). Then training goes on and must match a reference that started
// from the state re-sharded by hand.
void ReshardAfterLoss(int world, int shards,
                      std::vector<std::pair<int64_t, int64_t>> lost) {
  SlowMoOptions o = ShardedSlowMo();
  o.slowmo_num_shards(shards);
  std::mutex mu;
  torch::Tensor u_full = torch::zeros({kTotal});
  torch::Tensor old_full = torch::zeros({kTotal});
  torch::Tensor x_before;
  comm::InMemoryStore next_store;
  RunRanks(world, [&](int rank, std::shared_ptr<comm::Communicator> comm) {
    Model m = MakeModel(rank);
    auto s = *SlowMo::Create(m.params, {}, comm, 0, o);
    for (int64_t n = 0; n < 6; ++n) {
      LocalStep(m, rank, n);
      ASSERT_TRUE(s->PerformSlowMo(*m.opt).ok());
    }
    {
      std::lock_guard<std::mutex> lock(mu);
      const int64_t a = s->portion_start(), len = s->portion_end() - a;
      ASSERT_EQ(len, kTotal / shards);
      u_full.narrow(0, a, len).copy_(s->momentum_buffer());
      old_full.narrow(0, a, len).copy_(s->old_params());
      if (rank == 0) x_before = Flat(m);
    }
    torch::Tensor barrier = torch::ones({1});
    ASSERT_TRUE(comm->AllreduceSum(barrier, {})->Wait().ok());
    {
      // Each rank's replica is its predecessor's slice, bit for bit.
      std::lock_guard<std::mutex> lock(mu);
      const int64_t a = s->replica_start(), len = s->replica_end() - a;
      const int prev = (rank + world - 1) % world;
      ASSERT_EQ(a, prev * (kTotal / shards));
      ASSERT_EQ(len, kTotal / shards);
      EXPECT_TRUE(
          torch::equal(s->replica_momentum(), u_full.narrow(0, a, len)));
      EXPECT_TRUE(
          torch::equal(s->replica_old_params(), old_full.narrow(0, a, len)));
    }
    ASSERT_TRUE(comm->AllreduceSum(barrier, {})->Wait().ok());
    if (rank >= 2) return;  // gone

    std::shared_ptr<comm::Communicator> comm2 =
        NextGeneration(next_store, rank, 2, 2);
    ASSERT_NE(comm2, nullptr);
    ASSERT_TRUE(
        s->SyncState(comm2, /*authoritative_rank=*/0, /*step=*/6, *m.opt).ok());
    // By hand: the lost slices restart, everything else is kept.
    torch::Tensor u_ref = u_full.clone();
    torch::Tensor old_ref = old_full.clone();
    for (const auto& [a, b] : lost) {
      u_ref.narrow(0, a, b - a).zero_();
      old_ref.narrow(0, a, b - a).copy_(x_before.narrow(0, a, b - a));
    }
    EXPECT_EQ(s->num_shards(), 2);
    EXPECT_EQ(s->portion_start(), 6 * rank);
    EXPECT_EQ(s->portion_end(), 6 * rank + 6);
    EXPECT_TRUE(
        torch::equal(s->momentum_buffer(), u_ref.narrow(0, 6 * rank, 6)));
    EXPECT_TRUE(torch::equal(s->old_params(), old_ref.narrow(0, 6 * rank, 6)));
    EXPECT_EQ(s->replica_start(), 6 * (1 - rank));
    EXPECT_TRUE(torch::equal(s->replica_momentum(),
                             u_ref.narrow(0, 6 * (1 - rank), 6)));
    EXPECT_EQ(s->num_updates(), 6);

    const Reference ref = TrainOnAtTwo(m, *s, rank, o, Flat(m), u_ref, old_ref);
    ExpectClose(s->momentum_buffer(), ref.u.narrow(0, 6 * rank, 6), "u");
    ExpectClose(s->old_params(), ref.x_old.narrow(0, 6 * rank, 6), "x_old");
  });
}

// Rank 2 of 3 owned slice [8, 12); its replica on rank 0 survives: nothing
// restarts (the no-loss state).
TEST(SlowMoTest, MembershipChangeReshardsSlowMomentum) {
  ReshardAfterLoss(3, 3, {});
}

// Ranks 2 and 3 of 4: slice [6, 9) had its owner (2) and replica (3) both
// gone and restarts; slice [9, 12) comes from its replica on rank 0.
TEST(SlowMoTest, ShardLostWithItsReplicaRestarts) {
  ReshardAfterLoss(4, 4, {{6, 9}});
}

// SGP with unsharded slow momentum, 3 ranks -> 2 (rank 2 leaves, rank 1 is
// authoritative): everyone takes rank 1's u, x_old, weight and count, the
// graph is rebuilt for 2 ranks from round 0, and the next gossip averages
// the two ranks' numerators.
TEST(SlowMoTest, MembershipChangeRebuildsTheGossipGraph) {
  SlowMoOptions o;
  o.base_algorithm(BaseAlgorithm::kSgp);
  o.slowmo_memory_efficient(false);
  o.slowmo_frequency(2);
  comm::InMemoryStore next_store;
  std::mutex mu;
  torch::Tensor root_u, root_old;
  RunRanks(3, [&](int rank, std::shared_ptr<comm::Communicator> comm) {
    Model m = MakeModel(rank, /*differ=*/true);
    auto s = *SlowMo::Create(m.params, {}, comm, 0, o);
    for (int64_t n = 0; n < 3; ++n) {
      LocalStep(m, rank, n);
      ASSERT_TRUE(s->PerformSlowMo(*m.opt).ok());
    }
    EXPECT_EQ(s->gossip_round(), 3);
    if (rank == 1) {
      std::lock_guard<std::mutex> lock(mu);
      root_u = s->momentum_buffer().clone();
      root_old = s->old_params().clone();
    }
    torch::Tensor barrier = torch::ones({1});
    ASSERT_TRUE(comm->AllreduceSum(barrier, {})->Wait().ok());
    if (rank == 2) return;
    std::shared_ptr<comm::Communicator> comm2 =
        NextGeneration(next_store, rank, 2, 2);
    ASSERT_NE(comm2, nullptr);
    ASSERT_TRUE(s->SyncState(comm2, 1, /*step=*/3, *m.opt).ok());
    EXPECT_EQ(s->graph()->world_size(), 2);
    EXPECT_EQ(s->gossip_round(), 0);
    EXPECT_EQ(s->num_updates(), 3);
    EXPECT_TRUE(torch::equal(s->momentum_buffer(), root_u));
    EXPECT_TRUE(torch::equal(s->old_params(), root_old));
    // Update 4 is a slow step, not memory-efficient: gossip first, then
    // each rank's own slow step from the shared u and x_old.
    torch::Tensor mine = Flat(m);
    torch::Tensor theirs = mine.clone();
    std::vector<torch::Tensor> recv = {torch::empty_like(mine)};
    ASSERT_TRUE(
        comm2->Exchange(theirs, {1 - rank}, recv, {1 - rank}, {})->Wait().ok());
    ASSERT_TRUE(s->PerformSlowMo(*m.opt).ok());
    torch::Tensor x = (mine + recv[0]).mul_(0.5f);
    torch::Tensor u = root_u.clone(), x_old = root_old.clone();
    for (int64_t i = 0; i < kTotal; ++i) {
      const double lr = LrOf(i);
      const double ui = 0.5 * u[i].item<float>() +
                        (x_old[i].item<float>() - x[i].item<float>()) / lr;
      u[i] = ui;
      x_old[i] = x_old[i].item<float>() - lr * ui;
    }
    ExpectClose(Flat(m), x_old, "parameters after the slow step");
    ExpectClose(s->momentum_buffer(), u, "u");
    EXPECT_EQ(s->gossip_round(), 1);
  });
}

// An update whose collectives failed stays owed: the committed step is one
// ahead of SlowMo's count, and SyncState performs it (here in the same
// generation, with rank 1 authoritative).
TEST(SlowMoTest, SyncStateFinishesAnOwedUpdate) {
  const SlowMoOptions o = ShardedSlowMo();
  RunRanks(2, [&](int rank, std::shared_ptr<comm::Communicator> comm) {
    Model m = MakeModel(rank);
    auto s = *SlowMo::Create(m.params, {}, comm, 0, o);
    Reference ref = Start(2);
    for (int64_t n = 0; n < 4; ++n) {
      LocalStep(m, rank, n);
      ReferenceUpdate(ref, n, o);
      if (n < 3) {
        ASSERT_TRUE(s->PerformSlowMo(*m.opt).ok());
      }
    }
    EXPECT_EQ(s->num_updates(), 3);
    ASSERT_TRUE(s->SyncState(comm, 1, /*step=*/4, *m.opt).ok());
    EXPECT_EQ(s->num_updates(), 4);
    ExpectClose(Flat(m), ref.x[rank], "parameters after the owed update");
    const int64_t a = s->portion_start(), b = s->portion_end();
    ExpectClose(s->momentum_buffer(), ref.u.narrow(0, a, b - a), "u");
    // A count that is off by more than one is refused.
    const absl::Status bad = s->SyncState(comm, 0, /*step=*/9, *m.opt);
    EXPECT_TRUE(absl::IsFailedPrecondition(bad)) << bad;
  });
}

// `saved` with `key`'s tensor replaced by `t`.
NamedTensors Replaced(NamedTensors saved, const std::string& key,
                      const torch::Tensor& t) {
  for (auto& entry : saved) {
    if (entry.first == key) entry.second = t;
  }
  return saved;
}

// Two new processes, ranks 0 and 1 of generation 2, resume from `saved`
// of step 6 (rank 1 loads it, rank 0 holds nothing), as State::Sync does:
// first rank 1 is refused `bad` (FAILED_PRECONDITION naming `named`) and
// an empty state, and nothing changes. `*out` is null after a failure.
void ResumeAtTwo(comm::InMemoryStore& store, int rank, Model& fresh,
                 const SlowMoOptions& o, const NamedTensors& saved,
                 const NamedTensors& bad, const std::string& named,
                 std::unique_ptr<SlowMo>* out) {
  std::shared_ptr<comm::Communicator> comm2 = NextGeneration(store, rank, 2, 2);
  ASSERT_NE(comm2, nullptr);
  auto resumed = *SlowMo::Create(fresh.params, {}, comm2, 1, o);
  if (rank == 1) {
    const absl::Status refused = resumed->ResumeState(&bad, *fresh.opt);
    EXPECT_TRUE(absl::IsFailedPrecondition(refused)) << refused;
    EXPECT_NE(refused.message().find(named), absl::string_view::npos)
        << refused;
    EXPECT_EQ(resumed->num_updates(), 0);
    const NamedTensors none;
    EXPECT_TRUE(
        absl::IsFailedPrecondition(resumed->ResumeState(&none, *fresh.opt)));
    ASSERT_TRUE(resumed->ResumeState(&saved, *fresh.opt).ok());
  } else {
    ASSERT_TRUE(resumed->ResumeState(nullptr, *fresh.opt).ok());
  }
  ASSERT_TRUE(resumed->SyncState(comm2, 1, /*step=*/6, *fresh.opt).ok());
  *out = std::move(resumed);
}

// See Note [Participants in checkpoints]: 3 ranks with 3 shards take a
// checkpoint after 6 updates: every rank gets the whole u and x_old,
// gathered from the owners. Two new processes resume from it (rank 1 loads
// it, rank 0 holds nothing): SyncState re-shards it over 2 owners, and the
// next updates (a slow step among them) match the reference.
TEST(SlowMoTest, CheckpointHoldsTheWholeStateAndResumesAtAnotherWorld) {
  const SlowMoOptions o = ShardedSlowMo();
  std::mutex mu;
  NamedTensors saved;
  comm::InMemoryStore next_store;
  RunRanks(3, [&](int rank, std::shared_ptr<comm::Communicator> comm) {
    Model m = MakeModel(rank);
    auto s = *SlowMo::Create(m.params, {}, comm, 0, o);
    Reference ref = Start(3);
    for (int64_t n = 0; n < 6; ++n) {
      LocalStep(m, rank, n);
      ASSERT_TRUE(s->PerformSlowMo(*m.opt).ok());
      ReferenceUpdate(ref, n, o);
    }
    auto state = s->CheckpointState(*m.opt);
    ASSERT_TRUE(state.ok()) << state.status();
    std::map<std::string, torch::Tensor> by_name(state->begin(), state->end());
    EXPECT_EQ(by_name.at("updates").item<int64_t>(), 6);
    EXPECT_EQ(by_name.at("push_sum_numerator").item<int64_t>(), 0);
    ExpectClose(by_name.at("slow_momentum"), ref.u, "gathered u");
    ExpectClose(by_name.at("old_params"), ref.x_old, "gathered x_old");
    // Gathering changed nothing.
    EXPECT_EQ(s->portion_end() - s->portion_start(), 4);
    if (rank == 0) {
      std::lock_guard<std::mutex> lock(mu);
      for (const auto& [key, t] : *state) saved.emplace_back(key, t.clone());
    }
    torch::Tensor barrier = torch::ones({1});
    ASSERT_TRUE(comm->AllreduceSum(barrier, {})->Wait().ok());
    if (rank >= 2) return;

    // New processes: the model as the loading rank broadcasts it.
    Model fresh = MakeModel(rank);
    {
      torch::NoGradGuard no_grad;
      UnflattenInto(ref.x[0].clone(), fresh.params);
    }
    std::unique_ptr<SlowMo> resumed;
    ResumeAtTwo(next_store, rank, fresh, o, saved,
                Replaced(saved, "slow_momentum", torch::zeros({kTotal + 1})),
                "slow momentum", &resumed);
    ASSERT_NE(resumed, nullptr);
    EXPECT_EQ(resumed->num_updates(), 6);
    EXPECT_EQ(resumed->portion_start(), 6 * rank);
    // Bit for bit the gathered state's slices.
    EXPECT_TRUE(
        torch::equal(resumed->momentum_buffer(),
                     by_name.at("slow_momentum").narrow(0, 6 * rank, 6)));
    EXPECT_TRUE(torch::equal(resumed->old_params(),
                             by_name.at("old_params").narrow(0, 6 * rank, 6)));
    TrainOnAtTwo(fresh, *resumed, rank, o, ref.x[0], ref.u, ref.x_old);
  });
}

// See Note [Participants in checkpoints]: CheckpointDivergence is empty
// exactly when the 3 ranks' parameters are bit-identical (right after
// LocalSGD's average or a memory-efficient slow step), and never with an
// optimizer that keeps per-parameter state.
TEST(SlowMoTest, CheckpointDivergenceSaysWhetherTheRanksDiffer) {
  for (const SlowMoOptions& o : {LocalSgd(3), ShardedSlowMo()}) {
    RunRanks(3, [&](int rank, std::shared_ptr<comm::Communicator> comm) {
      Model m = MakeModel(rank);
      auto s = *SlowMo::Create(m.params, {}, comm, 0, o);
      EXPECT_EQ(s->CheckpointDivergence(*m.opt), "");  // no update yet
      // 12 updates: the last averages in both.
      for (int64_t n = 0; n < 12; ++n) {
        LocalStep(m, rank, n);
        ASSERT_TRUE(s->PerformSlowMo(*m.opt).ok());
        torch::Tensor all = torch::empty({3 * kTotal});
        ASSERT_TRUE(comm->Allgather(all, Flat(m), {})->Wait().ok());
        bool equal = true;
        for (int r = 1; r < 3; ++r) {
          equal = equal && torch::equal(all.narrow(0, r * kTotal, kTotal),
                                        all.narrow(0, 0, kTotal));
        }
        const std::string why = s->CheckpointDivergence(*m.opt);
        // The first update's gradients are the same everywhere (equal
        // without an average): from the second on they differ.
        if (n > 0) {
          EXPECT_EQ(why.empty(), equal) << "update " << n + 1;
        }
        if (!equal) {
          EXPECT_NE(why.find("LocalSGD"), std::string::npos) << why;
        }
      }
      // An optimizer with momentum over the same parameters.
      torch::optim::SGD with_momentum(
          m.params, torch::optim::SGDOptions(0.1).momentum(0.9));
      EXPECT_EQ(s->CheckpointDivergence(with_momentum), "");  // no state yet
      with_momentum.step();  // the gradients of the last LocalStep
      EXPECT_NE(
          s->CheckpointDivergence(with_momentum).find("per-parameter state"),
          std::string::npos);
    });
  }
}

// The optimizer's momentum buffers, one per parameter (copies).
std::vector<torch::Tensor> MomentumBuffers(const torch::optim::SGD& opt) {
  std::vector<torch::Tensor> out;
  for (const auto& [index, tensors] :
       checkpoint::CaptureOptimizer("optimizer", opt).state) {
    for (const auto& [key, t] : tensors) {
      if (key == "momentum_buffer") out.push_back(t.clone());
    }
  }
  return out;
}

std::unique_ptr<torch::optim::SGD> WithMomentum(const Model& m) {
  return std::make_unique<torch::optim::SGD>(
      m.params, torch::optim::SGDOptions(0.1).momentum(0.9));
}

// See Note [Each rank's optimizer state]: with SGD's momentum 3 ranks
// (LocalSGD, averaging every 3 updates) take a checkpoint after 6: it holds
// every rank's momentum buffers, row r rank r's, and no divergence is said.
// Two new processes resume from it (rank 1 loads it after rank 0's
// optimizer file, as State::Apply does; rank 0 holds that file's state, as
// State::Sync's broadcast leaves it): each ends with its own buffers, bit
// for bit. Rows that do not fit the optimizer are refused.
TEST(SlowMoTest, CheckpointKeepsEachRanksOptimizerState) {
  const SlowMoOptions o = LocalSgd(3);
  std::mutex mu;
  NamedTensors saved;
  checkpoint::OptimizerContent file;  // rank 0's, as optimizer.pt holds it
  std::vector<std::vector<torch::Tensor>> buffers(3);
  comm::InMemoryStore next_store;
  RunRanks(3, [&](int rank, std::shared_ptr<comm::Communicator> comm) {
    Model m = MakeModel(rank);
    m.opt = WithMomentum(m);
    auto s = *SlowMo::Create(m.params, {}, comm, 0, o);
    for (int64_t n = 0; n < 6; ++n) {
      LocalStep(m, rank, n);
      ASSERT_TRUE(s->PerformSlowMo(*m.opt).ok());
    }
    EXPECT_NE(s->CheckpointDivergence(*m.opt).find("per-parameter state"),
              std::string::npos);
    auto state = s->CheckpointState(*m.opt);
    ASSERT_TRUE(state.ok()) << state.status();
    EXPECT_EQ(s->CheckpointDivergence(*m.opt), "");
    std::map<std::string, torch::Tensor> by_name(state->begin(), state->end());
    const std::vector<torch::Tensor> mine = MomentumBuffers(*m.opt);
    ASSERT_EQ(mine.size(), m.params.size());
    for (size_t i = 0; i < mine.size(); ++i) {
      const torch::Tensor rows = by_name.at(
          "rank_optimizer/" + std::to_string(i) + "/momentum_buffer");
      ASSERT_EQ(rows.size(0), 3);
      EXPECT_TRUE(torch::equal(rows[rank], mine[i])) << "parameter " << i;
      // The ranks' really differ (the test can fail).
      EXPECT_FALSE(torch::equal(rows[0], rows[2])) << "parameter " << i;
    }
    {
      std::lock_guard<std::mutex> lock(mu);
      buffers[rank] = mine;
      if (rank == 0) {
        for (const auto& [key, t] : *state) saved.emplace_back(key, t.clone());
        file = checkpoint::CaptureOptimizer("optimizer", *m.opt);
        for (auto& [index, tensors] : file.state) {
          for (auto& [key, t] : tensors) t = t.clone();
        }
      }
    }
    torch::Tensor barrier = torch::ones({1});
    ASSERT_TRUE(comm->AllreduceSum(barrier, {})->Wait().ok());
    if (rank >= 2) return;

    Model fresh = MakeModel(rank);
    fresh.opt = WithMomentum(fresh);
    ASSERT_TRUE(checkpoint::ApplyOptimizer(file, *fresh.opt).ok());
    std::unique_ptr<SlowMo> resumed;
    ResumeAtTwo(next_store, rank, fresh, o, saved,
                Replaced(saved, "rank_optimizer/0/momentum_buffer",
                         torch::zeros({3, kSizes[0] + 1})),
                "0/momentum_buffer", &resumed);
    ASSERT_NE(resumed, nullptr);
    const std::vector<torch::Tensor> now = MomentumBuffers(*fresh.opt);
    ASSERT_EQ(now.size(), buffers[rank].size());
    for (size_t i = 0; i < now.size(); ++i) {
      EXPECT_TRUE(torch::equal(now[i], buffers[rank][i]))
          << "rank " << rank << " parameter " << i;
    }
  });
}

}  // namespace
}  // namespace concord::slowmo
