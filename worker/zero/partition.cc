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

BucketAssignment AssignBuckets(const std::vector<std::vector<int64_t>>& buckets,
                               int world_size, bool shard_buckets) {
  BucketAssignment out;
  out.ranks.resize(buckets.size());
  auto give = [&](int bucket, int rank, int offset, int length) {
    out.runs.push_back(BucketRun{bucket, rank, offset, length});
    std::vector<int>& holders = out.ranks[size_t(bucket)];
    if (std::find(holders.begin(), holders.end(), rank) == holders.end()) {
      holders.push_back(rank);
    }
  };
  if (!shard_buckets) {
    for (size_t b = 0; b < buckets.size(); ++b) {
      give(int(b), int(b) % world_size, 0, int(buckets[b].size()));
    }
  } else {
    int64_t total = 0;
    for (const auto& b : buckets) {
      total = std::accumulate(b.begin(), b.end(), total);
    }
    // PyTorch compares against total / world as a float.
    const double threshold = double(total) / world_size;
    std::vector<int64_t> sizes(size_t(world_size), 0);
    std::vector<int64_t> bucket_sizes;
    for (const auto& b : buckets) {
      bucket_sizes.push_back(std::accumulate(b.begin(), b.end(), int64_t{0}));
    }
    std::vector<int> order(buckets.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      return bucket_sizes[size_t(a)] < bucket_sizes[size_t(b)];
    });
    // The first rank with the fewest elements not holding part of `bucket`;
    // when every rank holds part of it, the first with the fewest.
    auto least = [&](int bucket) {
      const auto& taken = out.ranks[size_t(bucket)];
      const bool all = int(taken.size()) == world_size;
      int best = -1;
      for (int r = 0; r < world_size; ++r) {
        if (!all && std::find(taken.begin(), taken.end(), r) != taken.end()) {
          continue;
        }
        if (best < 0 || sizes[size_t(r)] < sizes[size_t(best)]) best = r;
      }
      return best;
    };
    for (int b : order) {
      const std::vector<int64_t>& params = buckets[size_t(b)];
      int offset = 0;
      int64_t run = 0;
      for (int i = 0; i < int(params.size()); ++i) {
        const int64_t n = params[size_t(i)];
        if (double(run + n) >= threshold && i > offset) {
          const int rank = least(b);
          give(b, rank, offset, i - offset);
          sizes[size_t(rank)] += run;
          offset = i;
          run = 0;
        }
        run += n;
      }
      const int rank = least(b);
      give(b, rank, offset, int(params.size()) - offset);
      sizes[size_t(rank)] += run;
    }
  }
  for (auto& r : out.ranks) std::sort(r.begin(), r.end());
  return out;
}

std::vector<int> MirrorsOf(const std::vector<std::string>& nodes,
                           const std::vector<int64_t>& sizes) {
  const int world = static_cast<int>(nodes.size());
  std::vector<int> out(nodes.size(), -1);
  if (world < 2) return out;
  // Without sizes, shards of one size.
  const std::vector<int64_t> own = sizes.size() == nodes.size()
                                       ? sizes
                                       : std::vector<int64_t>(nodes.size(), 1);
  std::vector<int64_t> load = own;
  // The shards, largest first (a stable sort: the lower rank on a tie).
  std::vector<int> order(nodes.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return own[size_t(a)] > own[size_t(b)];
  });
  for (int r : order) {
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
    load[size_t(best)] += own[size_t(r)];
  }
  return out;
}

bool EveryRankStepsAll(const std::vector<int>& mirrors,
                       const std::vector<int64_t>& sizes) {
  for (size_t r = 0; r < mirrors.size(); ++r) {
    if (r < sizes.size() && sizes[r] == 0) continue;
    for (size_t s = 0; s < mirrors.size(); ++s) {
      if (s != r && mirrors[r] != int(s)) return false;
    }
  }
  return true;
}

std::vector<int64_t> ShardSizes(
    const Partition& partition,
    const std::vector<std::vector<int64_t>>& numels) {
  std::vector<int64_t> out(partition.size(), 0);
  for (size_t rank = 0; rank < partition.size(); ++rank) {
    for (size_t g = 0; g < partition[rank].size() && g < numels.size(); ++g) {
      for (int i : partition[rank][g]) {
        if (i >= 0 && size_t(i) < numels[g].size()) {
          out[rank] += numels[g][size_t(i)];
        }
      }
    }
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
