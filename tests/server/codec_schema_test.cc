// Core's codec table (kvq/core/codec_schema.h) is the one description of the codec's settings:
// the wire's CodecSettings (its descriptor) and the Python client's CodecSettings dataclass
// (client/python/src/kvq/types.py, read as text from the repository root: this test's working
// directory) must name the same fields, with the same numbers, types and presence, in the
// same order.
#include "kvq/core/codec_schema.h"

#include <gtest/gtest.h>

#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "kvq/core/codec_json.h"
#include "kvq/v1/kvq.pb.h"

namespace kvq::testing {
namespace {

using google::protobuf::FieldDescriptor;

TEST(CodecSchema, TheWireDescriptorIsTheTable) {
  const google::protobuf::Descriptor* d = v1::CodecSettings::descriptor();
  ASSERT_EQ(static_cast<size_t>(d->field_count()), core::CodecFields().size());
  int i = 0;
  for (const core::CodecField& f : core::CodecFields()) {
    SCOPED_TRACE(std::string(f.name));
    const FieldDescriptor* w = d->field(i++);
    EXPECT_EQ(w->name(), std::string(f.name));
    EXPECT_EQ(w->number(), f.wire_number);
    EXPECT_TRUE(w->has_presence()) << "every setting must distinguish unset from 0";
    const FieldDescriptor::CppType want =
        f.type == core::CodecFieldType::kInt     ? FieldDescriptor::CPPTYPE_INT32
        : f.type == core::CodecFieldType::kFloat ? FieldDescriptor::CPPTYPE_FLOAT
        : f.type == core::CodecFieldType::kBool  ? FieldDescriptor::CPPTYPE_BOOL
                                                 : FieldDescriptor::CPPTYPE_ENUM;
    EXPECT_EQ(w->cpp_type(), want);
    EXPECT_EQ(core::FindCodecField(f.name), &f);
  }
}

TEST(CodecSchema, CodecJsonNamesEveryFieldOfTheTable) {
  core::CodecOptions all;
  all.sparse_keys = all.sparse_values = 1;  // written only when set
  const nlohmann::json j = core::CodecToJson(all);
  EXPECT_EQ(j.size(), core::CodecFields().size());
  for (const core::CodecField& f : core::CodecFields())
    EXPECT_TRUE(j.contains(std::string(f.name))) << f.name;
  // Read back over other defaults: the same codec.
  core::CodecOptions back;
  back.key_bits = 8;
  back.rotate_keys = true;
  ASSERT_TRUE(core::CodecFromJson(j, "codec.json", &back).ok());
  EXPECT_EQ(core::CodecToJson(back), j);
}

TEST(CodecSchema, ValidateChecksEveryRangeOfTheTable) {
  for (const core::CodecField& f : core::CodecFields()) {
    if (f.type == core::CodecFieldType::kBool || f.type == core::CodecFieldType::kValuePolicy)
      continue;
    SCOPED_TRACE(std::string(f.name));
    core::CodecOptions o;
    o.rank = 4;                               // side_bits applies
    o.value_policy = core::ValuePolicy::kA2;  // value_budget applies
    ASSERT_TRUE(o.Validate().ok()) << o.Validate();
    core::SetCodecField(f, -7, &o);
    const absl::Status st = o.Validate();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(st.message()).find(std::string("codec.") + std::string(f.name) + " = -7"),
              std::string::npos)
        << st;
  }
}

// The dataclass's fields as `name: type = default` lines of `class CodecSettings:`.
std::vector<std::pair<std::string, std::string>> PythonFields() {
  std::ifstream in("client/python/src/kvq/types.py");
  std::vector<std::pair<std::string, std::string>> out;
  if (!in) return out;
  std::string line;
  bool inside = false;
  const std::regex field(R"(^    ([a-z_0-9]+): ([^=]+?) = (.+)$)");
  while (std::getline(in, line)) {
    if (line.rfind("class CodecSettings", 0) == 0) {
      inside = true;
      continue;
    }
    if (inside && !line.empty() && line[0] != ' ' && line[0] != '#') break;  // next top level
    std::smatch m;
    if (inside && std::regex_match(line, m, field)) out.emplace_back(m[1], m[2]);
  }
  return out;
}

TEST(CodecSchema, ThePythonCodecSettingsIsTheTable) {
  const auto fields = PythonFields();
  ASSERT_FALSE(fields.empty())
      << "no CodecSettings fields read from client/python/src/kvq/types.py (run from the "
         "repository root)";
  ASSERT_EQ(fields.size(), core::CodecFields().size());
  size_t i = 0;
  for (const core::CodecField& f : core::CodecFields()) {
    const auto& [name, type] = fields[i++];
    EXPECT_EQ(name, std::string(f.name));
    const std::string want = f.type == core::CodecFieldType::kInt     ? "Optional[int]"
                             : f.type == core::CodecFieldType::kFloat ? "Optional[float]"
                             : f.type == core::CodecFieldType::kBool  ? "Optional[bool]"
                                                                      : "Optional[str]";
    EXPECT_EQ(type, want) << name << ": unset must be None, distinct from 0";
  }
}

}  // namespace
}  // namespace kvq::testing
