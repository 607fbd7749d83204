#pragma once
// Note [LibTorch versions]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// Concord builds against LibTorch 1.13 (Debian 12) through 2.x (Debian 13's
// 2.6, pip's on GPU machines). What differs between them, and what Concord does
// about it, lives here and nowhere else:
//
// - Optimizer::zero_grad() zeroes gradients in 1.13 but sets them to none
//   (undefined) in 2.x, as Python's does since 2.0. Concord always says which
//   it wants: ZeroGrad(optimizer, set_to_none), which programs call as
//   concord::zero_grad (concord/ddp.h).
// - TorchScript's CPU fuser: off in Debian 12's 1.13 (built without LLVM),
//   on in Debian 13's 2.6 (with LLVM), where a model's elementwise ops then
//   run in generated kernels that round differently from ATen's, and where
//   Python's torch hangs the first time it fuses a graph. concord-train runs
//   TorchScript unfused on CPU with every LibTorch, as the Python reference
//   tests do (tests/reference/fixtures.py): UnfusedTorchScriptOnCpu(), which
//   programs call as concord::disable_torchscript_cpu_fusion (concord/ddp.h).
// - DDP's first bucket (the same arithmetic as the PyTorch of the LibTorch
//   Concord is built with): 1.13 caps it at dist._DEFAULT_FIRST_BUCKET_BYTES
//   (1 MiB) whatever bucket_cap_mb says; 2.x (2.6 checked,
//   torch/nn/parallel/distributed.py) caps it at bucket_cap_mb when the user
//   gives one, initially and when rebuilt, and at 1 MiB only by default.
//   kFirstBucketFollowsUserCap says which; ddp::BucketCapsOf
//   (worker/ddp/reducer.h) applies it to DdpOptions::bucket_cap_mb.
// - An optimizer's per-parameter state is keyed by the parameter's
//   TensorImpl printed as a string in 1.13, by the pointer itself in 2.x:
//   OptimizerStateKey(parameter).
// - Optimizer::load puts the saved groups' options back in 2.x and leaves
//   them as they are in 1.13: a checkpoint's LibTorch archive sets them
//   itself for both (SavedNativeOptions in worker/checkpoint/content.cc).

#include <torch/optim/optimizer.h>
#include <torch/version.h>

// Declared in torch/csrc/jit/codegen/fuser/interface.h, which Debian's
// LibTorch packages do not install; exported by libtorch_cpu in 1.13 and 2.x.
namespace torch::jit {
TORCH_API void overrideCanFuseOnCPU(bool value);
}  // namespace torch::jit

namespace concord::compat {

// See above: a user-given bucket cap also caps DDP's first bucket.
inline constexpr bool kFirstBucketFollowsUserCap = TORCH_VERSION_MAJOR >= 2;

// TorchScript graphs run on CPU without fusion (see above), for the whole
// process.
inline void UnfusedTorchScriptOnCpu() {
  torch::jit::overrideCanFuseOnCPU(false);
}

// Zeroes every gradient the optimizer owns (set_to_none = false: detached
// and filled with zeros, as PyTorch's zero_grad(set_to_none=False)), or
// drops them (set_to_none = true).
inline void ZeroGrad(torch::optim::Optimizer& optimizer, bool set_to_none) {
#if TORCH_VERSION_MAJOR >= 2
  optimizer.zero_grad(set_to_none);
#else
  if (!set_to_none) {
    optimizer.zero_grad();
    return;
  }
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) p.mutable_grad() = at::Tensor();
  }
#endif
}

// The key of `parameter`'s entry in Optimizer::state() (see above).
inline auto OptimizerStateKey(const at::Tensor& parameter) {
#if TORCH_VERSION_MAJOR >= 2
  return static_cast<void*>(parameter.unsafeGetTensorImpl());
#else
  return c10::guts::to_string(parameter.unsafeGetTensorImpl());
#endif
}

}  // namespace concord::compat
