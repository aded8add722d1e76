#include "kvq/client/flags.h"

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

namespace kvq::client {

void FlagSet::Add(std::string name, std::string value_name, std::string help, Setter set) {
  flags_.push_back({std::move(name), std::move(value_name), std::move(help), std::move(set)});
}

void FlagSet::AddBool(std::string name, std::string help, bool* value) {
  Flag f{std::move(name), "", std::move(help), [value](const std::string& v) {
           const std::string s = absl::AsciiStrToLower(v);
           if (s.empty() || s == "1" || s == "true" || s == "yes" || s == "on") {
             *value = true;
             return true;
           }
           if (s == "0" || s == "false" || s == "no" || s == "off") {
             *value = false;
             return true;
           }
           return false;
         }};
  f.is_bool = true;
  flags_.push_back(std::move(f));
}

std::string FlagSet::EnvName(const std::string& flag) {
  return "KVQ_" + absl::AsciiStrToUpper(absl::StrReplaceAll(flag, {{"-", "_"}}));
}

absl::Status FlagSet::Parse(int argc, char** argv, int first,
                            std::vector<std::string>* positional) {
  for (const Flag& f : flags_) {
    if (f.name == "help") continue;
    const char* v = std::getenv(EnvName(f.name).c_str());
    if (v == nullptr) continue;
    if (!f.set(v)) {
      return absl::InvalidArgumentError(
          absl::StrCat("bad value '", v, "' in ", EnvName(f.name), " (", f.value_name, ")"));
    }
  }
  bool flags_done = false;
  for (int i = first; i < argc; ++i) {
    std::string arg = argv[i];
    if (flags_done || arg.rfind("--", 0) != 0 || arg == "-") {
      positional->push_back(arg);
      continue;
    }
    if (arg == "--") {
      flags_done = true;
      continue;
    }
    std::string name = arg.substr(2), value;
    bool has_value = false;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    absl::StrReplaceAll({{"_", "-"}}, &name);
    const Flag* flag = nullptr;
    for (const Flag& f : flags_) {
      if (f.name == name) flag = &f;
    }
    if (flag == nullptr) return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name));
    if (!has_value && !flag->is_bool) {
      if (i + 1 >= argc) {
        return absl::InvalidArgumentError(
            absl::StrCat("--", name, " needs a value (", flag->value_name, ")"));
      }
      value = argv[++i];
    }
    if (!flag->set(value)) {
      return absl::InvalidArgumentError(absl::StrCat("bad value '", value, "' for --", name,
                                                     flag->is_bool ? "" : " (", flag->value_name,
                                                     flag->is_bool ? "" : ")"));
    }
  }
  return absl::OkStatus();
}

std::string FlagSet::Help() const {
  std::string out;
  for (const Flag& f : flags_) {
    absl::StrAppend(&out, "  --", f.name, f.value_name.empty() ? "" : " ", f.value_name, "\n      ",
                    f.help);
    if (f.name != "help") absl::StrAppend(&out, "  [env ", EnvName(f.name), "]");
    absl::StrAppend(&out, "\n");
  }
  return out;
}

bool ParseDurationFlag(const std::string& s, absl::Duration* out) {
  if (absl::ParseDuration(s, out)) return *out >= absl::ZeroDuration();
  double secs = 0;  // a bare number: seconds
  if (absl::SimpleAtod(s, &secs) && secs >= 0) {
    *out = absl::Seconds(secs);
    return true;
  }
  return false;
}
bool ParseIntFlag(const std::string& s, int* out) { return absl::SimpleAtoi(s, out); }
bool ParseInt64Flag(const std::string& s, int64_t* out) { return absl::SimpleAtoi(s, out); }
bool ParseDoubleFlag(const std::string& s, double* out) { return absl::SimpleAtod(s, out); }

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
