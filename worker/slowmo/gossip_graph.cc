#include "worker/slowmo/gossip_graph.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace concord::slowmo {
namespace {

struct NamedGraph {
  const char* name;
  GraphType type;
};
constexpr NamedGraph kGraphs[] = {
    {"directed-exponential", GraphType::kDirectedExponential},
    {"npeer-directed-exponential", GraphType::kNPeerDirectedExponential},
    {"bipartite-exponential", GraphType::kBipartiteExponential},
    {"directed-linear", GraphType::kDirectedLinear},
    {"bipartite-linear", GraphType::kBipartiteLinear},
    {"ring", GraphType::kRing},
};

// Python's (r + p) % n for any sign.
int Wrap(int64_t r, int n) {
  const int64_t m = r % n;
  return static_cast<int>(m < 0 ? m + n : m);
}

// The largest i >= 0 with base^i <= x (x >= 1).
int FloorLog(int64_t x, int64_t base) {
  int i = 0;
  for (int64_t p = base; p <= x; p *= base) ++i;
  return i;
}

bool Passive(int rank) { return rank % 2 == 0; }

void Add(std::vector<int>& book, int peer) {
  if (std::find(book.begin(), book.end(), peer) == book.end()) {
    book.push_back(peer);
  }
}

// fairscale's bipartite rule: a peer pair joins only across the partition.
void AddBipartite(std::vector<int>& book, int rank, int f, int b) {
  if (!Passive(rank) && Passive(f) && Passive(b)) {
    Add(book, f);
    Add(book, b);
  } else if (Passive(rank) && !Passive(f) && !Passive(b)) {
    Add(book, f);
    Add(book, b);
  }
}

std::vector<int> Book(GraphType type, int rank, int n, int k) {
  std::vector<int> book;
  if (n < 2) return book;
  switch (type) {
    case GraphType::kDirectedExponential:
      for (int i = 0, top = FloorLog(n - 1, 2); i <= top; ++i) {
        Add(book, Wrap(rank + (int64_t{1} << i), n));
        Add(book, Wrap(rank - (int64_t{1} << i), n));
      }
      break;
    case GraphType::kNPeerDirectedExponential: {
      int64_t scale = 1;
      for (int i = 0, top = FloorLog(n - 1, k + 1); i <= top; ++i) {
        for (int j = 1; j <= k; ++j) {
          // With k > 1 a distance can be a multiple of n: a rank never
          // gossips with itself (fairscale would add it).
          const int peer = Wrap(rank + j * scale, n);
          if (peer != rank) Add(book, peer);
        }
        scale *= k + 1;
      }
      break;
    }
    case GraphType::kBipartiteExponential:
      for (int i = 0, top = FloorLog(n - 1, 2); i <= top; ++i) {
        const int64_t d = i == 0 ? 1 : 1 + (int64_t{1} << i);
        AddBipartite(book, rank, Wrap(rank + d, n), Wrap(rank - d, n));
      }
      break;
    case GraphType::kDirectedLinear:
      for (int i = 1; i < n; i += 2) {
        Add(book, Wrap(rank + i, n));
        Add(book, Wrap(rank - i, n));
      }
      break;
    case GraphType::kBipartiteLinear:
      for (int i = 1; i < n; ++i) {
        AddBipartite(book, rank, Wrap(rank + i, n), Wrap(rank - i, n));
      }
      break;
    case GraphType::kRing:
      Add(book, Wrap(rank + 1, n));
      Add(book, Wrap(rank - 1, n));
      break;
  }
  return book;
}

}  // namespace

absl::StatusOr<GraphType> ParseGraphType(std::string_view name) {
  for (const NamedGraph& g : kGraphs) {
    if (name == g.name) return g.type;
  }
  std::string known;
  for (const NamedGraph& g : kGraphs) {
    absl::StrAppend(&known, known.empty() ? "" : ", ", g.name);
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown gossip graph '", std::string(name), "' (one of ", known, ")"));
}

std::string GraphTypeName(GraphType type) {
  for (const NamedGraph& g : kGraphs) {
    if (g.type == type) return g.name;
  }
  return "unknown";
}

absl::StatusOr<GossipGraph> GossipGraph::Create(GraphType type, int world_size,
                                                int peers_per_itr) {
  if (world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("gossip over ", world_size, " ranks"));
  }
  if (peers_per_itr < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("peers per iteration must be >= 1, got ", peers_per_itr));
  }
  if (peers_per_itr != 1 && type != GraphType::kNPeerDirectedExponential) {
    return absl::InvalidArgumentError(absl::StrCat(
        "only npeer-directed-exponential gossips with more than one peer per "
        "iteration, not ",
        GraphTypeName(type)));
  }
  GossipGraph graph;
  graph.type_ = type;
  graph.peers_per_itr_ = peers_per_itr;
  if (world_size > 1 && graph.bipartite() && world_size % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(GraphTypeName(type),
                     " needs an even number of ranks, not ", world_size));
  }
  for (int r = 0; r < world_size; ++r) {
    graph.books_.push_back(Book(type, r, world_size, peers_per_itr));
    if (world_size > 1 &&
        graph.books_.back().size() < static_cast<size_t>(peers_per_itr)) {
      return absl::InvalidArgumentError(
          absl::StrCat(GraphTypeName(type), " over ", world_size, " ranks has ",
                       graph.books_.back().size(), " peer(s) for rank ", r,
                       ", fewer than ", peers_per_itr, " per iteration"));
    }
  }
  return graph;
}

std::vector<int> GossipGraph::IndicesAt(int64_t round, size_t book_size) const {
  std::vector<int> indices;
  const int64_t start = dynamic() ? round * peers_per_itr_ : 0;
  for (int i = 0; i < peers_per_itr_; ++i) {
    indices.push_back(
        static_cast<int>((start + i) % static_cast<int64_t>(book_size)));
  }
  return indices;
}

GossipPeers GossipGraph::PeersAt(int rank, int64_t round) const {
  GossipPeers peers;
  if (books_.size() < 2) return peers;
  const std::vector<int>& mine = books_[static_cast<size_t>(rank)];
  for (int g : IndicesAt(round, mine.size())) {
    peers.out.push_back(mine[static_cast<size_t>(g)]);
  }
  // fairscale applies this rank's indices to every book; books are equally
  // long for every graph Create accepts, so each rank's own indices (what it
  // really sends to) give the same in-peers, in the same order.
  for (int i = 0; i < peers_per_itr_; ++i) {
    for (int r = 0; r < world_size(); ++r) {
      if (r == rank) continue;
      const std::vector<int>& theirs = books_[static_cast<size_t>(r)];
      const int g = IndicesAt(round, theirs.size())[static_cast<size_t>(i)];
      if (theirs[static_cast<size_t>(g)] == rank) peers.in.push_back(r);
    }
  }
  return peers;
}

}  // namespace concord::slowmo
