// kvq-server: flags (each also settable from an environment variable) onto ServerOptions,
// then serve until SIGTERM or SIGINT, shut down gracefully and exit 0.
#include <pthread.h>
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "kvq/common/flags.h"
#include "server/server.h"

namespace {

using kvq::common::FlagSet;
using kvq::server::ServerOptions;

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
  if (!absl::SimpleAtoi(v, &n) || n < 0 || n > std::numeric_limits<int64_t>::max() / mult) {
    return false;
  }
  *out = n * mult;
  return true;
}

void AddFlags(FlagSet* flags, ServerOptions* o) {
  auto str = [](std::string* p) { return [p](const std::string& v) { return *p = v, true; }; };
  auto integer = [](int* p) {
    return [p](const std::string& v) { return kvq::common::ParseIntFlag(v, p); };
  };
  auto int64 = [](int64_t* p) {
    return [p](const std::string& v) { return kvq::common::ParseInt64Flag(v, p); };
  };
  auto bytes = [](int64_t* p) { return [p](const std::string& v) { return ParseBytes(v, p); }; };
  auto duration = [](absl::Duration* p) {
    return [p](const std::string& v) { return absl::ParseDuration(v, p); };
  };
  flags->Add("grpc-address", "ADDR", "gRPC listen address (default 0.0.0.0)",
             str(&o->grpc_address));
  flags->Add("grpc-port", "PORT", "gRPC port (default 50051; 0 picks one)", integer(&o->grpc_port));
  flags->Add("metrics-address", "ADDR", "Prometheus /metrics address (default 0.0.0.0)",
             str(&o->metrics_address));
  flags->Add("metrics-port", "PORT", "Prometheus /metrics port (default 9464; -1 off)",
             integer(&o->metrics_port));
  flags->Add("registry", "DIR", "model registry folder (default ~/.local/share/kvq/registry)",
             str(&o->registry_dir));
  flags->Add("memory", "POOL", "auto|gpu|pinned|host (default auto)", str(&o->memory));
  flags->Add("attend", "WHERE",
             "auto|gpu|cpu: which attend reads the blocks (default auto: gpu for gpu memory; "
             "gpu with --memory pinned: the device reads pinned memory)",
             str(&o->attend));
  flags->Add("capacity", "BYTES", "store capacity, e.g. 16G (default 0: half the physical memory)",
             bytes(&o->capacity_bytes));
  flags->Add("tenant-quota", "BYTES", "bytes one tenant may hold (default 0: no quota)",
             bytes(&o->tenant_quota_bytes));
  flags->Add("sequence-ttl", "DURATION",
             "drop sequences idle this long, e.g. 30m (default 0: never)", duration(&o->ttl));
  flags->AddBool("retain-prefixes",
                 "keep the shared prefix groups of deleted and expired sequences until room is "
                 "needed (default true)",
                 &o->retain_prefixes);
  flags->Add("workers", "N", "worker threads (default 0: one per core)", integer(&o->workers));
  flags->Add("split-attend-min-tokens", "N",
             "split one Attend item over a layer of at least N tokens across idle workers "
             "(min(idle + 1, 4, --workers) parts; none idle: unsplit; a batch's items take idle "
             "workers first; results within 2e-6 * max|v| of unsplit, 1e-5 on the int16 readout) "
             "(default 8192; 0 never)",
             int64(&o->split_attend_min_tokens));
  flags->Add("worker-poll-us", "N",
             "an idle worker polls for work this many microseconds before it sleeps: faster "
             "split Attends, at the cost of that much CPU per idle spell (default 0)",
             integer(&o->worker_poll_us));
  flags->Add("max-inflight", "N",
             "calls queued or running on the workers before new ones get RESOURCE_EXHAUSTED "
             "(default 4096; 0 no limit)",
             integer(&o->max_inflight));
  flags->Add("max-inflight-per-client", "N",
             "of those, what one client (tenant; with auth off tenant and address) may hold, "
             "streams included, before its next call gets RESOURCE_EXHAUSTED (default -1: a "
             "quarter of --max-inflight; 0 no limit)",
             integer(&o->max_inflight_per_client));
  flags->Add("stream-idle-timeout", "DURATION",
             "fail a PutBlocks stream quiet this long between messages with DEADLINE_EXCEEDED "
             "(default 60s; 0 never)",
             duration(&o->stream_idle_timeout));
  flags->AddBool("log-calls",
                 "log every call (method, tenant, status, duration, bytes) to stderr, not only "
                 "server-side failures (default false)",
                 &o->log_calls);
  flags->Add("max-message-bytes", "BYTES", "largest gRPC message (default 256M)",
             bytes(&o->max_message_bytes));
  flags->Add("tls-cert", "FILE", "server certificate chain (PEM); with --tls-key turns TLS on",
             str(&o->tls_cert));
  flags->Add("tls-key", "FILE", "server private key (PEM)", str(&o->tls_key));
  flags->Add("tls-client-ca", "FILE", "CA of client certificates (PEM): mutual TLS",
             str(&o->tls_client_ca));
  flags->Add("auth-tokens", "FILE", "bearer tokens file, lines '<token> <tenant>': auth on",
             str(&o->auth_tokens_file));
  flags->Add("admin-tenants", "LIST",
             "tenants allowed to RegisterBasis with auth on (default: all)",
             str(&o->admin_tenants));
  flags->Add("drop-after-probe-gap", "DURATION",
             "router tier: drop every sequence when a router's /healthz probe (x-kvq-probe) "
             "comes this long after its previous one, e.g. 2250ms (default 0: off; "
             "docs/ROUTER.md)",
             duration(&o->drop_after_probe_gap));
  flags->Add("shutdown-grace", "DURATION", "time in-flight calls get at shutdown (default 10s)",
             duration(&o->shutdown_grace));
  flags->Add("scrub-period", "DURATION", "checksum scrub period (default 10m; 0 off)",
             duration(&o->scrub_period));
  flags->AddBool("reflection", "gRPC server reflection (default true)", &o->reflection);
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
  FlagSet flags;
  AddFlags(&flags, &opts);
  flags.AddBool("help", "print this help", &help);
  std::vector<std::string> positional;
  if (absl::Status st = flags.Parse(argc, argv, 1, &positional); !st.ok()) {
    std::fprintf(stderr, "kvq-server: %s (see --help)\n", std::string(st.message()).c_str());
    return 2;
  }
  if (!positional.empty()) {
    std::fprintf(stderr, "kvq-server: unexpected argument '%s' (see --help)\n",
                 positional[0].c_str());
    return 2;
  }
  if (help) {
    std::printf(
        "Usage: kvq-server [flags]\n"
        "Serves the kvq.v1.Kvq gRPC API (plus grpc.health.v1.Health and reflection).\n"
        "Every flag can also be set from the environment variable shown (flags win).\n\n%s",
        flags.Help().c_str());
    return 0;
  }

  if (absl::Status st = kvq::server::ValidateOptions(opts); !st.ok()) {
    std::fprintf(stderr, "kvq-server: %s (see --help)\n", std::string(st.message()).c_str());
    return 2;
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
