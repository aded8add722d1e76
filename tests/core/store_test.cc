// core::Store and core::Registry without gRPC: TTL, LRU order, scrub, registry files, races.
#include "kvq/core/store.h"

#include <malloc.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvq::core {
namespace {

namespace fs = std::filesystem;

ModelEntry Entry(const std::string& name, int version, uint64_t seed, int rank = 8) {
  BasisManifest m;
  m.model = name;
  m.version = version;
  m.layers = 2;
  m.kv_heads = 2;
  m.q_heads = 4;
  m.head_dim = 64;
  m.rank = rank;
  m.kind = "random";
  ModelEntry e;
  e.manifest = m;
  e.has_basis = rank > 0;
  if (e.has_basis) e.basis = RandomBasis(m, seed);
  e.codec = Registry::DefaultCodec(m, e.has_basis);
  return e;
}

std::string TempDir() {
  std::string t = "/tmp/kvq-store-XXXXXX";
  return mkdtemp(t.data());
}

struct Data {
  std::vector<float> k, v;
  TensorView kt, vt;
  Data(int64_t n, uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd;
    k.resize(2 * n * 64);
    v.resize(2 * n * 64);
    for (auto& x : k) x = nd(rng);
    for (auto& x : v) x = nd(rng);
    kt = TensorView::Contiguous(k.data(), DType::kF32, {2, n, 64});
    vt = TensorView::Contiguous(v.data(), DType::kF32, {2, n, 64});
  }
};

AppendSpec Spec(const std::string& id, int layer, int64_t start, const Data& d,
                const std::string& model = "m") {
  AppendSpec s;
  s.sequence_id = id;
  s.layer = layer;
  s.start = start;
  s.keys = d.kt;
  s.values = d.vt;
  s.model = model;
  return s;
}

TEST(RegistryTest, PersistsAtomicallyAndReloadsSkippingBrokenEntries) {
  const std::string dir = TempDir();
  {
    Registry r(dir);
    ASSERT_TRUE(r.LoadAll(nullptr, nullptr).ok());
    bool already = true;
    auto e = r.Register(Entry("m", 1, 1), &already);
    ASSERT_TRUE(e.ok()) << e.status();
    EXPECT_FALSE(already);
    EXPECT_FALSE((*e)->manifest.fingerprint.empty());
    ASSERT_TRUE(r.Register(Entry("m", 1, 1), &already).ok());
    EXPECT_TRUE(already);
    EXPECT_EQ(r.Register(Entry("m", 1, 2), &already).status().code(),
              absl::StatusCode::kAlreadyExists);
    ASSERT_TRUE(r.Register(Entry("m", 2, 2), nullptr).ok());
    ASSERT_TRUE(r.Register(Entry("plain", 1, 0, /*rank=*/0), nullptr).ok());
    EXPECT_EQ((*r.Get("m", 0))->manifest.version, 2);
    EXPECT_EQ(r.Get("m", 3).status().code(), absl::StatusCode::kNotFound);
  }
  // No temporary folders are left; a broken entry and an interrupted one are skipped.
  for (const auto& p : fs::directory_iterator(dir)) {
    EXPECT_NE(p.path().filename().string()[0], '.') << p.path();
  }
  fs::create_directories(dir + "/broken/v1");
  std::ofstream(dir + "/broken/v1/manifest.json") << "{not json";
  fs::create_directories(dir + "/.tmp-x-v1-1");
  std::ofstream(dir + "/.tmp-x-v1-1/model.json") << "{}";
  Registry again(dir);
  std::vector<std::string> loaded, skipped;
  ASSERT_TRUE(again.LoadAll(&loaded, &skipped).ok());
  EXPECT_THAT(loaded, ::testing::UnorderedElementsAre("m v1", "m v2", "plain v1"));
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_THAT(skipped[0], ::testing::HasSubstr("broken"));
  // A folder name's bytes are escaped in its skip line: a newline cannot split the log line.
  fs::create_directories(dir + "/bad\nname\x01");
  std::vector<std::string> loaded2, skipped2;
  ASSERT_TRUE(Registry(dir).LoadAll(&loaded2, &skipped2).ok());
  ASSERT_EQ(skipped2.size(), 2u);
  const std::string& odd = skipped2[0].find("bad") != std::string::npos ? skipped2[0] : skipped2[1];
  EXPECT_EQ(odd, dir +
                     "/bad\\nname\\x01: not a model folder (names are 1..128 characters of "
                     "[A-Za-z0-9._-])");
  fs::remove_all(dir + "/bad\nname\x01");
  auto plain = again.Get("plain", 1);
  ASSERT_TRUE(plain.ok());
  EXPECT_FALSE((*plain)->has_basis);
  EXPECT_EQ((*plain)->codec.rank, 0);
  EXPECT_EQ((*again.Get("m", 1))->basis.u, Entry("m", 1, 1).basis.u);
  fs::remove_all(dir);
}

TEST(RegistryTest, RejectsBadEntriesNamingTheField) {
  Registry r("");
  ModelEntry e = Entry("m", 1, 1);
  e.basis.u[3] += 0.5f;  // no longer orthonormal
  auto st = r.Register(e, nullptr).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr("orthonormal"));
  e = Entry("bad name!", 1, 1);
  EXPECT_THAT(std::string(r.Register(e, nullptr).status().message()),
              ::testing::HasSubstr("[A-Za-z0-9._-]"));
  e = Entry("m", 1, 1);
  e.manifest.q_heads = 3;
  EXPECT_THAT(std::string(r.Register(e, nullptr).status().message()),
              ::testing::HasSubstr("q_heads 3 must be a multiple of kv_heads 2"));
}

