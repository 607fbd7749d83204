#include "worker/ddp/reducer.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "worker/ddp/bucket_assignment.h"
#include "worker/error.h"
#include "worker/tensor_ops.h"
#include "worker/torch_compat.h"
#include "worker/trace/recorder.h"
#include "worker/trace/work_tracer.h"

namespace concord::ddp {
namespace {

int64_t Micros(std::chrono::steady_clock::duration d) {
  return std::chrono::duration_cast<std::chrono::microseconds>(d).count();
}

}  // namespace

absl::StatusOr<BucketCaps> BucketCapsOf(const concord::DdpOptions& options,
                                        const ReducerInternals& internals) {
  BucketCaps caps;
  caps.first = 1 << 20;
  caps.later = 25 << 20;
  if (const std::optional<double>& mb = options.bucket_cap_mb()) {
    if (!(*mb > 0) || !std::isfinite(*mb) || *mb > 1024 * 1024) {
      return absl::InvalidArgumentError(
          absl::StrCat("DdpOptions::bucket_cap_mb: not a size in MiB in (0, "
                       "1048576]: ",
                       *mb));
    }
    caps.later = static_cast<int64_t>(std::llround(*mb * 1024 * 1024));
    // See Note [LibTorch versions] in worker/torch_compat.h.
    if (compat::kFirstBucketFollowsUserCap) caps.first = caps.later;
  }
  if (internals.first_bucket_bytes) caps.first = *internals.first_bucket_bytes;
  if (caps.first <= 0 || caps.later <= 0) {
    return absl::InvalidArgumentError("bucket caps must be positive");
  }
  return caps;
}

absl::Status Reducer::Validate(const concord::DdpOptions& o,
                               const ReducerInternals& internals,
                               bool has_hook) {
  if (absl::StatusOr<BucketCaps> caps = BucketCapsOf(o, internals);
      !caps.ok()) {
    return caps.status();
  }
  if (o.message_size() < 0) {
    return absl::InvalidArgumentError("message_size must not be negative");
  }
  if (!(o.gradient_predivide_factor() > 0)) {
    return absl::InvalidArgumentError(
        "gradient_predivide_factor must be positive");
  }
  const bool apex_scaling = o.allreduce_always_fp32() ||
                            !o.gradient_average() ||
                            o.gradient_predivide_factor() != 1.0;
  if (has_hook && apex_scaling) {
    return absl::InvalidArgumentError(
        "a communication hook decides the reduction: it cannot be combined "
        "with allreduce_always_fp32, gradient_average=false or "
        "gradient_predivide_factor");
  }
  if (o.delay_allreduce() && (!o.allreduce_trigger_params().empty() ||
                              !internals.trigger_params.empty())) {
    return absl::InvalidArgumentError(
        "delay_allreduce and allreduce_trigger_params contradict each other");
  }
  return absl::OkStatus();
}

Reducer::Reducer(std::vector<at::Tensor> params, std::vector<std::string> names,
                 std::shared_ptr<comm::Communicator> comm,
                 concord::DdpOptions options, ReducerInternals internals)
    : params_(std::move(params)),
      names_(std::move(names)),
      comm_(std::move(comm)),
      options_(std::move(options)),
      internals_(std::move(internals)) {
  ThrowIfError(Validate(options_, internals_, /*has_hook=*/false));
  caps_ = *BucketCapsOf(options_, internals_);
  divisor_ = static_cast<double>(comm_->size());
  SetScales();
  saved_grads_.resize(params_.size());
  Build({});
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
    if (b.work) b.work->Wait(internals_.collective_timeout).IgnoreError();
  }
}

void Reducer::SetTraceRecorder(std::shared_ptr<trace::Recorder> recorder) {
  work_tracer_.reset();
  trace_ = std::move(recorder);
  if (trace_) work_tracer_ = std::make_unique<trace::WorkTracer>(trace_);
}

void Reducer::SetScales() {
  const double f = options_.gradient_predivide_factor();
  pytorch_scaling_ = false;
  scale_in_fp32_ = false;
  if (hook_) {
    pre_scale_ = post_scale_ = 1.0;  // the hook divides
  } else if (f != 1.0 || !options_.gradient_average() ||
             options_.allreduce_always_fp32()) {
    // apex's arithmetic: 1/f before the allreduce, f/world after.
    pre_scale_ = 1.0 / f;
    post_scale_ =
        options_.gradient_average() && f != divisor_ ? f / divisor_ : 1.0;
    scale_in_fp32_ = options_.allreduce_always_fp32();
  } else {
    pre_scale_ = 1.0 / divisor_;  // PyTorch: divide while copying
    post_scale_ = 1.0;
    pytorch_scaling_ = true;
  }
}

