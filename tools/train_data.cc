#include "tools/train_data.h"

#include <fstream>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "worker/state_dict_file.h"

namespace concord::train {
namespace {

// First line of a LibTorch error, without the C++ backtrace.
std::string FirstLine(const std::exception& e) {
  const auto* c10 = dynamic_cast<const c10::Error*>(&e);
  std::string text = c10 ? c10->what_without_backtrace() : e.what();
  const size_t nl = text.find('\n');
  if (nl != std::string::npos) text.resize(nl);
  return text;
}

absl::Status Bad(const std::string& flag, const std::string& path,
                 const std::string& problem) {
  return absl::InvalidArgumentError(
      absl::StrCat(flag, " ", path, ": ", problem));
}

absl::StatusOr<std::vector<char>> ReadFile(const std::string& flag,
                                           const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Bad(flag, path, "cannot open file");
  return std::vector<char>(std::istreambuf_iterator<char>(in), {});
}

std::string Shape(const torch::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) {
    absl::StrAppend(&s, i ? ", " : "", t.size(i));
  }
  return s + "]";
}

}  // namespace

absl::StatusOr<torch::jit::Module> LoadModel(const std::string& path) {
  if (!std::ifstream(path)) return Bad("--model", path, "cannot open file");
  try {
    return torch::jit::load(path);
  } catch (const std::exception& e) {
    return Bad("--model", path,
               absl::StrCat("not a TorchScript module (", FirstLine(e), ")"));
  }
}

absl::StatusOr<Dataset> LoadData(const std::string& path, Loss loss) {
  auto bytes = ReadFile("--data", path);
  if (!bytes.ok()) return bytes.status();
  c10::IValue value;
  try {
    value = torch::pickle_load(*bytes);
  } catch (const std::exception& e) {
    return Bad(
        "--data", path,
        absl::StrCat("not a file written by torch.save (", FirstLine(e), ")"));
  }
  if (!value.isGenericDict()) {
    return Bad("--data", path,
               absl::StrCat("expected a dict {'inputs': Tensor, 'targets': "
                            "Tensor}, found ",
                            value.tagKind()));
  }
  const auto dict = value.toGenericDict();
  Dataset data;
  for (const char* key : {"inputs", "targets"}) {
    auto it = dict.find(c10::IValue(std::string(key)));
    if (it == dict.end()) {
      return Bad("--data", path, absl::StrCat("missing key '", key, "'"));
    }
    if (!it->value().isTensor()) {
      return Bad("--data", path,
                 absl::StrCat("'", key, "' is a ", it->value().tagKind(),
                              ", not a tensor"));
    }
    (std::string(key) == "inputs" ? data.inputs : data.targets) =
        it->value().toTensor();
  }
  if (data.inputs.dim() == 0 || data.targets.dim() == 0) {
    return Bad("--data", path, "inputs and targets need a sample dimension");
  }
  if (data.inputs.size(0) != data.targets.size(0)) {
    return Bad("--data", path,
               absl::StrCat("inputs has ", data.inputs.size(0),
                            " samples but targets has ", data.targets.size(0)));
  }
  if (data.inputs.size(0) == 0) return Bad("--data", path, "no samples");
  if (loss == Loss::kCrossEntropy) {
    if (data.targets.is_floating_point() || data.targets.is_complex() ||
        data.targets.scalar_type() == torch::kBool) {
      return Bad(
          "--data", path,
          absl::StrCat("cross_entropy needs integer class targets, "
                       "found ",
                       std::string(c10::toString(data.targets.scalar_type()))));
    }
    if (data.targets.dim() != 1) {
      return Bad("--data", path,
                 absl::StrCat("cross_entropy needs targets of shape [N], "
                              "found ",
                              Shape(data.targets)));
    }
    data.targets = data.targets.to(torch::kLong);
  } else if (!data.targets.is_floating_point()) {
    return Bad(
        "--data", path,
        absl::StrCat("mse needs floating-point targets, found ",
                     std::string(c10::toString(data.targets.scalar_type()))));
  }
  data.inputs = data.inputs.contiguous();
  data.targets = data.targets.contiguous();
  return data;
}