// The reason LoadAll gave for skipping the folder ending in `suffix` ("" when not skipped).
std::string SkipReason(const std::vector<std::string>& skipped, const std::string& suffix) {
  for (const std::string& s : skipped) {
    if (s.find(suffix + ": ") != std::string::npos) return s;
  }
  return "";
}

TEST(RegistryTest, MistypedGarbageAndMisplacedEntriesAreSkippedNamingTheField) {
  const std::string dir = TempDir();
  {
    Registry r(dir);
    ASSERT_TRUE(r.LoadAll(nullptr, nullptr).ok());
    ASSERT_TRUE(r.Register(Entry("m", 1, 1), nullptr).ok());
    ASSERT_TRUE(r.Register(Entry("plain", 1, 0, /*rank=*/0), nullptr).ok());
  }
  auto write = [&](const std::string& path, const std::string& text) {
    fs::create_directories(fs::path(dir + path).parent_path());
    std::ofstream(dir + path) << text;
  };
  const std::string model_json =
      R"({"model": "%s", "version": %s, "layers": 2, "kv_heads": 2, "q_heads": 4, )"
      R"("head_dim": 64})";
  auto model = [&](const std::string& name, const std::string& version) {
    std::string s = model_json;
    s.replace(s.find("%s"), 2, name);
    s.replace(s.find("%s"), 2, version);
    return s;
  };
  write("/typed/v1/model.json", model("typed", "1"));
  write("/typed/v1/codec.json", R"({"key_bits": "2"})");
  write("/layers/v1/model.json", R"({"model": "layers", "version": 1, "layers": "2"})");
  write("/frac/v1/model.json", model("frac", "1.5"));
  write("/huge/v1/model.json", model("huge", "99999999999"));
  write("/cut/v1/model.json", R"({"model": "cut", "vers)");
  write("/garbage/v1/manifest.json", "\x01\x02 not json at all");
  write("/mani/v1/manifest.json",
        R"({"format": "kvq-basis", "model": "mani", "version": 1, "layers": 2.5, "kv_heads": 2, )"
        R"("q_heads": 4, "head_dim": 64, "rank": 8, "rope_layout": "halves", "fingerprint": ""})");
  write("/policy/v1/model.json", model("policy", "1"));
  write("/policy/v1/codec.json", R"({"value_policy": "fast"})");
  write("/rope/v1/model.json",
        R"({"model": "rope", "version": 1, "layers": 2, "kv_heads": 2, "q_heads": 4, )"
        R"("head_dim": 64, "rope_layout": "spiral"})");
  // An impostor: its manifest claims to be plain v1 (it sorts first, so it used to win).
  write("/aaa/v1/model.json", R"({"model": "plain", "version": 1, "layers": 5, "kv_heads": 2, )"
                              R"("q_heads": 4, "head_dim": 64})");
  write("/plain/v2/model.json", model("plain", "3"));  // its folder says v2
  write("/m/v7/codec.json", "{}");                     // an entry without manifest
  write("/m/latest/model.json", model("m", "8"));      // not a version folder
  write("/m/v1/extra/model.json", model("m", "9"));    // deeper than an entry

  Registry again(dir);
  std::vector<std::string> loaded, skipped;
  ASSERT_TRUE(again.LoadAll(&loaded, &skipped).ok());
  EXPECT_THAT(loaded, ::testing::UnorderedElementsAre("m v1", "plain v1"));
  const std::vector<std::pair<std::string, std::string>> reasons = {
      {"typed/v1", "codec.json: field 'key_bits'"},
      {"layers/v1", "'layers'"},
      {"frac/v1", "'version'"},
      {"huge/v1", "'version'"},
      {"cut/v1", "not a JSON object"},
      {"garbage/v1", "not a JSON object"},
      {"mani/v1", "manifest.json: field 'layers' is mistyped: must be a 32-bit integer"},
      {"policy/v1", "'value_policy'"},
      {"rope/v1", "rope_layout"},
      {"aaa/v1", "names model 'plain'"},
      {"plain/v2", "version 3"},
      {"m/v7", "neither manifest.json"},
      {"m/latest", "not a version folder"},
  };
  for (const auto& [folder, why] : reasons) {
    EXPECT_THAT(SkipReason(skipped, folder), ::testing::HasSubstr(why)) << folder;
  }
  EXPECT_EQ(skipped.size(), 13u) << ::testing::PrintToString(skipped);
  // The real plain v1 is served, not the impostor.
  auto plain = again.Get("plain", 0);
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ((*plain)->manifest.version, 1);
  EXPECT_EQ((*plain)->manifest.layers, 2);
  fs::remove_all(dir);
}