void Reducer::SetGradientDivisor(double divisor) {
  if (!(divisor > 0)) {
    ThrowIfError(absl::InvalidArgumentError(
        absl::StrCat("gradient divisor must be positive, got ", divisor)));
  }
  divisor_ = divisor;
  SetScales();
}

void Reducer::Rebind(std::shared_ptr<comm::Communicator> comm,
                     int authoritative_rank) {
  // Collectives of the old generation may still be "in flight" on its
  // (aborted) communicator; their buffers are ours, so drop the handles
  // without touching the tensors they hold.
  for (auto& b : buckets_) b.work.reset();
  armed_ = false;
  callback_queued_ = false;
  next_bucket_ = 0;
  {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < params_.size(); ++i) {
      saved_grads_[i] = at::Tensor();
      params_[i].mutable_grad() = at::Tensor();
    }
  }
  hook_launch_us_.clear();
  comm_ = std::move(comm);
  internals_.authoritative_rank = authoritative_rank;
  hook_ = nullptr;
  divisor_ = static_cast<double>(comm_->size());
  SetScales();
}

at::Tensor Reducer::LayoutState() const {
  // [rebuilt, iterations, has static usage, order..., static usage...].
  const size_t n = params_.size();
  at::Tensor t = at::zeros({static_cast<int64_t>(3 + 2 * n)}, at::kLong);
  int64_t* v = t.data_ptr<int64_t>();
  v[0] = rebuilt_ ? 1 : 0;
  v[1] = stats_.iterations;
  v[2] = static_used_.empty() ? 0 : 1;
  for (size_t k = 0; k < rebuilt_order_.size() && k < n; ++k) {
    v[3 + k] = static_cast<int64_t>(rebuilt_order_[k]);
  }
  for (size_t k = 0; k < static_used_.size() && k < n; ++k) {
    v[3 + n + k] = static_used_[k] ? 1 : 0;
  }
  return t;
}

absl::Status Reducer::SetLayoutState(const at::Tensor& state) {
  const size_t n = params_.size();
  if (state.dim() != 1 || state.scalar_type() != at::kLong ||
      state.numel() != static_cast<int64_t>(3 + 2 * n)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a bucket layout of ", state.numel(), " entries, expected ", 3 + 2 * n,
        " for ", n, " parameters"));
  }
  const at::Tensor t = state.contiguous();
  const int64_t* v = t.data_ptr<int64_t>();
  std::vector<size_t> agreed;
  if (v[0] == 1) {
    std::vector<bool> seen(n, false);
    for (size_t k = 0; k < n; ++k) {
      if (v[3 + k] < 0 || static_cast<size_t>(v[3 + k]) >= n ||
          seen[static_cast<size_t>(v[3 + k])]) {
        return absl::InvalidArgumentError(
            "a bucket layout that is not an order of the parameters");
      }
      seen[static_cast<size_t>(v[3 + k])] = true;
      agreed.push_back(static_cast<size_t>(v[3 + k]));
    }
  }
  ready_order_.clear();
  if (v[0] == 1) {
    Build(agreed);
    rebuilt_order_ = std::move(agreed);
    rebuilt_ = true;
    stats_.iterations = std::max<int64_t>(stats_.iterations, v[1]);
  } else {
    // Nobody agreed on a layout yet: start over from the first-iteration
    // layout, and rebuild after the next iteration.
    Build({});
    rebuilt_order_.clear();
    rebuilt_ = false;
    stats_.iterations = 0;
  }
  static_used_.clear();
  if (v[2] == 1) {
    static_used_.resize(n);
    for (size_t k = 0; k < n; ++k) static_used_[k] = v[3 + n + k] != 0;
  }
  return absl::OkStatus();
}

absl::Status Reducer::SyncLayout() {
  at::Tensor t = LayoutState();
  comm::CollectiveOptions opts;
  opts.timeout = internals_.collective_timeout;
  absl::Status s =
      comm_->Broadcast(t, internals_.authoritative_rank, opts)->Wait();
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat("bucket layout broadcast "
                                               "failed: ",
                                               s.message()));
  }
  return SetLayoutState(t);
}

