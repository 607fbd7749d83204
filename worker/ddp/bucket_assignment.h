#pragma once
// Which gradients share a bucket. Torch-free, so it is cheap to test.
//
// Note [Bucket assignment]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// PyTorch's compute_bucket_assignment_by_size. Gradients are visited in an
// order and grouped by dtype (a bucket is one flat tensor of one dtype); a
// bucket closes once it holds at least its cap — the first bucket of each dtype
// `first_bucket_bytes` (PyTorch: 1 MiB), later ones `bucket_cap_bytes`
// (PyTorch: 25 MiB) — or at a gradient marked `closes_bucket` (apex's
// allreduce_trigger_params). Buckets are listed in the order they closed, then
// the ones left open.
//
// The first layout (before any backward) is PyTorch 1.13's: parameters in
// forward order, buckets sorted by their lowest index, the list reversed, so
// that bucket 0 holds the last parameters (the first gradients of backward)
// and the small first bucket ends up last. (PyTorch uses this capped layout
// only with find_unused_parameters and no static graph; otherwise its first
// iteration is one bucket per dtype — the reducer passes unlimited caps.) After
// the first iteration the reducer rebuilds the layout from the order gradients
// became ready, where the small bucket really is first. The layout never
// changes a sum; it matters to overlap and to PowerSGD, which compresses per
// bucket.

#include <cstddef>
#include <cstdint>
#include <vector>

namespace concord::ddp {

struct GradSpec {
  int64_t bytes = 0;  // or elements, when caps are given in elements
  int dtype = 0;      // gradients of different keys never share a bucket
  bool closes_bucket = false;
};

// Visits `grads` in `order` (indices into `grads`, each once): PyTorch's
// rebuild from the ready order. Returns each bucket's gradient indices, in
// layout order, buckets in launch order.
std::vector<std::vector<size_t>> ComputeBucketAssignment(
    const std::vector<GradSpec>& grads, const std::vector<size_t>& order,
    int64_t first_bucket_bytes, int64_t bucket_cap_bytes);

// PyTorch 1.13's initial layout (see the note).
std::vector<std::vector<size_t>> InitialBucketAssignment(
    const std::vector<GradSpec>& grads, int64_t first_bucket_bytes,
    int64_t bucket_cap_bytes);

}  // namespace concord::ddp
