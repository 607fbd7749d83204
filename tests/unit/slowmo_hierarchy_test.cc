// SlowMo's node hierarchy (see Note [Node hierarchy] in
// worker/slowmo/hierarchy.h): the grouping, and training with ranks as threads
// over real Gloo (node and master groups included) against a reference computed
// here with one unit per node, whose gradient is the average of its ranks'.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <mutex>

#include "rank_threads.h"
#include "slowmo_fixture.h"
#include "worker/comm/gloo/gloo_communicator.h"
#include "worker/slowmo/hierarchy.h"
#include "worker/slowmo/slowmo.h"

namespace concord::slowmo {
namespace {

using concord::testing::RunRanks;
using namespace concord::slowmo::fixture;  // NOLINT

TEST(NodeLayoutTest, GroupsRanksByNodeIdAndCapsTheirSize) {
  // Interleaved ids: nodes need not be consecutive ranks.
  NodeLayout l = GroupNodes({"a", "b", "a", "b"}, 2);
  EXPECT_EQ(l.nodes, (std::vector<std::vector<int>>{{0, 2}, {1, 3}}));
  EXPECT_EQ(l.masters, (std::vector<int>{0, 1}));
  EXPECT_EQ(l.node_of, (std::vector<int>{0, 1, 0, 1}));
  // One process per node: every rank is a node, as without a hierarchy.
  l = GroupNodes({"a", "a", "a"}, 1);
  EXPECT_EQ(l.masters, (std::vector<int>{0, 1, 2}));
  // No ids: fairscale's nodes of k consecutive ranks (the last smaller).
  l = GroupNodes({"", "", "", "", ""}, 2);
  EXPECT_EQ(l.nodes, (std::vector<std::vector<int>>{{0, 1}, {2, 3}, {4}}));
  // A node that lost its master (old rank 0) and a process elsewhere: the
  // next-lowest rank leads it, the other node goes on with what is left.
  l = GroupNodes({"b", "a", "b"}, 2);
  EXPECT_EQ(l.nodes, (std::vector<std::vector<int>>{{0, 2}, {1}}));
  EXPECT_EQ(l.masters, (std::vector<int>{0, 1}));
  // More processes on a host than nprocs_per_node: several nodes there.
  l = GroupNodes({"h", "h", "h", "g"}, 2);
  EXPECT_EQ(l.nodes, (std::vector<std::vector<int>>{{0, 1}, {2}, {3}}));
}

void SetGrads(Model& m, int rank, int64_t step) {
  int64_t at = 0;
  for (auto& p : m.params) {
    torch::Tensor g = torch::empty_like(p);
    for (int64_t i = 0; i < p.numel(); ++i) g[i] = Grad(rank, step, at + i);
    p.mutable_grad() = g;
    at += p.numel();
  }
}

// Ranks of node `u` under `ids` (nprocs_per_node 2).
struct Nodes {
  explicit Nodes(std::vector<std::string> ids)
      : ids(ids), layout(GroupNodes(ids, 2)) {}
  // The node's average gradient, summed as the allreduce does (each rank's
  // share divided first).
  float NodeGrad(int u, int64_t step, int64_t i) const {
    const auto& ranks = layout.nodes[static_cast<size_t>(u)];
    float sum = 0;
    for (int r : ranks) {
      sum += Grad(r, step, i) / static_cast<float>(ranks.size());
    }
    return sum;
  }
  std::vector<std::string> ids;
  NodeLayout layout;
};

// 4 ranks = 2 nodes x 2 (interleaved): gradients averaged in the node every
// step, LocalSGD and slow momentum between the masters, parameters
// broadcast in the node; equal to the reference over 2 units whose
// gradient is their node's average.
void TwoNodesOfTwo(SlowMoOptions o, int64_t steps) {
  const Nodes nodes({"n0", "n1", "n0", "n1"});
  o.nprocs_per_node(2);
  comm::InMemoryStore group_store;
  comm::GlooGroupFactory factory(&group_store, comm::GlooOptions());
  RunRanks(4, [&](int rank, std::shared_ptr<comm::Communicator> comm) {
    Model m = MakeModel(rank);
    SlowMoOptions mine = o;
    SlowMoInternals internals;
    internals.node_id = nodes.ids[static_cast<size_t>(rank)];
    auto made =
        SlowMo::Create(m.params, {}, comm, 0, mine, internals, &factory);
    ASSERT_TRUE(made.ok()) << made.status();
    auto& s = *made;
    const int node = nodes.layout.node_of[static_cast<size_t>(rank)];
    Reference ref = Start(2);
    bool differed = false;
    for (int64_t n = 0; n < steps; ++n) {
      ASSERT_TRUE(s->PrepareForward().ok());
      SetGrads(m, rank, n);
      ASSERT_TRUE(s->AfterBackward().ok());
      m.opt->step();
      ASSERT_TRUE(s->PerformSlowMo(*m.opt).ok());
      ReferenceUpdate(ref, n, o, [&](int u, int64_t step, int64_t i) {
        return nodes.NodeGrad(u, step, i);
      });
      ExpectClose(Flat(m), ref.x[static_cast<size_t>(node)],
                  "rank " + std::to_string(rank) + " after update " +
                      std::to_string(n));
      differed |= !torch::equal(ref.x[0], ref.x[1]);
      if (s->slowmo_enabled()) {
        const int64_t a = s->portion_start(), b = s->portion_end();
        if (!s->is_master()) {
          EXPECT_EQ(b, a) << "a member holds no state";
        }
        if (b > a) {
          ExpectClose(s->momentum_buffer(), ref.u.narrow(0, a, b - a), "u");
          ExpectClose(s->old_params(), ref.x_old.narrow(0, a, b - a), "x_old");
        }
      }
    }
    EXPECT_EQ(s->num_nodes(), 2);
    EXPECT_EQ(s->node_size(), 2);
    EXPECT_EQ(s->is_master(), rank < 2);
    EXPECT_TRUE(differed) << "the nodes never drifted apart";
  });
}

TEST(SlowMoHierarchyTest, LocalSgdBetweenMastersOfTwoNodesOfTwo) {
  SlowMoOptions o;
  o.localsgd_frequency(3);
  o.slowmo_momentum(0.0);  // slow momentum off
  o.slowmo_lr(1.0);
  TwoNodesOfTwo(o, 7);
}

TEST(SlowMoHierarchyTest, ShardedSlowMomentumBetweenMastersOfTwoNodesOfTwo) {
  SlowMoOptions o;
  o.localsgd_frequency(2);
  o.slowmo_momentum(0.6);
  o.slowmo_lr(1.2);
  o.slowmo_frequency(4);
  o.slowmo_memory_efficient(true);
  TwoNodesOfTwo(o, 12);
  o.slowmo_memory_efficient(false);
  TwoNodesOfTwo(o, 8);
}

// SGP between the masters of 3 nodes of 2, 1 and 2 ranks (ids {a, b, a, c,
// c}: masters 0, 1, 3): x_u <- (x_u + x_in) / 2 with fairscale's
// npeer-directed-exponential in-peer u - 1, u - 2 (mod 3) in turn, after
// each node took its average gradient; everyone in a node ends with its
// master's numerators and weight.
TEST(SlowMoHierarchyTest, SgpGossipsBetweenMastersOfUnevenNodes) {
  const Nodes nodes({"a", "b", "a", "c", "c"});
  SlowMoOptions o;
  o.base_algorithm(BaseAlgorithm::kSgp);
  o.slowmo_momentum(0.0);
  o.slowmo_lr(1.0);
  o.nprocs_per_node(2);
  comm::InMemoryStore group_store;
  comm::GlooGroupFactory factory(&group_store, comm::GlooOptions());
  RunRanks(5, [&](int rank, std::shared_ptr<comm::Communicator> comm) {
    Model m = MakeModel(rank);
    SlowMoOptions mine = o;
    SlowMoInternals internals;
    internals.node_id = nodes.ids[static_cast<size_t>(rank)];
    auto s = *SlowMo::Create(m.params, {}, comm, 0, mine, internals, &factory);
    const int node = nodes.layout.node_of[static_cast<size_t>(rank)];
    std::vector<torch::Tensor> x(3);
    for (auto& v : x) {
      v = torch::empty({kTotal});
      for (int64_t i = 0; i < kTotal; ++i) v[i] = Init(0, i);
    }
    for (int64_t t = 0; t < 5; ++t) {
      ASSERT_TRUE(s->PrepareForward().ok());
      SetGrads(m, rank, t);
      ASSERT_TRUE(s->AfterBackward().ok());
      m.opt->step();
      ASSERT_TRUE(s->PerformSlowMo(*m.opt).ok());
      for (int u = 0; u < 3; ++u) {
        for (int64_t i = 0; i < kTotal; ++i) {
          x[u][i] = x[u][i].item<float>() -
                    static_cast<float>(LrOf(i)) * nodes.NodeGrad(u, t, i);
        }
      }
      const int off = t % 2 == 0 ? 1 : 2;
      std::vector<torch::Tensor> next;
      for (int u = 0; u < 3; ++u) {
        next.push_back((x[u] + x[(u + 3 - off) % 3]).mul_(0.5f));
      }
      x = next;
      ExpectClose(
          Flat(m), x[static_cast<size_t>(node)],
          "rank " + std::to_string(rank) + ", round " + std::to_string(t));
      EXPECT_EQ(s->ps_weight(), 1.0);
    }
    EXPECT_EQ(s->num_nodes(), 3);
    EXPECT_EQ(s->graph()->world_size(), 3);
    EXPECT_EQ(s->node_size(), rank == 1 ? 1 : 2);
    EXPECT_EQ(s->is_master(), rank == 0 || rank == 1 || rank == 3);
  });
}

// 2 nodes x 2 (ids n0 n1 n0 n1: masters 0 and 1, owners of the two slices,
// each the other's replica) with sharded slow momentum; after 6 updates
// rank 0 (master of n0, owner of slice [0, 6)) dies. The survivors, ranks
// 1, 2, 3 -> 0, 1, 2, form the next generation: n1 = {0, 2} led by 0, n0 =
// {1} led by its next-lowest rank, which held no state. u and x_old after
// the re-form equal the no-loss state (slice 0 from its replica, slice 1
// from its owner, now a rank of another node's number), and two more
// updates (the second a slow step) match the reference over the new nodes.
TEST(SlowMoHierarchyTest, MasterDeathElectsTheNextRankAndKeepsTheState) {
  SlowMoOptions o;
  o.localsgd_frequency(2);
  o.slowmo_momentum(0.5);
  o.slowmo_lr(0.8);
  o.slowmo_frequency(4);
  o.slowmo_num_shards(2);
  o.nprocs_per_node(2);
  const Nodes before({"n0", "n1", "n0", "n1"});
  const Nodes after({"n1", "n0", "n1"});
  comm::InMemoryStore group_store, next_store;
  comm::GlooGroupFactory factory(&group_store, comm::GlooOptions());
  std::mutex mu;
  torch::Tensor u_full = torch::zeros({kTotal});
  torch::Tensor old_full = torch::zeros({kTotal});
  RunRanks(4, [&](int rank, std::shared_ptr<comm::Communicator> comm) {
    Model m = MakeModel(rank);
    SlowMoOptions mine = o;
    SlowMoInternals internals;
    internals.node_id = before.ids[static_cast<size_t>(rank)];
    auto s = *SlowMo::Create(m.params, {}, comm, 0, mine, internals, &factory);
    for (int64_t n = 0; n < 6; ++n) {
      SetGrads(m, rank, n);
      ASSERT_TRUE(s->AfterBackward().ok());
      m.opt->step();
      ASSERT_TRUE(s->PerformSlowMo(*m.opt).ok());
    }
    {
      std::lock_guard<std::mutex> lock(mu);
      const int64_t a = s->portion_start(), len = s->portion_end() - a;
      EXPECT_EQ(len, rank < 2 ? 6 : 0);
      if (len > 0) {
        u_full.narrow(0, a, len).copy_(s->momentum_buffer());
        old_full.narrow(0, a, len).copy_(s->old_params());
      }
    }
    torch::Tensor barrier = torch::ones({1});
    ASSERT_TRUE(comm->AllreduceSum(barrier, {})->Wait().ok());
    if (rank == 0) return;  // gone
    const int next = rank - 1;
    std::shared_ptr<comm::Communicator> comm2 =
        concord::testing::NextGeneration(next_store, next, 3, 2);
    ASSERT_NE(comm2, nullptr);
    ASSERT_TRUE(s->SyncState(comm2, 0, /*step=*/6, *m.opt).ok());
    EXPECT_EQ(s->num_nodes(), 2);
    EXPECT_EQ(s->is_master(), next < 2);
    EXPECT_EQ(s->node_size(), next == 1 ? 1 : 2);
    const int64_t a = s->portion_start(), len = s->portion_end() - a;
    EXPECT_EQ(len, next < 2 ? 6 : 0);
    if (len > 0) {
      EXPECT_TRUE(torch::equal(s->momentum_buffer(), u_full.narrow(0, a, len)));
      EXPECT_TRUE(torch::equal(s->old_params(), old_full.narrow(0, a, len)));
    }
    Reference ref;  // update 6 averaged: every rank has the same x
    ref.x = {Flat(m), Flat(m)};
    ref.u = u_full.clone();  // each thread its own reference
    ref.x_old = old_full.clone();
    ref.initialized = true;
    const int node = after.layout.node_of[static_cast<size_t>(next)];
    for (int64_t n = 6; n < 8; ++n) {
      SetGrads(m, next, n);
      ASSERT_TRUE(s->AfterBackward().ok());
      m.opt->step();
      ASSERT_TRUE(s->PerformSlowMo(*m.opt).ok());
      ReferenceUpdate(ref, n, o, [&](int u, int64_t step, int64_t i) {
        return after.NodeGrad(u, step, i);
      });
      ExpectClose(Flat(m), ref.x[static_cast<size_t>(node)],
                  "rank " + std::to_string(next) + " after update " +
                      std::to_string(n));
    }
    if (len > 0) {
      ExpectClose(s->momentum_buffer(), ref.u.narrow(0, a, len), "u");
      ExpectClose(s->old_params(), ref.x_old.narrow(0, a, len), "x_old");
    }
  });
}

// Without a group factory a hierarchy cannot be made: a clear error, no
// collective.
TEST(SlowMoHierarchyTest, HierarchyNeedsAGroupFactory) {
  RunRanks(1, [&](int, std::shared_ptr<comm::Communicator> comm) {
    Model m = MakeModel(0);
    SlowMoOptions o;
    o.nprocs_per_node(2);
    auto s = SlowMo::Create(m.params, {}, comm, 0, o);
    EXPECT_TRUE(absl::IsInvalidArgument(s.status())) << s.status();
    o.nprocs_per_node(0);
    s = SlowMo::Create(m.params, {}, comm, 0, o);
    EXPECT_TRUE(absl::IsInvalidArgument(s.status())) << s.status();
  });
}

}  // namespace
}  // namespace concord::slowmo
