// TLS, mutual TLS and bearer-token auth on real sockets, with certificates generated at
// test time by openssl.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/test_util.h"

namespace kvq::testing {
namespace {

std::string Slurp(const std::string& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

class TlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(TempDir("kvq-tls"));
    const std::string d = *dir_;
    ok_ = MakeTestCertificates(d);
    std::ofstream(d + "/tokens") << "tok-alpha-0123456789abcdef alpha\n";
  }
  static void TearDownTestSuite() {
    std::filesystem::remove_all(*dir_);
    delete dir_;
  }
  void SetUp() override { ASSERT_TRUE(ok_) << "openssl failed to make test certificates"; }

  static std::string P(const std::string& f) { return *dir_ + "/" + f; }
  static std::shared_ptr<grpc::ChannelCredentials> Tls(bool client_cert,
                                                       const std::string& cert = "client") {
    grpc::SslCredentialsOptions o;
    o.pem_root_certs = Slurp(P("ca.pem"));
    if (client_cert) {
      o.pem_private_key = Slurp(P(cert + ".key"));
      o.pem_cert_chain = Slurp(P(cert + ".pem"));
    }
    return grpc::SslCredentials(o);
  }
  static grpc::Status Echo(v1::Kvq::Stub& stub, const std::string& token) {
    v1::EchoRequest req;
    req.set_payload("ping");
    v1::EchoResponse resp;
    auto ctx = Ctx("", token, 5);
    grpc::Status st = stub.Echo(ctx.get(), req, &resp);
    if (st.ok() && resp.payload() != "ping")
      return grpc::Status(grpc::StatusCode::INTERNAL, "echo");
    return st;
  }

  static std::string* dir_;
  static bool ok_;
};
std::string* TlsTest::dir_ = nullptr;
bool TlsTest::ok_ = false;

constexpr char kToken[] = "tok-alpha-0123456789abcdef";

TEST_F(TlsTest, TlsWithBearerTokens) {
  server::ServerOptions o;
  o.tls_cert = P("server.pem");
  o.tls_key = P("server.key");
  o.auth_tokens_file = P("tokens");
  TestServer ts(o);
  auto stub = ts.Stub(Tls(false));
  EXPECT_TRUE(Echo(*stub, kToken).ok());
  EXPECT_EQ(Echo(*stub, "").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(Echo(*stub, "tok-wrong-0123456789abcdef").error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  // A real write and read over TLS, and the tenant comes from the token.
  Shape s;
  v1::RegisterBasisResponse rr;
  auto c = Ctx("", kToken);
  ASSERT_TRUE(stub->RegisterBasis(c.get(), MakeRegister(s, 3), &rr).ok());
  auto k = RandomKV(s.kv_heads, 33, s.head_dim, 1);
  v1::PutBlocksRequest m;
  *m.add_appends() = MakeAppend("x", 0, 0, k, k, s.kv_heads, 33, s.head_dim, "tiny");
  v1::PutBlocksResponse r;
  ASSERT_TRUE(Put(*stub, {m}, &r, "", kToken).ok());
  EXPECT_TRUE(ts.server().store().Describe("alpha", "x").ok());
  // Plaintext clients cannot talk to a TLS server.
  auto plain = ts.Stub();
  EXPECT_EQ(Echo(*plain, kToken).error_code(), grpc::StatusCode::UNAVAILABLE);
}

TEST_F(TlsTest, MutualTlsRequiresAClientCertificateFromTheCa) {
  server::ServerOptions o;
  o.tls_cert = P("server.pem");
  o.tls_key = P("server.key");
  o.tls_client_ca = P("ca.pem");
  TestServer ts(o);
  EXPECT_TRUE(Echo(*ts.Stub(Tls(true)), "").ok());
  EXPECT_FALSE(Echo(*ts.Stub(Tls(false)), "").ok());
  EXPECT_FALSE(Echo(*ts.Stub(Tls(true, "other")), "").ok());
}

TEST_F(TlsTest, BadTlsConfigurationFailsAtStart) {
  server::ServerOptions o;
  o.grpc_port = 0;
  o.metrics_port = -1;
  o.tls_cert = P("server.pem");  // no key
  server::KvqServer srv(o);
  absl::Status st = srv.Start();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr("--tls-cert and --tls-key"));
}

}  // namespace
}  // namespace kvq::testing
