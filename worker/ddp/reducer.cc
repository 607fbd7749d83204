#include "worker/ddp/reducer.h"

#include <ATen/ATen.h>
#include <spdlog/spdlog.h>
#include <torch/csrc/autograd/engine.h>

#include "absl/strings/str_cat.h"
#include "worker/ddp/bucket_assignment.h"
#include "worker/error.h"

namespace concord::ddp {

Reducer::Reducer(std::vector<at::Tensor> params, std::vector<std::string> names,
                 std::shared_ptr<comm::Communicator> comm,
                 ReducerOptions options)
    : params_(std::move(params)),
      names_(std::move(names)),
      comm_(std::move(comm)),
      options_(options),
      div_factor_(static_cast<double>(comm_->size())) {
  std::vector<GradSpec> specs;
  specs.reserve(params_.size());
  for (const auto& p : params_) {
    specs.push_back(GradSpec{static_cast<int64_t>(p.nbytes()),
                             static_cast<int>(p.scalar_type())});
  }
  const auto assignment = ComputeBucketAssignment(
      specs, options_.first_bucket_bytes, options_.bucket_cap_bytes);
  slots_.resize(params_.size());
  buckets_.reserve(assignment.size());
  for (const auto& indices : assignment) {
    Bucket bucket;
    bucket.params = indices;
    int64_t numel = 0;
    for (size_t i : indices) numel += params_[i].numel();
    const at::Tensor& first = params_[indices.front()];
    bucket.flat = at::zeros({numel}, first.options().requires_grad(false));
    int64_t offset = 0;
    for (size_t k = 0; k < indices.size(); ++k) {
      const at::Tensor& p = params_[indices[k]];
      bucket.views.push_back(
          bucket.flat.narrow(0, offset, p.numel()).view(p.sizes()));
      offset += p.numel();
      slots_[indices[k]] = Slot{buckets_.size(), k, false};
    }
    buckets_.push_back(std::move(bucket));
  }
  hook_handles_.reserve(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    hook_handles_.push_back(params_[i].register_hook(
        [this, i](const at::Tensor& grad) { OnGradReady(i, grad); }));
  }
}

Reducer::~Reducer() {
  for (size_t i = 0; i < params_.size(); ++i) {
    params_[i].remove_hook(hook_handles_[i]);
  }
  for (auto& b : buckets_) {
    if (b.work) b.work->Wait(options_.collective_timeout).IgnoreError();
  }
}

void Reducer::PrepareForBackward() {
  armed_ = true;
  callback_queued_ = false;
  next_bucket_ = 0;
  for (auto& s : slots_) s.ready = false;
  for (auto& b : buckets_) {
    b.pending = b.params.size();
    b.work.reset();
  }
}

void Reducer::OnGradReady(size_t param, const at::Tensor& grad) {
  if (!armed_) return;  // not a synchronised backward: accumulate locally
  Slot& slot = slots_[param];
  if (slot.ready) {
    ThrowIfError(absl::FailedPreconditionError(absl::StrCat(
        "parameter '", names_[param],
        "' received a gradient twice in one backward; call the DDP forward "
        "before each backward")));
  }
  if (!callback_queued_) {
    callback_queued_ = true;
    torch::autograd::Engine::get_default_engine().queue_callback(
        [this] { FinalizeBackward(); });
  }
  slot.ready = true;
  Bucket& bucket = buckets_[slot.bucket];
  at::Tensor& view = bucket.views[slot.index_in_bucket];
  {
    at::NoGradGuard no_grad;
    // PyTorch reduces the accumulated `param.grad`; the hook runs before the
    // engine adds `grad` to it, so add what is already there.
    const at::Tensor& existing = params_[param].grad();
    if (existing.defined()) {
      at::mul_out(view, at::add(existing, grad), 1.0 / div_factor_);
    } else {
      at::mul_out(view, grad, 1.0 / div_factor_);
    }
  }
  if (--bucket.pending == 0) LaunchReadyBuckets();
}

void Reducer::LaunchReadyBuckets() {
  comm::CollectiveOptions opts;
  opts.timeout = options_.collective_timeout;
  while (next_bucket_ < buckets_.size() &&
         buckets_[next_bucket_].pending == 0) {
    Bucket& bucket = buckets_[next_bucket_];
    bucket.work = comm_->AllreduceSum(bucket.flat, opts);
    ++next_bucket_;
  }
}

void Reducer::FinalizeBackward() {
  armed_ = false;
  if (next_bucket_ < buckets_.size()) {
    std::string missing;
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!slots_[i].ready) {
        absl::StrAppend(&missing, missing.empty() ? "" : ", ", names_[i]);
      }
    }
    ThrowIfError(absl::FailedPreconditionError(absl::StrCat(
        "parameters received no gradient in this backward (unused in "
        "forward?): ",
        missing)));
  }
  for (auto& bucket : buckets_) {
    absl::Status s = bucket.work->Wait(options_.collective_timeout);
    if (!s.ok()) {
      ThrowIfError(absl::Status(
          s.code(), absl::StrCat("gradient allreduce failed: ", s.message())));
    }
  }
  at::NoGradGuard no_grad;
  for (auto& bucket : buckets_) {
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      at::Tensor& p = params_[bucket.params[k]];
      at::Tensor& grad = p.mutable_grad();
      if (grad.defined()) {
        grad.copy_(bucket.views[k]);
      } else {
        grad = bucket.views[k].clone();
      }
    }
  }
  ++iterations_;
}

std::vector<BucketInfo> Reducer::buckets() const {
  std::vector<BucketInfo> out;
  for (const auto& b : buckets_) {
    out.push_back(BucketInfo{b.params, static_cast<int64_t>(b.flat.nbytes())});
  }
  return out;
}

}  // namespace concord::ddp
