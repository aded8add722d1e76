// kvq-bench-service: the service over loopback gRPC, each call next to Echo carrying the same
// bytes in the same run. PutBlocks ingest (GB/s of fp16 K+V in) and Score / Attend latency
// percentiles at a given cached context.
//
//   kvq-bench-service [--server ADDR] [--context 4096] [--layers 4] [--iters 1000]
//                     [--kv-heads 3] [--q-heads 9] [--head-dim 64] [--workers 0] [--reps 7]
// Without --server an in-process kvq server on 127.0.0.1:0 is started (same machine, same
// cores: client and server compete, as on a single loopback host).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "tests/server/test_util.h"

namespace kvq::testing {
namespace {

using Clock = std::chrono::steady_clock;

struct Stats {
  std::vector<double> ms;
  double Pct(double p) const {
    std::vector<double> s = ms;
    std::sort(s.begin(), s.end());
    if (s.empty()) return 0;
    const size_t i = std::min(s.size() - 1, static_cast<size_t>(p / 100.0 * s.size()));
    return s[i];
  }
};

void Row(const char* name, const Stats& s, size_t bytes) {
  std::printf("%-22s %7zu %10zu %8.3f %8.3f %8.3f %8.3f\n", name, s.ms.size(), bytes, s.Pct(50),
              s.Pct(90), s.Pct(99), s.Pct(100));
}

double Ms(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

int Main(int argc, char** argv) {
  std::string server;
  int context = 4096, layers = 4, iters = 1000, kv = 3, qh = 9, d = 64, workers = 0, reps = 7;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) {
      std::printf(
          "kvq-bench-service: PutBlocks ingest and Score / Attend latency over loopback gRPC, each "
          "next to Echo of the same bytes.\n"
          "  kvq-bench-service [--server ADDR] [--context 4096] [--layers 4] [--iters 1000]\n"
          "                    [--kv-heads 3] [--q-heads 9] [--head-dim 64] [--workers 0] "
          "[--reps 7]\n"
          "Without --server an in-process server on 127.0.0.1:0 is started. docs/BENCHMARKS.md "
          "(Service).\n");
      return 0;
    }
  }
  if (argc % 2 == 0) {
    std::fprintf(stderr, "%s needs a value (--help)\n", argv[argc - 1]);
    return 2;
  }
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string f = argv[i], v = argv[i + 1];
    auto num = [&](int* p) {
      if (!absl::SimpleAtoi(v, p)) {
        std::fprintf(stderr, "bad %s\n", f.c_str());
        std::exit(2);
      }
    };
    if (f == "--server")
      server = v;
    else if (f == "--context")
      num(&context);
    else if (f == "--layers")
      num(&layers);
    else if (f == "--iters")
      num(&iters);
    else if (f == "--kv-heads")
      num(&kv);
    else if (f == "--q-heads")
      num(&qh);
    else if (f == "--head-dim")
      num(&d);
    else if (f == "--workers")
      num(&workers);
    else if (f == "--reps")
      num(&reps);
    else {
      std::fprintf(stderr, "unknown flag %s\n", f.c_str());
      return 2;
    }
  }
  std::unique_ptr<TestServer> local;
  std::shared_ptr<grpc::Channel> channel;
  if (server.empty()) {
    server::ServerOptions o;
    o.workers = workers;
    o.capacity_bytes = int64_t{8} << 30;
    local = std::make_unique<TestServer>(o);
    channel = local->Channel();
    server = local->address();
  } else {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(256 << 20);
    args.SetMaxSendMessageSize(256 << 20);
    channel = grpc::CreateCustomChannel(server, grpc::InsecureChannelCredentials(), args);
  }
  auto stub = v1::Kvq::NewStub(channel);
  Shape s;
  s.model = "bench";
  s.layers = layers;
  s.kv_heads = kv;
  s.q_heads = qh;
  s.head_dim = d;
  s.basis_rank = std::min(8, d);
  {
    v1::RegisterBasisResponse r;
    auto ctx = Ctx();
    grpc::Status st = stub->RegisterBasis(ctx.get(), MakeRegister(s, 1), &r);
    if (!st.ok()) {
      std::fprintf(stderr, "RegisterBasis: %s\n", st.error_message().c_str());
      return 1;
    }
  }
  auto echo = [&](size_t bytes) {
    v1::EchoRequest req;
    req.set_payload(std::string(bytes, 'x'));
    v1::EchoResponse resp;
    auto ctx = Ctx();
    const auto t0 = Clock::now();
    grpc::Status st = stub->Echo(ctx.get(), req, &resp);
    const double ms = Ms(t0, Clock::now());
    if (!st.ok()) std::fprintf(stderr, "Echo: %s\n", st.error_message().c_str());
    return ms;
  };

