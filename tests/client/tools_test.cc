// The built kvq and kvq-load binaries against a real kvq server (in-process, port 0): the
// commands, their output, files and exit codes, and kvq-load's JSON report.
#include <sys/wait.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/cli/seq_file.h"
#include "client/load/load_report.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvq/core/basis.h"
#include "nlohmann/json.hpp"
#include "tests/server/test_util.h"

namespace kvq {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

struct ToolRun {
  int code = -1;
  std::string out;  // stdout
  std::string err;  // stderr
};

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

ToolRun Exec(const std::string& bin, const std::string& args) {
  const std::string dir = testing::TempDir("kvq-tools");
  const std::string out = dir + "/out", err = dir + "/err";
  const std::string cmd = absl::StrCat(bin, " ", args, " >", out, " 2>", err, " </dev/null");
  const int st = std::system(cmd.c_str());
  ToolRun r;
  r.code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  r.out = Slurp(out);
  r.err = Slurp(err);
  std::filesystem::remove_all(dir);
  return r;
}

ToolRun Kvq(const std::string& args) { return Exec(KVQ_CLI_BIN, args); }
ToolRun Load(const std::string& args) { return Exec(KVQ_LOAD_BIN, args); }

class ToolsTest : public ::testing::Test {
 protected:
  testing::TestServer server_;
  std::string flags_ = absl::StrCat("--server ", server_.address(), " --timeout 20s");
  std::string dir_ = testing::TempDir("kvq-tools-data");
  void TearDown() override { std::filesystem::remove_all(dir_); }
  // Registers `shape` (basis seed 7) and makes a sequence file of `tokens` random tokens a layer
  // in `dtype` (F32 or F16; layer l's keys seeded seed + l, values seed + 10 + l), naming the
  // model.
  client::SeqFile RegisterWithFile(const testing::Shape& shape, int64_t tokens, v1::DType dtype,
                                   uint32_t seed) {
    v1::RegisterBasisResponse registered;
    EXPECT_TRUE(
        server_.Stub()
            ->RegisterBasis(testing::Ctx().get(), testing::MakeRegister(shape, 7), &registered)
            .ok());
    client::SeqFile f;
    f.metadata["model"] = shape.model;
    auto bytes = [&](const std::vector<float>& x) {
      return dtype == v1::DTYPE_F16
                 ? testing::ToF16Bytes(x)
                 : std::string(reinterpret_cast<const char*>(x.data()), x.size() * 4);
    };
    for (int l = 0; l < shape.layers; ++l) {
      client::SeqLayer L;
      L.dtype = dtype;
      L.kv_heads = shape.kv_heads;
      L.tokens = tokens;
      L.head_dim = shape.head_dim;
      L.keys = bytes(testing::RandomKV(shape.kv_heads, tokens, shape.head_dim, seed + l));
      L.values = bytes(testing::RandomKV(shape.kv_heads, tokens, shape.head_dim, seed + 10 + l));
      f.layers.push_back(L);
    }
    return f;
  }
};

TEST_F(ToolsTest, HelpOnEveryCommand) {
  for (const char* cmd : {"", "health", "stats", "models", "models list", "models show",
                          "models register", "seq", "seq put", "seq get", "seq delete"}) {
    ToolRun r = Kvq(absl::StrCat(cmd, " --help"));
    EXPECT_EQ(r.code, 0) << cmd;
    EXPECT_THAT(r.out, HasSubstr("Usage: kvq")) << cmd;
    EXPECT_THAT(r.out, HasSubstr("--server")) << cmd;
  }
  ToolRun load = Load("--help");
  EXPECT_EQ(load.code, 0);
  EXPECT_THAT(load.out, HasSubstr("--concurrency"));
  EXPECT_THAT(load.out, HasSubstr("--baseline"));
}

TEST_F(ToolsTest, UsageErrorsExitTwo) {
  EXPECT_EQ(Kvq("").code, 2);
  ToolRun bad = Kvq("frobnicate");
  EXPECT_EQ(bad.code, 2);
  EXPECT_THAT(bad.err, HasSubstr("kvq: USAGE: unknown command 'frobnicate'"));
  EXPECT_EQ(Kvq("seq").code, 2);
  EXPECT_EQ(Kvq(absl::StrCat("health --bogus ", flags_)).code, 2);
  EXPECT_EQ(Kvq(absl::StrCat("seq delete ", flags_)).code, 2) << "missing ID";
  EXPECT_EQ(Kvq(absl::StrCat("seq delete a b ", flags_)).code, 2) << "extra argument";
  EXPECT_EQ(Kvq("health --timeout forever").code, 2);
  EXPECT_EQ(Load(absl::StrCat(flags_, " --mix attend,fly")).code, 2);
  EXPECT_EQ(Load(absl::StrCat(flags_, " --q-heads 6 --kv-heads 4")).code, 2);
  EXPECT_EQ(Load("stray").code, 2);
}

TEST_F(ToolsTest, HealthStatsAndUnreachableServers) {
  ToolRun h = Kvq(absl::StrCat("health ", flags_));
  EXPECT_EQ(h.code, 0) << h.err;
  EXPECT_EQ(h.out, absl::StrCat(server_.address(), " SERVING\n"));
  ToolRun s = Kvq(absl::StrCat("stats --json ", flags_));
  EXPECT_EQ(s.code, 0) << s.err;
  auto js = nlohmann::json::parse(s.out);
  EXPECT_EQ(js["tenant"], "default");
  EXPECT_EQ(js["memory_pool"], "host");

  std::string dead;
  {
    testing::TestServer gone;
    dead = gone.address();
  }
  ToolRun d = Kvq(absl::StrCat("health --retries 0 --server ", server_.address(), ",", dead));
  EXPECT_EQ(d.code, 10 + 14) << "UNAVAILABLE is 14";
  EXPECT_THAT(d.out, HasSubstr(absl::StrCat(server_.address(), " SERVING")));
  EXPECT_THAT(d.out, HasSubstr(absl::StrCat(dead, " UNAVAILABLE")));
  EXPECT_THAT(d.err, HasSubstr("kvq: UNAVAILABLE: "));
  // --json over several servers: an array, in --server order.
  testing::TestServer second;
  ToolRun two =
      Kvq(absl::StrCat("stats --json --server ", server_.address(), ",", second.address()));
  ASSERT_EQ(two.code, 0) << two.err;
  auto arr = nlohmann::json::parse(two.out);
  ASSERT_TRUE(arr.is_array());
  EXPECT_EQ(arr.size(), 2u);
  // The environment works as the flags do.
  ToolRun env = Exec(absl::StrCat("KVQ_SERVER=", server_.address(), " ", KVQ_CLI_BIN), "health");
  EXPECT_EQ(env.code, 0) << env.err;
}

TEST_F(ToolsTest, ModelsRegisterListShow) {
  // What kvq-calibrate writes: a registry entry folder.
  testing::Shape shape;
  shape.model = "cli-model";
  core::ModelBasis basis = testing::MakeBasis(shape, 3);
  const std::string entry = dir_ + "/entry";
  ASSERT_TRUE(core::WriteBasis(entry, basis).ok());

  ToolRun reg = Kvq(absl::StrCat("models register ", entry, " ", flags_));
  EXPECT_EQ(reg.code, 0) << reg.err;
  EXPECT_THAT(reg.out, HasSubstr("registered cli-model v1"));
  ToolRun again = Kvq(absl::StrCat("models register ", entry, " ", flags_));
  EXPECT_EQ(again.code, 0);
  EXPECT_THAT(again.out, HasSubstr("already registered"));

  ToolRun list = Kvq(absl::StrCat("models list ", flags_));
  EXPECT_EQ(list.code, 0);
  EXPECT_THAT(list.out, HasSubstr("cli-model"));
  EXPECT_THAT(list.out, HasSubstr(basis.manifest.fingerprint));
  ToolRun show = Kvq(absl::StrCat("models show cli-model ", flags_));
  EXPECT_EQ(show.code, 0);
  auto js = nlohmann::json::parse(show.out);
  EXPECT_EQ(js["layers"], shape.layers);
  EXPECT_EQ(js["basis_rank"], shape.basis_rank);
  EXPECT_EQ(js["has_basis"], true);

  ToolRun missing = Kvq(absl::StrCat("models show nope ", flags_));
  EXPECT_EQ(missing.code, 10 + 5);
  EXPECT_THAT(missing.err, HasSubstr("kvq: NOT_FOUND: "));
  ToolRun nodir = Kvq(absl::StrCat("models register ", dir_, "/absent ", flags_));
  EXPECT_EQ(nodir.code, 1) << "a local file error";
}

TEST_F(ToolsTest, ModelsRegisterTakesModelJsonAndCodecJson) {
  // A model without basis (model.json) with codec defaults (codec.json), as the registry
  // folder holds them.
  const std::string entry = dir_ + "/plain";
  std::filesystem::create_directories(entry);
  std::ofstream(entry + "/model.json")
      << R"({"model": "plain-model", "version": 3, "layers": 4, "kv_heads": 2, "q_heads": 6,
            "head_dim": 32})";
  std::ofstream(entry + "/codec.json") << R"({"key_bits": 4, "key_group": 64, "rank": 0,
                                              "value_bits": 3, "window": 16})";
  ToolRun reg = Kvq(absl::StrCat("models register ", entry, " ", flags_));
  ASSERT_EQ(reg.code, 0) << reg.err;
  ToolRun show = Kvq(absl::StrCat("models show plain-model --version 3 ", flags_));
  ASSERT_EQ(show.code, 0) << show.err;
  auto js = nlohmann::json::parse(show.out);
  EXPECT_EQ(js["has_basis"], false);
  EXPECT_EQ(js["q_heads"], 6);
  EXPECT_EQ(js["codec"]["key_bits"], 4);
  EXPECT_EQ(js["codec"]["key_group"], 64);
  EXPECT_EQ(js["codec"]["value_bits"], 3);
  EXPECT_EQ(js["codec"]["window"], 16);
  EXPECT_EQ(js["codec"]["rank"], 0);

  // The entry the server persisted for it registers again as "already registered".
  std::string persisted;
  for (const auto& e : std::filesystem::recursive_directory_iterator(server_.registry_dir())) {
    if (e.path().filename() == "model.json") persisted = e.path().parent_path().string();
  }
  ASSERT_FALSE(persisted.empty());
  ToolRun again = Kvq(absl::StrCat("models register ", persisted, " ", flags_));
  EXPECT_EQ(again.code, 0) << again.err;
  EXPECT_THAT(again.out, HasSubstr("already registered plain-model v3"));

  std::ofstream(entry + "/codec.json") << "{not json";
  EXPECT_EQ(Kvq(absl::StrCat("models register ", entry, " ", flags_)).code, 1);

  // Mistyped fields and an unknown value policy are local errors naming the field (the CLI
  // used to abort on nlohmann's exception, and to turn any policy but "a2" into uniform).
  std::ofstream(entry + "/codec.json") << R"({"key_bits": "2"})";
  ToolRun typed = Kvq(absl::StrCat("models register ", entry, " ", flags_));
  EXPECT_EQ(typed.code, 1) << typed.err;
  EXPECT_THAT(typed.err, HasSubstr("key_bits"));
  std::ofstream(entry + "/codec.json") << R"({"value_policy": "a3"})";
  ToolRun policy = Kvq(absl::StrCat("models register ", entry, " ", flags_));
  EXPECT_EQ(policy.code, 1) << policy.err;
  EXPECT_THAT(policy.err,
              HasSubstr("field 'value_policy' must be \"uniform\" or \"a2\" (got \"a3\")"));
  std::ofstream(entry + "/codec.json") << "{}";
  std::ofstream(entry + "/model.json") << R"({"model": "plain-model", "layers": 4.5})";
  ToolRun shape = Kvq(absl::StrCat("models register ", entry, " ", flags_));
  EXPECT_EQ(shape.code, 1) << shape.err;
  EXPECT_THAT(shape.err, HasSubstr("layers"));
}

