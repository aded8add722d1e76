// kvq_flags: environment then command line, value forms, booleans, positionals and errors.
#include "kvq/common/flags.h"

#include <cstdlib>

#include "gtest/gtest.h"

namespace kvq::common {
namespace {

struct Argv {
  std::vector<std::string> args;
  std::vector<char*> ptrs;
  explicit Argv(std::vector<std::string> a) : args(std::move(a)) {
    for (auto& s : args) ptrs.push_back(s.data());
  }
  int argc() { return static_cast<int>(ptrs.size()); }
  char** argv() { return ptrs.data(); }
};

struct Fixture {
  std::string name = "none";
  int port = 0;
  bool on = true, help = false;
  absl::Duration ttl = absl::ZeroDuration();
  FlagSet flags;
  Fixture() {
    flags.Add("name", "NAME", "a name", [this](const std::string& v) { return name = v, true; });
    flags.Add("grpc-port", "PORT", "a port",
              [this](const std::string& v) { return ParseIntFlag(v, &port); });
    flags.Add("ttl", "DURATION", "a duration",
              [this](const std::string& v) { return ParseDurationFlag(v, &ttl); });
    flags.AddBool("on", "a switch", &on);
    flags.AddBool("help", "help", &help);
  }
  absl::Status Parse(std::vector<std::string> args, std::vector<std::string>* pos) {
    args.insert(args.begin(), "prog");
    Argv a(std::move(args));
    return flags.Parse(a.argc(), a.argv(), 1, pos);
  }
};

TEST(FlagSetTest, EnvironmentThenCommandLine) {
  setenv("KVQ_GRPC_PORT", "7", 1);
  setenv("KVQ_NAME", "from-env", 1);
  setenv("KVQ_HELP", "1", 1);  // "help" has no variable
  Fixture f;
  std::vector<std::string> pos;
  ASSERT_TRUE(
      f.Parse({"--name", "x", "pos1", "--ttl=1m", "--on=false", "-", "--", "--name"}, &pos).ok());
  unsetenv("KVQ_GRPC_PORT");
  unsetenv("KVQ_NAME");
  unsetenv("KVQ_HELP");
  EXPECT_EQ(f.port, 7);
  EXPECT_EQ(f.name, "x");
  EXPECT_EQ(f.ttl, absl::Minutes(1));
  EXPECT_FALSE(f.on);
  EXPECT_FALSE(f.help);
  EXPECT_EQ(pos, (std::vector<std::string>{"pos1", "-", "--name"}));
}

TEST(FlagSetTest, UnderscoresBooleansAndLastWins) {
  Fixture f;
  std::vector<std::string> pos;
  ASSERT_TRUE(f.Parse({"--grpc_port", "1", "--grpc-port=2", "--on", "--help"}, &pos).ok());
  EXPECT_EQ(f.port, 2);
  EXPECT_TRUE(f.on);
  EXPECT_TRUE(f.help);
  EXPECT_TRUE(pos.empty());
  for (const char* v : {"0", "no", "off", "FALSE"}) {
    ASSERT_TRUE(f.Parse({std::string("--on=") + v}, &pos).ok()) << v;
    EXPECT_FALSE(f.on) << v;
  }
}

TEST(FlagSetTest, ErrorsNameTheFlagOrTheVariable) {
  Fixture f;
  std::vector<std::string> pos;
  EXPECT_EQ(f.Parse({"--nope"}, &pos).message(), "unknown flag --nope");
  EXPECT_EQ(f.Parse({"--name"}, &pos).message(), "--name needs a value (NAME)");
  EXPECT_EQ(f.Parse({"--grpc-port", "x"}, &pos).message(), "bad value 'x' for --grpc-port (PORT)");
  EXPECT_EQ(f.Parse({"--on=maybe"}, &pos).message(), "bad value 'maybe' for --on");
  EXPECT_EQ(f.Parse({"--ttl=-1s"}, &pos).message(), "bad value '-1s' for --ttl (DURATION)");
  setenv("KVQ_GRPC_PORT", "seven", 1);
  EXPECT_EQ(f.Parse({}, &pos).message(), "bad value 'seven' in KVQ_GRPC_PORT (PORT)");
  unsetenv("KVQ_GRPC_PORT");
}

TEST(FlagSetTest, HelpListsEveryFlagWithItsVariable) {
  Fixture f;
  const std::string h = f.flags.Help();
  EXPECT_NE(h.find("  --grpc-port PORT\n      a port  [env KVQ_GRPC_PORT]\n"), std::string::npos)
      << h;
  EXPECT_NE(h.find("  --on\n      a switch  [env KVQ_ON]\n"), std::string::npos) << h;
  EXPECT_NE(h.find("  --help\n      help\n"), std::string::npos) << h;
}

}  // namespace
}  // namespace kvq::common
