#include "worker/ddp/bucket_assignment.h"

#include <algorithm>
#include <map>

namespace concord::ddp {

std::vector<std::vector<size_t>> ComputeBucketAssignment(
    const std::vector<GradSpec>& grads, const std::vector<size_t>& order,
    int64_t first_bucket_bytes, int64_t bucket_cap_bytes) {
  struct Open {
    std::vector<size_t> indices;
    int64_t bytes = 0;
    bool first = true;  // the next bucket closed for this dtype is its first
  };
  std::map<int, Open> open;  // by dtype
  std::vector<std::vector<size_t>> result;
  for (size_t index : order) {
    const GradSpec& g = grads[index];
    Open& bucket = open[g.dtype];
    bucket.indices.push_back(index);
    bucket.bytes += g.bytes;
    const int64_t cap = bucket.first ? first_bucket_bytes : bucket_cap_bytes;
    if (bucket.bytes >= cap || g.closes_bucket) {
      result.push_back(std::move(bucket.indices));
      bucket.indices.clear();
      bucket.bytes = 0;
      bucket.first = false;
    }
  }
  for (auto& [dtype, bucket] : open) {
    if (!bucket.indices.empty()) result.push_back(std::move(bucket.indices));
  }
  return result;
}

std::vector<std::vector<size_t>> InitialBucketAssignment(
    const std::vector<GradSpec>& grads, int64_t first_bucket_bytes,
    int64_t bucket_cap_bytes) {
  std::vector<size_t> forward(grads.size());
  for (size_t i = 0; i < forward.size(); ++i) forward[i] = i;
  auto buckets = ComputeBucketAssignment(grads, forward, first_bucket_bytes,
                                         bucket_cap_bytes);
  std::sort(buckets.begin(), buckets.end(), [](const auto& a, const auto& b) {
    return *std::min_element(a.begin(), a.end()) <
           *std::min_element(b.begin(), b.end());
  });
  std::reverse(buckets.begin(), buckets.end());
  return buckets;
}

}  // namespace concord::ddp
