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

}  // namespace concord::zero