absl::Status Reducer::RegisterCommHook(CommHook hook) {
  if (hook_) {
    return absl::FailedPreconditionError(
        "a communication hook is already registered");
  }
  if (absl::Status s = Validate(options_, internals_, /*has_hook=*/true);
      !s.ok()) {
    return absl::FailedPreconditionError(s.message());
  }
  hook_ = std::move(hook);
  SetScales();
  return absl::OkStatus();
}

void Reducer::Build(const std::vector<size_t>& order) {
  std::vector<GradSpec> specs(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i];
    specs[i].bytes = options_.message_size() > 0
                         ? p.numel()
                         : static_cast<int64_t>(p.nbytes());
    specs[i].dtype = static_cast<int>(p.scalar_type());
  }
  for (size_t i : internals_.trigger_params) {
    if (i < specs.size()) specs[i].closes_bucket = true;
  }
  int64_t first =
      options_.message_size() > 0 ? options_.message_size() : caps_.first;
  int64_t cap =
      options_.message_size() > 0 ? options_.message_size() : caps_.later;
  const int64_t huge = std::numeric_limits<int64_t>::max();
  // PyTorch 1.13 reduces the first iteration in one bucket per dtype unless
  // it looks for unused parameters without a static graph (then it never
  // rebuilds); the capped layout comes with the rebuild.
  const bool single_first =
      order.empty() && options_.message_size() == 0 &&
      (options_.static_graph() || !options_.find_unused_parameters());
  if (options_.delay_allreduce() || single_first) first = cap = huge;
  const auto assignment =
      order.empty() ? InitialBucketAssignment(specs, first, cap)
                    : ComputeBucketAssignment(specs, order, first, cap);

  std::vector<Bucket> buckets;
  slots_.assign(params_.size(), Slot{});
  stats_.bucket_bytes.clear();
  stats_.bucket_params.clear();
  for (const auto& indices : assignment) {
    Bucket bucket;
    bucket.params = indices;
    std::vector<std::string>& named = stats_.bucket_params.emplace_back();
    for (size_t i : indices) named.push_back(names_[i]);
    int64_t numel = 0;
    for (size_t i : indices) numel += params_[i].numel();
    const at::Tensor& p0 = params_[indices.front()];
    bucket.flat = at::zeros({numel}, p0.options().requires_grad(false));
    int64_t offset = 0;
    for (size_t k = 0; k < indices.size(); ++k) {
      at::Tensor& p = params_[indices[k]];
      // Not an autograd view but a tensor on the bucket's storage: with
      // gradient_as_bucket_view it becomes `.grad`, and LibTorch's
      // Optimizer::zero_grad() calls detach_(), which views refuse.
      const at::Tensor shaped =
          bucket.flat.narrow(0, offset, p.numel()).view(p.sizes());
      at::Tensor view = at::empty({0}, bucket.flat.options());
      view.set_(bucket.flat.storage(), shaped.storage_offset(), shaped.sizes(),
                shaped.strides());
      offset += p.numel();
      slots_[indices[k]] = Slot{buckets.size(), k, false, false};
      if (options_.gradient_as_bucket_view() && p.grad().defined()) {
        at::NoGradGuard no_grad;
        view.copy_(p.grad());
        p.mutable_grad() = view;
      }
      bucket.views.push_back(std::move(view));
    }
    stats_.bucket_bytes.push_back(static_cast<int64_t>(bucket.flat.nbytes()));
    buckets.push_back(std::move(bucket));
  }
  buckets_ = std::move(buckets);
  if (stats_.initial_bucket_params.empty()) {
    stats_.initial_bucket_params = stats_.bucket_params;
  }
}

