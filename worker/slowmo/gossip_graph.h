#pragma once
// The time-varying peer graphs of Stochastic Gradient Push, as fairscale's
// gossip/graph_manager.py builds them (no LibTorch here).
//
// Note [Gossip graphs]
// ~~~~~~~~~~~~~~~~~~~~
// Every rank has a phone book, the list of ranks it may send to, built from the
// world size alone (so every rank computes every other rank's book). At gossip
// round t a rank sends to `peers_per_itr` entries of its book starting at index
// (t * peers_per_itr) mod |book| (dynamic graphs; the ring stays at index 0),
// and receives from every rank whose book has it at that round's indices. Books
// list each peer once, in the order fairscale adds them:
//   directed-exponential:  r ± 2^i,           i = 0..floor(log2(n-1))
//   npeer-directed-exponential (fairscale's default):
//                          r + j (k+1)^i,     j = 1..k, i =
//                          0..floor(log_{k+1}(n-1))
//   bipartite-exponential: r ± 1, r ± (1 + 2^i) for i >= 1, only between
//                          passive (even) and active (odd) ranks
//   directed-linear:       r ± i,             odd i in 1..n-1
//   bipartite-linear:      r ± i,             i = 1..n-1, passive <-> active
//   ring:                  r + 1, r - 1       (static)
// fairscale takes floor(log(x, b)) in floating point, which can come out one
// short for exact powers of b > 2 (log(243, 3) = 4.999...); Concord uses the
// exact integer floor. A world of one rank has no peers.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace concord::slowmo {

enum class GraphType {
  kDirectedExponential,
  kNPeerDirectedExponential,
  kBipartiteExponential,
  kDirectedLinear,
  kBipartiteLinear,
  kRing,
};

// "directed-exponential", "npeer-directed-exponential",
// "bipartite-exponential", "directed-linear", "bipartite-linear", "ring".
absl::StatusOr<GraphType> ParseGraphType(std::string_view name);
std::string GraphTypeName(GraphType type);

struct GossipPeers {
  std::vector<int> out;  // ranks this one sends to, in book order
  std::vector<int> in;   // ranks it receives from (fairscale's order)
};

class GossipGraph {
 public:
  // Errors: INVALID_ARGUMENT for world_size < 1, peers_per_itr < 1 or more
  // than a book holds, peers_per_itr != 1 for a graph other than
  // npeer-directed-exponential (fairscale's other graphs cycle one peer at
  // a time), and a bipartite graph over an odd number of ranks (some books
  // would be empty).
  static absl::StatusOr<GossipGraph> Create(GraphType type, int world_size,
                                            int peers_per_itr = 1);

  // Peers of `rank` at gossip round `round` (0 = the first gossip).
  GossipPeers PeersAt(int rank, int64_t round) const;

  GraphType type() const { return type_; }
  int world_size() const { return static_cast<int>(books_.size()); }
  int peers_per_itr() const { return peers_per_itr_; }
  bool dynamic() const { return type_ != GraphType::kRing; }
  bool bipartite() const {
    return type_ == GraphType::kBipartiteExponential ||
           type_ == GraphType::kBipartiteLinear;
  }
  const std::vector<std::vector<int>>& phone_books() const { return books_; }

 private:
  GossipGraph() = default;
  std::vector<int> IndicesAt(int64_t round, size_t book_size) const;

  GraphType type_ = GraphType::kNPeerDirectedExponential;
  int peers_per_itr_ = 1;
  std::vector<std::vector<int>> books_;
};

}  // namespace concord::slowmo
