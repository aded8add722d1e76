// Errors about one field of a call's arguments. Core names a field by its own argument names
// (`appends[3]`, `appends[3].codec.rank`); the message starts with that name, which also
// travels in the status as a payload, so that a caller whose own arguments are named
// otherwise (the server's wire paths: `items[2].append`) can write its name in place without
// searching the message.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvq::core {

// The payload's type URL.
inline constexpr char kFieldPayload[] = "kvq.dev/field";

// code, with the message `field` + `rest` (rest starts with its separator: ": why", " must").
absl::Status FieldError(absl::StatusCode code, absl::string_view field, absl::string_view rest);

// The field `st` names ("" when none).
std::string ErrorField(const absl::Status& st);

// `st` with the leading `from` of its field replaced by `to`, in the field and the message
// alike; `st` itself when `from` is not its field or a whole leading part of it.
absl::Status RenameField(const absl::Status& st, absl::string_view from, absl::string_view to);

}  // namespace kvq::core
