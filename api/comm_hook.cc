#include "concord/comm_hook.h"

#include "absl/strings/str_cat.h"
#include "api/internal.h"
#include "worker/comm/work.h"
#include "worker/error.h"

namespace concord {
namespace detail {
namespace {

// What a hook's exception becomes: a status the reducer reports from
// backward (a concord::Error keeps its code, so a failed collective stays
// retryable).
absl::Status HookFailure(const char* where) {
  try {
    throw;
  } catch (const Error& e) {
    return ToStatus(e);
  } catch (const std::exception& e) {
    return absl::InternalError(
        absl::StrCat("communication hook: ", where, ": ", e.what()));
  }
}

}  // namespace

ddp::CommHook ToEngineHook(const CommHook& hook,
                           std::shared_ptr<comm::Communicator> comm,
                           comm::CollectiveOptions options) {
  auto group = std::make_shared<ProcessGroupState>(
      ProcessGroupState{std::move(comm), options});
  return [hook, group](ddp::GradBucket& b) -> std::shared_ptr<comm::Work> {
    GradBucket bucket(b.index, b.buffer, b.gradients, b.parameters, b.is_last,
                      ProcessGroup(group));
    std::shared_ptr<FutureState> future;
    try {
      future = hook(bucket).state();
    } catch (...) {
      return comm::PromiseWork::Done(HookFailure("it threw"));
    }
    if (future == nullptr) {
      return comm::PromiseWork::Done(absl::InternalError(
          "communication hook: it returned an empty Future"));
    }
    std::shared_ptr<comm::Work> inner =
        future->work ? future->work : comm::PromiseWork::Done(absl::OkStatus());
    at::Tensor buffer = b.buffer;
    return comm::Then(std::move(inner), [future, buffer]() mutable {
      at::Tensor result;
      try {
        result = future->Value();
      } catch (...) {
        return HookFailure("its future's value");
      }
      if (!result.defined() || result.numel() != buffer.numel()) {
        return absl::InvalidArgumentError(
            absl::StrCat("communication hook: its future's value has ",
                         result.defined() ? result.numel() : 0,
                         " elements, the bucket's buffer ", buffer.numel()));
      }
      if (!result.is_same(buffer)) buffer.copy_(result.view_as(buffer));
      return absl::OkStatus();
    });
  };
}

}  // namespace detail

Future Future::completed(at::Tensor value) {
  return Future(std::make_shared<detail::FutureState>(
      nullptr, [value] { return value; }));
}

at::Tensor Future::wait() const {
  if (state_->work) ThrowIfError(state_->work->Wait());
  return state_->Value();
}

Future Future::then(std::function<at::Tensor(at::Tensor)> fn) const {
  auto previous = state_;
  return Future(std::make_shared<detail::FutureState>(
      previous->work,
      [previous, fn = std::move(fn)] { return fn(previous->Value()); }));
}

int ProcessGroup::rank() const { return state_->comm->rank(); }
int ProcessGroup::size() const { return state_->comm->size(); }

Future ProcessGroup::allreduce(at::Tensor tensor) {
  std::shared_ptr<comm::Work> work =
      state_->comm->AllreduceSum(tensor, state_->options);
  return Future(std::make_shared<detail::FutureState>(
      std::move(work), [tensor] { return tensor; }));
}

Future allreduce_hook(GradBucket& bucket) {
  ProcessGroup& group = bucket.process_group();
  return group.allreduce(bucket.buffer().div_(group.size()));
}

}  // namespace concord