absl::Status Reducer::Rebuild() {
  // Every rank takes the authoritative rank's observed order; parameters
  // that never became ready go last, in reverse order.
  std::vector<bool> seen(params_.size(), false);
  std::vector<int64_t> order;
  for (size_t i : ready_order_) {
    if (!seen[i]) order.push_back(static_cast<int64_t>(i));
    seen[i] = true;
  }
  for (size_t k = params_.size(); k-- > 0;) {
    if (!seen[k]) order.push_back(static_cast<int64_t>(k));
  }
  at::Tensor t = at::tensor(order, at::kLong);
  comm::CollectiveOptions opts;
  opts.timeout = internals_.collective_timeout;
  absl::Status s =
      comm_->Broadcast(t, internals_.authoritative_rank, opts)->Wait();
  if (!s.ok()) {
    return absl::Status(s.code(),
                        absl::StrCat("bucket rebuild failed: ", s.message()));
  }
  std::vector<size_t> agreed(params_.size());
  const int64_t* indices = t.data_ptr<int64_t>();
  for (size_t k = 0; k < agreed.size(); ++k) {
    agreed[k] = static_cast<size_t>(indices[k]);
  }
  Build(agreed);
  rebuilt_order_ = std::move(agreed);
  rebuilt_ = true;
  ++stats_.rebuilds;
  return absl::OkStatus();
}

absl::Status Reducer::PrepareForBackward() {
  const bool may_rebuild =
      !options_.delay_allreduce() &&
      (options_.static_graph() || !options_.find_unused_parameters());
  if (may_rebuild && !rebuilt_ && stats_.iterations >= 1) {
    if (absl::Status s = Rebuild(); !s.ok()) return s;
  }
  armed_ = true;
  callback_queued_ = false;
  next_bucket_ = 0;
  for (auto& s : slots_) s = Slot{s.bucket, s.index_in_bucket, false, false};
  for (auto& b : buckets_) {
    b.pending = b.params.size();
    b.work.reset();
  }
  t_armed_ = Clock::now();
  t_first_ready_ = t_last_ready_ = t_first_launch_ = Clock::time_point{};
  return absl::OkStatus();
}

void Reducer::MarkForwardDone() {
  stats_.forward_compute_us = Micros(Clock::now() - t_armed_);
}

void Reducer::OnGradReady(size_t param, const at::Tensor& grad) {
  if (gradient_observer_) gradient_observer_();
  if (!armed_) return;  // not a synchronised backward: accumulate locally
  Slot& slot = slots_[param];
  if (slot.ready) {
    ThrowIfError(absl::FailedPreconditionError(absl::StrCat(
        "parameter '", names_[param],
        "' received a gradient twice in one backward; call the DDP forward "
        "before each backward")));
  }
  const auto now = Clock::now();
  if (!callback_queued_) {
    callback_queued_ = true;
    t_first_ready_ = now;
    torch::autograd::Engine::get_default_engine().queue_callback(
        [this] { FinalizeBackward(); });
  }
  t_last_ready_ = now;
  if (ready_order_.size() < params_.size() && !rebuilt_) {
    ready_order_.push_back(param);
  }
  at::Tensor& view = buckets_[slot.bucket].views[slot.index_in_bucket];
  {
    at::NoGradGuard no_grad;
    // PyTorch reduces the accumulated `param.grad`; this hook runs before the
    // engine adds `grad` to it, so add what is already there ourselves, and
    // take `.grad` away from the engine: it then keeps `grad` as is (no
    // accumulation pass), and never writes into a bucket being reduced.
    at::Tensor& existing = params_[param].mutable_grad();
    const bool scale_here = pre_scale_ != 1.0 && !scale_in_fp32_;
    if (existing.defined() && existing.is_alias_of(view) && pytorch_scaling_) {
      // A bucket-view gradient: PyTorch accumulates in place and divides.
      at::add_out(view, existing, grad);
      view.div_(divisor_);
    } else if (existing.defined()) {
      at::add_out(view, existing, grad);
      if (scale_here) view.mul_(pre_scale_);
    } else if (scale_here) {
      at::mul_out(view, grad, pre_scale_);
    } else {
      view.copy_(grad);
    }
    saved_grads_[param] = existing;
    existing = at::Tensor();
  }
  slot.used = true;
  MarkReady(param);
}

void Reducer::MarkReady(size_t param) {
  Slot& slot = slots_[param];
  slot.ready = true;
  if (--buckets_[slot.bucket].pending == 0) LaunchReadyBuckets();
}

void Reducer::LaunchReadyBuckets() {
  while (next_bucket_ < buckets_.size() &&
         buckets_[next_bucket_].pending == 0) {
    if (launch_observer_) launch_observer_(next_bucket_);
    if (t_first_launch_ == Clock::time_point{}) t_first_launch_ = Clock::now();
    buckets_[next_bucket_].work = Launch(next_bucket_);
    ++next_bucket_;
  }
}