// The codec levers (rotation, metric rounding) live in codec.json like every other setting:
// written by Persist, read back by LoadAll, absent = off, a mistyped one skips the entry
// naming the field.
TEST(RegistryTest, CodecJsonCarriesRotationAndMetricRounding) {
  const std::string dir = TempDir();
  {
    Registry r(dir);
    ASSERT_TRUE(r.LoadAll(nullptr, nullptr).ok());
    ModelEntry e = Entry("rot", 1, 1);
    e.codec.rotate_keys = true;
    e.codec.rotate_values = true;
    e.basis.query_moment.assign(2 * 2 * 64 * 64, 0.0f);  // metric rounding needs a moment
    for (int h = 0; h < 4; ++h)
      for (int a = 0; a < 64; ++a) e.basis.query_moment[(h * 64 + a) * 64 + a] = 1.0f;
    e.codec.metric_rounding = true;
    ASSERT_TRUE(r.Register(e, nullptr).ok());
  }
  auto write = [&](const std::string& path, const std::string& text) {
    fs::create_directories(fs::path(dir + path).parent_path());
    std::ofstream(dir + path) << text;
  };
  const std::string model = R"({"model": "%s", "version": 1, "layers": 2, "kv_heads": 2, )"
                            R"("q_heads": 4, "head_dim": 64})";
  auto named = [&](const std::string& name) {
    std::string s = model;
    return s.replace(s.find("%s"), 2, name);
  };
  write("/rotv/v1/model.json", named("rotv"));
  write("/rotv/v1/codec.json", R"({"rotate_values": true})");
  write("/rotnum/v1/model.json", named("rotnum"));
  write("/rotnum/v1/codec.json", R"({"rotate_keys": 1})");
  write("/mrstr/v1/model.json", named("mrstr"));
  write("/mrstr/v1/codec.json", R"({"metric_rounding": "yes"})");
  write("/mrnone/v1/model.json", named("mrnone"));  // no basis, so no query moment
  write("/mrnone/v1/codec.json", R"({"metric_rounding": true})");
  Registry again(dir);
  std::vector<std::string> loaded, skipped;
  ASSERT_TRUE(again.LoadAll(&loaded, &skipped).ok());
  EXPECT_THAT(loaded, ::testing::UnorderedElementsAre("rot v1", "rotv v1"));
  EXPECT_THAT(SkipReason(skipped, "rotnum/v1"),
              ::testing::HasSubstr("field 'rotate_keys' is mistyped: must be true or false"));
  EXPECT_THAT(SkipReason(skipped, "mrstr/v1"), ::testing::HasSubstr("'metric_rounding'"));
  EXPECT_THAT(SkipReason(skipped, "mrnone/v1"), ::testing::HasSubstr("metric_rounding"));
  auto rot = again.Get("rot", 1);
  ASSERT_TRUE(rot.ok());
  EXPECT_TRUE((*rot)->codec.rotate_keys);
  EXPECT_TRUE((*rot)->codec.rotate_values);
  EXPECT_TRUE((*rot)->codec.metric_rounding);
  EXPECT_FALSE((*rot)->basis.query_moment.empty());
  auto rotv = again.Get("rotv", 1);
  ASSERT_TRUE(rotv.ok());
  EXPECT_FALSE((*rotv)->codec.rotate_keys);  // absent: off
  EXPECT_TRUE((*rotv)->codec.rotate_values);
  EXPECT_FALSE((*rotv)->codec.metric_rounding);
  fs::remove_all(dir);
}

// codec.json holds codec settings only: a field that is not one (a typo, or
// value_metric_rounding, an evaluation experiment and no setting) skips the entry naming it,
// rather than serving the entry with the default in its place.
TEST(RegistryTest, CodecJsonRefusesFieldsThatAreNotSettings) {
  const std::string dir = TempDir();
  {
    Registry r(dir);
    ASSERT_TRUE(r.LoadAll(nullptr, nullptr).ok());
    ASSERT_TRUE(r.Register(Entry("plain", 1, 2), nullptr).ok());
  }
  auto write = [&](const std::string& path, const std::string& text) {
    fs::create_directories(fs::path(dir + path).parent_path());
    std::ofstream(dir + path) << text;
  };
  const std::string model = R"({"model": "%s", "version": 1, "layers": 2, "kv_heads": 2, )"
                            R"("q_heads": 4, "head_dim": 64})";
  auto named = [&](const std::string& name) {
    std::string s = model;
    return s.replace(s.find("%s"), 2, name);
  };
  write("/vmr/v1/model.json", named("vmr"));
  write("/vmr/v1/codec.json", R"({"key_bits": 3, "value_metric_rounding": true})");
  write("/typo/v1/model.json", named("typo"));
  write("/typo/v1/codec.json", R"({"key_bit": 3})");
  Registry again(dir);
  std::vector<std::string> loaded, skipped;
  ASSERT_TRUE(again.LoadAll(&loaded, &skipped).ok());
  EXPECT_THAT(loaded, ::testing::UnorderedElementsAre("plain v1"));
  EXPECT_THAT(SkipReason(skipped, "vmr/v1"),
              ::testing::HasSubstr("field 'value_metric_rounding' is not a codec setting"));
  EXPECT_THAT(SkipReason(skipped, "typo/v1"),
              ::testing::HasSubstr("field 'key_bit' is not a codec setting"));
  fs::remove_all(dir);
}

