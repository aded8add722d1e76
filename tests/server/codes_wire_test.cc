// Codes on the wire over real gRPC: a client that fetched the basis (GetBasis) encodes with
// core's own cache and puts codes; the server stores exactly what it would have encoded from the
// rows; GetBlocks in codes answers with the stored blocks; every hostile run is refused naming
// the append, block and field, and stores nothing.
#include <xxhash.h>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvq/core/encoded_groups.h"
#include "kvq/format/block_format.h"
#include "kvq/wire/model.h"
#include "tests/server/test_util.h"

namespace kvq::testing {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kBasisSeed = 31;
constexpr int64_t kT = 200;  // 6 groups of 32 and 8 rows

class CodesWire : public ::testing::Test {
 protected:
  void SetUp() override {
    shape_.legacy_codec = true;
    ts_ = std::make_unique<TestServer>();
    stub_ = ts_->Stub();
    v1::RegisterBasisResponse resp;
    auto ctx = Ctx();
    grpc::Status st = stub_->RegisterBasis(ctx.get(), MakeRegister(shape_, kBasisSeed), &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
    // The client's side: the basis as the server holds it.
    v1::RegisterBasisRequest basis;
    auto bctx = Ctx();
    v1::GetModelRequest req;
    req.set_model(shape_.model);
    st = stub_->GetBasis(bctx.get(), req, &basis);
    ASSERT_TRUE(st.ok()) << st.error_message();
    absl::StatusOr<core::ModelEntry> e = wire::ModelFromWire(basis);
    ASSERT_TRUE(e.ok()) << e.status();
    entry_ = *std::move(e);
    entry_.manifest.fingerprint = basis.info().fingerprint();
    codec_ = entry_.codec;
    codec_.head_dim = shape_.head_dim;
    k_ = F16RoundTrip(RandomKV(shape_.kv_heads, kT, shape_.head_dim, 5));
    v_ = F16RoundTrip(RandomKV(shape_.kv_heads, kT, shape_.head_dim, 6));
  }

  // What the client's own cache makes of the rows: an append of encoded groups and window rows.
  v1::Append EncodedAppend(const std::string& seq, int layer) {
    core::LayerCache c(codec_, shape_.kv_heads, core::MakeLayerCodecTables(entry_, layer, codec_));
    const std::string kb = ToF16Bytes(k_), vb = ToF16Bytes(v_);
    const int kv = shape_.kv_heads, d = shape_.head_dim;
    EXPECT_TRUE(c.Append(core::TensorView::Contiguous(kb.data(), core::DType::kF16, {kv, kT, d}),
                         core::TensorView::Contiguous(vb.data(), core::DType::kF16, {kv, kT, d}), 0)
                    .ok());
    core::EncodedGroups run;
    EXPECT_TRUE(c.ExportGroups(0, c.encoded_tokens() / codec_.key_group, &run).ok());
    const int64_t E = c.encoded_tokens(), W = kT - E;
    v1::Append a = MakeAppend(seq, layer, 0, Slice(k_, kv, kT, d, E, W), Slice(v_, kv, kT, d, E, W),
                              kv, W, d, shape_.model);
    v1::EncodedGroups* e = a.mutable_encoded();
    e->set_blocks(run.bytes.data(), run.bytes.size());
    e->mutable_block_bytes()->Add(run.sizes.begin(), run.sizes.end());
    e->set_basis_fingerprint(entry_.manifest.fingerprint);
    return a;
  }
  grpc::Status PutOne(const v1::Append& a, v1::PutBlocksResponse* resp) {
    v1::PutBlocksRequest m;
    *m.add_appends() = a;
    return Put(*stub_, {m}, resp);
  }
  // Every message of a GetBlocks of layer 0.
  std::vector<v1::GetBlocksResponse> Get(const std::string& seq, bool codes, grpc::Status* st,
                                         int max_version = format::kMaxVersion) {
    v1::GetBlocksRequest req;
    req.set_sequence_id(seq);
    req.add_layers(0);
    req.set_dtype(v1::DTYPE_F16);
    req.set_codes(codes);
    req.set_max_block_version(max_version);
    auto ctx = Ctx();
    auto reader = stub_->GetBlocks(ctx.get(), req);
    std::vector<v1::GetBlocksResponse> out;
    v1::GetBlocksResponse r;
    while (reader->Read(&r)) out.push_back(r);
    *st = reader->Finish();
    return out;
  }

  Shape shape_;
  std::unique_ptr<TestServer> ts_;
  std::unique_ptr<v1::Kvq::Stub> stub_;
  core::ModelEntry entry_;
  core::CodecOptions codec_;
  std::vector<float> k_, v_;
};

TEST_F(CodesWire, ModelsSayWhichBlockVersionsTheServerTakes) {
  v1::ModelInfo info;
  v1::GetModelRequest req;
  req.set_model(shape_.model);
  auto ctx = Ctx();
  ASSERT_TRUE(stub_->GetModel(ctx.get(), req, &info).ok());
  EXPECT_EQ(info.block_version_min(), format::kMinVersion);
  EXPECT_EQ(info.block_version_max(), format::kMaxVersion);
  // GetBasis gives back the registered tensors: the same fingerprint once re-registered.
  EXPECT_EQ(entry_.basis.u, MakeBasis(shape_, kBasisSeed).u);
}

TEST_F(CodesWire, CodesPutEqualsRowsPutAndComeBackAsTheSameBlocksInAQuarterOfTheBytes) {
  const int kv = shape_.kv_heads, d = shape_.head_dim;
  v1::PutBlocksResponse resp;
  ASSERT_TRUE(PutOne(MakeAppend("rows", 0, 0, k_, v_, kv, kT, d, shape_.model), &resp).ok());
  const v1::Append coded = EncodedAppend("codes", 0);
  grpc::Status st = PutOne(coded, &resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(resp.tokens_written(), kT);
  // Decoded, the two sequences are the same bytes.
  const auto rows = Get("rows", false, &st);
  ASSERT_TRUE(st.ok()) << st.error_message();
  const auto codes_decoded = Get("codes", false, &st);
  ASSERT_EQ(rows.size(), codes_decoded.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    EXPECT_EQ(rows[i].keys().data(), codes_decoded[i].keys().data());
    EXPECT_EQ(rows[i].values().data(), codes_decoded[i].values().data());
  }
  // In codes: the client's blocks, then its window rows.
  const auto back = Get("rows", true, &st);
  ASSERT_TRUE(st.ok()) << st.error_message();
  ASSERT_EQ(back.size(), 1u);
  EXPECT_EQ(back[0].start(), 0);
  EXPECT_EQ(back[0].encoded().blocks(), coded.encoded().blocks());
  EXPECT_EQ(back[0].encoded().basis_fingerprint(), entry_.manifest.fingerprint);
  EXPECT_EQ(back[0].keys().data(), coded.keys().data());
  size_t fp16_bytes = 0;
  for (const auto& m : rows) fp16_bytes += m.ByteSizeLong();
  const double ratio = static_cast<double>(back[0].ByteSizeLong()) / fp16_bytes;
  EXPECT_LT(ratio, 0.35) << back[0].ByteSizeLong() << " of " << fp16_bytes;
  // And put back as codes, the same sequence again.
  v1::Append again = coded;
  again.set_sequence_id("again");
  *again.mutable_encoded() = back[0].encoded();
  ASSERT_TRUE(PutOne(again, &resp).ok());
  const auto again_decoded = Get("again", false, &st);
  ASSERT_EQ(again_decoded.size(), rows.size());
  EXPECT_EQ(again_decoded[0].keys().data(), rows[0].keys().data());
  // A client that reads only an older block version gets a clear refusal.
  Get("rows", true, &st, /*max_version=*/1);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(st.error_message(), HasSubstr("max_block_version 1"));
}

TEST_F(CodesWire, HostileRunsAreRefusedNamingTheBlockAndStoreNothing) {
  v1::PutBlocksResponse resp;
  const v1::Append good = EncodedAppend("h", 0);
  struct Bad {
    const char* what;
    std::function<void(v1::Append*)> spoil;
    grpc::StatusCode code;
    const char* says;
  };
  auto reseal = [](std::string* blocks, size_t at, size_t n) {
    auto* b = reinterpret_cast<uint8_t*>(blocks->data()) + at;
    const uint64_t head = XXH3_64bits(b, format::kHashedHeaderBytes);
    const uint64_t payload = XXH3_64bits(b + format::kHeaderBytes, n - format::kHeaderBytes);
    format::StoreU32(b + format::kChecksumAt, format::MixChecksum(payload, head));
  };
  const std::vector<Bad> cases = {
      {"a flipped bit", [](v1::Append* a) { (*a->mutable_encoded()->mutable_blocks())[50] ^= 4; },
       grpc::StatusCode::DATA_LOSS,
       "appends[0].encoded.blocks[0] (group 0, head 0, key): block checksum"},
      {"truncated", [](v1::Append* a) { a->mutable_encoded()->mutable_blocks()->pop_back(); },
       grpc::StatusCode::INVALID_ARGUMENT, "appends[0].encoded.blocks holds"},
      {"an odd count of sizes",
       [](v1::Append* a) { a->mutable_encoded()->mutable_block_bytes()->RemoveLast(); },
       grpc::StatusCode::INVALID_ARGUMENT, "appends[0].encoded.block_bytes has 23 sizes"},
      {"a NaN scale",
       [&](v1::Append* a) {
         std::string* b = a->mutable_encoded()->mutable_blocks();
         format::StoreU16(reinterpret_cast<uint8_t*>(b->data()) + format::kHeaderBytes, 0x7e00);
         reseal(b, 0, a->encoded().block_bytes(0));
       },
       grpc::StatusCode::INVALID_ARGUMENT, "(group 0, head 0, key): channel scale/zero[0]"},
      {"an unknown version",
       [&](v1::Append* a) {
         std::string* b = a->mutable_encoded()->mutable_blocks();
         (*b)[format::kVersionAt] = 7;
         reseal(b, 0, a->encoded().block_bytes(0));
       },
       grpc::StatusCode::FAILED_PRECONDITION,
       "block format version 7; this server reads versions 2 to 3"},
      {"another basis", [](v1::Append* a) { a->mutable_encoded()->set_basis_fingerprint("feed"); },
       grpc::StatusCode::FAILED_PRECONDITION, "appends[0].encoded.basis_fingerprint 'feed'"},
      {"sinks the codec does not keep",
       [](v1::Append* a) {
         *a->mutable_encoded()->mutable_sink_keys() =
             TensorF16(std::vector<float>(2 * 64), {2, 1, 64});
       },
       grpc::StatusCode::INVALID_ARGUMENT, "sink rows are sent only with group 0"},
      {"probe weights",
       [](v1::Append* a) {
         *a->mutable_probe_weights() = TensorF32(std::vector<float>(16, 1.0f), {2, 8});
       },
       grpc::StatusCode::INVALID_ARGUMENT, "probe_weights: not with encoded groups"},
      {"a start inside a group", [](v1::Append* a) { a->set_start(5); },
       grpc::StatusCode::INVALID_ARGUMENT, "start 5: encoded groups start at a multiple"},
  };
  for (const Bad& c : cases) {
    SCOPED_TRACE(c.what);
    v1::Append a = good;
    c.spoil(&a);
    const grpc::Status st = PutOne(a, &resp);
    EXPECT_EQ(st.error_code(), c.code) << st.error_message();
    EXPECT_THAT(st.error_message(), HasSubstr(c.says));
  }
  // Nothing of any refused message was stored; the good one still goes in whole.
  v1::StatsResponse stats;
  auto ctx = Ctx();
  ASSERT_TRUE(stub_->Stats(ctx.get(), v1::StatsRequest(), &stats).ok());
  EXPECT_EQ(stats.sequences(), 0);
  ASSERT_TRUE(PutOne(good, &resp).ok());
  EXPECT_EQ(resp.tokens_written(), kT);
}

}  // namespace
}  // namespace kvq::testing
