#pragma once
// concord::Error: what every function of Concord's API throws when it fails
// (LibTorch's convention: exceptions; c10::Error stays LibTorch's own, for
// bad tensors). The code says what kind of failure it is; the codes and
// their numbers are gRPC's and Abseil's status codes (docs/api.md lists
// which functions raise which). Header-only: the same type on both sides of
// libconcord.so.

#include <stdexcept>
#include <string>

namespace concord {

enum class ErrorCode : int {
  kCancelled = 1,
  kUnknown = 2,
  kInvalidArgument = 3,     // a bad option, flag, input or environment value
  kDeadlineExceeded = 4,    // a timeout ran out (join, a collective)
  kNotFound = 5,            // a named thing does not exist
  kAlreadyExists = 6,       // done once already (a comm hook registered)
  kPermissionDenied = 7,    // the coordinator refused the token
  kResourceExhausted = 8,   // the job is full
  kFailedPrecondition = 9,  // the job failed or was stopped; ranks disagree;
                            // a device or backend this machine lacks
  kAborted = 10,            // a collective was given up: the job re-forms
  kOutOfRange = 11,
  kUnimplemented = 12,
  kInternal = 13,     // a bug, or a payload that does not load
  kUnavailable = 14,  // a peer or the coordinator is unreachable
  kDataLoss = 15,     // a state file is corrupt
  kUnauthenticated = 16,
};

// The code's canonical name: "INVALID_ARGUMENT", ...
inline const char* error_code_name(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::kCancelled:
      return "CANCELLED";
    case ErrorCode::kUnknown:
      return "UNKNOWN";
    case ErrorCode::kInvalidArgument:
      return "INVALID_ARGUMENT";
    case ErrorCode::kDeadlineExceeded:
      return "DEADLINE_EXCEEDED";
    case ErrorCode::kNotFound:
      return "NOT_FOUND";
    case ErrorCode::kAlreadyExists:
      return "ALREADY_EXISTS";
    case ErrorCode::kPermissionDenied:
      return "PERMISSION_DENIED";
    case ErrorCode::kResourceExhausted:
      return "RESOURCE_EXHAUSTED";
    case ErrorCode::kFailedPrecondition:
      return "FAILED_PRECONDITION";
    case ErrorCode::kAborted:
      return "ABORTED";
    case ErrorCode::kOutOfRange:
      return "OUT_OF_RANGE";
    case ErrorCode::kUnimplemented:
      return "UNIMPLEMENTED";
    case ErrorCode::kInternal:
      return "INTERNAL";
    case ErrorCode::kUnavailable:
      return "UNAVAILABLE";
    case ErrorCode::kDataLoss:
      return "DATA_LOSS";
    case ErrorCode::kUnauthenticated:
      return "UNAUTHENTICATED";
  }
  return "UNKNOWN";
}

class Error : public std::runtime_error {
 public:
  // what(): "<CODE NAME>: <message>", as Abseil prints a status.
  Error(ErrorCode code, const std::string& message)
      : std::runtime_error(std::string(error_code_name(code)) + ": " + message),
        code_(code),
        message_(message) {}
  ErrorCode code() const noexcept { return code_; }
  // The message without the code.
  const std::string& message() const noexcept { return message_; }
  // A collective failed because a peer died or the generation ended
  // (UNAVAILABLE, ABORTED, DEADLINE_EXCEEDED): an elastic loop re-forms and
  // goes on.
  bool retryable() const noexcept {
    return code_ == ErrorCode::kUnavailable || code_ == ErrorCode::kAborted ||
           code_ == ErrorCode::kDeadlineExceeded;
  }

 private:
  ErrorCode code_;
  std::string message_;
};

}  // namespace concord