TEST(RegistryTest, RegisterRefusesWhatLoadingWouldAndConflictingMetadata) {
  const std::string dir = TempDir();
  Registry r(dir);
  ASSERT_TRUE(r.LoadAll(nullptr, nullptr).ok());
  using Mutation = std::function<void(ModelEntry&)>;
  // Each is refused, with and without basis, naming the field and the limit.
  const std::vector<std::pair<Mutation, std::string>> invalid = {
      {[](ModelEntry& e) { e.manifest.rope_layout = "spiral"; },
       "rope_layout must be 'adjacent_pairs' or 'halves'"},
      // What a message quotes of a bad string is one bounded line (fuzz_registry).
      {[](ModelEntry& e) { e.manifest.rope_layout = "halves\x01\n" + std::string(100, 'x'); },
       "(got 'halves\\x01\\n" + std::string(56, 'x') + "...')"},
      {[](ModelEntry& e) { e.manifest.model = "a\nb" + std::string(1 << 20, 'c'); },
       "model name 'a\\nb" + std::string(61, 'c') + "...' (1048579 bytes) must be 1..128"},
      {[](ModelEntry& e) { e.manifest.kind = std::string(1 << 20, 'k'); },
       "kind must be at most 256 bytes"},
      {[](ModelEntry& e) { e.manifest.kind = std::string(257, 'k'); },
       "kind must be at most 256 bytes"},
      {[](ModelEntry& e) { e.manifest.kind = "two\nlines"; }, "printable ASCII"},
      {[](ModelEntry& e) { e.manifest.channel_order = std::string(300, 'c'); },
       "channel_order must be at most 256 bytes"},
      {[](ModelEntry& e) { e.manifest.calibration_text = std::string(5000, 't'); },
       "calibration_text holds 5000 bytes; at most 4096"},
      {[](ModelEntry& e) { e.manifest.calibration_text = "\xff\xfe"; },
       "calibration_text must be UTF-8"},
  };
  for (const auto& [mutate, want] : invalid) {
    for (int rank : {8, 0}) {
      ModelEntry e = Entry(rank ? "m" : "plain", 1, 1, rank);
      mutate(e);
      const absl::Status st = r.Register(std::move(e), nullptr).status();
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << want;
      EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr(want));
    }
  }

  // The longest accepted fields; the same again is OK, other metadata is ALREADY_EXISTS
  // naming what differs.
  ModelEntry e = Entry("m", 1, 1);
  e.manifest.kind = std::string(256, 'k');
  ASSERT_TRUE(r.Register(e, nullptr).ok());
  bool already = false;
  ASSERT_TRUE(r.Register(e, &already).ok());
  EXPECT_TRUE(already);
  const std::vector<std::pair<Mutation, std::string>> conflicting = {
      {[](ModelEntry& e) { e.manifest.kind = "query_pca_centred"; }, "kind"},
      {[](ModelEntry& e) { e.manifest.rope_layout = "halves"; }, "rope_layout"},
      {[](ModelEntry& e) { e.manifest.channel_order = "hf"; }, "channel_order"},
      {[](ModelEntry& e) { e.manifest.calibration_tokens = 123; }, "calibration_tokens"},
      {[](ModelEntry& e) { e.codec.window = 64; }, "codec"},
  };
  for (const auto& [mutate, field] : conflicting) {
    ModelEntry other = e;
    mutate(other);
    const absl::Status st = r.Register(std::move(other), nullptr).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kAlreadyExists) << field;
    EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr("different " + field));
  }
  // Without basis the entry is stored as it loads back, so sending it again is idempotent.
  ModelEntry plain = Entry("plain", 1, 0, /*rank=*/0);
  ASSERT_TRUE(r.Register(plain, nullptr).ok());
  ASSERT_TRUE(r.Register(plain, &already).ok());
  EXPECT_TRUE(already);

  // None of the refused entries reached the folder; what was accepted loads back whole.
  Registry again(dir);
  std::vector<std::string> loaded, skipped;
  ASSERT_TRUE(again.LoadAll(&loaded, &skipped).ok());
  EXPECT_THAT(loaded, ::testing::UnorderedElementsAre("m v1", "plain v1"));
  EXPECT_THAT(skipped, ::testing::IsEmpty());
  EXPECT_EQ((*again.Get("m", 1))->manifest.kind, std::string(256, 'k'));
  ASSERT_TRUE(again.Register(plain, &already).ok());
  EXPECT_TRUE(already);
  fs::remove_all(dir);
}

class StoreTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(registry_.Register(Entry("m", 1, 1), nullptr).ok()); }
  // What one sequence of `d` in both layers takes, stored alone.
  int64_t BytesAlone(const Data& d) {
    Store probe({}, &registry_);
    AppendOutcome out;
    EXPECT_TRUE(probe.Append("t", {Spec("x", 0, 0, d), Spec("x", 1, 0, d)}, &out).ok());
    return probe.TotalUsage().bytes;
  }
  Registry registry_{""};
};

// Every sequence's cache of one layer reads the same basis, projection and metric-rounding
// tables (built once per entry, layer and codec, not per sequence: 1.6 MB a SmolLM2 sequence
// with metric rounding otherwise); another layer or codec has its own.
TEST_F(StoreTest, SequencesOfALayerShareItsCodecTables) {
  ModelEntry mm = Entry("mm", 1, 2);
  const int kv = mm.manifest.kv_heads, d = mm.manifest.head_dim;
  mm.basis.query_moment.assign(static_cast<size_t>(mm.manifest.layers) * kv * d * d, 0.0f);
  for (int h = 0; h < mm.manifest.layers * kv; ++h)
    for (int c = 0; c < d; ++c) mm.basis.query_moment[(static_cast<size_t>(h) * d + c) * d + c] = 1;
  mm.manifest.fingerprint = BasisFingerprint(mm.basis);
  ASSERT_TRUE(registry_.Register(mm, nullptr).ok());
  Store store({}, &registry_);
  Data data(40, 3);
  AppendOutcome out;
  auto spec = [&](const std::string& id, int layer, bool mr) {
    AppendSpec a = Spec(id, layer, 0, data, "mm");
    if (mr) {
      a.has_codec = true;
      a.codec = Registry::DefaultCodec(mm.manifest, true);
      a.codec.metric_rounding = true;
    }
    return a;
  };
  ASSERT_TRUE(store
                  .Append("t",
                          {spec("a", 0, false), spec("a", 1, false), spec("b", 0, false),
                           spec("c", 0, true), spec("e", 0, true)},
                          &out)
                  .ok());
  ASSERT_TRUE(store.Append("u", {spec("a", 0, false)}, &out).ok());
  auto tables = [&](const std::string& tenant, const std::string& id, int layer) {
    LayerCache* c = store.LayerForTest(tenant, id, layer);
    EXPECT_NE(c, nullptr) << id;
    return c ? c->tables().get() : nullptr;
  };
  EXPECT_EQ(tables("t", "a", 0), tables("t", "b", 0));
  EXPECT_EQ(tables("t", "a", 0), tables("u", "a", 0));  // the model's, not the tenant's
  EXPECT_NE(tables("t", "a", 0), tables("t", "a", 1));
  EXPECT_NE(tables("t", "a", 0), tables("t", "c", 0));
  EXPECT_EQ(tables("t", "c", 0), tables("t", "e", 0));
  EXPECT_TRUE(tables("t", "a", 0)->rounding.empty());
  EXPECT_EQ(tables("t", "c", 0)->rounding.size(), static_cast<size_t>(kv) * d * d);
  EXPECT_FALSE(tables("t", "a", 0)->basis.empty());
}

// The store never rounds values in the output projection's metric (an evaluation experiment,
// not a codec setting): an entry's value metrics are kept and served, but its sequences' layer
// tables hold no value rounding factors and their values decode as nearest rounding gives them.
TEST_F(StoreTest, ValueMetricsNeverChangeHowTheStoreEncodes) {
  ModelEntry vm = Entry("vm", 1, 3);
  const int kv = vm.manifest.kv_heads, d = vm.manifest.head_dim;
  vm.basis.value_metric.assign(static_cast<size_t>(vm.manifest.layers) * kv * d * d, 0.5f);
  for (int h = 0; h < vm.manifest.layers * kv; ++h)
    for (int c = 0; c < d; ++c) vm.basis.value_metric[(static_cast<size_t>(h) * d + c) * d + c] = 1;
  ASSERT_TRUE(registry_.Register(vm, nullptr).ok());
  Store store({}, &registry_);
  Data data(256, 5);  // two groups of the default codec's 128 tokens encoded
  AppendSpec a = Spec("s", 0, 0, data, "vm");
  AppendOutcome out;
  ASSERT_TRUE(store.Append("t", {a}, &out).ok());
  LayerCache* layer = store.LayerForTest("t", "s", 0);
  ASSERT_NE(layer, nullptr);
  EXPECT_TRUE(layer->tables()->value_rounding.empty());
  // The same rows through caches of the same codec and basis: one rounding to nearest decodes
  // as the store's, one rounding in the metric does not.
  const CodecOptions codec = Registry::DefaultCodec(vm.manifest, true);
  auto decoded_values = [&](const float* metric) {
    LayerCache c(codec, kv, layer->tables()->basis.data(), nullptr, nullptr, nullptr, metric);
    EXPECT_TRUE(c.Append(data.kt, data.vt, 0).ok());
    std::vector<float> k, v;
    EXPECT_TRUE(c.Decode(&k, &v).ok());
    return v;
  };
  std::vector<float> k0, v0;
  ASSERT_TRUE(layer->Decode(&k0, &v0).ok());
  EXPECT_EQ(decoded_values(nullptr), v0);
  EXPECT_NE(decoded_values(vm.basis.value_metric_head(0, 0)), v0);
}

