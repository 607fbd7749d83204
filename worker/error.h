#pragma once
// The exception that carries a Concord status out of code that cannot return
// one: autograd hooks and callbacks (they run inside `loss.backward()`) and
// the convenience wrappers of the training API.

#include <stdexcept>

#include "absl/status/status.h"

namespace concord {

class Error : public std::runtime_error {
 public:
  explicit Error(absl::Status status)
      : std::runtime_error(status.ToString()), status_(std::move(status)) {}
  const absl::Status& status() const { return status_; }

 private:
  absl::Status status_;
};

inline void ThrowIfError(absl::Status status) {
  if (!status.ok()) throw Error(std::move(status));
}

}  // namespace concord
