#include "worker/device.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace concord {

std::string DeviceRequest::ToString() const {
  switch (kind) {
    case Kind::kCpu:
      return "cpu";
    case Kind::kAuto:
      return "auto";
    case Kind::kCuda:
      return index < 0 ? "cuda" : absl::StrCat("cuda:", index);
  }
  return "cpu";
}

absl::StatusOr<DeviceRequest> ParseDeviceRequest(absl::string_view text) {
  DeviceRequest r;
  if (text == "cpu") return r;
  if (text == "auto") {
    r.kind = DeviceRequest::Kind::kAuto;
    return r;
  }
  absl::string_view rest = text;
  if (absl::ConsumePrefix(&rest, "cuda")) {
    r.kind = DeviceRequest::Kind::kCuda;
    if (rest.empty()) return r;
    int index = -1;
    if (absl::ConsumePrefix(&rest, ":") && !rest.empty() &&
        rest.find_first_not_of("0123456789") == absl::string_view::npos &&
        absl::SimpleAtoi(rest, &index)) {
      r.index = index;
      return r;
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "'", text, "' is not a device: expected cpu, cuda, cuda:N or auto"));
}

std::string WorkerDevice::ToString() const {
  return type == DeviceType::kCpu ? "cpu" : absl::StrCat("cuda:", index);
}

absl::StatusOr<ResolvedDevice> ResolveDevice(const DeviceRequest& request,
                                             int local_rank, int cuda_devices,
                                             absl::string_view no_cuda_why) {
  ResolvedDevice out;
  if (request.kind == DeviceRequest::Kind::kCpu) return out;
  const std::string none = absl::StrCat(
      "no CUDA device is visible",
      no_cuda_why.empty() ? "" : absl::StrCat(" (", no_cuda_why, ")"));
  if (cuda_devices <= 0) {
    if (request.kind == DeviceRequest::Kind::kAuto) {
      out.note = absl::StrCat("device auto: ", none, "; training on the CPU");
      return out;
    }
    return absl::FailedPreconditionError(
        absl::StrCat("device ", request.ToString(), ": ", none));
  }
  int index = request.index;
  if (index < 0) {
    // torchrun's convention: the local rank's device.
    index = local_rank < 0 ? 0 : local_rank;
    if (index >= cuda_devices) {
      return absl::FailedPreconditionError(
          absl::StrCat("device ", request.ToString(), ": local rank ",
                       local_rank, " has no CUDA device of its own (",
                       cuda_devices, " visible); start at most ", cuda_devices,
                       " workers on this node, or name one with cuda:N"));
    }
  } else if (index >= cuda_devices) {
    return absl::FailedPreconditionError(absl::StrCat(
        "device ", request.ToString(), ": only ", cuda_devices, " CUDA device",
        cuda_devices == 1 ? " is" : "s are", " visible"));
  }
  out.device.type = DeviceType::kCuda;
  out.device.index = index;
  return out;
}

absl::string_view BackendName(Backend backend) {
  return backend == Backend::kNccl ? "nccl" : "gloo";
}

absl::StatusOr<BackendRequest> ParseBackendRequest(absl::string_view text) {
  if (text == "auto") return BackendRequest::kAuto;
  if (text == "gloo") return BackendRequest::kGloo;
  if (text == "nccl") return BackendRequest::kNccl;
  return absl::InvalidArgumentError(absl::StrCat(
      "'", text, "' is not a backend: expected auto, gloo or nccl"));
}

absl::StatusOr<Backend> ChooseBackend(BackendRequest request,
                                      const WorkerDevice& device,
                                      bool nccl_built) {
  switch (request) {
    case BackendRequest::kGloo:
      return Backend::kGloo;
    case BackendRequest::kAuto:
      return device.is_cuda() && nccl_built ? Backend::kNccl : Backend::kGloo;
    case BackendRequest::kNccl:
      if (!device.is_cuda()) {
        return absl::FailedPreconditionError(
            absl::StrCat("backend nccl needs a CUDA device; this worker's is ",
                         device.ToString()));
      }
      if (!nccl_built) {
        return absl::FailedPreconditionError(
            "backend nccl: this Concord was built without NCCL "
            "(CONCORD_WITH_NCCL)");
      }
      return Backend::kNccl;
  }
  return Backend::kGloo;
}

}  // namespace concord
