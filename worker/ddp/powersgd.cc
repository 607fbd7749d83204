#include "worker/ddp/powersgd.h"

#include <ATen/ATen.h>
#include <torch/serialize.h>

#include <sstream>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace concord::ddp {

int64_t PowerSgdState::NextSeed() {
  // numpy's legacy bounded draw: 32-bit words masked to the next power of
  // two minus one, rejected until within range.
  constexpr uint32_t kMax = 999'999'999;
  constexpr uint32_t kMask = (1u << 30) - 1;
  uint32_t v;
  do {
    v = static_cast<uint32_t>(rng_()) & kMask;
  } while (v > kMax);
  return v;
}

void PowerSgdState::BeginStep() {
  Saved saved{rng_, iter_, error_, p_memory_, {}};
  for (const auto& [index, q] : q_memory_) saved.q_memory[index] = q.clone();
  saved_ = std::move(saved);
}

void PowerSgdState::Restore() {
  if (!saved_) return;
  rng_ = saved_->rng;
  iter_ = saved_->iter;
  error_ = std::move(saved_->error);
  p_memory_ = std::move(saved_->p_memory);
  q_memory_ = std::move(saved_->q_memory);
  saved_.reset();
}

std::string PowerSgdState::SaveReplicated() const {
  torch::serialize::OutputArchive archive;
  archive.write("iter", c10::IValue(iter_));
  std::ostringstream rng;
  rng << rng_;
  archive.write("rng", c10::IValue(rng.str()));
  for (const auto& [index, q] : q_memory_) {
    archive.write(absl::StrCat("q/", index), q.cpu());
    const auto p = p_memory_.find(index);
    archive.write(
        absl::StrCat("p/", index),
        c10::IValue(p == p_memory_.end() ? int64_t{0} : p->second.numel()));
  }
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

absl::Status PowerSgdState::LoadReplicated(const std::string& bytes,
                                           const at::TensorOptions& options) {
  int64_t iter = 0;
  std::mt19937 rng;
  std::map<size_t, at::Tensor> p_memory, q_memory;
  try {
    std::istringstream in(bytes);
    torch::serialize::InputArchive archive;
    archive.load_from(in);
    c10::IValue v;
    if (!archive.try_read("iter", v) || !v.isInt()) {
      return absl::InvalidArgumentError("PowerSGD state: no iteration count");
    }
    iter = v.toInt();
    if (!archive.try_read("rng", v) || !v.isString()) {
      return absl::InvalidArgumentError("PowerSGD state: no generator");
    }
    std::istringstream rng_in(v.toStringRef());
    rng_in >> rng;
    if (rng_in.fail()) {
      return absl::InvalidArgumentError("PowerSGD state: a bad generator");
    }
    for (const std::string& key : archive.keys()) {
      size_t index = 0;
      if (!absl::StartsWith(key, "q/") ||
          !absl::SimpleAtoi(key.substr(2), &index)) {
        continue;
      }
      at::Tensor q;
      archive.read(key, q);
      c10::IValue p;
      if (!archive.try_read(absl::StrCat("p/", index), p) || !p.isInt()) {
        return absl::InvalidArgumentError(
            absl::StrCat("PowerSGD state: bucket ", index, " has no P size"));
      }
      q_memory[index] = q.to(options).contiguous();
      p_memory[index] = at::empty({p.toInt()}, options);
    }
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("PowerSGD state does not load: ", e.what()));
  }
  iter_ = iter;
  rng_ = rng;
  p_memory_ = std::move(p_memory);
  q_memory_ = std::move(q_memory);
  return absl::OkStatus();
}

namespace {

void OrthogonalizeGramSchmidt(at::Tensor& matrices, double epsilon) {
  const int64_t cols = matrices.size(2);
  for (int64_t i = 0; i < cols; ++i) {
    at::Tensor col = matrices.narrow(2, i, 1);
    at::Tensor norm = at::frobenius_norm(col, {1}, /*keepdim=*/true);
    if (epsilon == 0) {
      col.div_(norm);
    } else {
      col.div_(norm + epsilon);
    }
    if (i + 1 < cols) {
      at::Tensor rest = matrices.narrow(2, i + 1, cols - i - 1);
      rest.sub_(at::sum(col * rest, {1}, /*keepdim=*/true) * col);
    }
  }
}

// PyTorch's _orthogonalize: Gram-Schmidt for rank <= 2 or half types, QR
// otherwise.
void Orthogonalize(at::Tensor& matrices, double epsilon) {
  const auto dtype = matrices.scalar_type();
  if (matrices.size(2) <= 2 || dtype == at::kHalf || dtype == at::kBFloat16) {
    OrthogonalizeGramSchmidt(matrices, epsilon);
  } else {
    matrices.copy_(std::get<0>(at::linalg_qr(matrices)));
  }
}

}  // namespace

