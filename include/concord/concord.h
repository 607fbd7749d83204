#pragma once
// Concord's programmer's API: elastic data-parallel training for LibTorch
// programs. One header, namespace concord (docs/api.md lists every type and
// function; the rule for nested namespaces: see Note [Public API] below).
//
//   #include <concord/concord.h>
//
//   concord::Job job;                                 // torchrun's env +
//   concord::DistributedDataParallel ddp(net, job);   //   init_process_group
//   torch::optim::SGD opt(ddp->parameters(), 0.1);
//   ... ddp->forward(x) ... loss.backward() ... opt.step() ...
//
// Build with find_package(Concord) and target_link_libraries(app
// Concord::concord): it needs LibTorch and nothing else.

#include "concord/checkpoint.h"       // IWYU pragma: export
#include "concord/data.h"             // IWYU pragma: export
#include "concord/ddp.h"              // IWYU pragma: export
#include "concord/elastic.h"          // IWYU pragma: export
#include "concord/error.h"            // IWYU pragma: export
#include "concord/job.h"              // IWYU pragma: export
#include "concord/sync_batch_norm.h"  // IWYU pragma: export
#include "concord/zero.h"             // IWYU pragma: export

// Note [Public API]
// ~~~~~~~~~~~~~~~~~
// Programs see include/concord/ only. Its headers include LibTorch's and each
// other, nothing else: what needs gRPC, Protobuf, Abseil or Gloo sits behind
// opaque handles (Job holds a detail::JobState, DistributedDataParallelImpl a
// detail::DdpCore), errors cross as concord::Error (header-only, so one type
// on both sides; inside, worker/error.h converts to and from absl::Status,
// whose codes it shares). libconcord.so links the static worker library
// (concord_worker: Session, ddp::Engine, elastic::State, SlowMo,
// SyncBatchNorm) and everything below it privately and exports only the API's
// own symbols (-Wl,--exclude-libs,ALL); Concord's tools, tests and benchmarks
// link concord_worker directly. The rule for names: everything public is in
// concord; a nested namespace only for what a program must not use
// (concord::detail). The API follows LibTorch's C++ frontend: options structs
// with chained setters (TORCH_ARG), module holders (DistributedDataParallel is
// ModuleHolder<DistributedDataParallelImpl<M>> with M deduced from the wrapped
// module), c10::Device, snake_case, and exceptions. The templates do only what
// depends on the wrapped module's type (calling its forward); everything else
// is a call into the library.