// What kvq-calibrate --variants --query-moment writes (an oblique pair with query moments) and
// a codec.json with the lever switches: the CLI sends all of it, the server keeps all of it.
TEST_F(ToolsTest, ModelsRegisterSendsEncodeBasisQueryMomentsAndCodecSwitches) {
  testing::Shape shape;
  shape.model = "cli-levers";
  core::ModelBasis basis = testing::MakeLeverBasis(shape, 4);
  const std::string entry = dir_ + "/levers";
  ASSERT_TRUE(core::WriteBasis(entry, basis).ok());
  std::ofstream(entry + "/codec.json")
      << R"({"key_bits": 3, "key_group": 128, "rank": 4, "side_bits": 4, "rotate_keys": true,
            "rotate_values": false, "metric_rounding": true})";
  ToolRun reg = Kvq(absl::StrCat("models register ", entry, " ", flags_));
  ASSERT_EQ(reg.code, 0) << reg.err;
  ToolRun show = Kvq(absl::StrCat("models show cli-levers ", flags_));
  ASSERT_EQ(show.code, 0) << show.err;
  auto js = nlohmann::json::parse(show.out);
  EXPECT_EQ(js["oblique"], true);
  EXPECT_EQ(js["has_query_moment"], true);
  EXPECT_EQ(js["fingerprint"], basis.manifest.fingerprint);
  EXPECT_EQ(js["codec"]["rotate_keys"], true);
  EXPECT_EQ(js["codec"]["rotate_values"], false);
  EXPECT_EQ(js["codec"]["metric_rounding"], true);
  EXPECT_EQ(js["codec"]["key_group"], 128);
  // The server's copy holds both tensors.
  absl::StatusOr<core::ModelBasis> kept =
      core::ReadBasis(server_.registry_dir() + "/cli-levers/v1");
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(kept->encode, basis.encode);
  EXPECT_EQ(kept->query_moment, basis.query_moment);

  std::ofstream(entry + "/codec.json") << R"({"rotate_keys": 1})";
  ToolRun typed = Kvq(absl::StrCat("models register ", entry, " ", flags_));
  EXPECT_EQ(typed.code, 1) << typed.err;
  EXPECT_THAT(typed.err, HasSubstr("field 'rotate_keys' is mistyped: must be true or false"));
  // A field that is not a codec setting is refused, never dropped (the server would serve
  // the default in its place under a codec.json that says otherwise).
  std::ofstream(entry + "/codec.json") << R"({"value_metric_rounding": true})";
  ToolRun vmr = Kvq(absl::StrCat("models register ", entry, " ", flags_));
  EXPECT_EQ(vmr.code, 1) << vmr.err;
  EXPECT_THAT(vmr.err, HasSubstr("field 'value_metric_rounding' is not a codec setting"));
}

