// The client's TLS and token options against a real server with mutual TLS and bearer-token
// auth on (certificates made by openssl at test time), through the library and the kvq CLI.
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvq/client/client.h"
#include "tests/server/test_util.h"

namespace kvq::client {
namespace {

using ::testing::HasSubstr;

class ClientTlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(kvq::testing::TempDir("kvq-client-tls"));
    ok_ = kvq::testing::MakeTestCertificates(*dir_);
    std::ofstream(*dir_ + "/tokens") << "tok-alpha-0123456789 alpha\ntok-beta-9876543210 beta\n";
    std::ofstream(*dir_ + "/alpha.token") << "tok-alpha-0123456789\n";
  }
  static void TearDownTestSuite() {
    std::filesystem::remove_all(*dir_);
    delete dir_;
  }
  static std::string P(const std::string& f) { return *dir_ + "/" + f; }

  void SetUp() override {
    ASSERT_TRUE(ok_) << "openssl failed to make test certificates";
    server::ServerOptions o;
    o.tls_cert = P("server.pem");
    o.tls_key = P("server.key");
    o.tls_client_ca = P("ca.pem");
    o.auth_tokens_file = P("tokens");
    server_ = std::make_unique<kvq::testing::TestServer>(o);
  }

  ClientOptions Secure(const std::string& token = "tok-alpha-0123456789") {
    ClientOptions o;
    o.servers = {server_->address()};
    o.tls = true;
    o.tls_ca = P("ca.pem");
    o.tls_cert = P("client.pem");
    o.tls_key = P("client.key");
    o.token = token;
    o.max_attempts = 1;
    o.timeout = absl::Seconds(10);
    return o;
  }

  static std::string* dir_;
  static bool ok_;
  std::unique_ptr<kvq::testing::TestServer> server_;
};
std::string* ClientTlsTest::dir_ = nullptr;
bool ClientTlsTest::ok_ = false;

TEST_F(ClientTlsTest, MutualTlsAndTokenNameTheTenant) {
  auto c = Client::Create(Secure());
  ASSERT_TRUE(c.ok()) << c.status();
  auto st = (*c)->Stats();
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->tenant(), "alpha");
  auto beta = Client::Create(Secure("tok-beta-9876543210"));
  ASSERT_TRUE(beta.ok());
  EXPECT_EQ((*beta)->Stats()->tenant(), "beta");
}

TEST_F(ClientTlsTest, BadTokenIsUnauthenticatedAndNotRetried) {
  ClientOptions o = Secure("tok-wrong");
  o.max_attempts = 4;
  int attempts = 0;
  o.on_attempt = [&](std::string_view, int, int, int) { ++attempts; };
  auto c = Client::Create(o);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ((*c)->Stats().status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(attempts, 1);
}

TEST_F(ClientTlsTest, HandshakeFailuresAreUnavailable) {
  ClientOptions no_cert = Secure();
  no_cert.tls_cert.clear();
  no_cert.tls_key.clear();
  EXPECT_EQ((*Client::Create(no_cert))->Stats().status().code(), absl::StatusCode::kUnavailable);
  ClientOptions untrusted = Secure();
  untrusted.tls_ca = P("other.pem");
  EXPECT_EQ((*Client::Create(untrusted))->Stats().status().code(), absl::StatusCode::kUnavailable);
  ClientOptions plain = Secure();
  plain.tls = false;
  plain.tls_ca.clear();
  plain.tls_cert.clear();
  plain.tls_key.clear();
  plain.allow_insecure_token = true;
  EXPECT_EQ((*Client::Create(plain))->Stats().status().code(), absl::StatusCode::kUnavailable);
}

int Cli(const std::string& args, std::string* out) {
  const std::string file = kvq::testing::TempDir("kvq-cli-out") + "/out";
  const int st = std::system(absl::StrCat(KVQ_CLI_BIN, " ", args, " >", file, " 2>&1").c_str());
  std::ifstream in(file);
  out->assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  std::filesystem::remove_all(std::filesystem::path(file).parent_path());
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

TEST_F(ClientTlsTest, CliTakesTlsFilesAndATokenFile) {
  const std::string tls =
      absl::StrCat("--server ", server_->address(), " --tls-ca ", P("ca.pem"), " --tls-cert ",
                   P("client.pem"), " --tls-key ", P("client.key"));
  std::string out;
  EXPECT_EQ(Cli(absl::StrCat("stats --json ", tls, " --token-file ", P("alpha.token")), &out), 0)
      << out;
  EXPECT_THAT(out, HasSubstr("\"tenant\": \"alpha\""));
  EXPECT_EQ(Cli(absl::StrCat("stats ", tls, " --token nope"), &out), 10 + 16) << out;
  EXPECT_THAT(out, HasSubstr("kvq: UNAUTHENTICATED: "));
  EXPECT_EQ(Cli(absl::StrCat("health ", tls, " --token-file ", P("alpha.token")), &out), 0) << out;
  // A token is never sent in the clear by accident.
  EXPECT_EQ(Cli(absl::StrCat("stats --server ", server_->address(), " --token x"), &out), 2);
  EXPECT_THAT(out, HasSubstr("plaintext"));
}

}  // namespace
}  // namespace kvq::client
