#pragma once
// What the public API's handles hold (include/concord/*.h declare them
// opaque): libconcord's own, never installed.

#include <memory>
#include <mutex>

#include "concord/job.h"
#include "worker/session.h"

namespace concord::detail {

class JobState {
 public:
  JobState(std::unique_ptr<worker::Session> session, Timeouts timeouts)
      : session_(std::move(session)), timeouts_(std::move(timeouts)) {}
  // Finishes the membership when nobody did (Job::finish).
  ~JobState();
  JobState(const JobState&) = delete;
  JobState& operator=(const JobState&) = delete;

  worker::Session& session() const { return *session_; }
  const Timeouts& timeouts() const { return timeouts_; }
  void Finish(bool ok, const std::string& message);

 private:
  std::unique_ptr<worker::Session> session_;
  Timeouts timeouts_;
  std::mutex mu_;
  bool finished_ = false;  // guarded by mu_
};

}  // namespace concord::detail
