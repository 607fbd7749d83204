#pragma once
// Concord's programmer's API: elastic data-parallel training for LibTorch
// programs. One header, namespace concord (docs/api.md lists every type and
// function; the rule for nested namespaces is in docs/architecture.md, Note
// [Public API]).
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
