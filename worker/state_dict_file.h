#pragma once
// Note [State dict files]
// ~~~~~~~~~~~~~~~~~~~~~~~
// The files Concord writes for Python users (concord-train's --output and
// --output-per-worker, test helpers' results) are what Python's
// `torch.save(dict_of_tensors, path)` writes: a zip archive with data.pkl and
// one record per storage, which `torch.load` reads in every PyTorch from 1.6
// on, with weights_only=True (2.6's default) included.
//
// LibTorch's own torch::pickle_save writes the same archive but tags every
// dict and list with its TorchScript type (a call to
// torch.jit._pickle.restore_type_tag), a global that torch.load's
// weights-only unpickler refuses. These files are written by LibTorch's
// pickler with type tags off, so the pickle holds nothing but a plain dict,
// strings and torch._utils._rebuild_tensor_v2 over torch.*Storage, all of
// which weights_only allows, in the archive Concord's own writer makes (see
// Note [Archive writer] in worker/zip_writer.h). Tensors are written as CPU
// tensors, whatever device they live on, so the file loads on a machine
// without a GPU.

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/zip_writer.h"

namespace concord {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// `value` pickled as torch.save pickles it: the pickle (data.pkl) and the
// storages its persistent ids "0", "1", ... name, in order. INTERNAL when
// LibTorch's pickler threw.
struct Pickled {
  std::vector<char> pickle;
  std::vector<at::Tensor> storages;
};
absl::StatusOr<Pickled> Pickle(const c10::IValue& value);

// Writes `value` (dicts, lists, tuples, strings, numbers, None and
// tensors) as the archive `torch.save(value, f)` writes (see Note [Archive
// writer] in worker/zip_writer.h), through `sink`. Tensors go as CPU
// tensors; a CPU storage's bytes reach the sink as `lasting`: they are the
// storage's own memory, valid while `value` lives and unchanged while the
// caller leaves its tensors alone. `crc32`, when given: the archive's
// CRC-32; `options`: the archive writer's. UNAVAILABLE when `sink` failed;
// INTERNAL when LibTorch's pickler threw. `holes`, when given: storages
// whose records are written as holes (ZipWriter::AddHole, their bytes never
// read), and where each one's data went.
struct ArchiveHoles {
  // By storage (its StorageImpl): the CRC-32 of the bytes that will fill it.
  std::map<const void*, uint32_t> crc;
  // Set by WriteArchive: each hole's data offset in the archive.
  std::map<const void*, uint64_t> offset;
};
absl::Status WriteArchive(const c10::IValue& value, const ZipWriter::Sink& sink,
                          uint32_t* crc32 = nullptr,
                          ZipWriter::Options options = {},
                          ArchiveHoles* holes = nullptr);

// What an archive of WriteArchive or torch.save holds. INVALID_ARGUMENT
// when `bytes` are not one.
absl::StatusOr<c10::IValue> ReadArchive(const std::vector<char>& bytes);

// The bytes of the archive holding `state` as a dict name -> tensor, in
// `state`'s order. INVALID_ARGUMENT for an undefined tensor or a name given
// twice.
absl::StatusOr<std::vector<char>> EncodeStateDict(const NamedTensors& state);

// Writes EncodeStateDict(state) to `path` atomically (a temporary file next
// to it, renamed into place): a reader never sees half a file.
// INVALID_ARGUMENT as EncodeStateDict; UNAVAILABLE naming `path` when it
// cannot be written.
absl::Status SaveStateDict(const NamedTensors& state, const std::string& path);

}  // namespace concord