// The hook's body; a class so that it can reach PowerSgdState's privates.
class PowerSgd {
 public:
  static std::shared_ptr<comm::Work> Run(PowerSgdState& state,
                                         comm::Communicator& comm,
                                         const comm::CollectiveOptions& opts,
                                         GradBucket& bucket);
};

std::shared_ptr<comm::Work> PowerSgd::Run(PowerSgdState& state,
                                          comm::Communicator& comm,
                                          const comm::CollectiveOptions& opts,
                                          GradBucket& bucket) {
  const PowerSgdOptions& o = state.options_;
  const double world = static_cast<double>(comm.size());
  at::Tensor input = bucket.buffer;
  const bool is_last = bucket.is_last;
  auto maybe_increase_iter = [&state, is_last] {
    if (is_last) ++state.iter_;
  };
  if (state.iter_ < o.start_iter) {
    maybe_increase_iter();
    input.div_(world);
    return comm.AllreduceSum(input, opts);
  }
  const size_t index = bucket.index;
  at::Tensor input_copy;
  if (o.use_error_feedback) {
    auto it = state.error_.find(index);
    if (it != state.error_.end()) {
      input.add_(it->second);
    } else {
      state.error_[index] = at::zeros_like(input);
    }
    input_copy = input.clone();
  }
  // Step I: which gradients are worth compressing.
  std::vector<at::Tensor> to_compress, uncompressed;
  int64_t ps_size = 0, qs_size = 0;
  for (const at::Tensor& grad : bucket.gradients) {
    if (grad.dim() == 0) {
      uncompressed.push_back(grad);
      continue;
    }
    at::Tensor matrix = grad.view({grad.size(0), -1});
    const int64_t n = matrix.size(0), m = matrix.size(1);
    const int64_t r = std::min({n, m, o.matrix_approximation_rank});
    if (static_cast<double>((n + m) * r) * o.min_compression_rate <
        static_cast<double>(n * m)) {
      to_compress.push_back(matrix);
      ps_size += n * r;
      qs_size += m * r;
    } else {
      uncompressed.push_back(grad);
    }
  }
  // Step II: the rest goes as one contiguous allreduce.
  std::vector<at::Tensor> flat;
  for (const auto& t : uncompressed) flat.push_back(t.view({-1}));
  at::Tensor uncompressed_memory =
      flat.empty() ? at::empty({0}, input.options()) : at::cat(flat);
  // Step III: P and Q memory (kept across iterations with warm start).
  bool randomize = false;
  if (!o.warm_start || state.p_memory_.count(index) == 0) {
    randomize = true;
    state.p_memory_[index] = at::empty({ps_size}, input.options());
    state.q_memory_[index] = at::empty({qs_size}, input.options());
  }
  at::Tensor p_memory = state.p_memory_[index];
  at::Tensor q_memory = state.q_memory_[index];
  // Same-shape tensors are visited together, in first-appearance order (the
  // order of PyTorch's shape dict), as batches of one.
  std::vector<std::vector<at::Tensor>> by_shape;
  for (const auto& t : to_compress) {
    auto it = std::find_if(by_shape.begin(), by_shape.end(), [&](auto& g) {
      return g.front().sizes() == t.sizes();
    });
    if (it == by_shape.end()) {
      by_shape.push_back({t});
    } else {
      it->push_back(t);
    }
  }
  std::vector<at::Tensor> tensors, ps, qs;
  int64_t p_idx = 0, q_idx = 0;
  for (const auto& group : by_shape) {
    for (const auto& t : group) {
      const int64_t n = t.size(0), m = t.size(1);
      const int64_t r = std::min({n, m, o.matrix_approximation_rank});
      tensors.push_back(t.unsqueeze(0));
      ps.push_back(p_memory.narrow(0, p_idx, n * r).view({1, n, r}));
      qs.push_back(q_memory.narrow(0, q_idx, m * r).view({1, m, r}));
      p_idx += n * r;
      q_idx += m * r;
    }
  }
  if (!randomize) {
    for (auto& q : qs) Orthogonalize(q, o.orthogonalization_epsilon);
  } else {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(
        static_cast<uint64_t>(state.NextSeed()));
    for (auto& q : qs) {
      q.copy_(at::randn(q.sizes(), gen, input.options().device(at::kCPU)));
      Orthogonalize(q, o.orthogonalization_epsilon);
    }
  }
  for (size_t k = 0; k < tensors.size(); ++k) {
    at::bmm_out(ps[k], tensors[k], qs[k]);
  }
  auto uncompressed_work = comm.AllreduceSum(uncompressed_memory, opts);

  // The rest runs when the bucket is waited for; its collectives come in
  // bucket order on every rank.
  PowerSgdState* s = &state;
  return comm::Then(
      std::move(uncompressed_work),
      [s, &comm, opts, world, index, input, input_copy, uncompressed,
       uncompressed_memory, tensors, ps, qs, p_memory, q_memory,
       maybe_increase =
           is_last](const comm::Waiter& wait) mutable -> absl::Status {
        uncompressed_memory.div_(world);
        int64_t idx = 0;
        for (auto& t : uncompressed) {
          t.copy_(uncompressed_memory.narrow(0, idx, t.numel()).view_as(t));
          idx += t.numel();
        }
        if (absl::Status st = wait(comm.AllreduceSum(p_memory, opts));
            !st.ok()) {
          return st;
        }
        const double eps = s->options_.orthogonalization_epsilon;
        for (auto& p : ps) Orthogonalize(p, eps);
        for (size_t k = 0; k < tensors.size(); ++k) {
          at::bmm_out(qs[k], tensors[k].transpose(1, 2), ps[k]);
        }
        if (absl::Status st = wait(comm.AllreduceSum(q_memory, opts));
            !st.ok()) {
          return st;
        }
        q_memory.div_(world);
        for (size_t k = 0; k < tensors.size(); ++k) {
          at::bmm_out(tensors[k], ps[k], qs[k].transpose(1, 2));
        }
        if (s->options_.use_error_feedback) {
          s->error_[index] = input_copy - input;
        }
        if (!s->options_.warm_start) {
          s->p_memory_.clear();
          s->q_memory_.clear();
        }
        if (maybe_increase) ++s->iter_;
        return absl::OkStatus();
      });
}

