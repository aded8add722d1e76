// The service tests' shared set-up: the model fixture, typed calls, an open PutBlocks stream.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvq/core/basis.h"
#include "kvq/core/cache.h"
#include "kvq/core/codec.h"
#include "kvq/core/tensor.h"
#include "kvq/v1/kvq.grpc.pb.h"
#include "server/server.h"
#include "tests/server/test_util.h"

namespace kvq::testing {

// The seed of the basis every test registers (MakeRegister(shape, kBasisSeed)).
inline constexpr uint64_t kBasisSeed = 7;

// Token counts in tests written around 32-token groups: the legacy default codec.
inline Shape LegacyShape() {
  Shape s;
  s.legacy_codec = true;
  return s;
}

// A model of shape `shape` (kBasisSeed's basis, the codec the server derives); Ref(layer): an
// empty in-process cache of that layer, the reference the served results are compared with.
struct Fixture {
  Shape shape;
  core::ModelBasis basis;
  core::CodecOptions codec;
  explicit Fixture(Shape s = Shape())
      : shape(std::move(s)), basis(MakeBasis(shape, kBasisSeed)), codec(CodecOf(shape)) {}
  std::unique_ptr<core::LayerCache> Ref(int layer) const {
    std::vector<float> b = LayerBasis(basis, layer, codec.rank);
    return std::make_unique<core::LayerCache>(codec, shape.kv_heads,
                                              b.empty() ? nullptr : b.data());
  }
};

// Random keys and values for every layer of `s`, [kv_heads][tokens][head_dim] each: layer l's
// keys from seed key_seed + l, its values from value_seed + l.
struct LayerRows {
  std::vector<std::vector<float>> k, v;
};
inline LayerRows RandomLayers(const Shape& s, int64_t tokens, uint32_t key_seed,
                              uint32_t value_seed) {
  LayerRows r;
  for (int l = 0; l < s.layers; ++l) {
    r.k.push_back(RandomKV(s.kv_heads, tokens, s.head_dim, key_seed + l));
    r.v.push_back(RandomKV(s.kv_heads, tokens, s.head_dim, value_seed + l));
  }
  return r;
}

// RegisterBasis(req) as `token`'s tenant; a failure fails the test.
inline void Register(v1::Kvq::Stub& stub, const v1::RegisterBasisRequest& req,
                     const std::string& token = "") {
  v1::RegisterBasisResponse resp;
  auto ctx = Ctx("", token);
  grpc::Status st = stub.RegisterBasis(ctx.get(), req, &resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
}

// Appends f16 bytes to an in-process cache exactly as the server receives them.
inline void RefAppend(core::LayerCache& c, const std::vector<float>& k, const std::vector<float>& v,
                      int kv, int64_t n, int d, int64_t start) {
  std::string kb = ToF16Bytes(k), vb = ToF16Bytes(v);
  auto kt = core::TensorView::Contiguous(kb.data(), core::DType::kF16, {kv, n, d});
  auto vt = core::TensorView::Contiguous(vb.data(), core::DType::kF16, {kv, n, d});
  ASSERT_TRUE(c.Append(kt, vt, start).ok());
}

// Score of one item (`seq`, `layer`, queries [qh, nq, d]) as `tenant`; the call's status goes
// to *status when given.
inline v1::ScoreResponse ScoreOne(v1::Kvq::Stub& stub, const std::string& seq, int layer,
                                  const std::vector<float>& q, int qh, int nq, int d,
                                  const std::string& tenant = "", grpc::Status* status = nullptr) {
  v1::ScoreRequest req;
  auto* it = req.add_items();
  it->set_sequence_id(seq);
  it->set_layer(layer);
  *it->mutable_queries() = TensorF32(q, {qh, nq, d});
  v1::ScoreResponse resp;
  auto ctx = Ctx(tenant);
  grpc::Status st = stub.Score(ctx.get(), req, &resp);
  if (status) *status = st;
  return resp;
}

// One layer's decoded keys and values, [kv][T][d] each, read by GetBlocks in messages of at most
// `chunk` tokens (0: the default, 4096).
inline std::vector<std::vector<float>> GetAll(v1::Kvq::Stub& stub, const std::string& seq,
                                              int layer, int kv, int d, int chunk = 0) {
  v1::GetBlocksRequest req;
  req.set_sequence_id(seq);
  req.add_layers(layer);
  req.set_max_tokens_per_message(chunk);
  auto ctx = Ctx();
  auto r = stub.GetBlocks(ctx.get(), req);
  v1::GetBlocksResponse m;
  std::vector<std::vector<float>> per_head_k(kv), per_head_v(kv);
  int64_t T = 0;
  while (r->Read(&m)) {
    T = m.layer_tokens();
    std::vector<float> k = FloatsOf(m.keys()), v = FloatsOf(m.values());
    const int64_t n = m.keys().shape(1);
    for (int h = 0; h < kv; ++h) {
      per_head_k[h].insert(per_head_k[h].end(), k.begin() + h * n * d, k.begin() + (h + 1) * n * d);
      per_head_v[h].insert(per_head_v[h].end(), v.begin() + h * n * d, v.begin() + (h + 1) * n * d);
    }
  }
  EXPECT_TRUE(r->Finish().ok());
  std::vector<float> k, v;
  for (int h = 0; h < kv; ++h) {
    k.insert(k.end(), per_head_k[h].begin(), per_head_k[h].end());
    v.insert(v.end(), per_head_v[h].begin(), per_head_v[h].end());
  }
  (void)T;
  return {k, v};
}

// Open(): a PutBlocks stream left open once its first message (16 tokens of `seq`, model "tiny",
// registered already) is applied: the call stays in flight on the server until Close().
struct OpenStream {
  std::unique_ptr<grpc::ClientContext> ctx = Ctx();
  v1::PutBlocksResponse resp;
  v1::PutBlocksRequest msg;
  std::unique_ptr<grpc::ClientWriter<v1::PutBlocksRequest>> writer;

  void Open(v1::Kvq::Stub& stub, const Shape& s, const std::string& seq, uint32_t seed) {
    auto k = RandomKV(s.kv_heads, 16, s.head_dim, seed);
    *msg.add_appends() = MakeAppend(seq, 0, 0, k, k, s.kv_heads, 16, s.head_dim, "tiny");
    writer = stub.PutBlocks(ctx.get(), &resp);
    ASSERT_TRUE(writer->Write(msg));
    for (int i = 0;; ++i) {  // Stats answers on the gRPC thread, outside --max-inflight
      v1::StatsResponse stats;
      auto c = Ctx();
      ASSERT_TRUE(stub.Stats(c.get(), {}, &stats).ok());
      if (stats.sequences() == 1) break;
      ASSERT_LT(i, 1000);
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  grpc::Status Close() {
    writer->WritesDone();
    return writer->Finish();
  }
};

// Options with /metrics on a free port of 127.0.0.1.
inline server::ServerOptions WithLocalMetrics() {
  server::ServerOptions o;
  o.metrics_port = 0;
  o.metrics_address = "127.0.0.1";
  return o;
}

// The value of an unlabelled metric in a /metrics text; -1 when absent.
inline double MetricValue(const std::string& text, const std::string& name) {
  const std::string key = "\n" + name + " ";
  const size_t at = text.find(key);
  return at == std::string::npos ? -1 : std::stod(text.substr(at + key.size()));
}

}  // namespace kvq::testing
