#pragma once
// The write side the coordinator's two server streams share: the workers'
// WatchMembership (WatchCall, service.cc) and the node agents' Node stream
// (NodeCall, agent_service.cc). Not installed; rpc/ only.

#include <grpcpp/grpcpp.h>

#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "common/grpc_status.h"
#include "concord/v1/worker.pb.h"
#include "coordinator/host/host.h"
#include "coordinator/metrics/metrics.h"

namespace concord::coordinator {

// Whether `state` is one a job does not leave.
inline bool Terminal(v1::JobState state) {
  return state == v1::JOB_STATE_SUCCEEDED || state == v1::JOB_STATE_FAILED ||
         state == v1::JOB_STATE_STOPPED;
}

// Note [Core streams]
// ~~~~~~~~~~~~~~~~~~~
// A stream that writes what the core decides, registered with the host as a
// waiter (Poll re-asks the core under the host's mutex). Its fields are
// guarded by the host's mutex and gRPC is called only through the host's
// Defer. One write is in flight at a time (`current_`); what comes while it
// is is queued by the stream itself and written by WriteQueued() when it
// completes. End() happens once, whichever way comes first: the core's
// answer, an error, the host abandoning the waiter, the client cancelling
// (lost = true) or a failed write (lost = true, the peer is gone); the
// stream then finishes with the status as soon as no write is in flight,
// never while one is (gRPC's rule for reactors).
//
// `Reactor` is grpc::ServerWriteReactor<Update> or
// grpc::ServerBidiReactor<Request, Update>. A subclass says what to stop
// waiting for (StopWaiting), what ending means to the core (Ending) and
// what to write next after a write (WriteQueued).
template <typename Reactor, typename Update>
class CoreStream : public Reactor, public CoreHost::Waiter {
 public:
  void OnWriteDone(bool ok) final {
    CoreHost::Lock lock(host_);
    writing_ = false;
    if (ended_) {
      host_->Defer([this, s = status_] { this->Finish(s); });
      return;
    }
    if (!ok) {
      StopWaiting();
      End(host_->core(), /*lost=*/true,
          absl::CancelledError("the stream was closed"));
      return;
    }
    WriteQueued();
  }
  void OnCancel() final {
    CoreHost::Lock lock(host_);
    if (ended_) return;
    StopWaiting();
    End(host_->core(), /*lost=*/true,
        absl::CancelledError("the call was cancelled"));
  }
  void OnDone() final { delete this; }

  // With the host's mutex held: ends the stream with `status` (see Note
  // [Core streams]); `lost`: the peer went away rather than the call being
  // answered or refused.
  void End(Core& core, bool lost, const absl::Status& status) {
    if (ended_) return;
    ended_ = true;
    Ending(core, lost);
    status_ = scope_->Done(ToGrpcStatus(status));
    if (!writing_) host_->Defer([this, s = status_] { this->Finish(s); });
  }

 protected:
  CoreStream(CoreHost* host, std::unique_ptr<RpcScope> scope)
      : host_(host), scope_(std::move(scope)) {}

  // With the host's mutex held, each: the waiter registrations the host
  // still holds are cancelled; the core learns of the end (`lost` as End's);
  // with no write in flight (a write completed, or something was queued),
  // what is queued is written, if anything (with Write) — or the stream
  // ends.
  virtual void StopWaiting() = 0;
  virtual void Ending(Core& core, bool lost) = 0;
  virtual void WriteQueued() = 0;

  // With the host's mutex held and no write in flight.
  void Write(Update update) {
    current_ = std::move(update);
    writing_ = true;
    host_->Defer([this] { this->StartWrite(&current_); });
  }
  bool writing() const { return writing_; }
  bool ended() const { return ended_; }

  CoreHost* const host_;

 private:
  std::unique_ptr<RpcScope> scope_;
  bool writing_ = false;  // a write is in flight (of current_)
  bool ended_ = false;    // Finish is due (once no write is in flight)
  Update current_;
  grpc::Status status_;
};

}  // namespace concord::coordinator
