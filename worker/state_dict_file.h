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
// which weights_only allows. Tensors are written as CPU tensors, whatever
// device they live on, so the file loads on a machine without a GPU.

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <cstddef>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace concord {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// Writes `value` (dicts, lists, tuples, strings, numbers, None and
// tensors) as the archive `torch.save(value, f)` writes, through `sink`
// (which returns the bytes it took: fewer is a failure). Tensors go as CPU
// tensors. UNAVAILABLE when `sink` failed; INTERNAL when LibTorch's writer
// threw.
absl::Status WriteArchive(
    const c10::IValue& value,
    const std::function<size_t(const void* data, size_t size)>& sink);

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