absl::Status CheckModelFitsData(torch::jit::Module& model, const Dataset& data,
                                Loss loss, const std::string& model_path,
                                const std::string& data_path) {
  const std::string where =
      absl::StrCat("--model ", model_path, " on --data ", data_path, ": ");
  const int64_t n = std::min<int64_t>(2, data.size());
  torch::Tensor x = data.inputs.narrow(0, 0, n);
  torch::Tensor y = data.targets.narrow(0, 0, n);
  torch::NoGradGuard no_grad;
  const bool was_training = model.is_training();
  model.eval();
  c10::IValue out;
  try {
    out = model.forward({x});
  } catch (const std::exception& e) {
    model.train(was_training);
    return absl::InvalidArgumentError(
        absl::StrCat(where, "forward fails on inputs of shape ", Shape(x), " (",
                     FirstLine(e), ")"));
  }
  model.train(was_training);
  if (!out.isTensor()) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, "forward returns a ", out.tagKind(), ", not a tensor"));
  }
  const torch::Tensor output = out.toTensor();
  if (loss == Loss::kCrossEntropy) {
    if (output.dim() != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "cross_entropy needs output [N, classes], found ",
                       Shape(output)));
    }
    const int64_t classes = output.size(1);
    const auto lo = data.targets.min().item<int64_t>();
    const auto hi = data.targets.max().item<int64_t>();
    if (lo < 0 || hi >= classes) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "targets range over [", lo, ", ", hi,
                       "] but the model has ", classes, " classes"));
    }
  } else if (output.sizes() != y.sizes()) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, "mse needs output shaped like the targets: ", Shape(output),
        " vs ", Shape(y)));
  }
  return absl::OkStatus();
}

absl::StatusOr<torch::nn::Sequential> BuiltinModel(
    const std::string& name, const Dataset& data, Loss loss, uint64_t seed,
    const std::string& data_path) {
  if (name != "builtin:cnn") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--model ", name, ": unknown built-in model (builtin:cnn)"));
  }
  const torch::Tensor& x = data.inputs;
  if (loss != Loss::kCrossEntropy || x.dim() != 4 || x.size(2) % 4 != 0 ||
      x.size(3) % 4 != 0 || !x.is_floating_point()) {
    return Bad("--data", data_path,
               absl::StrCat("builtin:cnn needs float inputs [N, C, H, W] with "
                            "H and W multiples of 4 and cross_entropy, found ",
                            Shape(x)));
  }
  const int64_t classes = data.targets.max().item<int64_t>() + 1;
  if (data.targets.min().item<int64_t>() < 0) {
    return Bad("--data", data_path, "negative class targets");
  }
  namespace nn = torch::nn;
  torch::manual_seed(seed);
  const int64_t flat = 32 * (x.size(2) / 4) * (x.size(3) / 4);
  return nn::Sequential(
      nn::Conv2d(nn::Conv2dOptions(x.size(1), 16, 3).padding(1)),
      nn::BatchNorm2d(16), nn::ReLU(), nn::MaxPool2d(2),
      nn::Conv2d(nn::Conv2dOptions(16, 32, 3).padding(1)), nn::BatchNorm2d(32),
      nn::ReLU(), nn::MaxPool2d(2), nn::Flatten(), nn::Linear(flat, 64),
      nn::BatchNorm1d(64), nn::ReLU(), nn::Linear(64, classes));
}

torch::Tensor ComputeLoss(Loss loss, const torch::Tensor& output,
                          const torch::Tensor& targets) {
  if (loss == Loss::kCrossEntropy) {
    return torch::nn::functional::cross_entropy(output, targets);
  }
  return torch::nn::functional::mse_loss(output, targets);
}

absl::Status SaveState(
    const std::vector<std::pair<std::string, torch::Tensor>>& state,
    const std::string& path) {
  // See Note [State dict files]: loads with torch.load(weights_only=True).
  if (absl::Status s = concord::SaveStateDict(state, path); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("--output ", s.message()));
  }
  return absl::OkStatus();
}

}  // namespace concord::train
