#pragma once
// Which gradients share a bucket. Torch-free, so it is cheap to test.
//
// Note [Bucket assignment]: like PyTorch's reducer, gradients are visited in
// reverse parameter order (the order in which backward tends to produce
// them), grouped by dtype (a bucket is one flat tensor of one dtype), and a
// bucket closes once it holds at least its cap: the first bucket of each
// dtype gets `first_bucket_bytes` (PyTorch: 1 MiB) so that communication
// starts early, later ones `bucket_cap_bytes` (PyTorch: 25 MiB). Buckets are
// numbered in the order their first gradient is visited, which is the order
// they are launched in.

#include <cstddef>
#include <cstdint>
#include <vector>

namespace concord::ddp {

struct GradSpec {
  int64_t bytes = 0;
  int dtype = 0;  // any key; gradients of different keys never share a bucket
};

// Returns, for each bucket in launch order, the indices of its gradients in
// the order they are laid out in the bucket.
std::vector<std::vector<size_t>> ComputeBucketAssignment(
    const std::vector<GradSpec>& grads, int64_t first_bucket_bytes,
    int64_t bucket_cap_bytes);

}  // namespace concord::ddp
