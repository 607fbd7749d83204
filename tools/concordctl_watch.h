#pragma once
// `concordctl watch JOB`: the job's state, members, steps and throughput,
// polled every `interval`. On a terminal the table is redrawn in place
// (ANSI: cursor home, clear); otherwise one plain snapshot per interval,
// separated by blank lines (with -o json: one JSON object per line, the
// fields of `status -o json`). Ends when the job does.
//
// Exit status: 0 when the job SUCCEEDED, 3 when it FAILED or was STOPPED,
// 1 when the coordinator refuses (e.g. NOT_FOUND for an unknown job; one
// line on stderr) or stays unreachable for longer than `timeout` (a
// transient UNAVAILABLE is shown and retried).

#include <grpcpp/grpcpp.h>

#include <functional>
#include <memory>
#include <string>

#include "absl/time/time.h"
#include "concord/v1/operator.grpc.pb.h"

namespace concord::ctl {

struct WatchOptions {
  std::string job;
  absl::Duration interval = absl::Seconds(2);
  // Give up after the coordinator was unreachable this long.
  absl::Duration timeout = absl::Seconds(30);
  bool json = false;
};

// How the coordinator sees a member (MemberStatus.health, docs/reliability.md
// "Hangs"), in a few words for a table's note: "waiting 6.2s in #11
// (broadcast)", "idle", "busy: checkpoint"; "" while it progresses.
std::string HealthNote(const v1::MemberStatus& m);

// `context()` makes a ClientContext with the deadline and the token.
int Watch(v1::OperatorService::Stub& stub,
          const std::function<std::unique_ptr<grpc::ClientContext>()>& context,
          const WatchOptions& options);

}  // namespace concord::ctl