TEST_F(ToolsTest, SeqPutGetDeleteRoundTrip) {
  testing::Shape shape;
  shape.legacy_codec = true;  // the token counts below are written around 32-token groups
  // A sequence file of 70 tokens in fp32 (the window keeps fp32, so tokens past the last
  // full group come back exactly).
  const client::SeqFile f = RegisterWithFile(shape, 70, v1::DTYPE_F32, 10);
  const std::string in = dir_ + "/in.safetensors", out = dir_ + "/out.safetensors";
  ASSERT_TRUE(client::WriteSeqFile(in, f).ok());

  ToolRun put = Kvq(absl::StrCat("seq put s7 ", in, " --chunk-tokens 32 ", flags_));
  EXPECT_EQ(put.code, 0) << put.err;
  EXPECT_THAT(put.out, HasSubstr("140 tokens written, 0 duplicate"));
  ToolRun reput = Kvq(absl::StrCat("seq put s7 ", in, " ", flags_));
  EXPECT_EQ(reput.code, 0) << reput.err;
  EXPECT_THAT(reput.out, HasSubstr("0 tokens written, 140 duplicate"));

  ToolRun get = Kvq(absl::StrCat("seq get s7 ", out, " --dtype f32 ", flags_));
  EXPECT_EQ(get.code, 0) << get.err;
  auto back = client::ReadSeqFile(out);
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_EQ(back->layers.size(), 2u);
  EXPECT_EQ(back->metadata["sequence_id"], "s7");
  for (int l = 0; l < 2; ++l) {
    const auto& L = back->layers[l];
    EXPECT_EQ(L.tokens, 70);
    EXPECT_EQ(L.kv_heads, shape.kv_heads);
    // Tokens 64..69 are the fp32 window: exact. Earlier ones are codes: close, not equal.
    const float* a = reinterpret_cast<const float*>(f.layers[l].keys.data());
    const float* b = reinterpret_cast<const float*>(L.keys.data());
    for (int h = 0; h < shape.kv_heads; ++h) {
      for (int t = 64; t < 70; ++t) {
        for (int d = 0; d < shape.head_dim; ++d) {
          const size_t i = (static_cast<size_t>(h) * 70 + t) * shape.head_dim + d;
          ASSERT_EQ(a[i], b[i]) << "layer " << l << " head " << h << " token " << t;
        }
      }
    }
    EXPECT_NE(f.layers[l].keys.substr(0, 256), L.keys.substr(0, 256)) << "encoded, not raw";
  }
  // Conflicting re-send: other bytes at the same positions (a key far off, so that its group
  // encodes to other blocks too: a change the codes absorb is a duplicate in codes).
  client::SeqFile other = f;
  const float far = 1000.0f;
  std::memcpy(other.layers[0].keys.data() + sizeof(float), &far, sizeof(float));
  ASSERT_TRUE(client::WriteSeqFile(in, other).ok());
  ToolRun conflict = Kvq(absl::StrCat("seq put s7 ", in, " ", flags_));
  EXPECT_EQ(conflict.code, 10 + 6) << conflict.err;
  EXPECT_THAT(conflict.err, HasSubstr("kvq: ALREADY_EXISTS: "));

  ToolRun del = Kvq(absl::StrCat("seq delete s7 ", flags_));
  EXPECT_EQ(del.code, 0) << del.err;
  EXPECT_THAT(del.out, HasSubstr("deleted"));
  EXPECT_EQ(Kvq(absl::StrCat("seq delete s7 ", flags_)).code, 10 + 5);
  EXPECT_EQ(Kvq(absl::StrCat("seq get s7 ", out, " ", flags_)).code, 10 + 5);

  // With token ids in the file, a second sequence of the same tokens shares the first's
  // groups (two of 32 per layer: 64 tokens each), and `kvq stats` reports the index.
  client::SeqFile with_ids = f;
  for (int t = 0; t < 70; ++t) with_ids.token_ids.push_back(500 + t);
  ASSERT_TRUE(client::WriteSeqFile(in, with_ids).ok());
  auto reread = client::ReadSeqFile(in);
  ASSERT_TRUE(reread.ok()) << reread.status();
  EXPECT_EQ(reread->token_ids, with_ids.token_ids);
  ToolRun first = Kvq(absl::StrCat("seq put p1 ", in, " ", flags_));
  EXPECT_THAT(first.out, HasSubstr("140 tokens written, 0 duplicate, 0 shared")) << first.err;
  ToolRun second = Kvq(absl::StrCat("seq put p2 ", in, " ", flags_));
  EXPECT_THAT(second.out, HasSubstr("12 tokens written, 0 duplicate, 128 shared")) << second.err;
  ToolRun stats = Kvq(absl::StrCat("stats ", flags_));
  EXPECT_THAT(stats.out, HasSubstr("prefix index: 4 groups, "));
  EXPECT_THAT(stats.out, HasSubstr("(0 retained), 128 tokens shared"));
  // A token_ids tensor of the wrong length is refused, naming it.
  std::string bytes;
  {
    std::ifstream fin(in, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(fin), std::istreambuf_iterator<char>());
  }
  const size_t at = bytes.find("\"token_ids\":{\"data_offsets\"");
  ASSERT_NE(at, std::string::npos);
  const size_t dims = bytes.find("[70]", at);
  ASSERT_NE(dims, std::string::npos);
  bytes.replace(dims, 4, "[69]");
  std::ofstream(in, std::ios::binary | std::ios::trunc) << bytes;
  EXPECT_THAT(std::string(client::ReadSeqFile(in).status().message()),
              HasSubstr("token_ids must be U32 [70]"));

  std::ofstream(dir_ + "/junk") << "not safetensors";
  ToolRun junk = Kvq(absl::StrCat("seq put s8 ", dir_, "/junk --model tiny ", flags_));
  EXPECT_EQ(junk.code, 1);
  EXPECT_THAT(junk.err, HasSubstr("not a kvq sequence file"));
}

