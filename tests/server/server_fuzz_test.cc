// Mutation fuzzing over real gRPC: valid requests of every call, serialized, damaged (bit
// flips, truncation, duplicated or random runs, huge varints) and sent as raw bytes (unary
// calls, through a generic stub, so that unparsable messages reach the server too) or
// re-parsed (streams). The server must answer every one with a status (no crash, no hang),
// stay SERVING, and a sequence stored before must read back bit for bit the same.
#include <cstdlib>
#include <future>
#include <limits>
#include <random>

#include "google/protobuf/stubs/logging.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/generic/generic_stub.h"
#include "gtest/gtest.h"
#include "tests/server/test_util.h"

namespace kvq::testing {
namespace {

std::string Mutate(std::string s, std::mt19937& rng) {
  std::uniform_int_distribution<int> kind(0, 5);
  const int rounds = 1 + static_cast<int>(rng() % 4);
  for (int r = 0; r < rounds; ++r) {
    if (s.empty()) s.push_back(static_cast<char>(rng()));
    const size_t at = rng() % s.size();
    switch (kind(rng)) {
      case 0:  // flip a bit
        s[at] = static_cast<char>(s[at] ^ (1 << (rng() % 8)));
        break;
      case 1:  // truncate
        s.resize(at);
        break;
      case 2: {  // duplicate a run
        const size_t n = std::min<size_t>(s.size() - at, 1 + rng() % 64);
        s.insert(at, s.substr(at, n));
        break;
      }
      case 3:  // random byte
        s[at] = static_cast<char>(rng());
        break;
      case 4: {  // a 10-byte varint of all ones (a huge length or value)
        s.insert(at, std::string(9, '\xff') + '\x01');
        break;
      }
      default: {  // random run
        const size_t n = 1 + rng() % 16;
        std::string junk(n, '\0');
        for (auto& c : junk) c = static_cast<char>(rng());
        s.insert(at, junk);
      }
    }
  }
  return s;
}

// Structured damage: one scalar field somewhere in the message (found by reflection) gets an
// extreme or random value, or a repeated scalar field gains or loses an element; strings get
// another sequence id or garbage. Such messages parse, so they reach the server's validation.
void MutateField(google::protobuf::Message* m, std::mt19937& rng) {
  using google::protobuf::FieldDescriptor;
  std::vector<std::pair<google::protobuf::Message*, const FieldDescriptor*>> fields;
  std::vector<google::protobuf::Message*> todo{m};
  while (!todo.empty()) {
    google::protobuf::Message* cur = todo.back();
    todo.pop_back();
    const auto* d = cur->GetDescriptor();
    const auto* r = cur->GetReflection();
    for (int i = 0; i < d->field_count(); ++i) {
      const FieldDescriptor* f = d->field(i);
      if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
        if (f->is_repeated()) {
          for (int j = 0; j < r->FieldSize(*cur, f); ++j)
            todo.push_back(r->MutableRepeatedMessage(cur, f, j));
        } else if (r->HasField(*cur, f)) {
          todo.push_back(r->MutableMessage(cur, f));
        }
      } else {
        fields.emplace_back(cur, f);
      }
    }
  }
  if (fields.empty()) return;
  auto [msg, f] = fields[rng() % fields.size()];
  const auto* r = msg->GetReflection();
  const int64_t extremes[] = {0, -1, 1, 2, 7, 33, 4096, 65537, INT32_MAX, INT32_MIN, INT64_MAX};
  const int64_t x = rng() % 3 == 0 ? static_cast<int64_t>(rng()) : extremes[rng() % 11];
  if (f->is_repeated()) {
    const int n = r->FieldSize(*msg, f);
    if (n > 0 && rng() % 2) {
      r->RemoveLast(msg, f);
      return;
    }
    switch (f->cpp_type()) {
      case FieldDescriptor::CPPTYPE_INT64:
        r->AddInt64(msg, f, x);
        break;
      case FieldDescriptor::CPPTYPE_INT32:
        r->AddInt32(msg, f, static_cast<int32_t>(x));
        break;
      case FieldDescriptor::CPPTYPE_UINT32:
        r->AddUInt32(msg, f, static_cast<uint32_t>(x));
        break;
      default:
        break;
    }
    return;
  }
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT64:
      r->SetInt64(msg, f, x);
      break;
    case FieldDescriptor::CPPTYPE_INT32:
      r->SetInt32(msg, f, static_cast<int32_t>(x));
      break;
    case FieldDescriptor::CPPTYPE_UINT32:
      r->SetUInt32(msg, f, static_cast<uint32_t>(x));
      break;
    case FieldDescriptor::CPPTYPE_FLOAT:
      r->SetFloat(msg, f, rng() % 2 ? std::numeric_limits<float>::quiet_NaN() : -1e30f);
      break;
    case FieldDescriptor::CPPTYPE_BOOL:
      r->SetBool(msg, f, !r->GetBool(*msg, f));
      break;
    case FieldDescriptor::CPPTYPE_ENUM:
      r->SetEnumValue(msg, f, static_cast<int>(x % 7));
      break;
    case FieldDescriptor::CPPTYPE_STRING: {
      std::string v = r->GetString(*msg, f);
      if (f->type() == FieldDescriptor::TYPE_BYTES && !v.empty()) {
        v.resize(rng() % v.size());  // tensor data of the wrong length
      } else {
        v = rng() % 2 ? std::string("") : std::string(300, 'z');
      }
      r->SetString(msg, f, v);
      break;
    }
    default:
      break;
  }
}

