#include "tests/server/test_util.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <random>

#include "absl/strings/str_cat.h"
#include "kvq/core/half.h"
#include "kvq/core/store.h"

namespace kvq::testing {

core::ModelBasis MakeBasis(const Shape& s, uint64_t seed) {
  core::BasisManifest m;
  m.model = s.model;
  m.version = s.version;
  m.layers = s.layers;
  m.kv_heads = s.kv_heads;
  m.q_heads = s.q_heads;
  m.head_dim = s.head_dim;
  m.rank = s.basis_rank;
  m.kind = "random";
  return core::RandomBasis(m, seed);
}

v1::CodecSettings LegacyCodecSettings(int head_dim) {
  core::BasisManifest m;
  m.head_dim = head_dim;
  const core::CodecOptions c = K2G32Codec(m, false);
  v1::CodecSettings w;
  w.set_key_bits(c.key_bits);
  w.set_key_group(c.key_group);
  w.set_side_bits(c.side_bits);
  w.set_value_bits(c.value_bits);
  w.set_value_group(c.value_group);
  return w;
}

v1::RegisterBasisRequest MakeRegister(const Shape& s, uint64_t seed, int codec_rank) {
  v1::RegisterBasisRequest r;
  v1::ModelInfo* i = r.mutable_info();
  i->set_model(s.model);
  i->set_version(s.version);
  i->set_layers(s.layers);
  i->set_kv_heads(s.kv_heads);
  i->set_q_heads(s.q_heads);
  i->set_head_dim(s.head_dim);
  i->set_basis_rank(s.basis_rank);
  i->set_kind("random");
  if (s.legacy_codec) *i->mutable_codec() = LegacyCodecSettings(s.head_dim);
  if (s.basis_rank > 0) {
    i->mutable_codec()->set_rank(codec_rank);
    core::ModelBasis b = MakeBasis(s, seed);
    const size_t per = static_cast<size_t>(s.kv_heads) * s.head_dim * s.basis_rank;
    for (int l = 0; l < s.layers; ++l) {
      std::vector<float> u(b.u.begin() + l * per, b.u.begin() + (l + 1) * per);
      *r.add_basis() = TensorF32(u, {s.kv_heads, s.head_dim, s.basis_rank});
    }
  }
  return r;
}

core::ModelBasis MakeLeverBasis(const Shape& s, uint64_t seed) {
  core::ModelBasis b = MakeBasis(s, seed);
  b.manifest.kind = "oblique_rrr";
  const int d = s.head_dim, R = s.basis_rank;
  const size_t heads = static_cast<size_t>(s.layers) * s.kv_heads;
  b.encode = b.u;
  for (size_t h = 0; h < heads; ++h)
    for (int a = 0; a < d; ++a)
      for (int j = 0; j < R; ++j) {
        const float scale = 0.5f + 0.25f * static_cast<float>(j % 4);  // exact in binary
        b.u[(h * d + a) * R + j] *= scale;
        b.encode[(h * d + a) * R + j] /= scale;
      }
  std::mt19937 rng(static_cast<uint32_t>(seed) + 17);
  std::normal_distribution<float> nd;
  b.query_moment.assign(heads * d * d, 0.0f);
  std::vector<float> x(d);
  for (size_t h = 0; h < heads; ++h) {
    for (float& v : x) v = nd(rng);
    for (int a = 0; a < d; ++a)
      for (int c = 0; c < d; ++c)
        b.query_moment[(h * d + a) * d + c] = (a == c ? 1.0f : 0.0f) + x[a] * x[c];
  }
  b.manifest.fingerprint = core::BasisFingerprint(b);
  return b;
}

v1::RegisterBasisRequest RegisterOf(const core::ModelBasis& b, int codec_rank) {
  const core::BasisManifest& m = b.manifest;
  v1::RegisterBasisRequest r;
  v1::ModelInfo* i = r.mutable_info();
  i->set_model(m.model);
  i->set_version(m.version);
  i->set_layers(m.layers);
  i->set_kv_heads(m.kv_heads);
  i->set_q_heads(m.q_heads);
  i->set_head_dim(m.head_dim);
  i->set_basis_rank(m.rank);
  i->set_kind(m.kind);
  i->mutable_codec()->set_rank(codec_rank);
  const size_t per = static_cast<size_t>(m.kv_heads) * m.head_dim * m.rank;
  const size_t per_moment = static_cast<size_t>(m.kv_heads) * m.head_dim * m.head_dim;
  for (int l = 0; l < m.layers; ++l) {
    auto slice = [&](const std::vector<float>& x, size_t n) {
      return std::vector<float>(x.begin() + l * n, x.begin() + (l + 1) * n);
    };
    *r.add_basis() = TensorF32(slice(b.u, per), {m.kv_heads, m.head_dim, m.rank});
    if (b.oblique())
      *r.add_encode_basis() = TensorF32(slice(b.encode, per), {m.kv_heads, m.head_dim, m.rank});
    if (!b.query_moment.empty())
      *r.add_query_moment() =
          TensorF32(slice(b.query_moment, per_moment), {m.kv_heads, m.head_dim, m.head_dim});
  }
  return r;
}

core::CodecOptions CodecOf(const Shape& s, int codec_rank) {
  core::BasisManifest m;
  m.head_dim = s.head_dim;
  m.rank = s.basis_rank;
  core::CodecOptions c = s.legacy_codec ? K2G32Codec(m, s.basis_rank > 0)
                                        : core::Registry::DefaultCodec(m, s.basis_rank > 0);
  if (s.basis_rank > 0) c.rank = codec_rank;
  return c;
}

std::vector<float> LayerBasis(const core::ModelBasis& b, int layer, int rank, bool encode) {
  const auto& m = b.manifest;
  std::vector<float> out;
  if (encode && !b.oblique()) return out;
  for (int h = 0; h < m.kv_heads; ++h) {
    const float* u = encode ? b.encode_head(layer, h) : b.head(layer, h);
    for (int i = 0; i < m.head_dim; ++i) {
      for (int j = 0; j < rank; ++j) out.push_back(u[i * m.rank + j]);
    }
  }
  return out;
}

std::vector<float> RandomKV(int kv_heads, int64_t tokens, int head_dim, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(kv_heads) * tokens * head_dim);
  for (int h = 0; h < kv_heads; ++h) {
    for (int64_t t = 0; t < tokens; ++t) {
      for (int c = 0; c < head_dim; ++c) {
        const float scale = (c % 13 == 0) ? 6.0f : 1.0f;  // outlier channels
        x[(static_cast<size_t>(h) * tokens + t) * head_dim + c] =
            nd(rng) * scale + 0.1f * c / head_dim;
      }
    }
  }
  return x;
}