TEST_F(ToolsTest, LoadRunsAMixAndWritesTheJsonReport) {
  const std::string json = dir_ + "/report.json";
  ToolRun r = Load(absl::StrCat(flags_,
                                " --concurrency 3 --requests 60 --context 80 --layers 2 --q-heads 4"
                                " --kv-heads 2 --head-dim 64 --basis-rank 8"
                                " --mix attend:3,put:1,score:1,readout:1 --baseline noop --json ",
                                json));
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("attend"));
  EXPECT_THAT(r.out, HasSubstr("errors by code: none"));
  EXPECT_THAT(r.err, HasSubstr("kvq-load: done: 60 requests, 60 noop, 0 errors"));
  auto js = nlohmann::json::parse(Slurp(json));
  int64_t total = 0;
  for (const char* m : {"attend", "put", "score", "readout"}) {
    if (!js["methods"].contains(m)) continue;
    const auto& s = js["methods"][m];
    for (const char* k :
         {"requests", "errors", "rps", "gbps", "p50_ms", "p90_ms", "p99_ms", "max_ms"}) {
      EXPECT_TRUE(s.contains(k)) << m << "." << k;
    }
    EXPECT_EQ(s["errors"], 0);
    EXPECT_GT(s["gbps"].get<double>(), 0);
    EXPECT_LE(s["p50_ms"].get<double>(), s["p99_ms"].get<double>());
    EXPECT_LE(s["p99_ms"].get<double>(), s["max_ms"].get<double>());
    total += s["requests"].get<int64_t>();
  }
  EXPECT_EQ(total, 60);
  EXPECT_EQ(js["methods"]["noop"]["requests"], 60);
  EXPECT_TRUE(js["errors_by_code"].empty());
  EXPECT_EQ(js["config"]["concurrency"], 3);
  EXPECT_EQ(js["config"]["context"], 80);
  EXPECT_EQ(js["config"]["baseline"], "noop");
  // The sequences were deleted at the end.
  v1::StatsResponse stats;
  ASSERT_TRUE(server_.Stub()->Stats(testing::Ctx().get(), v1::StatsRequest(), &stats).ok());
  EXPECT_EQ(stats.sequences(), 0);
}

