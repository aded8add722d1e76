// Error-propagation macros for absl::Status / absl::StatusOr (Debian's Abseil has no
// status_macros.h). Use only inside functions returning absl::Status or absl::StatusOr.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define KVQ_CONCAT_INNER_(a, b) a##b
#define KVQ_CONCAT_(a, b) KVQ_CONCAT_INNER_(a, b)

#define RETURN_IF_ERROR(expr)                  \
  do {                                         \
    ::absl::Status kvq_status_ = (expr);       \
    if (!kvq_status_.ok()) return kvq_status_; \
  } while (0)

#define ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                           \
  if (!tmp.ok()) return tmp.status();          \
  lhs = std::move(tmp).value()

#define ASSIGN_OR_RETURN(lhs, expr) \
  ASSIGN_OR_RETURN_IMPL_(KVQ_CONCAT_(kvq_statusor_, __LINE__), lhs, expr)