// Memory a workload of many tiny sequences takes on the heap, against what the store counts
// (capacity and quota are enforced on the count).
// glibc's heap statistics: meaningless under a sanitizer's allocator.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kGlibcHeap = false;
#else
constexpr bool kGlibcHeap = true;
#endif

TEST_F(StoreTest, TinySequencesAreCountedAtTheMemoryTheyTake) {
  if (!kGlibcHeap) GTEST_SKIP() << "heap statistics need glibc's allocator";
  Store store({}, &registry_);
  Data one(1, 4);
  constexpr int kSequences = 20000;
  const size_t heap_before = mallinfo2().uordblks;
  for (int i = 0; i < kSequences; ++i) {
    AppendOutcome out;
    const std::string id = absl::StrCat("seq-", i);
    ASSERT_TRUE(store.Append("t", {Spec(id, 0, 0, one), Spec(id, 1, 0, one)}, &out).ok());
  }
  const double heap = static_cast<double>(mallinfo2().uordblks - heap_before) / kSequences;
  const double counted = static_cast<double>(store.TotalUsage().bytes) / kSequences;
  std::printf("per one-token, two-layer sequence: heap %.0f B, counted %.0f B\n", heap, counted);
  EXPECT_LE(heap, 1.1 * counted);
}

// Under a capacity, the same workload evicts: what the store holds (and the heap it takes)
// stays within the capacity (+ 10% and one batch's overhead).
TEST_F(StoreTest, TinySequencesStayWithinCapacity) {
  if (!kGlibcHeap) GTEST_SKIP() << "heap statistics need glibc's allocator";
  StoreOptions o;
  o.capacity_bytes = 8 << 20;
  Data one(1, 4);
  const size_t heap_before = mallinfo2().uordblks;
  {
    Store store(o, &registry_);
    for (int i = 0; i < 20000; ++i) {
      AppendOutcome out;
      const std::string id = absl::StrCat("seq-", i);
      ASSERT_TRUE(store.Append("t", {Spec(id, 0, 0, one), Spec(id, 1, 0, one)}, &out).ok());
    }
    EXPECT_GT(store.TotalUsage().evictions, 0);
    EXPECT_LE(store.TotalUsage().bytes, o.capacity_bytes + 16384);
    const double heap = static_cast<double>(mallinfo2().uordblks - heap_before);
    EXPECT_LE(heap, 1.1 * static_cast<double>(o.capacity_bytes) + (1 << 20));
  }
}

// Host memory, until `allow` more allocations have been made: then std::bad_alloc, as a pool
// that cannot take another slab would (the allocation seam of fault tests).
class FailingPool final : public BytePool {
 public:
  std::atomic<int64_t> allow{1 << 30};
  kernels::Pool pool() const override { return kernels::Pool::kHost; }
  void* Allocate(size_t n) override {
    if (allow.fetch_sub(1) <= 0) throw std::bad_alloc();
    return HostBytePool()->Allocate(n);
  }
  void Free(void* p, size_t n) override { HostBytePool()->Free(p, n); }
  Usage usage() const override { return {}; }
};

