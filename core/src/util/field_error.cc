#include "kvq/core/field_error.h"

#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace kvq::core {

absl::Status FieldError(absl::StatusCode code, absl::string_view field, absl::string_view rest) {
  absl::Status st(code, absl::StrCat(field, rest));
  st.SetPayload(kFieldPayload, absl::Cord(field));
  return st;
}

std::string ErrorField(const absl::Status& st) {
  auto f = st.GetPayload(kFieldPayload);  // absl::optional in Debian's Abseil
  return f ? std::string(*f) : std::string();
}

absl::Status RenameField(const absl::Status& st, absl::string_view from, absl::string_view to) {
  const std::string field = ErrorField(st);
  // `from` must be the field or a whole part of it (appends[1] is no part of appends[10]).
  const bool part =
      absl::StartsWith(field, from) &&
      (field.size() == from.size() || field[from.size()] == '.' || field[from.size()] == '[');
  if (!part || !absl::StartsWith(st.message(), field)) return st;
  const std::string renamed = absl::StrCat(to, absl::string_view(field).substr(from.size()));
  return FieldError(st.code(), renamed, st.message().substr(field.size()));
}

}  // namespace kvq::core