std::vector<float> RandomQueries(int q_heads, int n_q, int head_dim, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(q_heads) * n_q * head_dim);
  for (auto& v : x) v = nd(rng);
  return x;
}

std::string ToF16Bytes(const std::vector<float>& x) {
  std::string s(x.size() * 2, '\0');
  core::FloatToHalfN(x.data(), reinterpret_cast<uint16_t*>(s.data()), x.size());
  return s;
}

std::vector<float> F16RoundTrip(const std::vector<float>& x) {
  std::vector<float> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = core::HalfToFloat(core::FloatToHalf(x[i]));
  return y;
}

std::vector<float> Slice(const std::vector<float>& x, int kv, int64_t T, int d, int64_t from,
                         int64_t n) {
  std::vector<float> out;
  out.reserve(static_cast<size_t>(kv) * n * d);
  for (int h = 0; h < kv; ++h) {
    const float* p = x.data() + (static_cast<size_t>(h) * T + from) * d;
    out.insert(out.end(), p, p + n * d);
  }
  return out;
}

v1::Tensor TensorF16(const std::vector<float>& x, std::initializer_list<int64_t> shape) {
  v1::Tensor t;
  t.set_dtype(v1::DTYPE_F16);
  for (int64_t s : shape) t.add_shape(s);
  t.set_data(ToF16Bytes(x));
  return t;
}

v1::Tensor TensorF32(const std::vector<float>& x, std::initializer_list<int64_t> shape) {
  v1::Tensor t;
  t.set_dtype(v1::DTYPE_F32);
  for (int64_t s : shape) t.add_shape(s);
  t.set_data(std::string(reinterpret_cast<const char*>(x.data()), x.size() * 4));
  return t;
}

std::vector<float> FloatsOf(const v1::Tensor& t) {
  size_t n = 1;
  for (int64_t s : t.shape()) n *= static_cast<size_t>(s);
  std::vector<float> out(n);
  if (t.dtype() == v1::DTYPE_F32 && t.data().size() == n * 4) {
    std::memcpy(out.data(), t.data().data(), n * 4);
  } else if (t.dtype() == v1::DTYPE_F16 && t.data().size() == n * 2) {
    core::HalfToFloatN(reinterpret_cast<const uint16_t*>(t.data().data()), out.data(), n);
  } else {
    out.clear();
  }
  return out;
}

v1::Append MakeAppend(const std::string& seq, int layer, int64_t start, const std::vector<float>& k,
                      const std::vector<float>& v, int kv, int64_t n, int d,
                      const std::string& model, bool f16) {
  v1::Append a;
  a.set_sequence_id(seq);
  a.set_layer(layer);
  a.set_start(start);
  *a.mutable_keys() = f16 ? TensorF16(k, {kv, n, d}) : TensorF32(k, {kv, n, d});
  *a.mutable_values() = f16 ? TensorF16(v, {kv, n, d}) : TensorF32(v, {kv, n, d});
  if (!model.empty()) a.set_model(model);
  return a;
}

