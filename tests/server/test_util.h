// Helpers for the service tests and the service benchmark: models, random K/V, an in-process
// server on port 0 and typed calls over real gRPC channels.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "grpcpp/grpcpp.h"
#include "kvq/core/basis.h"
#include "kvq/core/cache.h"
#include "kvq/core/store.h"
#include "kvq/v1/kvq.grpc.pb.h"
#include "server/server.h"
#include "tests/core/test_util.h"

namespace kvq::testing {

struct Shape {
  std::string model = "tiny";
  int version = 1;
  int layers = 2;
  int kv_heads = 2;
  int q_heads = 4;  // grouped-query attention
  int head_dim = 64;
  int basis_rank = 8;  // 0: no basis
  // Registered with the pre-frontier default codec (testing::K2G32Codec: 2-bit keys in groups
  // of 32), for tests whose token counts are written around 32-token groups;
  // false: the model gets the server's default codec.
  bool legacy_codec = false;
};

// The wire settings of testing::K2G32Codec (rank and switches left to the model).
v1::CodecSettings LegacyCodecSettings(int head_dim);
// A registration request with a random orthonormal basis (deterministic in seed).
v1::RegisterBasisRequest MakeRegister(const Shape& s, uint64_t seed, int codec_rank = 4);
// The same basis as core::ModelBasis (to build in-process caches).
core::ModelBasis MakeBasis(const Shape& s, uint64_t seed);
// The codec levers' basis (what kvq-calibrate --variants --query-moment writes): MakeBasis's U
// made an oblique pair, decode B = U diag(s) and encode A = U diag(1/s) per head (A^T B = I,
// B not orthonormal), plus a query moment E[q q^T] = I + x x^T per head (kind
// "oblique_rrr").
core::ModelBasis MakeLeverBasis(const Shape& s, uint64_t seed);
// A registration request carrying every tensor of `b` (basis, encode_basis, query_moment),
// with info.codec.rank = codec_rank.
v1::RegisterBasisRequest RegisterOf(const core::ModelBasis& b, int codec_rank = 4);
// The codec the server derives for a model registered by MakeRegister.
core::CodecOptions CodecOf(const Shape& s, int codec_rank = 4);
// The basis of one layer truncated to `rank` columns, [kv][d][rank] (encode: the encode
// basis of an oblique pair instead of U; empty when the basis is not oblique).
std::vector<float> LayerBasis(const core::ModelBasis& b, int layer, int rank, bool encode = false);

// Random values (heavy-ish outlier channels, like real keys), fp32.
std::vector<float> RandomKV(int kv_heads, int64_t tokens, int head_dim, uint32_t seed);
std::vector<float> RandomQueries(int q_heads, int n_q, int head_dim, uint32_t seed);
// fp32 -> fp16 bytes.
std::string ToF16Bytes(const std::vector<float>& x);
std::vector<float> F16RoundTrip(const std::vector<float>& x);
// Tokens [from, from + n) of a [kv][T][d] array as [kv][n][d].
std::vector<float> Slice(const std::vector<float>& x, int kv, int64_t T, int d, int64_t from,
                         int64_t n);

v1::Tensor TensorF16(const std::vector<float>& x, std::initializer_list<int64_t> shape);
v1::Tensor TensorF32(const std::vector<float>& x, std::initializer_list<int64_t> shape);
std::vector<float> FloatsOf(const v1::Tensor& t);

// One append (creating the sequence when model is set).
v1::Append MakeAppend(const std::string& seq, int layer, int64_t start, const std::vector<float>& k,
                      const std::vector<float>& v, int kv, int64_t n, int d,
                      const std::string& model = "", bool f16 = true);

// An in-process kvq server on 127.0.0.1:0 with a temporary registry folder.
class TestServer {
 public:
  explicit TestServer(server::ServerOptions opts = {}, bool keep_registry_dir = false);
  ~TestServer();
  std::string address() const;
  server::KvqServer& server() { return *server_; }
  const std::string& registry_dir() const { return registry_dir_; }
  std::unique_ptr<v1::Kvq::Stub> Stub(std::shared_ptr<grpc::ChannelCredentials> creds = nullptr);
  std::shared_ptr<grpc::Channel> Channel(std::shared_ptr<grpc::ChannelCredentials> creds = nullptr);

 private:
  std::string registry_dir_;
  bool own_dir_;
  std::unique_ptr<server::KvqServer> server_;
};

std::string TempDir(const std::string& prefix);

// Writes into `dir` (with openssl): a test CA (ca.pem, ca.key), a server certificate for
// localhost and 127.0.0.1 signed by it (server.pem, server.key), a client certificate signed
// by it (client.pem, client.key) and a self-signed certificate nobody trusts (other.pem,
// other.key). False when openssl failed.
bool MakeTestCertificates(const std::string& dir);

// A client context with a deadline and optional tenant/token metadata.
std::unique_ptr<grpc::ClientContext> Ctx(const std::string& tenant = "",
                                         const std::string& token = "", int deadline_s = 30);

// PutBlocks with one message per entry; returns the status and fills resp.
grpc::Status Put(v1::Kvq::Stub& stub, const std::vector<v1::PutBlocksRequest>& msgs,
                 v1::PutBlocksResponse* resp, const std::string& tenant = "",
                 const std::string& token = "");

// A TCP connection to 127.0.0.1:port (-1 when refused).
int ConnectLocal(int port);
// The same to an IPv4 address.
int ConnectTo(const std::string& ipv4, int port);
// GET path over HTTP/1.0 from 127.0.0.1:port (the metrics port): the whole answer, or what
// came before `timeout_s` passed without a byte. extra_headers: "Name: value\r\n" lines.
std::string HttpGet(int port, const std::string& path, int timeout_s = 30,
                    const std::string& extra_headers = "");

}  // namespace kvq::testing