CommHook PowerSgdHook(std::shared_ptr<PowerSgdState> state,
                      std::shared_ptr<comm::Communicator> comm,
                      comm::CollectiveOptions options) {
  return [state = std::move(state), comm = std::move(comm),
          options](GradBucket& bucket) {
    return PowerSgd::Run(*state, *comm, options, bucket);
  };
}

absl::StatusOr<PowerSgdOptions> ParsePowerSgd(const std::string& spec) {
  std::vector<std::string> parts = absl::StrSplit(spec, ':');
  PowerSgdOptions o;
  if (parts.empty() || parts[0] != "powersgd" || parts.size() > 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", spec, "': expected powersgd[:RANK[:START_ITER]]"));
  }
  if (parts.size() > 1 &&
      (!absl::SimpleAtoi(parts[1], &o.matrix_approximation_rank) ||
       o.matrix_approximation_rank < 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", spec, "': the rank must be a positive integer"));
  }
  if (parts.size() > 2 &&
      (!absl::SimpleAtoi(parts[2], &o.start_iter) || o.start_iter < 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", spec, "': the start iteration must be a non-negative integer"));
  }
  if (o.start_iter <= 1 && (o.use_error_feedback || o.warm_start)) {
    // As PyTorch: the buckets are rebuilt after the first iteration, and
    // error feedback and warm start are kept per bucket.
    return absl::InvalidArgumentError(absl::StrCat(
        "'", spec,
        "': the start iteration must be at least 2 with error feedback and "
        "warm start"));
  }
  return o;
}

}  // namespace concord::ddp