// Sessions after a shared system prompt: each attaches the prompt's whole groups by token ids
// (256 of 300 tokens: two groups of 128, the default codec's G), so the report says 100% of
// what could be attached
// was; the prompt is stored once (prefix bytes do not grow with the sessions); the sessions'
// sequences are gone at the end.
TEST_F(ToolsTest, LoadSessionsAttachTheSharedPrompt) {
  const std::string json = dir_ + "/report.json";
  ToolRun r = Load(absl::StrCat(flags_,
                                " --concurrency 2 --requests 40 --context 40 --layers 2 --q-heads 4"
                                " --kv-heads 2 --head-dim 64 --basis-rank 8 --put-tokens 5"
                                " --mix session:1,attend:1 --shared-prefix 300 --json ",
                                json));
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("session"));
  auto js = nlohmann::json::parse(Slurp(json));
  const int64_t sessions = js["methods"]["session"]["requests"].get<int64_t>();
  ASSERT_GT(sessions, 0);
  EXPECT_EQ(js["config"]["session_prompt_tokens"].get<int64_t>(), sessions * 2 * 300);
  EXPECT_EQ(js["config"]["session_attached_tokens"].get<int64_t>(), sessions * 2 * 256);
  v1::StatsResponse stats;
  ASSERT_TRUE(server_.Stub()->Stats(testing::Ctx().get(), v1::StatsRequest(), &stats).ok());
  EXPECT_EQ(stats.sequences(), 0);
  EXPECT_EQ(stats.prefix_blocks(), 2 * 2);  // the prompt's groups, once (retained now)
  EXPECT_EQ(stats.shared_tokens(), sessions * 2 * 256 + 2 * 256);  // + the second stream's prompt
  // The two go together.
  ToolRun bad = Load(absl::StrCat(flags_, " --mix session --requests 1"));
  EXPECT_EQ(bad.code, 2);
  EXPECT_THAT(bad.err, HasSubstr("--shared-prefix"));
}

