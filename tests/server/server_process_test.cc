// The kvq-server binary end to end: environment variables, the default registry folder,
// health, and a graceful exit 0 on SIGTERM with a call in flight.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "kvq/kernels/device.h"
#include "tests/server/test_util.h"

namespace kvq::testing {
namespace {

struct Process {
  pid_t pid = -1;
  FILE* err = nullptr;  // the child's stderr
};

Process Spawn(const std::vector<std::string>& args, const std::vector<std::string>& env) {
  int fds[2];
  EXPECT_EQ(pipe(fds), 0);
  Process p;
  p.pid = fork();
  if (p.pid == 0) {
    dup2(fds[1], 2);
    close(fds[0]);
    for (const auto& e : env) putenv(const_cast<char*>(e.c_str()));
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(fds[1]);
  p.err = fdopen(fds[0], "r");
  return p;
}

// Reads the child's log until the "serving gRPC on ADDR:PORT" line; returns the port.
int WaitForPort(Process& p, std::string* log) {
  char line[4096];
  std::regex re("serving gRPC on [^ ]+:([0-9]+);");
  while (std::fgets(line, sizeof line, p.err)) {
    *log += line;
    std::cmatch m;
    if (std::regex_search(line, m, re)) return std::stoi(m[1]);
  }
  return -1;
}

TEST(ServerProcessTest, EnvFlagsDefaultRegistryHealthAndGracefulSigterm) {
  const std::string home = TempDir("kvq-home");
  Process p = Spawn(
      {KVQ_SERVER_BIN, "--grpc-port", "0"},
      {"HOME=" + home, "KVQ_GRPC_ADDRESS=127.0.0.1", "KVQ_METRICS_PORT=-1", "KVQ_CAPACITY=64M",
       "KVQ_SHUTDOWN_GRACE=5s", "KVQ_MAX_INFLIGHT=7", "KVQ_RETAIN_PREFIXES=false"});
  std::string log;
  const int port = WaitForPort(p, &log);
  ASSERT_GT(port, 0) << log;
  EXPECT_NE(log.find("memory: auto -> host"), std::string::npos) << log;
  EXPECT_NE(log.find("capacity: 67108864 bytes"), std::string::npos) << log;
  EXPECT_NE(log.find("max in flight: 7 (per client: 1);"), std::string::npos) << log;
  EXPECT_NE(log.find("prefixes retained: no"), std::string::npos) << log;
  EXPECT_TRUE(std::filesystem::is_directory(home + "/.local/share/kvq/registry")) << log;

  auto channel =
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials());
  auto health = grpc::health::v1::Health::NewStub(channel);
  grpc::health::v1::HealthCheckResponse h;
  auto ctx = Ctx();
  ASSERT_TRUE(health->Check(ctx.get(), {}, &h).ok());
  EXPECT_EQ(h.status(), grpc::health::v1::HealthCheckResponse::SERVING);

  // A PutBlocks stream is open when SIGTERM arrives; it still completes.
  auto stub = v1::Kvq::NewStub(channel);
  Shape s;
  v1::RegisterBasisResponse rr;
  auto c1 = Ctx();
  ASSERT_TRUE(stub->RegisterBasis(c1.get(), MakeRegister(s, 1), &rr).ok());
  auto k = RandomKV(s.kv_heads, 64, s.head_dim, 1);
  grpc::ClientContext sctx;
  v1::PutBlocksResponse resp;
  auto w = stub->PutBlocks(&sctx, &resp);
  v1::PutBlocksRequest m;
  *m.add_appends() = MakeAppend("x", 0, 0, k, k, s.kv_heads, 64, s.head_dim, "tiny");
  ASSERT_TRUE(w->Write(m));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  kill(p.pid, SIGTERM);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  // Draining: health says NOT_SERVING and new calls are refused, the open stream continues.
  auto c2 = Ctx();
  ASSERT_TRUE(health->Check(c2.get(), {}, &h).ok());
  EXPECT_EQ(h.status(), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  v1::EchoResponse er;
  auto c3 = Ctx();
  EXPECT_EQ(stub->Echo(c3.get(), {}, &er).error_code(), grpc::StatusCode::UNAVAILABLE);
  w->WritesDone();
  grpc::Status st = w->Finish();
  EXPECT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(resp.tokens_written(), 64);

  int status = 0;
  ASSERT_EQ(waitpid(p.pid, &status, 0), p.pid);
  char line[4096];
  while (std::fgets(line, sizeof line, p.err)) log += line;
  fclose(p.err);
  EXPECT_TRUE(WIFEXITED(status)) << log;
  EXPECT_EQ(WEXITSTATUS(status), 0) << log;
  EXPECT_NE(log.find("SIGTERM: shutting down"), std::string::npos) << log;
  // The registration was persisted under the default folder.
  EXPECT_TRUE(std::filesystem::exists(home + "/.local/share/kvq/registry/tiny/v1/manifest.json"));
  std::filesystem::remove_all(home);
}

// A port free now on loopback (bound, read, released), for a server restarted on the same one.
int FreeLoopbackPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  int port = -1;
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  close(fd);
  return port;
}

// Whether `pid` reaches the stopped state ('T' in /proc/PID/stat) within 5 s: the signal is
// delivered asynchronously, and a call sent before it takes effect would still be answered.
bool WaitUntilStopped(pid_t pid) {
  for (int i = 0; i < 500; ++i) {
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    std::getline(stat, line);
    const size_t paren = line.rfind(')');
    if (paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] == 'T')
      return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

// Faults, on the real binary: SIGKILL with a PutBlocks stream open (the client gets
// UNAVAILABLE; restarted on the same registry and port, the model is there and the client's
// retry succeeds), SIGSTOP with 1 s deadlines (DEADLINE_EXCEEDED, no hang; SIGCONT and it
// answers again), and a client that cancels mid-stream (only whole messages were applied).
TEST(ServerProcessTest, KillStopAndCancelLeaveAWorkingServer) {
  const std::string reg = TempDir("kvq-faults");
  const int port = FreeLoopbackPort();
  ASSERT_GT(port, 0);
  auto start = [&](std::string* log) {
    Process p = Spawn({KVQ_SERVER_BIN, "--grpc-address", "127.0.0.1", "--grpc-port",
                       std::to_string(port), "--metrics-port", "-1", "--registry", reg},
                      {});
    EXPECT_EQ(WaitForPort(p, log), port) << *log;
    return p;
  };
  std::string log;
  Process p = start(&log);
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 50);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 200);
  auto channel = grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port),
                                           grpc::InsecureChannelCredentials(), args);
  auto stub = v1::Kvq::NewStub(channel);
  Shape s;
  v1::RegisterBasisResponse rr;
  ASSERT_TRUE(stub->RegisterBasis(Ctx().get(), MakeRegister(s, 1), &rr).ok());
  const auto k = RandomKV(s.kv_heads, 64, s.head_dim, 2);
  v1::PutBlocksRequest m;
  *m.add_appends() = MakeAppend("x", 0, 0, k, k, s.kv_heads, 64, s.head_dim, "tiny");

  // 1. SIGKILL mid-stream.
  {
    grpc::ClientContext ctx;
    v1::PutBlocksResponse resp;
    auto w = stub->PutBlocks(&ctx, &resp);
    ASSERT_TRUE(w->Write(m));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    kill(p.pid, SIGKILL);
    int status = 0;
    ASSERT_EQ(waitpid(p.pid, &status, 0), p.pid);
    fclose(p.err);
    w->WritesDone();
    EXPECT_EQ(w->Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
  }
  p = start(&log);
  v1::ModelInfo info;
  v1::GetModelRequest gm;
  gm.set_model("tiny");
  ASSERT_TRUE(stub->GetModel(Ctx().get(), gm, &info).ok()) << "the registry survives SIGKILL";
  EXPECT_EQ(info.version(), 1);
  // The client's retry (same channel, reconnecting) lands on the restarted server; the sequence
  // did not survive (the store is memory), so the retry creates it again.
  grpc::Status retried;
  v1::PutBlocksResponse resp;
  for (int attempt = 0; attempt < 50; ++attempt) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    auto w = stub->PutBlocks(&ctx, &resp);
    w->Write(m);
    w->WritesDone();
    retried = w->Finish();
    if (retried.error_code() != grpc::StatusCode::UNAVAILABLE) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(retried.ok()) << retried.error_message();
  EXPECT_EQ(resp.tokens_written(), 64);

  // 2. SIGSTOP: calls with 1 s deadlines end DEADLINE_EXCEEDED, promptly; SIGCONT resumes.
  kill(p.pid, SIGSTOP);
  ASSERT_TRUE(WaitUntilStopped(p.pid)) << "the server did not stop";
  const auto t0 = std::chrono::steady_clock::now();
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
    v1::StatsResponse st;
    EXPECT_EQ(stub->Stats(&ctx, v1::StatsRequest(), &st).error_code(),
              grpc::StatusCode::DEADLINE_EXCEEDED);
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(3));
  kill(p.pid, SIGCONT);
  {
    v1::StatsResponse st;
    auto ctx = Ctx();
    ASSERT_TRUE(stub->Stats(ctx.get(), v1::StatsRequest(), &st).ok());
    EXPECT_EQ(st.sequences(), 1);
  }

  // 3. A client cancels a stream after some messages: what was applied is whole messages.
  {
    grpc::ClientContext ctx;
    v1::PutBlocksResponse r;
    auto w = stub->PutBlocks(&ctx, &r);
    const auto kk = RandomKV(s.kv_heads, 16, s.head_dim, 3);
    for (int i = 0; i < 8; ++i) {
      v1::PutBlocksRequest mi;
      *mi.add_appends() =
          MakeAppend("c", 0, 16 * i, kk, kk, s.kv_heads, 16, s.head_dim, i == 0 ? "tiny" : "");
      if (!w->Write(mi)) break;
    }
    ctx.TryCancel();
    EXPECT_EQ(w->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  v1::GetBlocksRequest g;
  g.set_sequence_id("c");
  g.add_layers(0);
  grpc::ClientContext gctx;
  auto reader = stub->GetBlocks(&gctx, g);
  v1::GetBlocksResponse chunk;
  int64_t tokens = 0;
  while (reader->Read(&chunk)) tokens = chunk.layer_tokens();
  const grpc::Status gs = reader->Finish();
  // Either nothing was applied (the sequence does not exist) or whole 16-token messages.
  if (gs.ok()) {
    EXPECT_EQ(tokens % 16, 0) << tokens;
    EXPECT_LE(tokens, 8 * 16);
  } else {
    EXPECT_EQ(gs.error_code(), grpc::StatusCode::NOT_FOUND) << gs.error_message();
  }
  // And the server still serves.
  v1::EchoResponse er;
  EXPECT_TRUE(stub->Echo(Ctx().get(), {}, &er).ok());
  kill(p.pid, SIGTERM);
  int status = 0;
  waitpid(p.pid, &status, 0);
  fclose(p.err);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  std::filesystem::remove_all(reg);
}

// The call wrapper's log: --log-calls (here from its environment variable) writes one line
// per call, refused ones included; without it only server-side failures are logged, and the
// capacity default (half the physical memory) says so at start-up.
TEST(ServerProcessTest, LogCallsWritesOneLinePerCall) {
  for (const bool on : {true, false}) {
    std::vector<std::string> env = {"KVQ_GRPC_ADDRESS=127.0.0.1", "KVQ_METRICS_PORT=-1",
                                    "KVQ_REGISTRY=" + TempDir("kvq-log-calls")};
    if (on) env.push_back("KVQ_LOG_CALLS=true");
    Process p = Spawn({KVQ_SERVER_BIN, "--grpc-port", "0"}, env);
    std::string log;
    const int port = WaitForPort(p, &log);
    ASSERT_GT(port, 0) << log;
    EXPECT_NE(log.find("bytes (auto: half the physical memory)"), std::string::npos) << log;
    auto stub = v1::Kvq::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
    v1::EchoRequest req;
    req.set_payload("hello");
    v1::EchoResponse er;
    auto c1 = Ctx("acme");
    ASSERT_TRUE(stub->Echo(c1.get(), req, &er).ok());
    v1::ModelInfo mi;
    v1::GetModelRequest gr;
    gr.set_model("absent");
    auto c2 = Ctx("acme");
    EXPECT_EQ(stub->GetModel(c2.get(), gr, &mi).error_code(), grpc::StatusCode::NOT_FOUND);
    kill(p.pid, SIGTERM);
    int status = 0;
    ASSERT_EQ(waitpid(p.pid, &status, 0), p.pid);
    char line[4096];
    while (std::fgets(line, sizeof line, p.err)) log += line;
    fclose(p.err);
    const bool echo = log.find("kvq-server: Echo tenant 'acme': OK in ") != std::string::npos;
    const bool get =
        log.find("kvq-server: GetModel tenant 'acme': NOT_FOUND in ") != std::string::npos;
    EXPECT_EQ(echo, on) << log;
    EXPECT_EQ(get, on) << log;
    if (on) {
      EXPECT_NE(log.find("7 bytes in, 7 out"), std::string::npos) << log;
    }
  }
}

TEST(ServerProcessTest, BadFlagsExitNonZeroWithAMessage) {
  Process p = Spawn({KVQ_SERVER_BIN, "--memory", "floppy", "--grpc-port", "0", "--metrics-port",
                     "-1", "--registry", ""},
                    {});
  std::string log;
  char line[4096];
  while (std::fgets(line, sizeof line, p.err)) log += line;
  fclose(p.err);
  int status = 0;
  waitpid(p.pid, &status, 0);
  EXPECT_EQ(WEXITSTATUS(status), 1) << log;
  EXPECT_NE(log.find("--memory must be auto, gpu, pinned or host"), std::string::npos) << log;
  // Pools that cannot work here are refused at start with the reason: gpu always (no CUDA
  // attend in this version), pinned without a CUDA driver.
  for (const char* pool : {"gpu", "pinned"}) {
    if (std::string(pool) == "pinned" && kernels::CudaAvailable()) continue;
    Process r = Spawn({KVQ_SERVER_BIN, "--memory", pool, "--grpc-port", "0", "--metrics-port", "-1",
                       "--registry", ""},
                      {});
    log.clear();
    while (std::fgets(line, sizeof line, r.err)) log += line;
    fclose(r.err);
    waitpid(r.pid, &status, 0);
    EXPECT_EQ(WEXITSTATUS(status), 1) << log;
    EXPECT_NE(
        log.find(std::string("--memory ") + pool + " is not available: memory pool '" + pool + "'"),
        std::string::npos)
        << log;
  }
  // --attend: an unknown name, and the CUDA attend where no device runs it.
  for (const char* attend : {"tpu", "gpu"}) {
    if (std::string(attend) == "gpu" && kernels::CudaAvailable()) continue;
    Process r = Spawn({KVQ_SERVER_BIN, "--memory", "host", "--attend", attend, "--grpc-port", "0",
                       "--metrics-port", "-1", "--registry", ""},
                      {});
    log.clear();
    while (std::fgets(line, sizeof line, r.err)) log += line;
    fclose(r.err);
    waitpid(r.pid, &status, 0);
    EXPECT_EQ(WEXITSTATUS(status), 1) << log;
    EXPECT_NE(log.find(std::string(attend) == "tpu"
                           ? "--attend must be auto, gpu or cpu (got 'tpu')"
                           : "--attend gpu: the 'cuda' attend cannot read host memory: "),
              std::string::npos)
        << log;
  }
  Process q = Spawn({KVQ_SERVER_BIN, "--no-such-flag"}, {});
  log.clear();
  while (std::fgets(line, sizeof line, q.err)) log += line;
  fclose(q.err);
  waitpid(q.pid, &status, 0);
  EXPECT_EQ(WEXITSTATUS(status), 2);
  EXPECT_NE(log.find("unknown flag --no-such-flag"), std::string::npos) << log;
}

// Runs the binary to its exit and returns its exit status (-1: it was still running after
// 10 s, so it was killed: for these tests a server that starts is the failure) and its log.
int RunToExit(const std::vector<std::string>& args, std::string* log) {
  Process p = Spawn(args, {});
  int status = 0;
  bool exited = false;
  for (int i = 0; i < 1000 && !exited; ++i) {
    exited = waitpid(p.pid, &status, WNOHANG) == p.pid;
    if (!exited) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (!exited) {
    kill(p.pid, SIGKILL);
    waitpid(p.pid, &status, 0);
  }
  char line[4096];
  while (std::fgets(line, sizeof line, p.err)) *log += line;
  fclose(p.err);
  return exited && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST(ServerProcessTest, OutOfRangeNumericFlagsExit2NamingTheFlagAndTheRange) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--grpc-port", "70000"}, "--grpc-port 70000 must be in 0..65535"},
      {{"--grpc-port", "-1"}, "--grpc-port -1 must be in 0..65535"},
      {{"--metrics-port", "-2"}, "--metrics-port -2 must be in -1..65535"},
      {{"--metrics-port", "65536"}, "--metrics-port 65536 must be in -1..65535"},
      {{"--workers", "-3"}, "--workers -3 must be in 0..1024"},
      {{"--workers", "100000"}, "--workers 100000 must be in 0..1024"},
      {{"--max-inflight", "-1"}, "--max-inflight -1 must be in 0..1000000"},
      {{"--max-inflight-per-client", "-2"}, "--max-inflight-per-client -2 must be in -1..1000000"},
      {{"--split-attend-min-tokens", "-1"},
       "--split-attend-min-tokens -1 must be in 0..9223372036854775807"},
      {{"--worker-poll-us", "20000"}, "--worker-poll-us 20000 must be in 0..10000"},
      {{"--max-message-bytes", "0"}, "--max-message-bytes 0 must be in 65536..2147483647"},
      {{"--max-message-bytes", "100"}, "--max-message-bytes 100 must be in 65536..2147483647"},
      {{"--max-message-bytes", "3G"}, "--max-message-bytes 3221225472 must be in"},
      {{"--sequence-ttl", "-5s"}, "--sequence-ttl -5s must be finite and >= 0"},
      {{"--shutdown-grace", "-1s"}, "--shutdown-grace -1s must be finite and >= 0"},
      {{"--shutdown-grace", "inf"}, "--shutdown-grace inf must be finite and >= 0"},
      {{"--scrub-period", "-1m"}, "--scrub-period -1m must be finite and >= 0"},
      {{"--stream-idle-timeout", "-1s"}, "--stream-idle-timeout -1s must be 0 (never) or in 1ms.."},
      {{"--stream-idle-timeout", "25h"}, "--stream-idle-timeout 25h must be 0 (never) or in 1ms.."},
      {{"--drop-after-probe-gap", "5ms"},
       "--drop-after-probe-gap 5ms must be 0 (off) or in 10ms.."},
      {{"--drop-after-probe-gap", "2h"}, "--drop-after-probe-gap 2h must be 0 (off) or in 10ms.."},
      {{"--capacity", "99999999999T"}, "bad value '99999999999T' for --capacity"},
      {{"--tenant-quota", "-1"}, "bad value '-1' for --tenant-quota"},
  };
  for (const auto& [flag, want] : cases) {
    std::vector<std::string> args = {
        KVQ_SERVER_BIN, "--grpc-address", "127.0.0.1", "--grpc-port", "0", "--metrics-port",
        "-1",           "--registry",     ""};
    args.insert(args.end(), flag.begin(), flag.end());  // the last of a flag wins
    std::string log;
    EXPECT_EQ(RunToExit(args, &log), 2) << flag[0] << " " << flag[1] << "\n" << log;
    EXPECT_NE(log.find(want), std::string::npos) << want << "\n" << log;
  }
}

}  // namespace
}  // namespace kvq::testing