grpc::Status RawUnary(grpc::GenericStub& gs, const std::string& method, const std::string& bytes) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  grpc::Slice slice(bytes);
  grpc::ByteBuffer req(&slice, 1), resp;
  std::promise<grpc::Status> done;
  gs.UnaryCall(&ctx, method, grpc::StubOptions(), &req, &resp,
               [&](grpc::Status st) { done.set_value(st); });
  return done.get_future().get();
}

TEST(ServiceFuzz, DamagedRequestsGetAStatusAndHarmNothing) {
  TestServer ts;
  auto stub = ts.Stub();
  Shape s;
  {
    v1::RegisterBasisResponse r;
    auto ctx = Ctx();
    ASSERT_TRUE(stub->RegisterBasis(ctx.get(), MakeRegister(s, 5), &r).ok());
  }
  const int kv = s.kv_heads, d = s.head_dim, qh = s.q_heads;
  const int64_t T = 100;
  auto k = RandomKV(kv, T, d, 1), v = RandomKV(kv, T, d, 2);
  auto append = [&](const std::string& id, int layer) {
    v1::Append a = MakeAppend(id, layer, 0, k, v, kv, T, d, "tiny");
    for (int t = 0; t < T; ++t) a.add_token_ids(100 + t);
    return a;
  };
  v1::PutBlocksRequest put;
  *put.add_appends() = append("ref", 0);
  *put.add_appends() = append("ref", 1);
  v1::PutBlocksResponse pr;
  ASSERT_TRUE(Put(*stub, {put}, &pr).ok());
  auto q = RandomQueries(qh, 2, d, 3);
  auto score_ref = [&](int layer) {
    v1::ScoreRequest req;
    auto* it = req.add_items();
    it->set_sequence_id("ref");
    it->set_layer(layer);
    *it->mutable_queries() = TensorF32(q, {qh, 2, d});
    v1::ScoreResponse resp;
    auto ctx = Ctx();
    EXPECT_TRUE(stub->Score(ctx.get(), req, &resp).ok());
    return FloatsOf(resp.results(0).logits());
  };
  const std::vector<float> before0 = score_ref(0), before1 = score_ref(1);

  // Templates: valid requests naming sequence "fz" (never "ref").
  std::vector<std::pair<std::string, std::string>> unary;
  std::vector<std::unique_ptr<google::protobuf::Message>> protos;  // parallel to unary
  auto keep = [&](const google::protobuf::Message& m) {
    protos.emplace_back(m.New());
    protos.back()->CopyFrom(m);
  };
  {
    v1::ScoreRequest r;
    auto* it = r.add_items();
    it->set_sequence_id("fz");
    *it->mutable_queries() = TensorF32(q, {qh, 2, d});
    unary.emplace_back("/kvq.v1.Kvq/Score", r.SerializeAsString());
    keep(r);
    v1::AttendRequest a;
    auto* ai = a.add_items();
    ai->set_sequence_id("fz");
    ai->set_causal_offset(3);
    *ai->mutable_queries() = TensorF16(q, {qh, 2, d});
    unary.emplace_back("/kvq.v1.Kvq/Attend", a.SerializeAsString());
    keep(a);
    // An Attend and a Score carrying their append (the decode path in one round trip).
    v1::AttendRequest aa = a;
    *aa.mutable_items(0)->mutable_append() =
        MakeAppend("fz", 0, 40, Slice(k, kv, T, d, 40, 1), Slice(v, kv, T, d, 40, 1), kv, 1, d);
    unary.emplace_back("/kvq.v1.Kvq/Attend", aa.SerializeAsString());
    keep(aa);
    v1::ScoreRequest sa = r;
    *sa.mutable_items(0)->mutable_append() = aa.items(0).append();
    unary.emplace_back("/kvq.v1.Kvq/Score", sa.SerializeAsString());
    keep(sa);
    v1::ReadoutRequest ro;
    auto* ri = ro.add_items();
    ri->set_sequence_id("fz");
    *ri->mutable_weights() = TensorF32(std::vector<float>(qh * 2 * 40, 0.025f), {qh, 2, 40});
    unary.emplace_back("/kvq.v1.Kvq/Readout", ro.SerializeAsString());
    keep(ro);
    v1::GetModelRequest gm;
    gm.set_model("tiny");
    unary.emplace_back("/kvq.v1.Kvq/GetModel", gm.SerializeAsString());
    keep(gm);
    v1::DeleteSequenceRequest del;
    del.set_sequence_id("fz");
    unary.emplace_back("/kvq.v1.Kvq/DeleteSequence", del.SerializeAsString());
    keep(del);
    Shape other = s;
    other.model = "fuzzmodel";
    unary.emplace_back("/kvq.v1.Kvq/RegisterBasis", MakeRegister(other, 9).SerializeAsString());
    keep(MakeRegister(other, 9));
    unary.emplace_back("/kvq.v1.Kvq/Stats", v1::StatsRequest().SerializeAsString());
    keep(v1::StatsRequest());
  }
  v1::PutBlocksRequest put_fz;
  {
    v1::Append a = MakeAppend("fz", 0, 0, Slice(k, kv, T, d, 0, 40), Slice(v, kv, T, d, 0, 40), kv,
                              40, d, "tiny");
    for (int t = 0; t < 40; ++t) a.add_token_ids(100 + t);
    *put_fz.add_appends() = a;
  }
  const std::string put_bytes = put_fz.SerializeAsString();
  v1::GetBlocksRequest gb;
  gb.set_sequence_id("fz");
  const std::string gb_bytes = gb.SerializeAsString();

  grpc::GenericStub gs(ts.Channel());
  // Damaged strings are often invalid UTF-8, which protobuf logs on every parse: silence it.
  google::protobuf::SetLogHandler(nullptr);
  // KVQ_FUZZ_SEED and KVQ_FUZZ_ITERS run it longer or elsewhere (CI: the defaults).
  const char* seed_env = std::getenv("KVQ_FUZZ_SEED");
  const char* iters_env = std::getenv("KVQ_FUZZ_ITERS");
  const uint32_t seed =
      seed_env ? static_cast<uint32_t>(std::strtoul(seed_env, nullptr, 10)) : 20261129u;
  const int iters = iters_env ? std::atoi(iters_env) : 3000;
  std::mt19937 rng(seed);
  std::map<int, int> codes;
  int sent = 0, stream_sent = 0;
  for (int i = 0; i < iters; ++i) {
    // Now and then a valid write of "fz", so that reads of it find data to misread.
    if (i % 50 == 0) {
      v1::PutBlocksResponse r;
      Put(*stub, {put_fz}, &r);
    }
    const int pick = static_cast<int>(rng() % (unary.size() + 2));
    if (pick < static_cast<int>(unary.size())) {
      std::string bytes;
      if (rng() % 2) {
        std::unique_ptr<google::protobuf::Message> m(protos[pick]->New());
        m->CopyFrom(*protos[pick]);
        for (int r = 0, n = 1 + static_cast<int>(rng() % 3); r < n; ++r) MutateField(m.get(), rng);
        bytes = m->SerializeAsString();
      } else {
        bytes = Mutate(unary[pick].second, rng);
      }
      const grpc::Status st = RawUnary(gs, unary[pick].first, bytes);
      ASSERT_NE(st.error_code(), grpc::StatusCode::UNAVAILABLE) << "server gone at " << i;
      ASSERT_NE(st.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << "hang at " << i;
      ++codes[st.error_code()];
      ++sent;
      continue;
    }
    // Streams: the damaged bytes parsed as the message type (when they still parse).
    const bool is_put = pick == static_cast<int>(unary.size());
    std::string bytes;
    if (rng() % 2) {
      v1::PutBlocksRequest pm = put_fz;
      v1::GetBlocksRequest gm = gb;
      google::protobuf::Message* m = is_put ? static_cast<google::protobuf::Message*>(&pm) : &gm;
      for (int r = 0, n = 1 + static_cast<int>(rng() % 3); r < n; ++r) MutateField(m, rng);
      bytes = m->SerializeAsString();
    } else {
      bytes = Mutate(is_put ? put_bytes : gb_bytes, rng);
    }
    grpc::Status st;
    if (is_put) {
      v1::PutBlocksRequest m;
      if (!m.ParseFromString(bytes)) continue;
      v1::PutBlocksResponse r;
      st = Put(*stub, {m}, &r);
    } else {
      v1::GetBlocksRequest m;
      if (!m.ParseFromString(bytes)) continue;
      auto ctx = Ctx();
      auto reader = stub->GetBlocks(ctx.get(), m);
      v1::GetBlocksResponse resp;
      while (reader->Read(&resp)) {
      }
      st = reader->Finish();
    }
    ASSERT_NE(st.error_code(), grpc::StatusCode::UNAVAILABLE) << "server gone at " << i;
    ASSERT_NE(st.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << "hang at " << i;
    ++codes[st.error_code()];
    ++stream_sent;
  }
  for (const auto& [code, n] : codes) std::printf("code %d: %d calls\n", code, n);
  EXPECT_GT(sent, iters * 2 / 3);
  EXPECT_GT(stream_sent, iters / 30);
  // Damage that still parses reaches the server's validation (INVALID_ARGUMENT naming the
  // field); damage that does not parse is refused by gRPC itself before any handler runs
  // (UNIMPLEMENTED, gRPC 1.51's answer to an unparsable request); some requests still make
  // sense (OK). Nothing is UNKNOWN or INTERNAL: every failure was a deliberate status.
  EXPECT_GT(codes[grpc::StatusCode::INVALID_ARGUMENT], iters / 30);
  EXPECT_GT(codes[grpc::StatusCode::UNIMPLEMENTED], iters / 30);
  EXPECT_GT(codes[grpc::StatusCode::OK], iters / 300);
  EXPECT_EQ(codes[grpc::StatusCode::UNKNOWN], 0);
  EXPECT_EQ(codes[grpc::StatusCode::INTERNAL], 0);

  // Still serving; the sequence stored before reads back bit for bit.
  auto health = grpc::health::v1::Health::NewStub(ts.Channel());
  grpc::health::v1::HealthCheckRequest hreq;
  grpc::health::v1::HealthCheckResponse hresp;
  auto hctx = Ctx();
  ASSERT_TRUE(health->Check(hctx.get(), hreq, &hresp).ok());
  EXPECT_EQ(hresp.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_EQ(score_ref(0), before0);
  EXPECT_EQ(score_ref(1), before1);
}

}  // namespace
}  // namespace kvq::testing
