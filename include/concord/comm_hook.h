#pragma once
// A program's own DDP communication hook: PyTorch's
// ddp.register_comm_hook(state, hook), with hook(state, bucket) returning a
// future of the reduced bucket.
//
//   struct Halving { int calls = 0; };
//   ddp->register_comm_hook(std::make_shared<Halving>(),
//       [](Halving& s, concord::GradBucket& bucket) {
//         concord::ProcessGroup& group = bucket.process_group();
//         torch::Tensor t = bucket.buffer().div_(group.size());
//         const double f = ++s.calls % 2 ? 0.5 : 1.0;
//         return group.allreduce(t).then(
//             [f](torch::Tensor sum) { return sum.mul_(f); });
//       });
//
// Without a hook a bucket holds each gradient divided by the world size and
// is summed over the ranks (see Note [DDP Communication Hook] in
// worker/ddp/comm_hooks.h). With one, the bucket holds the plain (accumulated)
// gradients and the hook decides; the future's value, a tensor shaped like
// bucket.buffer(), becomes the bucket's gradients. Hooks run on the thread
// running backward, one bucket at a time in bucket order, identically on
// every rank: each rank must issue the same collectives. A hook is kept
// across re-forms: after one, its buckets come with the new generation's
// group.

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <vector>

namespace concord {

namespace detail {
struct FutureState;
struct ProcessGroupState;
}  // namespace detail

// An asynchronous tensor (PyTorch's torch.futures.Future[Tensor]).
class Future {
 public:
  // A future that is already done with `value` (a hook that reduces
  // nothing, or computes its result itself).
  static Future completed(at::Tensor value);

  // Blocks until the value is there and returns it. Throws Error when the
  // collective behind it failed (retryable: a peer went away, the
  // generation ended).
  at::Tensor wait() const;
  // A future of fn(value), run once this one is done (on the thread that
  // waits for it), as PyTorch's fut.then(lambda f: fn(f.value())).
  Future then(std::function<at::Tensor(at::Tensor)> fn) const;

  // Inside Concord (the reducer waits for it).
  explicit Future(std::shared_ptr<detail::FutureState> state)
      : state_(std::move(state)) {}
  const std::shared_ptr<detail::FutureState>& state() const { return state_; }

 private:
  std::shared_ptr<detail::FutureState> state_;
};

// The ranks a hook's collectives run over: the current generation's
// (PyTorch's process group).
class ProcessGroup {
 public:
  int rank() const;
  int size() const;
  // Sums `tensor` over the ranks, in place; the future's value is
  // `tensor`. Asynchronous: it returns at once.
  Future allreduce(at::Tensor tensor);

  explicit ProcessGroup(std::shared_ptr<detail::ProcessGroupState> state)
      : state_(std::move(state)) {}

 private:
  std::shared_ptr<detail::ProcessGroupState> state_;
};

// One bucket of gradients to reduce (PyTorch's dist.GradBucket).
class GradBucket {
 public:
  GradBucket(size_t index, at::Tensor buffer, std::vector<at::Tensor> gradients,
             std::vector<at::Tensor> parameters, bool is_last,
             ProcessGroup group)
      : index_(index),
        buffer_(std::move(buffer)),
        gradients_(std::move(gradients)),
        parameters_(std::move(parameters)),
        is_last_(is_last),
        group_(std::move(group)) {}

  // The bucket's place in the order buckets are reduced (0 first).
  size_t index() const { return index_; }
  // Its gradients, flattened into one tensor of one dtype.
  const at::Tensor& buffer() const { return buffer_; }
  // Each parameter's gradient: views into buffer().
  const std::vector<at::Tensor>& gradients() const { return gradients_; }
  const std::vector<at::Tensor>& parameters() const { return parameters_; }
  // Whether this is the iteration's last bucket.
  bool is_last() const { return is_last_; }
  // The group to reduce it over.
  ProcessGroup& process_group() { return group_; }

 private:
  size_t index_;
  at::Tensor buffer_;
  std::vector<at::Tensor> gradients_;
  std::vector<at::Tensor> parameters_;
  bool is_last_;
  ProcessGroup group_;
};

// A hook: the future of the bucket's reduced gradients.
using CommHook = std::function<Future(GradBucket& bucket)>;

// PyTorch's allreduce_hook (ddp_comm_hooks.default_hooks): the bucket
// divided by the world size, then summed over the ranks. DDP without a hook
// multiplies by 1/world while copying instead, which rounds differently
// from dividing at some world sizes.
Future allreduce_hook(GradBucket& bucket);

}  // namespace concord