  // ---- PutBlocks ingest: sequences of `context` tokens x `layers`, 512-token messages.
  const int64_t chunk = std::min(512, context);
  auto k = RandomKV(kv, context, d, 1), v = RandomKV(kv, context, d, 2);
  std::vector<v1::PutBlocksRequest> msgs;
  size_t msg_bytes = 0;
  for (int64_t from = 0; from < context; from += chunk) {
    const int64_t n = std::min<int64_t>(chunk, context - from);
    v1::PutBlocksRequest m;
    for (int l = 0; l < layers; ++l) {
      *m.add_appends() = MakeAppend("", l, from, Slice(k, kv, context, d, from, n),
                                    Slice(v, kv, context, d, from, n), kv, n, d, "bench");
    }
    msg_bytes = std::max(msg_bytes, m.ByteSizeLong());
    msgs.push_back(std::move(m));
  }
  const double fp16_bytes = 2.0 * kv * context * d * 2 * layers;  // K and V, fp16
  // Interleaved per repetition (PutBlocks, store only, Echo) so that noise from other work on
  // the machine hits all three alike; the median repetition is reported.
  const std::string kb = ToF16Bytes(k), vb = ToF16Bytes(v);
  std::vector<double> put_gbps, echo_gbps, store_gbps;
  for (int r = 0; r < reps; ++r) {
    const std::string id = absl::StrCat("ingest", r);
    for (auto& m : msgs) {
      for (auto& a : *m.mutable_appends()) a.set_sequence_id(id);
    }
    v1::PutBlocksResponse resp;
    auto t0 = Clock::now();
    grpc::Status st = Put(*stub, msgs, &resp);
    put_gbps.push_back(fp16_bytes / (Ms(t0, Clock::now()) / 1000) / 1e9);
    if (!st.ok()) {
      std::fprintf(stderr, "PutBlocks: %s\n", st.error_message().c_str());
      return 1;
    }
    double echo_s = 0;
    for (const auto& m : msgs) echo_s += echo(m.ByteSizeLong()) / 1000;
    echo_gbps.push_back(fp16_bytes / echo_s / 1e9);
    if (!local) continue;
    // The same appends straight into core::Store: the encode cost without gRPC.
    const std::string direct = absl::StrCat("direct", r);
    t0 = Clock::now();
    for (int64_t from = 0; from < context; from += chunk) {
      const int64_t n = std::min<int64_t>(chunk, context - from);
      std::vector<core::AppendSpec> batch;
      for (int l = 0; l < layers; ++l) {
        core::AppendSpec a;
        a.sequence_id = direct;
        a.layer = l;
        a.start = from;
        a.model = "bench";
        a.keys = core::TensorView::Contiguous(kb.data(), core::DType::kF16, {kv, context, d});
        a.values = core::TensorView::Contiguous(vb.data(), core::DType::kF16, {kv, context, d});
        for (core::TensorView* t : {&a.keys, &a.values}) {  // tokens [from, from + n)
          t->data = static_cast<const uint8_t*>(t->data) + from * d * 2;
          t->shape[1] = n;
        }
        batch.push_back(a);
      }
      core::AppendOutcome out;
      absl::Status ast = local->server().store().Append("default", batch, &out);
      if (!ast.ok()) std::fprintf(stderr, "store Append: %s\n", ast.ToString().c_str());
    }
    store_gbps.push_back(fp16_bytes / (Ms(t0, Clock::now()) / 1000) / 1e9);
    (void)local->server().store().Delete("default", direct);
  }
  auto median = [](std::vector<double> x) {
    std::sort(x.begin(), x.end());
    return x.empty() ? 0.0 : x[x.size() / 2];
  };
  auto best = [](const std::vector<double>& x) {
    return x.empty() ? 0.0 : *std::max_element(x.begin(), x.end());
  };
  std::printf(
      "# kvq-bench-service  server=%s%s  context=%d layers=%d kv_heads=%d q_heads=%d "
      "head_dim=%d\n",
      server.c_str(), local ? " (in-process)" : "", context, layers, kv, qh, d);
  std::printf(
      "ingest of %.1f MB fp16 K+V per sequence in %zu messages of <= %.1f MB, %d reps "
      "(GB/s of fp16 in: median, best)\n",
      fp16_bytes / 1e6, msgs.size(), msg_bytes / 1e6, reps);
  std::printf("  PutBlocks stream     %.3f  %.3f\n", median(put_gbps), best(put_gbps));
  std::printf(
      "  Echo same bytes      %.3f  %.3f  (a unary Echo per message; it carries the bytes "
      "back too)\n",
      median(echo_gbps), best(echo_gbps));
  if (local) {
    std::printf("  core::Store only     %.3f  %.3f  (the same appends, no gRPC)\n",
                median(store_gbps), best(store_gbps));
  }
  std::printf("\n");

