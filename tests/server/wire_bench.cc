// kvq-bench-wire: codes on the wire against fp16 rows, for the server's default codec and the
// B = 3 codecs chosen for both evaluation models, on the models' shapes (SmolLM2-135M: 30 layers,
// 3 KV heads; Qwen2.5-0.5B: 24 layers, 2 KV heads; head_dim 64), random K/V in fp16.
//
// Per configuration, each repetition puts one sequence of --tokens tokens on every layer as rows
// and as codes (encoded by the client, kvq::client::ModelCodes), then gets both back as rows and
// as codes (decoded by the client). Measured:
//   * bytes on the wire, both directions, framing included (HTTP/2, gRPC and TCP payload: the
//     client talks to the server through a relay on 127.0.0.1 that counts every byte it
//     forwards), per token and layer, and codes / rows;
//   * put and get throughput over loopback (tokens/s and GB/s of fp16 K+V equivalent), codes
//     with the client's encode (overlapping the transfer: PutBlocksStream) or decode (one message
//     ahead of the stream: DecodeAhead) included;
//   * the client's encode and decode speed against a memcpy of the same fp16 bytes in the same
//     run (the ratio is the figure; the memcpy is the baseline): the encode while the transfer
//     runs (the server storing other layers on the same cores), and both alone (every layer
//     encoded and every message of the first get decoded again after the transfers).
// Client, relay and server share the machine's cores. Medians of --reps repetitions.
// --server IP:PORT measures against a kvq-server started elsewhere instead of one in this
// process (scripts/bench-link.sh: one in a network namespace behind a rate-limited veth pair);
// --only TEXT keeps the configurations whose name contains TEXT; --delay-us N has the relay hold
// each direction's bytes back N microseconds (a round trip of 2N).
//
//   kvq-bench-wire [--tokens 4096] [--reps 3] [--chunk 1024] [--server IP:PORT] [--only TEXT]
//                  [--delay-us N]
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "kvq/client/client.h"
#include "kvq/client/codes.h"
#include "kvq/client/decode_ahead.h"
#include "kvq/format/block_format.h"
#include "tests/server/test_util.h"

namespace kvq::testing {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

double Median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  return x.empty() ? 0.0 : x[x.size() / 2];
}

