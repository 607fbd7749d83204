#include "worker/syncbn/sync_batch_norm.h"

#include <torch/torch.h>

#include "worker/syncbn/sync_batch_norm_function.h"

namespace concord {

detail::SyncBnGroup::SyncBnGroup(
    std::shared_ptr<comm::Communicator> communicator,
    comm::CollectiveOptions options)
    : communicator_(std::move(communicator)), options_(options) {}

void detail::SyncBnGroup::SetCommunicator(
    std::shared_ptr<comm::Communicator> communicator) {
  std::lock_guard<std::mutex> lock(mu_);
  communicator_ = std::move(communicator);
}

std::shared_ptr<comm::Communicator> detail::SyncBnGroup::communicator() const {
  std::lock_guard<std::mutex> lock(mu_);
  return communicator_;
}

SyncBatchNormImpl::SyncBatchNormImpl(const torch::nn::BatchNormOptions& options,
                                     std::shared_ptr<SyncBnGroup> group)
    : options(options),
      group_(group ? std::move(group) : std::make_shared<SyncBnGroup>()) {
  reset();
}

void SyncBatchNormImpl::reset() {
  const int64_t c = options.num_features();
  if (options.affine()) {
    weight = register_parameter("weight", torch::empty({c}));
    bias = register_parameter("bias", torch::empty({c}));
  } else {
    weight = register_parameter("weight", torch::Tensor(), false);
    bias = register_parameter("bias", torch::Tensor(), false);
  }
  if (options.track_running_stats()) {
    running_mean = register_buffer("running_mean", torch::zeros({c}));
    running_var = register_buffer("running_var", torch::ones({c}));
    num_batches_tracked =
        register_buffer("num_batches_tracked", torch::tensor(0, torch::kLong));
  } else {
    running_mean = register_buffer("running_mean", torch::Tensor());
    running_var = register_buffer("running_var", torch::Tensor());
    num_batches_tracked =
        register_buffer("num_batches_tracked", torch::Tensor());
  }
  reset_parameters();
}

void SyncBatchNormImpl::reset_running_stats() {
  if (options.track_running_stats()) {
    torch::NoGradGuard no_grad;
    running_mean.zero_();
    running_var.fill_(1);
    num_batches_tracked.zero_();
  }
}

void SyncBatchNormImpl::reset_parameters() {
  reset_running_stats();
  if (options.affine()) {
    torch::nn::init::ones_(weight);
    torch::nn::init::zeros_(bias);
  }
}

void SyncBatchNormImpl::set_group(std::shared_ptr<SyncBnGroup> group) {
  TORCH_CHECK(group != nullptr, "SyncBatchNorm needs a group");
  group_ = std::move(group);
}

void SyncBatchNormImpl::AdoptState(const torch::Tensor& weight_in,
                                   const torch::Tensor& bias_in,
                                   const torch::Tensor& running_mean_in,
                                   const torch::Tensor& running_var_in,
                                   const torch::Tensor& num_batches_in) {
  const int64_t c = options.num_features();
  auto check = [c](const torch::Tensor& t, const char* name) {
    TORCH_CHECK(!t.defined() || (t.dim() == 1 && t.size(0) == c), name,
                " must have ", c, " elements");
  };
  check(weight_in, "weight");
  check(bias_in, "bias");
  check(running_mean_in, "running_mean");
  check(running_var_in, "running_var");
  // Parameters: the same tensors (protected parameters_ holds them by name).
  if (options.affine()) {
    weight = parameters_["weight"] = weight_in;
    bias = parameters_["bias"] = bias_in;
  }
  // Buffers: registered tensors take the adopted storage (set_data keeps the
  // registration and shares the data).
  torch::NoGradGuard no_grad;
  if (options.track_running_stats()) {
    running_mean.set_data(running_mean_in);
    running_var.set_data(running_var_in);
    if (num_batches_in.defined()) num_batches_tracked.set_data(num_batches_in);
  }
}

torch::Tensor SyncBatchNormImpl::forward(const torch::Tensor& input) {
  TORCH_CHECK(input.dim() >= 2 && input.dim() <= 5,
              "SyncBatchNorm expects 2-D to 5-D input, got ", input.dim(),
              "-D");
  TORCH_CHECK(input.size(1) == options.num_features(), "SyncBatchNorm expects ",
              options.num_features(), " channels, got input of size ",
              input.sizes());
  const bool running = running_mean.defined() && running_var.defined();
  if (is_training() || !running) {
    syncbn::SyncBnCall call;
    call.eps = options.eps();
    call.momentum = options.momentum();
    if (is_training()) {
      call.communicator = group_->communicator();
      call.options = group_->options();
    }
    // else PyTorch's rule: eval without running stats normalises with the
    // local batch's statistics, without communication (no communicator).
    return syncbn::SyncBatchNormTrain(
        input, weight, bias, running ? running_mean : torch::Tensor(),
        running ? running_var : torch::Tensor(),
        running ? num_batches_tracked : torch::Tensor(), call);
  }
  if (input.scalar_type() == torch::kFloat) {
    return torch::batch_norm(input, weight, bias, running_mean, running_var,
                             /*training=*/false, 0.0, options.eps(),
                             /*cudnn_enabled=*/false);
  }
  // fp16/bf16 input with an fp32 layer: normalise in float, round once.
  std::vector<int64_t> shape(static_cast<size_t>(input.dim()), 1);
  shape[1] = options.num_features();
  torch::Tensor scale = torch::rsqrt(running_var + options.eps());
  if (weight.defined()) scale = scale * weight;
  torch::Tensor shift = -running_mean * scale;
  if (bias.defined()) shift = shift + bias;
  return torch::addcmul(shift.view(shape), input.to(torch::kFloat),
                        scale.view(shape))
      .to(input.scalar_type());
}

void SyncBatchNormImpl::pretty_print(std::ostream& stream) const {
  stream << "concord::SyncBatchNorm(" << options.num_features()
         << ", eps=" << options.eps() << ", momentum=";
  if (options.momentum().has_value()) {
    stream << *options.momentum();
  } else {
    stream << "None";
  }
  stream << ", affine=" << options.affine()
         << ", track_running_stats=" << options.track_running_stats() << ")";
}

namespace {

// A SyncBatchNorm for `module` when it is a BatchNorm{1,2,3}d, else null.
template <typename Impl>
std::shared_ptr<SyncBatchNormImpl> FromBatchNorm(
    const std::shared_ptr<torch::nn::Module>& module,
    const std::shared_ptr<SyncBnGroup>& group) {
  auto bn = std::dynamic_pointer_cast<Impl>(module);
  if (!bn) return nullptr;
  torch::nn::BatchNormOptions options(bn->options.num_features());
  options.eps(bn->options.eps())
      .momentum(bn->options.momentum())
      .affine(bn->options.affine())
      .track_running_stats(bn->options.track_running_stats());
  auto sync = std::make_shared<SyncBatchNormImpl>(options, group);
  sync->AdoptState(bn->weight, bn->bias, bn->running_mean, bn->running_var,
                   bn->num_batches_tracked);
  sync->train(bn->is_training());
  return sync;
}

std::shared_ptr<SyncBatchNormImpl> MaybeConvert(
    const std::shared_ptr<torch::nn::Module>& module,
    const std::shared_ptr<SyncBnGroup>& group) {
  if (auto s = FromBatchNorm<torch::nn::BatchNorm1dImpl>(module, group))
    return s;
  if (auto s = FromBatchNorm<torch::nn::BatchNorm2dImpl>(module, group))
    return s;
  return FromBatchNorm<torch::nn::BatchNorm3dImpl>(module, group);
}

void ConvertChildren(torch::nn::Module& parent, const std::string& prefix,
                     const std::shared_ptr<SyncBnGroup>& group,
                     std::vector<std::string>* replaced) {
  auto* sequential = dynamic_cast<torch::nn::SequentialImpl*>(&parent);
  auto* list = dynamic_cast<torch::nn::ModuleListImpl*>(&parent);
  auto* dict = dynamic_cast<torch::nn::ModuleDictImpl*>(&parent);
  int64_t index = 0;
  for (const auto& item : parent.named_children()) {
    const std::string& name = item.key();
    const std::shared_ptr<torch::nn::Module>& child = item.value();
    const std::string qualified = prefix.empty() ? name : prefix + "." + name;
    if (auto sync = MaybeConvert(child, group)) {
      parent.replace_module(name, sync);
      // Containers call their own lists, not the registered children:
      // rebind those in place (their iterators hand out references).
      if (sequential != nullptr) {
        *(sequential->begin() + index) = torch::nn::AnyModule(sync);
      } else if (list != nullptr) {
        *(list->begin() + index) = sync;
      } else if (dict != nullptr) {
        for (auto& entry : *dict) {
          if (entry.key() == name) entry.value() = sync;
        }
      }
      if (replaced != nullptr) replaced->push_back(qualified);
    } else {
      ConvertChildren(*child, qualified, group, replaced);
    }
    ++index;
  }
}

}  // namespace

std::shared_ptr<torch::nn::Module> ConvertSyncBatchNorm(
    std::shared_ptr<torch::nn::Module> root, std::shared_ptr<SyncBnGroup> group,
    std::vector<std::string>* replaced) {
  TORCH_CHECK(root != nullptr, "ConvertSyncBatchNorm: null module");
  if (!group) group = std::make_shared<SyncBnGroup>();
  if (auto sync = MaybeConvert(root, group)) {
    if (replaced != nullptr) replaced->push_back("");
    return sync;
  }
  ConvertChildren(*root, "", group, replaced);
  return root;
}

std::shared_ptr<torch::nn::Module> convert_sync_batchnorm(
    std::shared_ptr<torch::nn::Module> module) {
  if (module == nullptr) {
    throw Error(ErrorCode::kInvalidArgument,
                "convert_sync_batchnorm: null module");
  }
  return ConvertSyncBatchNorm(std::move(module), nullptr);
}

}  // namespace concord