  // ---- Prefix sharing: a prompt of `context` tokens already indexed (sent once with token
  // ids), then requests with that prompt plus `tail` new tokens, three ways.
  {
    const int64_t tail = 64, total = context + tail;
    auto pk = RandomKV(kv, total, d, 11), pv = RandomKV(kv, total, d, 12);
    std::vector<uint32_t> ids(total);
    for (int64_t i = 0; i < total; ++i) ids[i] = static_cast<uint32_t>(7 * i + 1);
    // Messages of <= chunk tokens over [from, to), every layer; data and/or ids. Each request
    // has its own new tokens (salt), as different questions after one system prompt.
    auto build = [&](const std::string& id, int64_t from, int64_t to, bool data, bool with_ids,
                     uint32_t salt) {
      std::vector<v1::PutBlocksRequest> out;
      for (int64_t at = from; at < to; at += chunk) {
        const int64_t n = std::min<int64_t>(chunk, to - at);
        v1::PutBlocksRequest m;
        for (int l = 0; l < layers; ++l) {
          v1::Append a;
          if (data) {
            a = MakeAppend(id, l, at, Slice(pk, kv, total, d, at, n),
                           Slice(pv, kv, total, d, at, n), kv, n, d, "bench");
          } else {
            a.set_sequence_id(id);
            a.set_layer(l);
            a.set_start(at);
            a.set_model("bench");
          }
          if (with_ids) {
            for (int64_t t = at; t < at + n; ++t) {
              a.add_token_ids(ids[t] + (t >= context ? salt * 100003u : 0u));
            }
          }
          *m.add_appends() = std::move(a);
        }
        out.push_back(std::move(m));
      }
      return out;
    };
    auto put = [&](const std::vector<v1::PutBlocksRequest>& m, v1::PutBlocksResponse* r) {
      grpc::Status st = Put(*stub, m, r);
      if (!st.ok()) std::fprintf(stderr, "PutBlocks: %s\n", st.error_message().c_str());
    };
    auto stored = [&]() {
      v1::StatsResponse r;
      auto ctx = Ctx();
      (void)stub->Stats(ctx.get(), v1::StatsRequest(), &r);
      return r.stored_bytes();
    };
    v1::PutBlocksResponse r;
    put(build("prompt", 0, context, true, true, 0), &r);  // indexes the prompt's groups
    std::vector<double> plain, dedupe, attach;
    int64_t bytes_plain = 0, bytes_shared = 0, shared_tokens = 0;
    for (int rep = 0; rep < reps; ++rep) {
      const std::string a = absl::StrCat("plain", rep), b = absl::StrCat("dedupe", rep),
                        c = absl::StrCat("attach", rep);
      const auto ma = build(a, 0, total, true, false, 0);
      const auto mb = build(b, 0, total, true, true, 3 * rep + 1);
      const auto mc = build(c, 0, context, false, true, 0);
      const auto mc_tail = build(c, context, total, true, true, 3 * rep + 2);
      int64_t before = stored();
      auto t0 = Clock::now();
      put(ma, &r);
      plain.push_back(Ms(t0, Clock::now()));
      bytes_plain = stored() - before;
      t0 = Clock::now();
      put(mb, &r);
      dedupe.push_back(Ms(t0, Clock::now()));
      before = stored();
      t0 = Clock::now();
      put(mc, &r);  // the attach answers how far the index reached: the tail starts there
      shared_tokens = r.tokens_shared();
      put(mc_tail, &r);
      attach.push_back(Ms(t0, Clock::now()));
      bytes_shared = stored() - before;
      for (const std::string& id : {a, b, c}) {
        v1::DeleteSequenceRequest dr;
        dr.set_sequence_id(id);
        v1::DeleteSequenceResponse dresp;
        auto ctx = Ctx();
        (void)stub->DeleteSequence(ctx.get(), dr, &dresp);
      }
    }
    const double base = median(plain);
    std::printf(
        "prefix sharing: a %d-token prompt already indexed + %lld new tokens, %d layers, %d reps "
        "(ms per request: median; ratio to the plain put)\n",
        context, static_cast<long long>(tail), layers, reps);
    std::printf("  PutBlocks, data, no ids           %9.3f  1.00x\n", base);
    std::printf("  PutBlocks, data + ids (dedupe)    %9.3f  %.2fx\n", median(dedupe),
                median(dedupe) / base);
    std::printf("  attach by ids + tail with data    %9.3f  %.3fx\n", median(attach),
                median(attach) / base);
    std::printf("  bytes added per request: plain %lld, attach %lld (%.3fx); tokens shared %lld\n",
                static_cast<long long>(bytes_plain), static_cast<long long>(bytes_shared),
                bytes_plain ? static_cast<double>(bytes_shared) / bytes_plain : 0.0,
                static_cast<long long>(shared_tokens));
    std::printf("\n");
  }