// A TCP relay on 127.0.0.1:0 to target_ip:target_port, counting the bytes it forwards each way
// and, with delay_us > 0, holding each read back that long before writing it on (a delay line
// per direction: the link's one-way delay, which tc's netem would add where the kernel has it).
class CountingRelay {
 public:
  CountingRelay(std::string target_ip, int target_port, int delay_us)
      : target_ip_(std::move(target_ip)), target_(target_port), delay_(delay_us) {
    listen_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    bind(listen_, reinterpret_cast<sockaddr*>(&a), sizeof a);
    listen(listen_, 16);
    socklen_t len = sizeof a;
    getsockname(listen_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    accepter_ = std::thread([this] { Accept(); });
  }
  ~CountingRelay() {
    stop_ = true;
    shutdown(listen_, SHUT_RDWR);
    close(listen_);
    accepter_.join();
    for (auto& t : pumps_) t.join();
  }
  int port() const { return port_; }
  int64_t bytes() const { return up_ + down_; }

 private:
  void Accept() {
    while (!stop_) {
      const int c = accept(listen_, nullptr, nullptr);
      if (c < 0) return;
      const int s = ConnectTo(target_ip_, target_);
      if (s < 0) {
        close(c);
        continue;
      }
      // Each direction ends by shutting down its write side; the second to end closes both.
      auto open = std::make_shared<std::atomic<int>>(2);
      pumps_.emplace_back([this, c, s, open] { Forward(c, s, &up_, open.get(), c, s); });
      pumps_.emplace_back([this, c, s, open] { Forward(s, c, &down_, open.get(), c, s); });
    }
  }
  // Copies `from` to `to` through a delay line of delay_ microseconds (none at 0).
  void Forward(int from, int to, std::atomic<int64_t>* counted, std::atomic<int>* open, int c,
               int s) {
    struct Chunk {
      Clock::time_point due;
      std::string bytes;
    };
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Chunk> line;
    bool done = false;
    std::thread writer([&] {
      for (;;) {
        Chunk ch;
        {
          std::unique_lock<std::mutex> l(mu);
          cv.wait(l, [&] { return done || !line.empty(); });
          if (line.empty()) return;
          ch = std::move(line.front());
          line.pop_front();
        }
        std::this_thread::sleep_until(ch.due);
        for (size_t off = 0; off < ch.bytes.size();) {
          const ssize_t w = write(to, ch.bytes.data() + off, ch.bytes.size() - off);
          if (w <= 0) return;
          off += static_cast<size_t>(w);
        }
      }
    });
    std::vector<char> buf(1 << 16);
    pollfd fd = {from, POLLIN, 0};
    while (!stop_) {
      if (poll(&fd, 1, 100) <= 0) continue;
      const ssize_t n = read(from, buf.data(), buf.size());
      if (n <= 0) break;
      *counted += n;
      std::lock_guard<std::mutex> l(mu);
      line.push_back(
          {Clock::now() + std::chrono::microseconds(delay_), std::string(buf.data(), n)});
      cv.notify_one();
    }
    {
      std::lock_guard<std::mutex> l(mu);
      done = true;
      cv.notify_one();
    }
    writer.join();
    shutdown(to, SHUT_WR);
    if (--*open == 0) {
      close(c);
      close(s);
    }
  }

  std::string target_ip_;
  int target_, delay_, listen_ = -1, port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> up_{0}, down_{0};
  std::thread accepter_;
  std::vector<std::thread> pumps_;
};

struct Config {
  const char* name;
  Shape shape;
  v1::CodecSettings codec;  // over the server's default (unset: the default itself)
};

std::vector<Config> Configs() {
  Shape smol;
  smol.model = "smollm2-shape";
  smol.layers = 30;
  smol.kv_heads = 3;
  smol.q_heads = 9;
  smol.basis_rank = 8;
  Shape qwen = smol;
  qwen.model = "qwen2.5-shape";
  qwen.layers = 24;
  qwen.kv_heads = 2;
  qwen.q_heads = 14;
  // The B = 3 choices (docs/RESULTS.md): SmolLM2 headq-kv2-g128-s4-rotk-mr-sink4, Qwen2.5
  // headq-kv2-g128-vg64-obl-mr-sink4 (metric rounding and the oblique pair change no byte
  // count and are left out here).
  v1::CodecSettings smol3, qwen3;
  smol3.set_key_bits(2);
  smol3.set_rotate_keys(true);
  smol3.set_fp16_sinks(4);
  qwen3.set_key_bits(2);
  qwen3.set_value_group(64);
  qwen3.set_fp16_sinks(4);
  Shape smol_b3 = smol, qwen_b3 = qwen;
  smol_b3.model += "-b3";
  qwen_b3.model += "-b3";
  return {{"SmolLM2 shape, default codec", smol, {}},
          {"SmolLM2 shape, its B = 3 codec", smol_b3, smol3},
          {"Qwen2.5 shape, default codec", qwen, {}},
          {"Qwen2.5 shape, its B = 3 codec", qwen_b3, qwen3}};
}

int Main(int argc, char** argv) {
  int tokens = 4096, reps = 3, chunk = 1024, delay_us = 0;
  std::string server, only;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    if (f == "--help" || f == "-h") {
      std::printf(
          "kvq-bench-wire: bytes on the wire, throughput and client encode/decode speed of codes "
          "against fp16 rows (docs/BENCHMARKS.md, \"Codes on the wire\").\n"
          "  kvq-bench-wire [--tokens 4096] [--reps 3] [--chunk 1024] [--server IP:PORT] "
          "[--only TEXT] [--delay-us N]\n"
          "  --server: a running kvq-server (default: one in this process)\n"
          "  --only: the configurations whose name contains TEXT\n"
          "  --delay-us: one-way delay the relay adds to each direction (RTT = 2N)\n");
      return 0;
    }
    if ((f == "--server" || f == "--only") && i + 1 < argc) {
      (f == "--server" ? server : only) = argv[++i];
      continue;
    }
    int* p = f == "--tokens"     ? &tokens
             : f == "--reps"     ? &reps
             : f == "--chunk"    ? &chunk
             : f == "--delay-us" ? &delay_us
                                 : nullptr;
    if (p == nullptr || i + 1 >= argc || !absl::SimpleAtoi(argv[i + 1], p) ||
        *p < (p == &delay_us ? 0 : 1)) {
      std::fprintf(stderr, "kvq-bench-wire: bad flag %s (--help)\n", f.c_str());
      return 2;
    }
    ++i;
  }
  std::unique_ptr<TestServer> ts;
  if (server.empty()) {
    ts = std::make_unique<TestServer>();
    server = ts->address();
  }
  const size_t colon = server.rfind(':');
  int server_port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(server.substr(colon + 1), &server_port)) {
    std::fprintf(stderr, "kvq-bench-wire: --server %s is not IP:PORT\n", server.c_str());
    return 2;
  }
  const std::string ip =
      server.substr(0, colon) == "localhost" ? "127.0.0.1" : server.substr(0, colon);
  CountingRelay relay(ip, server_port, delay_us);
  client::ClientOptions co;
  co.servers = {absl::StrCat("127.0.0.1:", relay.port())};
  co.timeout = absl::Seconds(300);
  auto c = client::Client::Create(co);
  if (!c.ok()) return 1;
  client::Client& cl = **c;
  std::printf("kvq-bench-wire: %d tokens a layer, %d repetitions (medians)\n", tokens, reps);
  std::printf("%-32s %-6s %12s %12s %8s %10s %10s %9s\n", "configuration", "call", "rows B/t/l",
              "codes B/t/l", "ratio", "rows GB/s", "codes GB/s", "codes/rows");
  for (const Config& cfg : Configs()) {
    if (std::string(cfg.name).find(only) == std::string::npos) continue;
    const Shape& s = cfg.shape;
    v1::RegisterBasisRequest reg = MakeRegister(s, 11);
    if (cfg.codec.ByteSizeLong() > 0) *reg.mutable_info()->mutable_codec() = cfg.codec;
    if (!cl.RegisterBasis(reg).ok()) return 1;
    auto basis = cl.GetBasis(s.model);
    if (!basis.ok()) return 1;
    auto codes = client::ModelCodes::Create(*basis);
    if (!codes.ok()) return 1;
    const core::CodecOptions codec = *(*codes)->CodecOf(v1::CodecSettings());
    const int kv = s.kv_heads, d = s.head_dim, L = s.layers;
    std::vector<std::string> kb(L), vb(L);
    for (int l = 0; l < L; ++l) {
      kb[l] = ToF16Bytes(RandomKV(kv, tokens, d, 100 + l));
      vb[l] = ToF16Bytes(RandomKV(kv, tokens, d, 200 + l));
    }
    const double fp16_bytes = 2.0 * L * kv * tokens * d * 2;  // K and V
    const double token_layers = static_cast<double>(tokens) * L;
    std::vector<double> put_rows_b, put_codes_b, get_rows_b, get_codes_b;
    std::vector<double> put_rows_s, put_codes_s, get_rows_s, get_codes_s, enc_s, copy_s;
    std::vector<double> enc_alone_s, dec_alone_s;
    std::vector<v1::GetBlocksResponse> got;  // the codes of the first get, decoded again alone
    std::vector<core::CodecOptions> got_codec(L);
    for (int r = 0; r < reps; ++r) {
      // Rows: chunk-token appends, one message each (what kvq seq put sends).
      std::vector<v1::PutBlocksRequest> rows;
      for (int l = 0; l < L; ++l) {
        for (int t0 = 0; t0 < tokens; t0 += chunk) {
          const int n = std::min(chunk, tokens - t0);
          v1::Append* a = rows.emplace_back().add_appends();
          a->set_sequence_id("rows");
          a->set_layer(l);
          a->set_start(t0);
          if (l == 0 && t0 == 0) a->set_model(s.model);
          for (auto [src, t] :
               {std::pair{&kb[l], a->mutable_keys()}, std::pair{&vb[l], a->mutable_values()}}) {
            t->set_dtype(v1::DTYPE_F16);
            for (int64_t dim : {int64_t{kv}, int64_t{n}, int64_t{d}}) t->add_shape(dim);
            for (int h = 0; h < kv; ++h) {
              t->mutable_data()->append(*src, (static_cast<size_t>(h) * tokens + t0) * d * 2,
                                        static_cast<size_t>(n) * d * 2);
            }
          }
        }
      }
      int64_t b0 = relay.bytes();
      auto t0 = Clock::now();
      if (!cl.PutBlocks(rows).ok()) return 1;
      put_rows_s.push_back(Seconds(t0, Clock::now()));
      put_rows_b.push_back(static_cast<double>(relay.bytes() - b0));
      // Codes: each layer encoded here as the stream reaches it (PutBlocksStream), so that the
      // encode of one layer overlaps the transfer of the ones before, as kvq seq put does.
      int next_layer = 0;
      std::vector<v1::Append> pending;
      size_t sent = 0;
      double encoding = 0;
      auto next = [&](v1::PutBlocksRequest* m) -> absl::StatusOr<bool> {
        while (sent == pending.size()) {
          if (next_layer == L) return false;
          const auto e0 = Clock::now();
          auto view = [&](const std::string& b) {
            return core::TensorView::Contiguous(b.data(), core::DType::kF16, {kv, tokens, d});
          };
          const int l = next_layer++;
          absl::StatusOr<std::vector<v1::Append>> appends =
              (*codes)->EncodeLayer("codes", l, codec, view(kb[l]), view(vb[l]), chunk);
          if (!appends.ok()) return appends.status();
          pending = std::move(*appends);
          sent = 0;
          encoding += Seconds(e0, Clock::now());
        }
        *m->add_appends() = std::move(pending[sent++]);
        return true;
      };
      b0 = relay.bytes();
      t0 = Clock::now();
      if (!cl.PutBlocksStream("codes", next).ok()) return 1;
      enc_s.push_back(encoding);
      put_codes_s.push_back(Seconds(t0, Clock::now()));
      put_codes_b.push_back(static_cast<double>(relay.bytes() - b0));
      // The baseline of the client's codec: a memcpy of the same fp16 bytes.
      std::vector<char> dst(kb[0].size());
      t0 = Clock::now();
      for (int l = 0; l < L; ++l) {
        std::memcpy(dst.data(), kb[l].data(), kb[l].size());
        std::memcpy(dst.data(), vb[l].data(), vb[l].size());
      }
      copy_s.push_back(Seconds(t0, Clock::now()));
      // Get: rows, then codes decoded here.
      for (const bool as_codes : {false, true}) {
        v1::GetBlocksRequest req;
        req.set_sequence_id(as_codes ? "codes" : "rows");
        req.set_dtype(v1::DTYPE_F16);
        req.set_codes(as_codes);
        req.set_max_block_version(format::kMaxVersion);
        req.set_max_tokens_per_message(chunk);
        std::vector<core::CodecOptions> layer_codec(L);
        std::vector<uint8_t> k, v;
        absl::Status bad;
        b0 = relay.bytes();
        t0 = Clock::now();
        // In codes: decoded one message ahead of the stream (the client library's
        // DecodeAhead).
        client::DecodeAhead ahead(**codes, core::DType::kF16,
                                  [&](const v1::GetBlocksResponse&, std::vector<uint8_t>&,
                                      std::vector<uint8_t>&) { return absl::OkStatus(); });
        absl::Status st = cl.GetBlocks(req, [&](const v1::GetBlocksResponse& m) {
          if (!as_codes) return true;
          if (m.has_codec()) layer_codec[m.layer()] = *(*codes)->CodecOf(m.codec());
          if (r == 0) got.push_back(m);
          return ahead.Push(m);
        });
        bad = ahead.Finish();
        const double took = Seconds(t0, Clock::now());
        if (!st.ok() || !bad.ok()) return 1;
        (as_codes ? get_codes_s : get_rows_s).push_back(took);
        (as_codes ? get_codes_b : get_rows_b).push_back(static_cast<double>(relay.bytes() - b0));
        if (as_codes) got_codec = layer_codec;
      }
      // The client's codec alone: the same encode and decode with nothing else running.
      auto e0 = Clock::now();
      for (int l = 0; l < L; ++l) {
        auto view = [&](const std::string& b) {
          return core::TensorView::Contiguous(b.data(), core::DType::kF16, {kv, tokens, d});
        };
        if (!(*codes)->EncodeLayer("codes", l, codec, view(kb[l]), view(vb[l]), chunk).ok()) {
          return 1;
        }
      }
      enc_alone_s.push_back(Seconds(e0, Clock::now()));
      std::vector<uint8_t> k, v;
      e0 = Clock::now();
      for (const v1::GetBlocksResponse& m : got) {
        if (!(*codes)->Decode(m, got_codec[m.layer()], core::DType::kF16, &k, &v).ok()) return 1;
      }
      dec_alone_s.push_back(Seconds(e0, Clock::now()));
      (void)cl.DeleteSequence("rows");
      (void)cl.DeleteSequence("codes");
    }
    auto line = [&](const char* call, const std::vector<double>& rb, const std::vector<double>& cb,
                    const std::vector<double>& rs, const std::vector<double>& cs) {
      const double r_b = Median(rb) / token_layers, c_b = Median(cb) / token_layers;
      const double r_gb = fp16_bytes / Median(rs) / 1e9, c_gb = fp16_bytes / Median(cs) / 1e9;
      std::printf("%-32s %-6s %12.1f %12.1f %8.3f %10.3f %10.3f %9.2f\n", cfg.name, call, r_b, c_b,
                  c_b / r_b, r_gb, c_gb, c_gb / r_gb);
    };
    line("put", put_rows_b, put_codes_b, put_rows_s, put_codes_s);
    line("get", get_rows_b, get_codes_b, get_rows_s, get_codes_s);
    const double copy = Median(copy_s);
    std::printf(
        "%-32s client encode in the put %.3f GB/s of fp16; memcpy %.3f GB/s: encode %.2fx "
        "memcpy; %.0f / %.0f tokens/s put / get in codes\n",
        cfg.name, fp16_bytes / Median(enc_s) / 1e9, fp16_bytes / copy / 1e9, copy / Median(enc_s),
        tokens / Median(put_codes_s), tokens / Median(get_codes_s));
    std::printf(
        "%-32s client codec alone: encode %.3f GB/s, decode %.3f GB/s of fp16: encode %.2fx, "
        "decode %.2fx memcpy\n",
        cfg.name, fp16_bytes / Median(enc_alone_s) / 1e9, fp16_bytes / Median(dec_alone_s) / 1e9,
        copy / Median(enc_alone_s), copy / Median(dec_alone_s));
  }
  return 0;
}

}  // namespace
}  // namespace kvq::testing

int main(int argc, char** argv) { return kvq::testing::Main(argc, argv); }
