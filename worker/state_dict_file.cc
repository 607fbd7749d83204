#include "worker/state_dict_file.h"

#include <caffe2/serialize/versions.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace concord {

absl::StatusOr<Pickled> Pickle(const c10::IValue& value) {
  // See Note [State dict files]: the pickle without type tags, the storages as
  // records data/0, data/1, ... (persistent ids "0", "1", ... in order).
  Pickled out;
  try {
    torch::jit::Pickler pickler(
        [&](const char* bytes, size_t n) {
          out.pickle.insert(out.pickle.end(), bytes, bytes + n);
        },
        /*tensor_table=*/nullptr, /*type_renamer=*/nullptr,
        /*memoized_class_types=*/nullptr, /*get_tensor_id=*/nullptr,
        /*tag_aggregates=*/false);
    pickler.protocol();
    pickler.pushIValue(value);
    pickler.stop();
    out.storages = pickler.tensorData();
  } catch (const std::exception& e) {
    return absl::InternalError(
        absl::StrCat("pickling the archive: ", e.what()));
  }
  return out;
}

absl::Status WriteArchive(const c10::IValue& value, const ZipWriter::Sink& sink,
                          uint32_t* crc32, ZipWriter::Options options,
                          ArchiveHoles* holes) {
  // The archive around the pickle: see Note [Archive writer].
  CONCORD_ASSIGN_OR_RETURN(Pickled pickled, Pickle(value));
  const std::vector<char>& pickle = pickled.pickle;
  const std::vector<at::Tensor>& storages = pickled.storages;
  ZipWriter zip("archive", sink, options);
  for (size_t i = 0; i < storages.size(); ++i) {
    const void* storage = storages[i].storage().unsafeGetStorageImpl();
    if (holes != nullptr) {
      if (auto hole = holes->crc.find(storage); hole != holes->crc.end()) {
        CONCORD_ASSIGN_OR_RETURN(
            holes->offset[storage],
            zip.AddHole(absl::StrCat("data/", i),
                        storages[i].storage().nbytes(), hole->second));
        continue;
      }
    }
    // A CPU storage's bytes are its own memory, which `value` keeps alive;
    // one on a device is copied to the host here, for this call only.
    const bool own = storages[i].device().is_cpu();
    const torch::jit::WriteableTensorData data =
        torch::jit::getWriteableTensorData(storages[i]);
    CONCORD_RETURN_IF_ERROR(zip.Add(absl::StrCat("data/", i), data.data(),
                                    data.sizeInBytes(), /*lasting=*/own));
  }
  CONCORD_RETURN_IF_ERROR(
      zip.Add("data.pkl", pickle.data(), pickle.size(), /*lasting=*/false));
  // PyTorch's writer's "version" record: the format of a plain pickle.
  const std::string version =
      absl::StrCat(caffe2::serialize::kMinProducedFileFormatVersion, "\n");
  CONCORD_RETURN_IF_ERROR(
      zip.Add("version", version.data(), version.size(), /*lasting=*/false));
  CONCORD_RETURN_IF_ERROR(zip.Finish());
  if (crc32 != nullptr) *crc32 = zip.crc32();
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
      WriteArchive(c10::IValue(dict), [&](const void* data, size_t n, bool) {
        const char* bytes = static_cast<const char*>(data);
        archive.insert(archive.end(), bytes, bytes + n);
        return true;
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
