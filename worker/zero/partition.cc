#include "worker/zero/partition.h"

#include <algorithm>
#include <numeric>

namespace concord::zero {

Partition PartitionParameters(const std::vector<std::vector<int64_t>>& numels,
                              int world_size) {
  Partition shards(static_cast<size_t>(world_size),
                   std::vector<std::vector<int>>(numels.size()));
  std::vector<int64_t> sizes(static_cast<size_t>(world_size), 0);
  for (size_t g = 0; g < numels.size(); ++g) {
    std::vector<int> order(numels[g].size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      return numels[g][static_cast<size_t>(a)] >
             numels[g][static_cast<size_t>(b)];
    });
    for (int i : order) {
      // The first rank with the smallest total (PyTorch's _get_min_index).
      const auto rank = static_cast<size_t>(
          std::min_element(sizes.begin(), sizes.end()) - sizes.begin());
      shards[rank][g].push_back(i);
      sizes[rank] += numels[g][static_cast<size_t>(i)];
    }
  }
  return shards;
}

std::vector<int> OwnerOf(const Partition& partition,
                         const std::vector<std::vector<int64_t>>& numels) {
  std::vector<size_t> offsets(numels.size(), 0);
  size_t total = 0;
  for (size_t g = 0; g < numels.size(); ++g) {
    offsets[g] = total;
    total += numels[g].size();
  }
  std::vector<int> owner(total, -1);
  for (size_t rank = 0; rank < partition.size(); ++rank) {
    for (size_t g = 0; g < partition[rank].size(); ++g) {
      for (int i : partition[rank][g]) {
        owner[offsets[g] + static_cast<size_t>(i)] = static_cast<int>(rank);
      }
    }
  }
  return owner;
}

std::vector<int> MirrorsOf(const std::vector<std::string>& nodes) {
  const int world = static_cast<int>(nodes.size());
  std::vector<int> out(nodes.size(), -1);
  std::vector<int> load(nodes.size(), 0);
  for (int r = 0; world > 1 && r < world; ++r) {
    bool elsewhere = false;
    for (int k = 1; k < world; ++k) {
      elsewhere =
          elsewhere || nodes[size_t((r + k) % world)] != nodes[size_t(r)];
    }
    // The least loaded candidate, the first after r on a tie.
    int best = -1;
    for (int k = 1; k < world; ++k) {
      const int other = (r + k) % world;
      if (elsewhere && nodes[size_t(other)] == nodes[size_t(r)]) continue;
      if (best < 0 || load[size_t(other)] < load[size_t(best)]) best = other;
    }
    out[size_t(r)] = best;
    ++load[size_t(best)];
  }
  return out;
}

Offer OfferAt(int64_t base, bool stepped, bool copied, int64_t step) {
  if ((stepped ? base + 1 : base) == step) return Offer::kLive;
  if (stepped && copied && base == step) return Offer::kCopy;
  return Offer::kNone;
}

Sources SourcesOf(const std::vector<std::vector<int64_t>>& offers,
                  int64_t parameters) {
  Sources out;
  out.rank.assign(static_cast<size_t>(parameters), -1);
  for (size_t r = 0; r < offers.size(); ++r) {
    for (int64_t i : offers[r]) {
      if (i >= 0 && i < parameters && out.rank[size_t(i)] < 0) {
        out.rank[size_t(i)] = static_cast<int>(r);
      }
    }
  }
  for (int64_t i = 0; i < parameters; ++i) {
    if (out.rank[size_t(i)] < 0) out.missing.push_back(i);
  }
  return out;
}

}  // namespace concord::zero