// GetBlocks as a load method, with stalled readers beside it: every get returns the whole
// layer (its bytes in the report), and each stalled stream got its first message and ended.
TEST_F(ToolsTest, LoadGetsBlocksBesideStalledReaders) {
  const std::string json = dir_ + "/report.json";
  ToolRun r =
      Load(absl::StrCat(flags_,
                        " --concurrency 2 --duration 1s --context 100 --layers 2 --q-heads 4"
                        " --kv-heads 2 --head-dim 64 --basis-rank 8 --mix get:1,attend:1"
                        " --stalled-readers 3 --progress 0 --json ",
                        json));
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("3 of 3 stalled readers got their first message"));
  auto js = nlohmann::json::parse(Slurp(json));
  const auto& get = js["methods"]["get"];
  ASSERT_GT(get["requests"].get<int64_t>(), 0);
  EXPECT_EQ(get["errors"].get<int64_t>(), 0);
  // 100 tokens x 2 KV heads x 64 x 2 tensors at fp16 at least, per get.
  EXPECT_GT(get["gbps"].get<double>() * 1e9 / get["rps"].get<double>(), 100 * 2 * 64 * 2 * 2);
}

// Three servers: sessions carry their stream's hash tag, so each lands where its prompt is and
// still attaches every whole group.
// `kvq seq put/get` send and fetch codes by default: encoded in the CLI, the same sequence as a
// `--rows` put, bit for bit, for fewer bytes each way; decoded in the CLI, the same file as a
// `--rows` get.
TEST_F(ToolsTest, SeqPutGetInCodesEqualRowsForFewerBytes) {
  testing::Shape shape;
  shape.legacy_codec = true;
  const client::SeqFile f = RegisterWithFile(shape, 300, v1::DTYPE_F16, 30);
  const std::string in = dir_ + "/codes.safetensors";
  ASSERT_TRUE(client::WriteSeqFile(in, f).ok());
  ToolRun rows = Kvq(absl::StrCat("seq put r ", in, " --rows ", flags_));
  EXPECT_THAT(rows.out, HasSubstr("sent as rows"));
  ASSERT_EQ(rows.code, 0) << rows.err;
  ToolRun codes = Kvq(absl::StrCat("seq put c ", in, " --chunk-tokens 128 ", flags_));
  ASSERT_EQ(codes.code, 0) << codes.err;
  EXPECT_THAT(codes.out, HasSubstr("600 tokens written, 0 duplicate"));
  EXPECT_THAT(codes.out, HasSubstr("sent as codes"));
  ToolRun again = Kvq(absl::StrCat("seq put c ", in, " ", flags_));
  EXPECT_THAT(again.out, HasSubstr("0 tokens written, 600 duplicate")) << again.err;
  // Sent bytes: the numbers before " bytes sent".
  auto bytes_of = [](const std::string& out, const char* what) {
    const size_t at = out.find(what);
    size_t from = out.rfind(", ", at);
    return std::stoll(out.substr(from + 2, at - from - 2));
  };
  EXPECT_LT(bytes_of(codes.out, " bytes sent"), 0.35 * bytes_of(rows.out, " bytes sent"));
  const std::string out_rows = dir_ + "/r.safetensors", out_codes = dir_ + "/c.safetensors",
                    out_codes_of_rows = dir_ + "/rc.safetensors";
  ToolRun get_rows = Kvq(absl::StrCat("seq get r ", out_rows, " --rows ", flags_));
  EXPECT_THAT(get_rows.out, HasSubstr("received as rows"));
  ASSERT_EQ(get_rows.code, 0) << get_rows.err;
  ToolRun get_codes = Kvq(absl::StrCat("seq get c ", out_codes, " ", flags_));
  EXPECT_THAT(get_codes.out, HasSubstr("received as codes"));
  ASSERT_EQ(get_codes.code, 0) << get_codes.err;
  ToolRun get_rc = Kvq(absl::StrCat("seq get r ", out_codes_of_rows, " ", flags_));
  ASSERT_EQ(get_rc.code, 0) << get_rc.err;
  EXPECT_LT(bytes_of(get_codes.out, " bytes received"),
            0.35 * bytes_of(get_rows.out, " bytes received"));
  auto a = client::ReadSeqFile(out_rows), b = client::ReadSeqFile(out_codes),
       c = client::ReadSeqFile(out_codes_of_rows);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  for (int l = 0; l < shape.layers; ++l) {
    EXPECT_EQ(a->layers[l].keys, b->layers[l].keys) << l;
    EXPECT_EQ(a->layers[l].values, b->layers[l].values) << l;
    EXPECT_EQ(a->layers[l].keys, c->layers[l].keys) << l;
    EXPECT_EQ(a->layers[l].values, c->layers[l].values) << l;
  }
}

