// A model registered without an explicit codec is served with the calibrated one: the entry
// that kvq-calibrate --bits writes (tiny model, a second), registered with the kvq CLI
// (`kvq models register DIR` sends DIR/codec.json), then a sequence of that model created
// without codec settings is stored with the codec codec.json names (its block sizes, bit for
// bit) and the model's defaults are that codec.
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kvq/core/basis.h"
#include "kvq/core/codec_json.h"
#include "kvq/core/store.h"
#include "nlohmann/json.hpp"
#include "tests/frontend/tiny_model.h"
#include "tests/frontend/tool_run.h"
#include "tests/server/test_util.h"

namespace kvq::frontend {
namespace {

namespace fs = std::filesystem;

TEST(CalibratedCodecServe, RegisteredEntryServesItsSequencesWithTheCalibratedCodec) {
  const std::string dir = testing::TempDir("kvq-calibrated-serve");
  TinyOptions o;
  o.byte_tokenizer = true;
  o.output_scale = 0.05f;
  const std::string model = WriteTinyModel(o);
  const std::string text = dir + "/valid.txt";
  {
    std::ofstream t(text);
    for (int i = 0; t.tellp() < 2000; ++i) t << "Validation line " << i << ", words and digits. ";
  }
  const std::string entry = dir + "/entry";
  ToolRun cal = RunTool(KVQ_CALIBRATE_BIN,
                        absl::StrCat("--model ", model, " --text ", text, " --out ", entry,
                                     " --model-name calibrated-tiny --tokens 512 --window-len 256"
                                     " --rank 4 --threads 1 --bits 2.7 --search-windows 2"
                                     " --search-window-len 256"),
                        dir);
  ASSERT_EQ(cal.code, 0) << cal.err;
  std::ifstream cf(entry + "/codec.json");
  const nlohmann::json codec_json = nlohmann::json::parse(cf, nullptr, false);
  ASSERT_TRUE(codec_json.is_object());
  // What core reads from it over the entry's defaults, as the registry does.
  auto basis = core::ReadBasis(entry);
  ASSERT_TRUE(basis.ok()) << basis.status();
  const core::CodecOptions builtin = core::Registry::DefaultCodec(basis->manifest, true);
  core::CodecOptions want = builtin;
  ASSERT_TRUE(core::CodecFromJson(codec_json, "codec.json", &want).ok());
  // The search's choice differs from the built-in default (2-bit G=32 keys with rank 4:
  // 3.34 bits per element, over this budget), so the test tells the two apart.
  ASSERT_NE(core::CodecToJson(want), core::CodecToJson(builtin));

  testing::TestServer server;
  ToolRun reg = RunTool(
      KVQ_CLI_BIN,
      absl::StrCat("models register ", entry, " --server ", server.address(), " --timeout 20s"),
      dir);
  ASSERT_EQ(reg.code, 0) << reg.err;
  auto stub = server.Stub();
  v1::GetModelRequest gm;
  gm.set_model("calibrated-tiny");
  v1::ModelInfo info;
  ASSERT_TRUE(stub->GetModel(testing::Ctx().get(), gm, &info).ok());
  EXPECT_EQ(info.codec().key_bits(), want.key_bits);
  EXPECT_EQ(info.codec().key_group(), want.key_group);
  EXPECT_EQ(info.codec().rank(), want.rank);
  EXPECT_EQ(info.codec().side_bits(), want.side_bits);
  EXPECT_EQ(info.codec().value_bits(), want.value_bits);
  EXPECT_EQ(info.codec().value_group(), want.value_group);

  // A sequence created without codec settings: two whole groups of layer 0 (no fp16 tail
  // with R = 0), so the tenant's bits per element are the codec's block sizes plus its fp16
  // sink rows (16 bits per element of S of the n rows; docs/CODEC.md).
  const int kv = kKv, d = kH / kHeads, n = 2 * want.key_group;
  const std::vector<float> k = testing::RandomKV(kv, n, d, 1), v = testing::RandomKV(kv, n, d, 2);
  v1::PutBlocksRequest m;
  *m.add_appends() = testing::MakeAppend("s", 0, 0, k, v, kv, n, d, "calibrated-tiny");
  v1::PutBlocksResponse put;
  ASSERT_TRUE(testing::Put(*stub, {m}, &put, "t1").ok());
  v1::StatsResponse stats;
  ASSERT_TRUE(stub->Stats(testing::Ctx("t1").get(), {}, &stats).ok());
  EXPECT_EQ(stats.tokens(), n);
  const double sink_bits = 16.0 * want.fp16_sinks / n;
  EXPECT_DOUBLE_EQ(stats.k_bits_per_element(),
                   8.0 * core::KeyBlockBytes(want) / (want.key_group * d) + sink_bits);
  EXPECT_DOUBLE_EQ(stats.v_bits_per_element(),
                   8.0 * core::ValueBlockBytes(want) / (want.key_group * d) + sink_bits);
  fs::remove_all(dir);
  fs::remove(model);
}

}  // namespace
}  // namespace kvq::frontend
