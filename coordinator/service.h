#pragma once
// The gRPC face of the coordinator: converts protos and waits; every decision
// is the Core's.
//
// Thread-safety: every method may be called from any thread. One mutex
// serialises all access to the Core; a condition variable wakes blocked Join
// and KvGet calls after every mutation so they re-ask.

#include <grpcpp/grpcpp.h>

#include <condition_variable>
#include <mutex>
#include <utility>

#include "absl/time/time.h"
#include "common/clock.h"
#include "concord/v1/worker.grpc.pb.h"
#include "coordinator/core.h"

namespace concord::coordinator {

class WorkerServiceImpl final : public v1::WorkerService::Service {
 public:
  // `clock` drives the Core (heartbeat and rendezvous timeouts); waits in Join
  // and KvGet always use real time. `clock` must outlive the service.
  explicit WorkerServiceImpl(const Clock* clock);

  // Registers the worker, then blocks until its generation forms, for at most
  // wait_timeout_ms (default 300 s when 0) and the call's deadline. Errors:
  // INVALID_ARGUMENT, FAILED_PRECONDITION, ALREADY_EXISTS (from the Core),
  // DEADLINE_EXCEEDED, CANCELLED, ABORTED (the generation it was placed in
  // ended before the call saw it: join again), UNAVAILABLE (shutting down).
  grpc::Status Join(grpc::ServerContext* context,
                    const v1::JoinRequest* request,
                    v1::JoinResponse* response) override;
  // Never blocks. Errors as Core::Heartbeat.
  grpc::Status Heartbeat(grpc::ServerContext* context,
                         const v1::HeartbeatRequest* request,
                         v1::HeartbeatResponse* response) override;
  // Never blocks. Errors as Core::Leave.
  grpc::Status Leave(grpc::ServerContext* context,
                     const v1::LeaveRequest* request,
                     v1::LeaveResponse* response) override;
  // Never blocks. Errors as Core::KvSet.
  grpc::Status KvSet(grpc::ServerContext* context,
                     const v1::KvSetRequest* request,
                     v1::KvSetResponse* response) override;
  // Blocks until every key is set, for at most wait_timeout_ms (default
  // 300 s when 0) and the call's deadline. Errors as Core::KvGet, plus
  // DEADLINE_EXCEEDED, CANCELLED, UNAVAILABLE (shutting down).
  grpc::Status KvGet(grpc::ServerContext* context,
                     const v1::KvGetRequest* request,
                     v1::KvGetResponse* response) override;

  // Runs Core::Tick() and wakes waiters. Call periodically.
  void Tick();

  // Makes blocked Join/KvGet calls return UNAVAILABLE promptly, and every
  // later one at once. Idempotent.
  void Shutdown();

  // Runs `fn(core)` under the service's mutex and returns its result; for
  // tests and status. Waiters are woken afterwards in case `fn` mutated.
  template <typename Fn>
  auto WithCore(Fn&& fn) {
    struct Notify {
      std::condition_variable& cv;
      ~Notify() { cv.notify_all(); }
    } notify{changed_};
    std::lock_guard<std::mutex> lock(mu_);
    return std::forward<Fn>(fn)(core_);
  }

 private:
  // Waits, with `lock` held on entry and exit, until `poll()` (an
  // absl::StatusOr<std::optional<T>>) fails or has a value; returns that, or
  // DEADLINE_EXCEEDED / CANCELLED / UNAVAILABLE.
  template <typename Poll>
  auto WaitFor(grpc::ServerContext* context, absl::Duration timeout,
               std::unique_lock<std::mutex>& lock, Poll poll)
      -> decltype(poll());

  std::mutex mu_;
  std::condition_variable changed_;
  Core core_;
  bool shutting_down_ = false;
};

}  // namespace concord::coordinator
