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
    size_t opened_at = 0;  // visiting position of its first gradient
    bool first = true;     // the next bucket closed for this dtype is its first
  };
  std::map<int, Open> open;  // by dtype
  std::vector<std::pair<size_t, std::vector<size_t>>> closed;

  for (size_t step = 0; step < order.size(); ++step) {
    const size_t index = order[step];
    const GradSpec& g = grads[index];
    Open& bucket = open[g.dtype];
    if (bucket.indices.empty()) bucket.opened_at = step;
    bucket.indices.push_back(index);
    bucket.bytes += g.bytes;
    const int64_t cap = bucket.first ? first_bucket_bytes : bucket_cap_bytes;
    if (bucket.bytes >= cap || g.closes_bucket) {
      closed.emplace_back(bucket.opened_at, std::move(bucket.indices));
      bucket.indices.clear();
      bucket.bytes = 0;
      bucket.first = false;
    }
  }
  for (auto& [dtype, bucket] : open) {
    if (!bucket.indices.empty()) {
      closed.emplace_back(bucket.opened_at, std::move(bucket.indices));
    }
  }
  std::sort(closed.begin(), closed.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<std::vector<size_t>> result;
  result.reserve(closed.size());
  for (auto& c : closed) result.push_back(std::move(c.second));
  return result;
}

std::vector<std::vector<size_t>> ComputeBucketAssignment(
    const std::vector<GradSpec>& grads, int64_t first_bucket_bytes,
    int64_t bucket_cap_bytes) {
  std::vector<size_t> order(grads.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = order.size() - 1 - i;
  return ComputeBucketAssignment(grads, order, first_bucket_bytes,
                                 bucket_cap_bytes);
}

}  // namespace concord::ddp