std::shared_ptr<comm::Work> Reducer::Launch(size_t index) {
  Bucket& bucket = buckets_[index];
  // The communicator's work for the timeline (null: not traced).
  auto traced = [&](std::shared_ptr<comm::Work> work) {
    if (trace_) {
      trace_->NameThread(trace::Recorder::BucketThread(index),
                         absl::StrCat("allreduce bucket ", index));
      work_tracer_->Watch(
          work, "allreduce", trace::Recorder::BucketThread(index),
          {{"bucket", static_cast<int64_t>(index)},
           {"buckets", static_cast<int64_t>(buckets_.size())},
           {"bytes", static_cast<int64_t>(bucket.flat.nbytes())}});
    }
    return work;
  };
  if (trace_) {
    hook_launch_us_.resize(buckets_.size());
    hook_launch_us_[index] = hook_ ? trace::NowMicros() : 0;
  }
  if (hook_) {
    GradBucket grad_bucket;
    grad_bucket.index = index;
    grad_bucket.buffer = bucket.flat;
    grad_bucket.gradients = bucket.views;
    for (size_t i : bucket.params) grad_bucket.parameters.push_back(params_[i]);
    grad_bucket.is_last = index + 1 == buckets_.size();
    return hook_(grad_bucket);
  }
  comm::CollectiveOptions opts;
  opts.timeout = internals_.collective_timeout;
  at::Tensor flat = bucket.flat;
  if (scale_in_fp32_ && flat.scalar_type() != at::kFloat) {
    // apex's allreduce_different_streams path: the bucket widened to fp32,
    // scaled and reduced there, and narrowed back (see Note [Kernels in the
    // worker] for the casts and scaling).
    at::Tensor wide = CastTo(flat, at::kFloat);
    if (pre_scale_ != 1.0) Scale(wide, pre_scale_);
    const double post = post_scale_;
    return comm::Then(traced(comm_->AllreduceSum(wide, opts)),
                      [flat, wide, post]() mutable {
                        if (post != 1.0) Scale(wide, post);
                        CastInto(wide, flat);
                        return absl::OkStatus();
                      });
  }
  if (scale_in_fp32_ && pre_scale_ != 1.0) Scale(flat, pre_scale_);
  auto work = traced(comm_->AllreduceSum(flat, opts));
  if (post_scale_ == 1.0) return work;
  const double post = post_scale_;
  return comm::Then(std::move(work), [flat, post]() mutable {
    Scale(flat, post);
    return absl::OkStatus();
  });
}

void Reducer::FinalizeBackward() {
  armed_ = false;
  // Parameters that got no gradient take part with zeros, so that every rank
  // launches every bucket (a peer never waits for a bucket that will not
  // come).
  std::vector<size_t> unused;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!slots_[i].ready) unused.push_back(i);
  }
  for (size_t i : unused) {
    // As in PyTorch, an unused parameter contributes its existing `.grad`
    // (zeros when it has none).
    const Slot& slot = slots_[i];
    at::Tensor& view = buckets_[slot.bucket].views[slot.index_in_bucket];
    const at::Tensor& existing = params_[i].grad();
    at::NoGradGuard no_grad;
    if (!existing.defined()) {
      view.zero_();
    } else if (pre_scale_ != 1.0 && !scale_in_fp32_) {
      at::mul_out(view, existing, pre_scale_);
    } else {
      view.copy_(existing);
    }
    saved_grads_[i] = existing;
    MarkReady(i);
  }
  LaunchReadyBuckets();

  const bool tracks_usage =
      options_.find_unused_parameters() || options_.static_graph();
  std::vector<bool> globally_used(params_.size(), true);
  absl::Status status;
  if (tracks_usage && !static_used_.empty()) {
    globally_used = static_used_;  // static graph: learnt in iteration 1
  } else if (tracks_usage) {
    std::vector<int32_t> flags(params_.size());
    for (size_t i = 0; i < params_.size(); ++i) flags[i] = slots_[i].used;
    at::Tensor used = at::tensor(flags, at::kInt);
    comm::CollectiveOptions opts;
    opts.timeout = internals_.collective_timeout;
    status = comm_->AllreduceSum(used, opts)->Wait();
    const int32_t* counts = used.data_ptr<int32_t>();
    for (size_t i = 0; status.ok() && i < params_.size(); ++i) {
      globally_used[i] = counts[i] > 0;
    }
    if (options_.static_graph() && status.ok()) static_used_ = globally_used;
  }
  if (status.ok()) {
    const int64_t wait_start = trace_ ? trace::NowMicros() : 0;
    status = WaitAndWriteBack(globally_used);
    if (trace_) {
      const int64_t now = trace::NowMicros();
      trace_->Complete("wait for buckets", trace::Recorder::kTrainThread,
                       wait_start, now);
    }
  }
  if (!status.ok()) {
    ThrowIfError(absl::Status(
        status.code(),
        absl::StrCat("gradient allreduce failed: ", status.message())));
  }
  stats_.unused_parameters.clear();
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!globally_used[i]) stats_.unused_parameters.push_back(names_[i]);
  }
  const auto done = Clock::now();
  stats_.backward_compute_us = Micros(t_last_ready_ - t_first_ready_);
  stats_.backward_comm_us = Micros(done - t_first_launch_);
  stats_.overlap_us =
      std::max<int64_t>(0, Micros(t_last_ready_ - t_first_launch_));
  stats_.backward_done_unix_us = trace::NowMicros();
  ++stats_.iterations;
  if (!tracks_usage && !unused.empty()) {
    std::string names;
    for (size_t i : unused) {
      absl::StrAppend(&names, names.empty() ? "" : ", ", names_[i]);
    }
    ThrowIfError(absl::FailedPreconditionError(absl::StrCat(
        "parameters received no gradient in this backward: ", names,
        "; if they are unused in forward, enable find_unused_parameters")));
  }
}

