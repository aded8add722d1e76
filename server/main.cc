// kvq-server: flags (each also settable from an environment variable) onto ServerOptions,
// then serve until SIGTERM or SIGINT, shut down gracefully and exit 0.
#include <pthread.h>
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/time/time.h"
#include "server/server.h"

namespace {

using kvq::server::ServerOptions;

struct Flag {
  const char* name;  // --name; env KVQ_NAME (upper case, '-' -> '_')
  const char* value_name;
  const char* help;
  std::function<bool(const std::string&)> set;
};

bool ParseBytes(const std::string& s, int64_t* out) {
  // Accepts plain bytes or a K/M/G/T suffix (powers of 1024), e.g. 512M, 16G.
  std::string v = absl::AsciiStrToUpper(s);
  int64_t mult = 1;
  if (!v.empty() && std::string("KMGT").find(v.back()) != std::string::npos) {
    mult = int64_t{1} << (10 * (1 + std::string("KMGT").find(v.back())));
    v.pop_back();
    if (!v.empty() && v.back() == 'I') v.pop_back();
  } else if (v.size() > 1 && v.back() == 'B') {
    v.pop_back();
  }
  int64_t n = 0;
  if (!absl::SimpleAtoi(v, &n) || n < 0) return false;
  *out = n * mult;
  return true;
}

bool ParseBool(const std::string& s, bool* out) {
  std::string v = absl::AsciiStrToLower(s);
  if (v == "1" || v == "true" || v == "yes" || v == "on" || v.empty()) return *out = true, true;
  if (v == "0" || v == "false" || v == "no" || v == "off") return *out = false, true;
  return false;
}

std::vector<Flag> MakeFlags(ServerOptions* o, bool* help) {
  auto str = [](std::string* p) { return [p](const std::string& v) { return *p = v, true; }; };
  auto integer = [](int* p) {
    return [p](const std::string& v) { return absl::SimpleAtoi(v, p); };
  };
  auto bytes = [](int64_t* p) { return [p](const std::string& v) { return ParseBytes(v, p); }; };
  auto duration = [](absl::Duration* p) {
    return [p](const std::string& v) { return absl::ParseDuration(v, p); };
  };
  return {
      {"grpc-address", "ADDR", "gRPC listen address (default 0.0.0.0)", str(&o->grpc_address)},
      {"grpc-port", "PORT", "gRPC port (default 50051; 0 picks one)", integer(&o->grpc_port)},
      {"metrics-address", "ADDR", "Prometheus /metrics address (default 0.0.0.0)",
       str(&o->metrics_address)},
      {"metrics-port", "PORT", "Prometheus /metrics port (default 9464; -1 off)",
       integer(&o->metrics_port)},
      {"registry", "DIR", "model registry folder (default ~/.local/share/kvq/registry)",
       str(&o->registry_dir)},
      {"memory", "POOL", "auto|gpu|pinned|host (default auto)", str(&o->memory)},
      {"capacity", "BYTES", "store capacity, e.g. 16G (default 0: half the physical memory)",
       bytes(&o->capacity_bytes)},
      {"tenant-quota", "BYTES", "bytes one tenant may hold (default 0: no quota)",
       bytes(&o->tenant_quota_bytes)},
      {"sequence-ttl", "DURATION", "drop sequences idle this long, e.g. 30m (default 0: never)",
       duration(&o->sequence_ttl)},
      {"workers", "N", "worker threads (default 0: one per core)", integer(&o->workers)},
      {"max-inflight", "N",
       "calls queued or running on the workers before new ones get RESOURCE_EXHAUSTED "
       "(default 4096; 0 no limit)",
       integer(&o->max_inflight)},
      {"max-message-bytes", "BYTES", "largest gRPC message (default 256M)",
       bytes(&o->max_message_bytes)},
      {"tls-cert", "FILE", "server certificate chain (PEM); with --tls-key turns TLS on",
       str(&o->tls_cert)},
      {"tls-key", "FILE", "server private key (PEM)", str(&o->tls_key)},
      {"tls-client-ca", "FILE", "CA of client certificates (PEM): mutual TLS",
       str(&o->tls_client_ca)},
      {"auth-tokens", "FILE", "bearer tokens file, lines '<token> <tenant>': auth on",
       str(&o->auth_tokens_file)},
      {"admin-tenants", "LIST", "tenants allowed to RegisterBasis with auth on (default: all)",
       str(&o->admin_tenants)},
      {"shutdown-grace", "DURATION", "time in-flight calls get at shutdown (default 10s)",
       duration(&o->shutdown_grace)},
      {"scrub-period", "DURATION", "checksum scrub period (default 10m; 0 off)",
       duration(&o->scrub_period)},
      {"reflection", "BOOL", "gRPC server reflection (default true)",
       [o](const std::string& v) { return ParseBool(v, &o->reflection); }},
      {"help", "", "print this help", [help](const std::string&) { return *help = true, true; }},
  };
}

std::string EnvName(const char* flag) {
  return "KVQ_" + absl::AsciiStrToUpper(absl::StrReplaceAll(flag, {{"-", "_"}}));
}

void PrintHelp(const std::vector<Flag>& flags) {
  std::printf(
      "Usage: kvq-server [flags]\n"
      "Serves the kvq.v1.Kvq gRPC API (plus grpc.health.v1.Health and reflection).\n"
      "Every flag can also be set from the environment variable shown (flags win).\n\n");
  for (const Flag& f : flags) {
    if (std::string(f.name) == "help") continue;
    std::printf("  --%s %s\n      %s  [env %s]\n", f.name, f.value_name, f.help,
                EnvName(f.name).c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  ServerOptions opts;
  if (const char* home = std::getenv("HOME")) {
    opts.registry_dir = absl::StrCat(home, "/.local/share/kvq/registry");
  } else {
    opts.registry_dir = "kvq-registry";
  }
  bool help = false;
  std::vector<Flag> flags = MakeFlags(&opts, &help);
  for (const Flag& f : flags) {
    const char* v = std::getenv(EnvName(f.name).c_str());
    if (v == nullptr || std::string(f.name) == "help") continue;
    if (!f.set(v)) {
      std::fprintf(stderr, "kvq-server: bad value '%s' for %s\n", v, EnvName(f.name).c_str());
      return 2;
    }
  }
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg.rfind("--", 0) != 0) {
      std::fprintf(stderr, "kvq-server: unexpected argument '%s' (see --help)\n", arg.c_str());
      return 2;
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
    for (const Flag& f : flags) {
      if (name == f.name) flag = &f;
    }
    if (flag == nullptr) {
      std::fprintf(stderr, "kvq-server: unknown flag --%s (see --help)\n", name.c_str());
      return 2;
    }
    const bool takes_value = flag->value_name[0] != '\0' && std::string(flag->value_name) != "BOOL";
    if (!has_value && takes_value) {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "kvq-server: --%s needs a value (%s)\n", name.c_str(),
                     flag->value_name);
        return 2;
      }
      value = argv[++i];
    }
    if (!flag->set(value)) {
      std::fprintf(stderr, "kvq-server: bad value '%s' for --%s (%s)\n", value.c_str(),
                   name.c_str(), flag->value_name);
      return 2;
    }
  }
  if (help) {
    PrintHelp(flags);
    return 0;
  }

  // Block the shutdown signals in every thread; the main thread waits for them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  kvq::server::KvqServer server(opts);
  if (absl::Status st = server.Start(); !st.ok()) {
    std::fprintf(stderr, "kvq-server: %s\n", st.ToString().c_str());
    return 1;
  }
  int sig = 0;
  sigwait(&signals, &sig);
  std::fprintf(stderr, "kvq-server: %s: shutting down (grace %s)\n",
               sig == SIGTERM ? "SIGTERM" : "SIGINT",
               absl::FormatDuration(opts.shutdown_grace).c_str());
  const absl::Time t0 = absl::Now();
  server.Shutdown();
  std::fprintf(stderr, "kvq-server: stopped (shutdown took %s)\n",
               absl::FormatDuration(absl::Trunc(absl::Now() - t0, absl::Milliseconds(1))).c_str());
  return 0;
}
