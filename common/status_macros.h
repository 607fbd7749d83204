#pragma once
// Abseil 20220623 has no status macros; these are the project's.

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define CONCORD_STATUS_CONCAT_INNER_(a, b) a##b
#define CONCORD_STATUS_CONCAT_(a, b) CONCORD_STATUS_CONCAT_INNER_(a, b)

// Returns from the enclosing function when `expr` (an absl::Status) is not OK.
#define CONCORD_RETURN_IF_ERROR(expr)                  \
  do {                                                 \
    ::absl::Status concord_status_ = (expr);           \
    if (!concord_status_.ok()) return concord_status_; \
  } while (false)

// `lhs` = value of `rexpr` (an absl::StatusOr<T>), or returns its status.
#define CONCORD_ASSIGN_OR_RETURN(lhs, rexpr) \
  CONCORD_ASSIGN_OR_RETURN_IMPL_(            \
      CONCORD_STATUS_CONCAT_(concord_statusor_, __LINE__), lhs, rexpr)

#define CONCORD_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                   \
  if (!statusor.ok()) return statusor.status();              \
  lhs = std::move(statusor).value()