absl::Status Reducer::WaitAndWriteBack(const std::vector<bool>& globally_used) {
  for (size_t b = 0; b < buckets_.size(); ++b) {
    // See Note [Stream-ordered waits]: the copies below are queued on the
    // current stream, after the collective (device) or after it ended
    // (host).
    comm::Work& work = *buckets_[b].work;
    absl::Status s = internals_.blocking_wait
                         ? work.Wait(internals_.collective_timeout)
                         : work.Synchronize(internals_.collective_timeout);
    if (trace_ && b < hook_launch_us_.size() && hook_launch_us_[b] != 0) {
      // A hook's work: it ended (as far as anyone can tell) when this wait
      // did.
      trace_->NameThread(trace::Recorder::BucketThread(b),
                         absl::StrCat("allreduce bucket ", b));
      trace::Args args = {
          {"bucket", static_cast<int64_t>(b)},
          {"buckets", static_cast<int64_t>(buckets_.size())},
          {"bytes", static_cast<int64_t>(buckets_[b].flat.nbytes())},
          {"hook", 1}};
      if (!s.ok()) args.emplace_back("failed", 1);
      trace_->Complete("allreduce", trace::Recorder::BucketThread(b),
                       hook_launch_us_[b], trace::NowMicros(), std::move(args));
      hook_launch_us_[b] = 0;
    }
    if (!s.ok()) return s;
  }
  at::NoGradGuard no_grad;
  for (auto& bucket : buckets_) {
    // The user's gradient tensors keep their identity (PyTorch copies into
    // them): one unflatten per bucket.
    std::vector<FlatPiece> copies;
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      const size_t i = bucket.params[k];
      // PyTorch leaves the gradient of a globally unused parameter alone.
      if (!globally_used[i]) continue;
      at::Tensor& saved = saved_grads_[i];
      at::Tensor& grad = params_[i].mutable_grad();
      if (options_.gradient_as_bucket_view()) {
        grad = bucket.views[k];  // the bucket is the gradient
      } else if (saved.defined() && !saved.is_alias_of(bucket.flat)) {
        copies.push_back(FlatPiece{saved, bucket.views[k].storage_offset() -
                                              bucket.flat.storage_offset()});
        grad = saved;
      } else {
        grad = bucket.views[k].clone();
      }
      saved = at::Tensor();
    }
    UnflattenInto(bucket.flat, copies);
  }
  return absl::OkStatus();
}

std::vector<BucketInfo> Reducer::buckets() const {
  std::vector<BucketInfo> out;
  for (const auto& b : buckets_) {
    out.push_back(BucketInfo{b.params, static_cast<int64_t>(b.flat.nbytes())});
  }
  return out;
}

}  // namespace concord::ddp