TEST(ToolsShards, LoadSessionsFindTheirPromptOnEveryShard) {
  testing::TestServer a, b, c;
  const std::string dir = testing::TempDir("kvq-tools-shards");
  const std::string json = dir + "/report.json";
  ToolRun r = Load(absl::StrCat("--server ", a.address(), ",", b.address(), ",", c.address(),
                                " --timeout 20s --concurrency 4 --requests 40 --context 40"
                                " --layers 2 --q-heads 4 --kv-heads 2 --head-dim 64"
                                " --basis-rank 8 --mix session --shared-prefix 256 --json ",
                                json));
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  auto js = nlohmann::json::parse(Slurp(json));
  EXPECT_EQ(js["config"]["session_attached_tokens"], js["config"]["session_prompt_tokens"]);
  EXPECT_EQ(js["config"]["session_prompt_tokens"].get<int64_t>(), 40 * 2 * 256);
  std::filesystem::remove_all(dir);
}

TEST_F(ToolsTest, LoadStopsByItselfAndReportsErrors) {
  // A duration run ends on its own; the progress line goes to stderr.
  ToolRun timed = Load(absl::StrCat(flags_,
                                    " --concurrency 2 --duration 1s --context 40 --layers 1"
                                    " --q-heads 2 --kv-heads 1 --head-dim 32 --basis-rank 0"));
  EXPECT_EQ(timed.code, 0) << timed.err;
  EXPECT_THAT(timed.err, HasSubstr("kvq-load: done: "));
  // An unknown model fails the setup (exit 3); an unreachable server too.
  ToolRun nomodel = Load(absl::StrCat(flags_, " --model absent --requests 5"));
  EXPECT_EQ(nomodel.code, 3);
  EXPECT_THAT(nomodel.err, HasSubstr("NOT_FOUND"));
  ToolRun noserver = Load("--server 127.0.0.1:1 --retries 0 --requests 5");
  EXPECT_EQ(noserver.code, 3);
  EXPECT_THAT(noserver.err, HasSubstr("UNAVAILABLE"));
}

