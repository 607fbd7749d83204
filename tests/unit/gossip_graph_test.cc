// Gossip graphs: phone books worked out by hand from fairscale's
// definitions, peer sequences, and the consistency every round must have.
#include "worker/slowmo/gossip_graph.h"

#include <gtest/gtest.h>

#include <algorithm>

namespace concord::slowmo {
namespace {

using Books = std::vector<std::vector<int>>;

GossipGraph Make(GraphType type, int world, int k = 1) {
  auto g = GossipGraph::Create(type, world, k);
  EXPECT_TRUE(g.ok()) << g.status();
  return *g;
}

TEST(GossipGraphTest, PhoneBooksFollowFairscale) {
  // r ± 2^i, i = 0..floor(log2(n-1)), duplicates dropped.
  EXPECT_EQ(Make(GraphType::kDirectedExponential, 8).phone_books()[0],
            (std::vector<int>{1, 7, 2, 6, 4}));
  EXPECT_EQ(Make(GraphType::kDirectedExponential, 4).phone_books()[1],
            (std::vector<int>{2, 0, 3}));
  EXPECT_EQ(Make(GraphType::kDirectedExponential, 3).phone_books()[0],
            (std::vector<int>{1, 2}));
  // r + j (k+1)^i.
  EXPECT_EQ(Make(GraphType::kNPeerDirectedExponential, 8).phone_books()[0],
            (std::vector<int>{1, 2, 4}));
  EXPECT_EQ(Make(GraphType::kNPeerDirectedExponential, 9, 2).phone_books()[0],
            (std::vector<int>{1, 2, 3, 6}));
  EXPECT_EQ(Make(GraphType::kNPeerDirectedExponential, 10, 2).phone_books()[4],
            (std::vector<int>{5, 6, 7, 0, 3, 2}));
  // Passive (even) ranks talk to active (odd) ones only.
  EXPECT_EQ(
      Make(GraphType::kBipartiteExponential, 6).phone_books(),
      (Books{
          {1, 5, 3}, {2, 0, 4}, {3, 1, 5}, {4, 2, 0}, {5, 3, 1}, {0, 4, 2}}));
  EXPECT_EQ(Make(GraphType::kDirectedLinear, 5).phone_books()[0],
            (std::vector<int>{1, 4, 3, 2}));
  EXPECT_EQ(Make(GraphType::kBipartiteLinear, 4).phone_books(),
            (Books{{1, 3}, {2, 0}, {3, 1}, {0, 2}}));
  EXPECT_EQ(Make(GraphType::kRing, 5).phone_books()[0],
            (std::vector<int>{1, 4}));
  EXPECT_EQ(Make(GraphType::kRing, 2).phone_books(), (Books{{1}, {0}}));
  EXPECT_TRUE(Make(GraphType::kRing, 1).phone_books()[0].empty());
}

TEST(GossipGraphTest, PeersCycleThroughTheBook) {
  // Default graph, 8 ranks: rank 0 sends to 1, 2, 4, 1, ... and hears from
  // the ranks for which it is at the same distance.
  GossipGraph g = Make(GraphType::kNPeerDirectedExponential, 8);
  const std::vector<int> out = {1, 2, 4, 1};
  const std::vector<int> in = {7, 6, 4, 7};
  for (int t = 0; t < 4; ++t) {
    GossipPeers p = g.PeersAt(0, t);
    EXPECT_EQ(p.out, std::vector<int>{out[t]}) << "round " << t;
    EXPECT_EQ(p.in, std::vector<int>{in[t]}) << "round " << t;
  }
  // Two peers per round on 9 ranks: indices (0,1), (2,3), (0,1), ...
  GossipGraph g2 = Make(GraphType::kNPeerDirectedExponential, 9, 2);
  EXPECT_EQ(g2.PeersAt(0, 0).out, (std::vector<int>{1, 2}));
  EXPECT_EQ(g2.PeersAt(0, 0).in, (std::vector<int>{8, 7}));
  EXPECT_EQ(g2.PeersAt(0, 1).out, (std::vector<int>{3, 6}));
  EXPECT_EQ(g2.PeersAt(0, 1).in, (std::vector<int>{6, 3}));
  EXPECT_EQ(g2.PeersAt(0, 2).out, (std::vector<int>{1, 2}));
  // The ring is static.
  GossipGraph ring = Make(GraphType::kRing, 5);
  for (int t = 0; t < 3; ++t) {
    EXPECT_EQ(ring.PeersAt(2, t).out, std::vector<int>{3});
    EXPECT_EQ(ring.PeersAt(2, t).in, std::vector<int>{1});
  }
  EXPECT_TRUE(Make(GraphType::kRing, 1).PeersAt(0, 0).out.empty());
}

TEST(GossipGraphTest, EveryRoundIsConsistentAndRegular) {
  const GraphType types[] = {
      GraphType::kDirectedExponential,  GraphType::kNPeerDirectedExponential,
      GraphType::kBipartiteExponential, GraphType::kDirectedLinear,
      GraphType::kBipartiteLinear,      GraphType::kRing};
  for (GraphType type : types) {
    for (int world = 2; world <= 12; ++world) {
      auto g = GossipGraph::Create(type, world);
      if (!g.ok()) {
        // Only bipartite graphs over odd worlds are refused.
        EXPECT_TRUE(type == GraphType::kBipartiteExponential ||
                    type == GraphType::kBipartiteLinear);
        EXPECT_EQ(world % 2, 1) << GraphTypeName(type);
        continue;
      }
      for (int64_t t = 0; t < 2 * world; ++t) {
        for (int r = 0; r < world; ++r) {
          const GossipPeers p = g->PeersAt(r, t);
          ASSERT_EQ(p.out.size(), 1u);
          // Regular: one in-peer, and it really sends to r this round.
          ASSERT_EQ(p.in.size(), 1u) << GraphTypeName(type) << " " << world;
          const GossipPeers q = g->PeersAt(p.in[0], t);
          EXPECT_EQ(q.out[0], r);
          EXPECT_NE(p.out[0], r);
          if (g->bipartite()) {
            EXPECT_NE(p.out[0] % 2, r % 2);
          }
        }
      }
    }
  }
}

TEST(GossipGraphTest, BadGraphsAreRefused) {
  EXPECT_TRUE(absl::IsInvalidArgument(
      GossipGraph::Create(GraphType::kBipartiteLinear, 5).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(
      GossipGraph::Create(GraphType::kRing, 4, 2).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(
      GossipGraph::Create(GraphType::kNPeerDirectedExponential, 3, 3)
          .status()));
  EXPECT_TRUE(absl::IsInvalidArgument(
      GossipGraph::Create(GraphType::kRing, 0).status()));
  EXPECT_TRUE(ParseGraphType("ring").ok());
  EXPECT_EQ(*ParseGraphType("npeer-directed-exponential"),
            GraphType::kNPeerDirectedExponential);
  EXPECT_TRUE(absl::IsInvalidArgument(ParseGraphType("star").status()));
}

}  // namespace
}  // namespace concord::slowmo