  // ---- Score / Attend latency at `context` cached tokens (layer 0 of "ingest0").
  std::printf("%-22s %7s %10s %8s %8s %8s %8s\n", "call", "n", "bytes", "p50_ms", "p90_ms",
              "p99_ms", "max_ms");
  auto q = RandomQueries(qh, 1, d, 3);
  v1::ScoreRequest sreq;
  {
    auto* it = sreq.add_items();
    it->set_sequence_id("ingest0");
    *it->mutable_queries() = TensorF32(q, {qh, 1, d});
  }
  v1::AttendRequest areq;
  for (int b = 0; b < 1; ++b) {
    auto* it = areq.add_items();
    it->set_sequence_id("ingest0");
    it->set_observe(false);
    *it->mutable_queries() = TensorF32(q, {qh, 1, d});
  }
  v1::AttendRequest areq3;  // a decode batch: 3 sequences, one item each
  for (int b = 0; b < 3; ++b) {
    auto* it = areq3.add_items();
    it->set_sequence_id(absl::StrCat("ingest", b));
    it->set_observe(false);
    *it->mutable_queries() = TensorF32(q, {qh, 1, d});
  }
  auto run = [&](const char* name, auto call) {
    Stats st, es;
    size_t bytes = 0;
    for (int i = 0; i < iters / 10; ++i) call(&bytes);  // warm-up
    for (int i = 0; i < iters; ++i) {
      st.ms.push_back(call(&bytes));
      es.ms.push_back(echo(bytes / 2));  // Echo moves its payload both ways: same total bytes
    }
    Row(name, st, bytes);
    Row(absl::StrCat("  echo same bytes").c_str(), es, bytes);
  };
  if (local) {  // the same work without gRPC: core::Store in this process
    Stats sc, at;
    std::vector<float> out;
    core::AttendOptions ao;
    ao.observe = false;
    for (int i = 0; i < iters; ++i) {
      auto t0 = Clock::now();
      absl::Status scored =
          local->server()
              .store()
              .Score({"default", "ingest0", 0, 0}, {q.data(), qh, 1, d}, 0, false, &out)
              .status();
      auto t1 = Clock::now();
      absl::Status attended =
          local->server()
              .store()
              .Attend({"default", "ingest0", 0, 0}, {q.data(), qh, 1, d}, ao, &out)
              .status();
      auto t2 = Clock::now();
      if (!scored.ok() || !attended.ok()) std::fprintf(stderr, "store-only call failed\n");
      sc.ms.push_back(Ms(t0, t1));
      at.ms.push_back(Ms(t1, t2));
    }
    Row("Score, store only", sc, 0);
    Row("Attend, store only", at, 0);
  }
  run("Score 1 item", [&](size_t* bytes) {
    v1::ScoreResponse resp;
    auto ctx = Ctx();
    const auto t0 = Clock::now();
    grpc::Status st = stub->Score(ctx.get(), sreq, &resp);
    const double ms = Ms(t0, Clock::now());
    if (!st.ok() || resp.results(0).status().code() != 0) std::fprintf(stderr, "Score failed\n");
    *bytes = sreq.ByteSizeLong() + resp.ByteSizeLong();
    return ms;
  });
  run("Attend 1 item", [&](size_t* bytes) {
    v1::AttendResponse resp;
    auto ctx = Ctx();
    const auto t0 = Clock::now();
    grpc::Status st = stub->Attend(ctx.get(), areq, &resp);
    const double ms = Ms(t0, Clock::now());
    if (!st.ok() || resp.results(0).status().code() != 0) std::fprintf(stderr, "Attend failed\n");
    *bytes = areq.ByteSizeLong() + resp.ByteSizeLong();
    return ms;
  });
  run("Attend batch of 3", [&](size_t* bytes) {
    v1::AttendResponse resp;
    auto ctx = Ctx();
    const auto t0 = Clock::now();
    grpc::Status st = stub->Attend(ctx.get(), areq3, &resp);
    const double ms = Ms(t0, Clock::now());
    if (!st.ok()) std::fprintf(stderr, "Attend failed\n");
    *bytes = areq3.ByteSizeLong() + resp.ByteSizeLong();
    return ms;
  });

