#pragma once
// Note [Worker device]
// ~~~~~~~~~~~~~~~~~~~~
// Which device a worker trains on and which communicator its generations use.
// Torch-free decisions, tested on CPU; the caller supplies what only LibTorch
// knows (how many CUDA devices are visible, and why none are).
//
// Device, as asked for (WorkerOptions::device, CONCORD_DEVICE,
// `concord-train --device`):
//   cpu       the CPU (the default);
//   cuda      cuda:<local rank>, as torchrun's LOCAL_RANK convention has it
//             (concord-run sets CONCORD_LOCAL_RANK); an error when there is
//             no such device;
//   cuda:N    that device, whatever the local rank (several processes may
//             share one GPU, over Gloo);
//   auto      cuda:<local rank> when CUDA devices are visible, else the CPU,
//             said once.
// Backend (WorkerOptions::backend, CONCORD_BACKEND, `--backend`):
//   auto      NCCL for a CUDA device when Concord was built with NCCL, Gloo
//             otherwise (CUDA tensors then travel through pinned host
//             memory, see Note [CUDA tensors over Gloo]);
//   gloo      Gloo for every device: what several processes sharing one GPU
//             need, since NCCL refuses two ranks on one device;
//   nccl      NCCL; an error for a CPU worker or a build without NCCL.

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace concord {

enum class DeviceType { kCpu, kCuda };

struct DeviceRequest {
  enum class Kind { kCpu, kCuda, kAuto };
  Kind kind = Kind::kCpu;
  int index = -1;                // cuda:N; -1: the local rank's
  std::string ToString() const;  // as parsed: cpu, cuda, cuda:1, auto
};

// "cpu", "cuda", "cuda:N" (N >= 0), "auto". INVALID_ARGUMENT otherwise.
absl::StatusOr<DeviceRequest> ParseDeviceRequest(absl::string_view text);

struct WorkerDevice {
  DeviceType type = DeviceType::kCpu;
  int index = -1;  // the CUDA device; -1 for the CPU
  bool is_cuda() const { return type == DeviceType::kCuda; }
  std::string ToString() const;  // cpu, cuda:0
  friend bool operator==(const WorkerDevice& a, const WorkerDevice& b) {
    return a.type == b.type && a.index == b.index;
  }
};

struct ResolvedDevice {
  WorkerDevice device;
  // Set when `auto` fell back to the CPU: the one line that says so.
  std::string note;
};

// The device a request means for the worker of `local_rank` on a machine
// with `cuda_devices` visible CUDA devices. `no_cuda_why` says why there are
// none when there are none (e.g. "LibTorch 1.13.0 was built without CUDA"),
// for the messages. FAILED_PRECONDITION, one line naming the request and the
// problem: cuda with no device, or no device for the local rank; cuda:N
// beyond the visible devices.
absl::StatusOr<ResolvedDevice> ResolveDevice(const DeviceRequest& request,
                                             int local_rank, int cuda_devices,
                                             absl::string_view no_cuda_why);

enum class Backend { kGloo, kNccl };
enum class BackendRequest { kAuto, kGloo, kNccl };

absl::string_view BackendName(Backend backend);
// "auto", "gloo", "nccl". INVALID_ARGUMENT otherwise.
absl::StatusOr<BackendRequest> ParseBackendRequest(absl::string_view text);

// The communicator of a worker on `device` (see above). `nccl_built`:
// Concord was built with NCCL. FAILED_PRECONDITION for nccl on the CPU or
// without NCCL.
absl::StatusOr<Backend> ChooseBackend(BackendRequest request,
                                      const WorkerDevice& device,
                                      bool nccl_built);

}  // namespace concord
