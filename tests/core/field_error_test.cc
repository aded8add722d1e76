// Field errors: the field travels beside the message, and renaming it touches only the field.
#include "kvq/core/field_error.h"

#include "gtest/gtest.h"

namespace kvq::core {
namespace {

TEST(FieldError, CarriesItsFieldAndRenamesOnlyThat) {
  const absl::Status st = FieldError(absl::StatusCode::kInvalidArgument, "appends[0]",
                                     ".layer 40 must be in 0..29 (appends[0] is the first)");
  EXPECT_EQ(st.message(), "appends[0].layer 40 must be in 0..29 (appends[0] is the first)");
  EXPECT_EQ(ErrorField(st), "appends[0]");
  const absl::Status wire = RenameField(st, "appends[0]", "items[7].append");
  EXPECT_EQ(wire.code(), absl::StatusCode::kInvalidArgument);
  // The reason keeps its own words, even one that repeats the old name.
  EXPECT_EQ(wire.message(), "items[7].append.layer 40 must be in 0..29 (appends[0] is the first)");
  EXPECT_EQ(ErrorField(wire), "items[7].append");
}

TEST(FieldError, ErrorsWithoutThatFieldStayAsTheyAre) {
  const absl::Status plain = absl::NotFoundError("appends[0]: looks like a field, is not one");
  EXPECT_EQ(ErrorField(plain), "");
  EXPECT_EQ(RenameField(plain, "appends[0]", "items[1].append"), plain);
  const absl::Status other = FieldError(absl::StatusCode::kNotFound, "appends[10]", ": gone");
  EXPECT_EQ(RenameField(other, "appends[1]", "x"), other);  // a prefix, not the field
  EXPECT_EQ(RenameField(absl::OkStatus(), "appends[0]", "x"), absl::OkStatus());
}

}  // namespace
}  // namespace kvq::core
