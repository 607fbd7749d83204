#pragma once
// Which gradients share a bucket. Torch-free, so it is cheap to test.
//
// Note [Bucket assignment]: like PyTorch's reducer, gradients are visited in
// the order backward is expected to produce them — reverse parameter order at
// first, the order observed in the first iteration after the rebuild —
// grouped by dtype (a bucket is one flat tensor of one dtype), and a bucket
// closes once it holds at least its cap: the first bucket of each dtype gets
// `first_bucket_bytes` (PyTorch: 1 MiB) so that communication starts early,
// later ones `bucket_cap_bytes` (PyTorch: 25 MiB). A gradient marked
// `closes_bucket` (apex's allreduce_trigger_params) closes its bucket
// whatever its size. Buckets are numbered in the order their first gradient
// is visited, which is the order they are launched in.

#include <cstddef>
#include <cstdint>
#include <vector>

namespace concord::ddp {

struct GradSpec {
  int64_t bytes = 0;  // or elements, when caps are given in elements
  int dtype = 0;      // gradients of different keys never share a bucket
  bool closes_bucket = false;
};

// Visits `grads` in `order` (indices into `grads`, each once). Returns, for
// each bucket in launch order, the indices of its gradients in the order
// they are laid out in the bucket.
std::vector<std::vector<size_t>> ComputeBucketAssignment(
    const std::vector<GradSpec>& grads, const std::vector<size_t>& order,
    int64_t first_bucket_bytes, int64_t bucket_cap_bytes);

// The same, visiting in reverse index order.
std::vector<std::vector<size_t>> ComputeBucketAssignment(
    const std::vector<GradSpec>& grads, int64_t first_bucket_bytes,
    int64_t bucket_cap_bytes);

}  // namespace concord::ddp