// A failing allocation during an append leaves the store as it was: RESOURCE_EXHAUSTED, no
// partial sequence, no lock held (the next append and reads proceed), the stored tokens
// untouched; with memory back, the same append succeeds.
TEST_F(StoreTest, AFailingAllocationLeavesTheStoreAsItWas) {
  FailingPool pool;
  StoreOptions o;
  o.byte_pool = &pool;
  Store store(o, &registry_);
  Data first(130, 1), more(170, 2);  // G = 128: one group, then two more
  AppendOutcome out;
  pool.allow = 0;  // a new sequence: nothing stored, nothing left behind
  absl::Status st = store.Append("t", {Spec("new", 0, 0, first)}, &out);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_EQ(store.Describe("t", "new").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store.TotalUsage().bytes, 0);
  EXPECT_EQ(store.TotalUsage().sequences, 0);
  pool.allow = 1 << 30;
  ASSERT_TRUE(store.Append("t", {Spec("s", 0, 0, first)}, &out).ok());
  std::vector<float> q(4 * 64, 0.25f), before, after;
  ASSERT_TRUE(store.Score({"t", "s", 0, 0}, {q.data(), 4, 1, 64}, 0, false, &before).ok());
  const UsageStats used = store.TotalUsage();
  for (int allow : {0, 1, 2, 3}) {  // each pool allocation of the next append in turn
    SCOPED_TRACE(allow);
    pool.allow = allow;
    st = store.Append("t", {Spec("s", 0, 130, more)}, &out);
    if (st.ok()) break;  // it needed fewer allocations
    EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
    EXPECT_NE(st.message().find("block pool"), std::string::npos) << st;
    pool.allow = 1 << 30;
    const absl::StatusOr<int64_t> tokens =
        store.Score({"t", "s", 0, 0}, {q.data(), 4, 1, 64}, 0, false, &after);
    ASSERT_TRUE(tokens.ok());
    EXPECT_EQ(*tokens, 130);
    EXPECT_EQ(after, before);
    EXPECT_EQ(store.TotalUsage().bytes, used.bytes);
  }
  pool.allow = 1 << 30;
  st = store.Append("t", {Spec("s", 0, 130, more)}, &out);
  ASSERT_TRUE(st.ok()) << st;
  const absl::StatusOr<int64_t> tokens =
      store.Score({"t", "s", 0, 0}, {q.data(), 4, 1, 64}, 0, false, &after);
  ASSERT_TRUE(tokens.ok());
  EXPECT_EQ(*tokens, 300);
  // The same tokens stored in one healthy store read the same.
  Store ref({}, &registry_);
  ASSERT_TRUE(ref.Append("t", {Spec("s", 0, 0, first)}, &out).ok());
  ASSERT_TRUE(ref.Append("t", {Spec("s", 0, 130, more)}, &out).ok());
  std::vector<float> want;
  ASSERT_TRUE(ref.Score({"t", "s", 0, 0}, {q.data(), 4, 1, 64}, 0, false, &want).ok());
  EXPECT_EQ(after, want);
}

// One write that needs the room of a thousand small sequences evicts them in one plan whose
// cost is linear in the sequences (it was quadratic in the victims: 64,000 one-token
// sequences stalled the store's lock for seconds), and frees them after the lock.
TEST_F(StoreTest, EvictingManySmallSequencesPlansInLinearSteps) {
  Data big(20000, 3), one(1, 4);
  const int64_t big_bytes = BytesAlone(big);
  StoreOptions o;
  o.capacity_bytes = big_bytes + 4096;
  Store store(o, &registry_);
  int small = 0;
  AppendOutcome out;
  while (store.TotalUsage().bytes + 8192 < o.capacity_bytes) {
    const std::string id = absl::StrCat("s", small++);
    ASSERT_TRUE(store.Append("t", {Spec(id, 0, 0, one), Spec(id, 1, 0, one)}, &out).ok());
  }
  ASSERT_GT(small, 500);
  EXPECT_EQ(store.TotalUsage().evictions, 0);
  ASSERT_TRUE(store.Append("t", {Spec("big", 0, 0, big), Spec("big", 1, 0, big)}, &out).ok());
  const int64_t evicted = store.TotalUsage().evictions;
  EXPECT_GT(evicted, small * 9 / 10);
  EXPECT_LE(store.LastEvictionPlanStepsForTest(), 3 * (small + 1)) << evicted << " evicted";
  // (The write is reserved by its estimate, which misses a few KiB of its bookkeeping, as in
  // TinySequencesStayWithinCapacity.)
  EXPECT_LE(store.TotalUsage().bytes, o.capacity_bytes + 16384);
}

TEST_F(StoreTest, TtlDropsIdleSequences) {
  absl::Time now = absl::FromUnixSeconds(1000);
  StoreOptions o;
  o.ttl = absl::Seconds(60);
  o.now = [&] { return now; };
  Store store(o, &registry_);
  Data d(40, 1);
  AppendOutcome out;
  ASSERT_TRUE(store.Append("t", {Spec("old", 0, 0, d)}, &out).ok());
  now += absl::Seconds(50);
  ASSERT_TRUE(store.Append("t", {Spec("new", 0, 0, d)}, &out).ok());
  now += absl::Seconds(20);
  EXPECT_EQ(store.Sweep(), 1);
  EXPECT_FALSE(store.Describe("t", "old").ok());
  EXPECT_TRUE(store.Describe("t", "new").ok());
  EXPECT_EQ(store.TotalUsage().expirations, 1);
}