  // ---- A decode step, every layer: PutBlocks of the new token then Attend (two round trips)
  // against Attend items that carry their append (one round trip), alternating, on two
  // sequences of `context` tokens.
  {
    for (const char* id : {"dec_two", "dec_one"}) {
      for (auto& m : msgs) {
        for (auto& a : *m.mutable_appends()) a.set_sequence_id(id);
      }
      v1::PutBlocksResponse r;
      (void)Put(*stub, msgs, &r);
    }
    auto tk = RandomKV(kv, 1, d, 21), tv = RandomKV(kv, 1, d, 22);
    Stats two, one;
    const int steps = std::max(10, iters / 4);
    for (int t = 0; t < steps; ++t) {
      const int64_t pos = context + t;
      v1::PutBlocksRequest put;
      v1::AttendRequest att2, att1;
      for (int l = 0; l < layers; ++l) {
        *put.add_appends() = MakeAppend("dec_two", l, pos, tk, tv, kv, 1, d);
        for (auto* req : {&att2, &att1}) {
          auto* it = req->add_items();
          it->set_sequence_id(req == &att2 ? "dec_two" : "dec_one");
          it->set_layer(l);
          *it->mutable_queries() = TensorF32(q, {qh, 1, d});
          if (req == &att1) *it->mutable_append() = MakeAppend("dec_one", l, pos, tk, tv, kv, 1, d);
        }
      }
      v1::PutBlocksResponse pr;
      v1::AttendResponse r2, r1;
      auto t0 = Clock::now();
      (void)Put(*stub, {put}, &pr);
      auto c2 = Ctx();
      (void)stub->Attend(c2.get(), att2, &r2);
      auto t1 = Clock::now();
      auto c1 = Ctx();
      grpc::Status st = stub->Attend(c1.get(), att1, &r1);
      auto t2 = Clock::now();
      if (!st.ok() || r1.results(0).status().code() != 0) std::fprintf(stderr, "step failed\n");
      two.ms.push_back(Ms(t0, t1));
      one.ms.push_back(Ms(t1, t2));
    }
    std::printf("\ndecode step over %d layers at %d tokens (ms; ratio of medians %.2fx)\n", layers,
                context, one.Pct(50) / two.Pct(50));
    Row("PutBlocks + Attend", two, 0);
    Row("Attend with append", one, 0);
  }
  return 0;
}

}  // namespace
}  // namespace kvq::testing

int main(int argc, char** argv) { return kvq::testing::Main(argc, argv); }
