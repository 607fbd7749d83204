#include "worker/state_dict_file.h"

#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <set>

#include "absl/strings/str_cat.h"

namespace concord {

absl::Status WriteArchive(
    const c10::IValue& value,
    const std::function<size_t(const void* data, size_t size)>& sink) {
  // See Note [State dict files]: the pickle without type tags, the storages as
  // records data/0, data/1, ... (persistent ids "0", "1", ... in order).
  bool failed = false;
  try {
    std::vector<char> pickle;
    torch::jit::Pickler pickler(
        [&](const char* bytes, size_t n) {
          pickle.insert(pickle.end(), bytes, bytes + n);
        },
        /*tensor_table=*/nullptr, /*type_renamer=*/nullptr,
        /*memoized_class_types=*/nullptr, /*get_tensor_id=*/nullptr,
        /*tag_aggregates=*/false);
    pickler.protocol();
    pickler.pushIValue(value);
    pickler.stop();
    caffe2::serialize::PyTorchStreamWriter writer(
        [&](const void* data, size_t n) -> size_t {
          if (failed) return 0;
          const size_t done = sink(data, n);
          if (done != n) failed = true;
          return done;
        });
    const std::vector<at::Tensor>& storages = pickler.tensorData();
    for (size_t i = 0; i < storages.size(); ++i) {
      const torch::jit::WriteableTensorData data =
          torch::jit::getWriteableTensorData(storages[i]);
      writer.writeRecord(absl::StrCat("data/", i), data.data(),
                         data.sizeInBytes());
    }
    writer.writeRecord("data.pkl", pickle.data(), pickle.size());
    writer.writeEndOfFile();
  } catch (const std::exception& e) {
    if (failed) return absl::UnavailableError("the archive's write failed");
    return absl::InternalError(absl::StrCat("writing the archive: ", e.what()));
  }
  if (failed) return absl::UnavailableError("the archive's write failed");
  return absl::OkStatus();
}

absl::StatusOr<c10::IValue> ReadArchive(const std::vector<char>& bytes) {
  try {
    return torch::jit::pickle_load(bytes);
  } catch (const std::exception& e) {
    std::string what = e.what();
    if (auto nl = what.find('\n'); nl != std::string::npos) what.resize(nl);
    return absl::InvalidArgumentError(
        absl::StrCat("not a torch.save archive: ", what));
  }
}

absl::StatusOr<std::vector<char>> EncodeStateDict(const NamedTensors& state) {
  c10::impl::GenericDict dict(c10::StringType::get(), c10::TensorType::get());
  std::set<std::string> names;
  for (const auto& [name, tensor] : state) {
    if (!tensor.defined()) {
      return absl::InvalidArgumentError(
          absl::StrCat("state entry '", name, "' is an undefined tensor"));
    }
    if (!names.insert(name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("state entry '", name, "' is given twice"));
    }
    dict.insert(name, tensor.detach().to(at::kCPU));
  }
  std::vector<char> archive;
  absl::Status written =
      WriteArchive(c10::IValue(dict), [&](const void* data, size_t n) {
        const char* bytes = static_cast<const char*>(data);
        archive.insert(archive.end(), bytes, bytes + n);
        return n;
      });
  if (!written.ok()) return written;
  return archive;
}

absl::Status SaveStateDict(const NamedTensors& state, const std::string& path) {
  absl::StatusOr<std::vector<char>> bytes = EncodeStateDict(state);
  if (!bytes.ok()) return bytes.status();
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(bytes->data(), static_cast<std::streamsize>(bytes->size()));
    out.close();
    if (!out) {
      std::remove(tmp.c_str());
      return absl::UnavailableError(
          absl::StrCat(path, ": cannot write: ", std::strerror(errno)));
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    std::remove(tmp.c_str());
    return absl::UnavailableError(
        absl::StrCat(path, ": cannot rename into place: ", why));
  }
  return absl::OkStatus();
}

}  // namespace concord