TEST_F(ToolsTest, LoadStopsOnSigintWithAReport) {
  // A long run, interrupted once its progress line shows it measuring: it stops, prints what
  // ran, deletes its sequences and exits 130.
  const std::string err = dir_ + "/err", out = dir_ + "/out";
  const std::string script = absl::StrCat(
      KVQ_LOAD_BIN, " ", flags_,
      " --duration 300s --concurrency 2 --context 32 --layers 1 --q-heads 2 --kv-heads 1"
      " --head-dim 32 --progress 100ms >",
      out, " 2>", err, " & pid=$!; for i in $(seq 1 600); do grep -q s/300s ", err,
      " 2>/dev/null && break; sleep 0.1; done; kill -INT $pid; wait $pid; exit $?");
  const int st = std::system(absl::StrCat("bash -c '", script, "'").c_str());
  ASSERT_TRUE(WIFEXITED(st));
  EXPECT_EQ(WEXITSTATUS(st), 130) << Slurp(err);
  EXPECT_THAT(Slurp(err), HasSubstr("(interrupted)"));
  EXPECT_THAT(Slurp(out), HasSubstr("attend"));
  v1::StatsResponse stats;
  ASSERT_TRUE(server_.Stub()->Stats(testing::Ctx().get(), v1::StatsRequest(), &stats).ok());
  EXPECT_EQ(stats.sequences(), 0);
}

TEST_F(ToolsTest, LoadShardsOverSeveralServers) {
  testing::TestServer second;
  const std::string both = absl::StrCat(server_.address(), ",", second.address());
  ToolRun r = Load(absl::StrCat("--server ", both,
                                " --concurrency 4 --batch 3 --requests 40 --context 40"
                                " --layers 2 --q-heads 4 --kv-heads 2 --head-dim 32"
                                " --mix attend,put --baseline noop --keep --progress 0"
                                " --run-id shardtest"));
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  // 12 sequences over two servers (fixed names, so a fixed placement): both hold some, and
  // together all of them.
  int64_t total = 0;
  for (testing::TestServer* s : {&server_, &second}) {
    v1::StatsResponse st;
    ASSERT_TRUE(s->Stub()->Stats(testing::Ctx().get(), v1::StatsRequest(), &st).ok());
    EXPECT_GT(st.sequences(), 0) << s->address();
    total += st.sequences();
  }
  EXPECT_EQ(total, 12);
}

TEST_F(ToolsTest, LoadOpenLoopAtARate) {
  const std::string json = dir_ + "/open.json";
  ToolRun r = Load(absl::StrCat(flags_,
                                " --concurrency 2 --requests 30 --rate 300 --context 40"
                                " --layers 1 --q-heads 2 --kv-heads 1 --head-dim 32"
                                " --mix score,readout --progress 0 --json ",
                                json));
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("open loop 300 req/s"));
  auto js = nlohmann::json::parse(Slurp(json));
  EXPECT_EQ(js["config"]["closed_loop"], false);
  EXPECT_EQ(js["config"]["rate"], 300.0);
  int64_t total = 0;
  for (auto& [name, m] : js["methods"].items()) total += m["requests"].get<int64_t>();
  EXPECT_EQ(total, 30);
  EXPECT_FALSE(js["methods"].contains("noop")) << "no baseline asked";
  EXPECT_EQ(r.err, "") << "--progress 0 silences stderr";
}

TEST(LoadReport, PercentilesAndJsonShape) {
  load::MethodStats s;
  for (int i = 1; i <= 200; ++i) s.latency_s.push_back(i * 1e-3);
  s.requests = 200;
  s.bytes = 2'000'000'000;
  s.errors = 2;
  s.errors_by_code["UNAVAILABLE"] = 2;
  EXPECT_DOUBLE_EQ(load::Percentile(s.latency_s, 50), 0.100);
  EXPECT_DOUBLE_EQ(load::Percentile(s.latency_s, 99), 0.198);
  EXPECT_DOUBLE_EQ(load::Percentile(s.latency_s, 100), 0.200);
  EXPECT_DOUBLE_EQ(load::Percentile({}, 50), 0);
  auto js = load::ReportJson({{"attend", s}}, 2.0, {{"concurrency", 1}});
  EXPECT_DOUBLE_EQ(js["methods"]["attend"]["rps"].get<double>(), 100);
  EXPECT_DOUBLE_EQ(js["methods"]["attend"]["gbps"].get<double>(), 1.0);
  EXPECT_DOUBLE_EQ(js["methods"]["attend"]["p90_ms"].get<double>(), 180);
  EXPECT_EQ(js["errors_by_code"]["UNAVAILABLE"], 2);
  EXPECT_EQ(js["config"]["concurrency"], 1);
  EXPECT_THAT(load::ReportText({{"attend", s}}, 2.0), HasSubstr("UNAVAILABLE=2"));
}

}  // namespace
}  // namespace kvq
