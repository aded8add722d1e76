#include "kvq/client/flags.h"

#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace kvq::client {

void AddClientFlags(FlagSet* flags, ClientOptions* o, ClientFlags* extra) {
  flags->Add("server", "ADDR[,ADDR...]",
             "kvq server(s); several: sequences sharded by consistent hash (default "
             "localhost:50051)",
             [extra](const std::string& v) { return extra->servers = v, !v.empty(); });
  flags->Add("timeout", "DURATION",
             absl::StrCat("deadline of each call attempt, e.g. 5s (default ",
                          absl::FormatDuration(o->timeout), ")"),
             [o](const std::string& v) {
               return ParseDurationFlag(v, &o->timeout) && o->timeout > absl::ZeroDuration();
             });
  flags->Add("retries", "N",
             absl::StrCat("retries of idempotent calls on UNAVAILABLE, with jittered backoff "
                          "(default ",
                          o->max_attempts - 1, ")"),
             [o](const std::string& v) {
               int n = 0;
               if (!ParseIntFlag(v, &n) || n < 0) return false;
               o->max_attempts = n + 1;
               return true;
             });
  flags->AddBool("tls", "use TLS (default off)", &o->tls);
  flags->Add(
      "tls-ca", "FILE", "CA certificate (PEM) to verify the server; implies --tls",
      [o](const std::string& v) { return o->tls_ca = v, o->tls = !v.empty() || o->tls, true; });
  flags->Add(
      "tls-cert", "FILE", "client certificate (PEM) for mutual TLS; implies --tls",
      [o](const std::string& v) { return o->tls_cert = v, o->tls = !v.empty() || o->tls, true; });
  flags->Add("tls-key", "FILE", "client private key (PEM) for mutual TLS",
             [o](const std::string& v) { return o->tls_key = v, true; });
  flags->Add("tls-server-name", "NAME", "name to verify in the server certificate",
             [o](const std::string& v) { return o->tls_server_name = v, true; });
  flags->Add("token", "TOKEN", "bearer token (auth on; prefer --token-file)",
             [o](const std::string& v) { return o->token = v, true; });
  flags->Add("token-file", "FILE", "file holding the bearer token",
             [extra](const std::string& v) { return extra->token_file = v, true; });
  flags->AddBool("allow-insecure-token", "allow a token over plaintext (loopback tests only)",
                 &o->allow_insecure_token);
  flags->AddBool("router",
                 "--server is a routing proxy (deploy/haproxy): send x-kvq-route with every call "
                 "and split batches by routing key (default off)",
                 &o->router);
  flags->Add("tenant", "NAME", "tenant sent as x-kvq-tenant when auth is off (default: default)",
             [o](const std::string& v) { return o->tenant = v, true; });
}

absl::Status ResolveClientFlags(const ClientFlags& extra, ClientOptions* o) {
  o->servers = SplitServers(extra.servers);
  if (!extra.token_file.empty()) {
    std::ifstream in(extra.token_file);
    if (!in)
      return absl::InvalidArgumentError(
          absl::StrCat("cannot read --token-file '", extra.token_file, "'"));
    std::stringstream ss;
    ss << in.rdbuf();
    o->token = std::string(absl::StripAsciiWhitespace(ss.str()));
    if (o->token.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--token-file '", extra.token_file, "' is empty"));
    }
  }
  return absl::OkStatus();
}

}  // namespace kvq::client