std::string TempDir(const std::string& prefix) {
  const char* base = std::getenv("TMPDIR");
  std::string tmpl = absl::StrCat(base ? base : "/tmp", "/", prefix, "-XXXXXX");
  char* p = mkdtemp(tmpl.data());
  return p ? std::string(p) : std::string();
}

bool MakeTestCertificates(const std::string& dir) {
  const std::string key = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
  const std::string cmd = absl::StrCat(
      "cd ", dir, " && (", "openssl req -x509 ", key,
      " -keyout ca.key -out ca.pem -days 1 -subj /CN=kvq-test-ca", " && openssl req ", key,
      " -keyout server.key -out server.csr -subj /CN=localhost",
      " && printf 'subjectAltName=DNS:localhost,IP:127.0.0.1' > san.ext",
      " && openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial",
      " -out server.pem -days 1 -extfile san.ext", " && openssl req ", key,
      " -keyout client.key -out client.csr -subj /CN=kvq-client",
      " && openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial",
      " -out client.pem -days 1", " && openssl req -x509 ", key,
      " -keyout other.key -out other.pem -days 1", " -subj /CN=untrusted", ") >/dev/null 2>&1");
  return std::system(cmd.c_str()) == 0;
}

TestServer::TestServer(server::ServerOptions opts, bool keep) : own_dir_(!keep) {
  if (opts.registry_dir.empty()) {
    registry_dir_ = TempDir("kvq-registry");
    opts.registry_dir = registry_dir_;
  } else {
    registry_dir_ = opts.registry_dir;
    own_dir_ = false;
  }
  opts.grpc_address = "127.0.0.1";
  opts.grpc_port = 0;
  if (opts.metrics_port == 9464) opts.metrics_port = -1;
  if (opts.capacity_bytes == 0) opts.capacity_bytes = int64_t{1} << 30;
  server_ = std::make_unique<server::KvqServer>(opts);
  absl::Status st = server_->Start();
  if (!st.ok()) {
    std::fprintf(stderr, "TestServer: %s\n", st.ToString().c_str());
    std::abort();
  }
}

TestServer::~TestServer() {
  server_.reset();
  if (own_dir_ && !registry_dir_.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(registry_dir_, ec);
  }
}

std::string TestServer::address() const { return absl::StrCat("127.0.0.1:", server_->grpc_port()); }

std::shared_ptr<grpc::Channel> TestServer::Channel(
    std::shared_ptr<grpc::ChannelCredentials> creds) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(256 << 20);
  args.SetMaxSendMessageSize(256 << 20);
  return grpc::CreateCustomChannel(address(), creds ? creds : grpc::InsecureChannelCredentials(),
                                   args);
}

std::unique_ptr<v1::Kvq::Stub> TestServer::Stub(std::shared_ptr<grpc::ChannelCredentials> creds) {
  return v1::Kvq::NewStub(Channel(std::move(creds)));
}

std::unique_ptr<grpc::ClientContext> Ctx(const std::string& tenant, const std::string& token,
                                         int deadline_s) {
  auto c = std::make_unique<grpc::ClientContext>();
  c->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(deadline_s));
  if (!tenant.empty()) c->AddMetadata("x-kvq-tenant", tenant);
  if (!token.empty()) c->AddMetadata("authorization", "Bearer " + token);
  return c;
}

grpc::Status Put(v1::Kvq::Stub& stub, const std::vector<v1::PutBlocksRequest>& msgs,
                 v1::PutBlocksResponse* resp, const std::string& tenant, const std::string& token) {
  auto ctx = Ctx(tenant, token, 120);
  auto w = stub.PutBlocks(ctx.get(), resp);
  for (const auto& m : msgs) {
    if (!w->Write(m)) break;
  }
  w->WritesDone();
  return w->Finish();
}

int ConnectLocal(int port) { return ConnectTo("127.0.0.1", port); }

int ConnectTo(const std::string& ipv4, int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  inet_pton(AF_INET, ipv4.c_str(), &addr.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

std::string HttpGet(int port, const std::string& path, int timeout_s,
                    const std::string& extra_headers) {
  const int fd = ConnectLocal(port);
  if (fd < 0) return "";
  timeval tv{timeout_s, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  const std::string req = "GET " + path + " HTTP/1.0\r\nHost: localhost\r\n" + extra_headers +
                          "Connection: close\r\n\r\n";
  (void)!write(fd, req.data(), req.size());
  std::string out;
  char buf[65536];
  for (ssize_t n; (n = read(fd, buf, sizeof buf)) > 0;) out.append(buf, n);
  close(fd);
  return out;
}

}  // namespace kvq::testing
