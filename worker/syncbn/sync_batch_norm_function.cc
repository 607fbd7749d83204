#include "worker/syncbn/sync_batch_norm_function.h"

#include <torch/torch.h>

#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/syncbn.h"
#include "worker/error.h"
#include "worker/kernel_dispatch.h"

namespace concord::syncbn {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

kernels::DType KernelType(const at::Tensor& t) {
  const auto type = kernels_dispatch::KernelType(t.scalar_type());
  TORCH_CHECK(type.has_value(),
              "SyncBatchNorm takes float32, float16 or bfloat16 input, got ",
              t.scalar_type());
  return *type;
}

// A raw float pointer, or null for an undefined tensor.
const float* FloatPtr(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<float>() : nullptr;
}

// The input in a layout the kernels take (see Note [Activation layout]):
// channels innermost when it already is (channels-last), else contiguous.
struct Layout {
  at::Tensor x;
  kernels::ActivationShape shape;
};

Layout MakeLayout(const at::Tensor& input) {
  const int64_t n = input.size(0), c = input.size(1);
  int64_t spatial = 1;
  for (int64_t d = 2; d < input.dim(); ++d) spatial *= input.size(d);
  if (input.dim() > 2 && !input.is_contiguous()) {
    std::vector<int64_t> perm{0};
    for (int64_t d = 2; d < input.dim(); ++d) perm.push_back(d);
    perm.push_back(1);
    if (input.permute(perm).is_contiguous()) {
      return {input, {n * spatial, c, 1}};
    }
  }
  return {input.contiguous(), {n, c, spatial}};
}

// See Note [Stream-ordered waits]: on a device the kernels that read the result
// are queued after the collective; the host does not wait, as in PyTorch.
void WaitOrThrow(const std::shared_ptr<comm::Work>& work, const char* what) {
  absl::Status s = work->Synchronize();
  if (!s.ok()) {
    throw ToError(absl::Status(
        s.code(), absl::StrCat("SyncBatchNorm ", what, ": ", s.message())));
  }
}

// Keeps the forward's communicator for the backward (saved_data holds
// IValues only).
struct CommunicatorCapsule : torch::CustomClassHolder {
  std::shared_ptr<comm::Communicator> communicator;
  comm::CollectiveOptions options;
};

class SyncBnFunction : public torch::autograd::Function<SyncBnFunction> {
 public:
  // Absent tensors are nullopt: LibTorch 1.13's Function rejects undefined
  // tensor arguments.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            const c10::optional<at::Tensor>& weight_opt,
                            const c10::optional<at::Tensor>& bias_opt,
                            const c10::optional<at::Tensor>& running_mean_opt,
                            const c10::optional<at::Tensor>& running_var_opt,
                            const c10::optional<at::Tensor>& batches_opt,
                            const SyncBnCall& call) {
    const at::Tensor weight = weight_opt.value_or(at::Tensor());
    const at::Tensor bias = bias_opt.value_or(at::Tensor());
    at::Tensor running_mean = running_mean_opt.value_or(at::Tensor());
    at::Tensor running_var = running_var_opt.value_or(at::Tensor());
    at::Tensor num_batches_tracked = batches_opt.value_or(at::Tensor());
    const kernels::DType dtype = KernelType(input);
    Layout layout = MakeLayout(input);
    const auto& shape = layout.shape;
    const int64_t c = shape.channels;
    const auto f32 = input.options().dtype(at::kFloat);

    // 1. Local statistics, 2. one allgather.
    at::Tensor row = at::empty({kernels::StatsRowSize(c)}, f32);
    kernels_dispatch::OnDevice(
        layout.x, "SyncBatchNorm",
        [&] {
          kernels::WelfordStatsCpu(layout.x.data_ptr(), dtype, shape,
                                   row.data_ptr<float>());
        },
        [&](auto stream) {
#if defined(CONCORD_KERNELS_CUDA)
          // From the caching allocator, on this stream: free again once the
          // kernels queued here have run.
          at::Tensor scratch =
              at::empty({kernels::SyncBnScratchFloats(shape)}, f32);
          return kernels::WelfordStatsCuda(layout.x.data_ptr(), dtype, shape,
                                           row.data_ptr<float>(),
                                           scratch.data_ptr<float>(), stream);
#endif
        });
    const auto& comm = call.communicator;
    const int world = comm ? comm->size() : 1;
    at::Tensor gathered = row;
    if (world > 1) {
      gathered = at::empty({world * row.numel()}, f32);
      WaitOrThrow(comm->Allgather(gathered, row, call.options),
                  "statistics allgather");
    }

    // 3. Combination (the same on every rank).
    at::Tensor mean = at::empty({c}, f32), invstd = at::empty({c}, f32),
               var_unbiased = at::empty({c}, f32), total = at::empty({1}, f32);
    kernels_dispatch::OnDevice(
        layout.x, "SyncBatchNorm",
        [&] {
          kernels::WelfordCombineCpu(
              gathered.data_ptr<float>(), world, c,
              static_cast<float>(call.eps), mean.data_ptr<float>(),
              invstd.data_ptr<float>(), var_unbiased.data_ptr<float>(),
              total.data_ptr<float>());
        },
        [&](auto stream) {
#if defined(CONCORD_KERNELS_CUDA)
          return kernels::WelfordCombineCuda(
              gathered.data_ptr<float>(), world, c,
              static_cast<float>(call.eps), mean.data_ptr<float>(),
              invstd.data_ptr<float>(), var_unbiased.data_ptr<float>(),
              total.data_ptr<float>(), stream);
#endif
        });
    // Fewer than two values per channel over the group: the variance does
    // not exist. On the CPU the group's count is at hand; on a device
    // reading it would stop the host every step, so there only the local
    // count of a group of one is checked, as PyTorch does.
    if (!layout.x.is_cuda()) {
      const float total_count = total.item<float>();
      TORCH_CHECK(total_count > 1.0f,
                  "Expected more than 1 value per channel when training, got "
                  "input size ",
                  input.sizes(), " (", total_count,
                  " values per channel over the group)");
    } else {
      TORCH_CHECK(world > 1 || input.numel() / c > 1,
                  "Expected more than 1 value per channel when training, got "
                  "input size ",
                  input.sizes());
    }

    // 4. Running statistics (PyTorch's update, unbiased variance).
    if (running_mean.defined() && running_var.defined()) {
      double factor = call.momentum.value_or(0.0);
      if (num_batches_tracked.defined()) {
        num_batches_tracked.add_(1);
        if (!call.momentum.has_value()) {
          factor =
              1.0 / static_cast<double>(num_batches_tracked.item<int64_t>());
        }
      }
      running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype()), factor);
      running_var.mul_(1 - factor)
          .add_(var_unbiased.to(running_var.dtype()), factor);
    }

    at::Tensor y = at::empty_like(layout.x);
    kernels_dispatch::OnDevice(
        layout.x, "SyncBatchNorm",
        [&] {
          kernels::BatchNormForwardCpu(
              layout.x.data_ptr(), dtype, shape, mean.data_ptr<float>(),
              invstd.data_ptr<float>(), FloatPtr(weight), FloatPtr(bias),
              y.data_ptr());
        },
        [&](auto stream) {
#if defined(CONCORD_KERNELS_CUDA)
          return kernels::BatchNormForwardCuda(
              layout.x.data_ptr(), dtype, shape, mean.data_ptr<float>(),
              invstd.data_ptr<float>(), FloatPtr(weight), FloatPtr(bias),
              y.data_ptr(), stream);
#endif
        });

    // The count stays where the combination wrote it (see Note [Stream-ordered
    // waits]): the CUDA backward reads it on the device.
    ctx->save_for_backward({layout.x, weight, mean, invstd, total});
    auto capsule = c10::make_intrusive<CommunicatorCapsule>();
    capsule->communicator = comm;
    capsule->options = call.options;
    ctx->saved_data["comm"] = c10::IValue::make_capsule(std::move(capsule));
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& mean = saved[2];
    const at::Tensor& invstd = saved[3];
    const at::Tensor& total = saved[4];
    auto capsule = c10::static_intrusive_pointer_cast<CommunicatorCapsule>(
        ctx->saved_data["comm"].toCapsule());

    Layout layout = MakeLayout(x);
    const auto& shape = layout.shape;
    const kernels::DType dtype = KernelType(x);
    const int64_t c = shape.channels;
    // The gradient in the input's layout and dtype.
    at::Tensor dy = grads[0];
    // An unused output still takes part in the allreduce (peers wait for
    // it): its gradient is zero.
    if (!dy.defined()) dy = at::zeros_like(x);
    if (dy.scalar_type() != x.scalar_type() ||
        !dy.strides().equals(x.strides())) {
      dy = at::empty_like(x).copy_(dy);
    }

    at::Tensor reduced = at::empty({2 * c}, x.options().dtype(at::kFloat));
    kernels_dispatch::OnDevice(
        x, "SyncBatchNorm",
        [&] {
          kernels::BackwardReduceCpu(dy.data_ptr(), x.data_ptr(), dtype, shape,
                                     mean.data_ptr<float>(),
                                     reduced.data_ptr<float>());
        },
        [&](auto stream) {
#if defined(CONCORD_KERNELS_CUDA)
          at::Tensor scratch = at::empty({kernels::SyncBnScratchFloats(shape)},
                                         reduced.options());
          return kernels::BackwardReduceCuda(
              dy.data_ptr(), x.data_ptr(), dtype, shape, mean.data_ptr<float>(),
              reduced.data_ptr<float>(), scratch.data_ptr<float>(), stream);
#endif
        });
    // This rank's contributions to weight/bias gradients (see Note [SyncBN
    // arithmetic]) before the sums become global.
    at::Tensor grad_weight, grad_bias;
    if (weight.defined()) {
      grad_weight = reduced.narrow(0, c, c) * invstd;
      grad_bias = reduced.narrow(0, 0, c).clone();
    }
    const auto& comm = capsule->communicator;
    if (comm && comm->size() > 1) {
      WaitOrThrow(comm->AllreduceSum(reduced, capsule->options),
                  "gradient allreduce");
    }
    at::Tensor dx = at::empty_like(x);
    kernels_dispatch::OnDevice(
        x, "SyncBatchNorm",
        [&] {
          kernels::BackwardElementwiseCpu(
              dy.data_ptr(), x.data_ptr(), dtype, shape, mean.data_ptr<float>(),
              invstd.data_ptr<float>(), FloatPtr(weight),
              reduced.data_ptr<float>(), total.item<float>(), dx.data_ptr());
        },
        [&](auto stream) {
#if defined(CONCORD_KERNELS_CUDA)
          return kernels::BackwardElementwiseCuda(
              dy.data_ptr(), x.data_ptr(), dtype, shape, mean.data_ptr<float>(),
              invstd.data_ptr<float>(), FloatPtr(weight),
              reduced.data_ptr<float>(), total.data_ptr<float>(), dx.data_ptr(),
              stream);
#endif
        });
    return {dx,           grad_weight,  grad_bias,   at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor SyncBatchNormTrain(const at::Tensor& input, const at::Tensor& weight,
                              const at::Tensor& bias, at::Tensor running_mean,
                              at::Tensor running_var,
                              at::Tensor num_batches_tracked,
                              const SyncBnCall& call) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{
           &weight, &bias, &running_mean, &running_var}) {
    TORCH_CHECK(!t->defined() || (t->scalar_type() == at::kFloat &&
                                  t->device() == input.device()),
                "SyncBatchNorm's parameters and buffers must be float32 on "
                "the input's device");
  }
  auto opt = [](const at::Tensor& t) {
    return t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt;
  };
  return SyncBnFunction::apply(input, opt(weight), opt(bias), opt(running_mean),
                               opt(running_var), opt(num_batches_tracked),
                               call);
}

}  // namespace concord::syncbn