TEST_F(StoreTest, LruEvictsLeastRecentlyUsedWholeSequences) {
  Data d(64, 1);
  const int64_t one = BytesAlone(d);
  StoreOptions o;
  o.capacity_bytes = 3 * one;
  Store store(o, &registry_);
  AppendOutcome out;
  for (const char* id : {"s0", "s1", "s2"}) {
    ASSERT_TRUE(store.Append("t", {Spec(id, 0, 0, d), Spec(id, 1, 0, d)}, &out).ok());
  }
  std::vector<float> q(4 * 64, 0.1f), logits;
  ASSERT_TRUE(store.Score({"t", "s0", 0, 0}, {q.data(), 4, 1, 64}, 0, false, &logits).ok());
  ASSERT_TRUE(store.Append("t", {Spec("s3", 0, 0, d), Spec("s3", 1, 0, d)}, &out).ok());
  EXPECT_TRUE(store.Describe("t", "s0").ok());
  EXPECT_FALSE(store.Describe("t", "s1").ok());  // the LRU one
  EXPECT_TRUE(store.Describe("t", "s2").ok());
  EXPECT_EQ(store.TotalUsage().evictions, 1);
  EXPECT_LE(store.TotalUsage().bytes, o.capacity_bytes);
  // Appending to a live sequence never evicts that sequence itself.
  Data more(64, 2);
  absl::Status st = store.Append("t", {Spec("s3", 0, 64, more)}, &out);
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_TRUE(store.Describe("t", "s3").ok());
}

TEST_F(StoreTest, ScrubFindsCorruptionAndReadsFailWithDataLoss) {
  Store store({}, &registry_);
  Data d(128, 1);  // one whole key group of the default codec (G = 128): encoded blocks
  AppendOutcome out;
  ASSERT_TRUE(store.Append("t", {Spec("x", 0, 0, d)}, &out).ok());
  EXPECT_EQ(store.Scrub(), 0);
  LayerCache* c = store.LayerForTest("t", "x", 0);
  ASSERT_NE(c, nullptr);
  ASSERT_GT(c->key_blocks(1).size(), 100u);
  c->key_blocks(1)[100] ^= 0x10;
  EXPECT_EQ(store.Scrub(), 1);
  std::vector<float> q(4 * 64, 0.1f), logits;
  absl::Status st = store.Score({"t", "x", 0, 0}, {q.data(), 4, 1, 64}, 0, false, &logits).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  std::vector<float> k, v;
  EXPECT_EQ(store.Decode({"t", "x", 0, 0}, {}, &k, &v).status().code(),
            absl::StatusCode::kDataLoss);
}

// A batch whose later item holds an element beyond the fp16 range (or a non-finite one) is
// rejected before anything is applied: the earlier, valid items are not stored either.
TEST_F(StoreTest, BadElementInALaterItemLeavesTheWholeBatchUnapplied) {
  Store store({}, &registry_);
  Data good(40, 1), big(40, 2), nan(40, 3);
  big.k[(1 * 40 + 7) * 64 + 3] = 4e6f;
  nan.v[(0 * 40 + 2) * 64 + 5] = std::nanf("");
  AppendOutcome out;
  using Case = std::pair<const Data*, std::string>;
  for (const auto& [bad, want] :
       {Case{&big, "keys[1, 7, 3] = 4e+06"}, Case{&nan, "values[0, 2, 5] is not finite"}}) {
    const absl::Status st = store.Append("t", {Spec("x", 0, 0, good), Spec("x", 1, 0, *bad)}, &out);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr("appends[1] (layer 1): " + want));
    EXPECT_FALSE(store.Describe("t", "x").ok());
    EXPECT_EQ(store.TotalUsage().bytes, 0);
  }
  // One item alone: the layer cache rejects it without change, reported the same way.
  const absl::Status st = store.Append("t", {Spec("x", 1, 0, big)}, &out);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()),
              ::testing::HasSubstr("appends[0] (layer 1): keys[1, 7, 3]"));
  ASSERT_TRUE(store.Append("t", {Spec("x", 0, 0, good), Spec("x", 1, 0, good)}, &out).ok());
}

TEST_F(StoreTest, RacingIdenticalResendsStoreEachTokenOnce) {
  Store store({}, &registry_);
  const int64_t T = 200;
  Data d(T, 7);
  std::vector<std::thread> th;
  std::atomic<int> errors{0};
  for (int i = 0; i < 4; ++i) {
    th.emplace_back([&] {
      for (int64_t from = 0; from < T; from += 20) {
        TensorView k = d.kt, v = d.vt;
        k.data = d.k.data() + from * 64;
        v.data = d.v.data() + from * 64;
        k.shape[1] = v.shape[1] = 20;
        AppendSpec s = Spec("x", 0, from, d);
        s.keys = k;
        s.values = v;
        AppendOutcome out;
        absl::Status st = store.Append("t", {s}, &out);
        // Another thread may not have reached `from` yet: a gap, retried.
        while (st.code() == absl::StatusCode::kFailedPrecondition ||
               st.code() == absl::StatusCode::kAborted) {
          std::this_thread::yield();
          st = store.Append("t", {s}, &out);
        }
        if (!st.ok()) ++errors;
      }
    });
  }
  for (auto& t : th) t.join();
  EXPECT_EQ(errors.load(), 0);
  auto info = store.Describe("t", "x");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->layer_tokens[0], T);
}

}  // namespace
}  // namespace kvq::core
