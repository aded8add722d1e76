// Faults injected through core::Env: a registration whose write, fsync, rename or folder
// creation fails leaves the registry as it was, in memory and on disk, and a registry folder
// with a truncated, garbage or mistyped entry still loads the rest.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvq/core/env.h"
#include "kvq/core/status.h"
#include "kvq/core/store.h"

namespace kvq::core {
namespace {
namespace fs = std::filesystem;

// Counts the calls that change the disk and fails the `fail_at`-th one (0-based; -1 none),
// and fails every read of a path containing `fail_reads` (empty: none).
class FaultyEnv : public Env {
 public:
  int fail_at = -1;
  int calls = 0;
  std::string fail_reads;
  std::vector<std::string> ops;

  absl::Status WriteFile(const std::string& p, absl::string_view b) override {
    RETURN_IF_ERROR(Fault("write", p));
    return Env::WriteFile(p, b);
  }
  absl::Status Sync(const std::string& p) override {
    RETURN_IF_ERROR(Fault("fsync", p));
    return Env::Sync(p);
  }
  absl::Status Rename(const std::string& f, const std::string& t) override {
    RETURN_IF_ERROR(Fault("rename", f));
    return Env::Rename(f, t);
  }
  absl::Status CreateDirs(const std::string& p) override {
    RETURN_IF_ERROR(Fault("mkdir", p));
    return Env::CreateDirs(p);
  }
  absl::StatusOr<std::string> ReadFile(const std::string& p, size_t limit) override {
    if (!fail_reads.empty() && p.find(fail_reads) != std::string::npos)
      return absl::DataLossError(absl::StrCat("injected: read ", p));
    return Env::ReadFile(p, limit);
  }

 private:
  absl::Status Fault(const char* op, const std::string& p) {
    ops.push_back(absl::StrCat(op, " ", p));
    if (calls++ == fail_at) return absl::InternalError(absl::StrCat("injected: ", op, " ", p));
    return absl::OkStatus();
  }
};

ModelEntry Entry(const std::string& model, bool basis) {
  BasisManifest m;
  m.model = model;
  m.version = 1;
  m.layers = 2;
  m.kv_heads = 2;
  m.q_heads = 4;
  m.head_dim = 64;
  m.rank = basis ? 4 : 0;
  m.kind = "random";
  ModelEntry e;
  e.manifest = m;
  e.has_basis = basis;
  if (basis) e.basis = RandomBasis(m, 7);
  e.codec = Registry::DefaultCodec(m, basis);
  return e;
}

std::string TempDir() {
  std::string t = (fs::temp_directory_path() / "kvq-registry-faults-XXXXXX").string();
  return mkdtemp(t.data());
}

// Everything under dir, as "relative/path" names (what the next start would see).
std::vector<std::string> Tree(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    out.push_back(fs::relative(e.path(), dir).string());
  std::sort(out.begin(), out.end());
  return out;
}

TEST(RegistryFaults, AFailingWriteSyncRenameOrMkdirLeavesTheRegistryAsItWas) {
  for (bool basis : {true, false}) {
    SCOPED_TRACE(basis ? "with basis" : "without basis");
    const std::string dir = TempDir();
    {
      Registry r(dir);
      ASSERT_TRUE(r.Register(Entry("kept", true), nullptr).ok());
    }
    const std::vector<std::string> before = Tree(dir);
    // How many disk-changing calls one successful registration makes (in a scratch folder).
    FaultyEnv count;
    const std::string scratch = TempDir();
    {
      Registry r(scratch, &count);
      ASSERT_TRUE(r.Register(Entry("new", basis), nullptr).ok());
    }
    ASSERT_GE(count.calls, 6) << "writes, fsyncs, mkdirs and the rename";
    for (int k = 0; k < count.calls; ++k) {
      SCOPED_TRACE(count.ops[k]);
      FaultyEnv env;
      env.fail_at = k;
      Registry r(dir, &env);
      std::vector<std::string> loaded, skipped;
      ASSERT_TRUE(r.LoadAll(&loaded, &skipped).ok());
      absl::StatusOr<std::shared_ptr<const ModelEntry>> got =
          r.Register(Entry("new", basis), nullptr);
      ASSERT_FALSE(got.ok());
      EXPECT_NE(got.status().message().find("injected"), std::string::npos) << got.status();
      EXPECT_EQ(r.Get("new", 0).status().code(), absl::StatusCode::kNotFound);
      EXPECT_EQ(r.List().size(), 1u);
      EXPECT_EQ(Tree(dir), before);  // no half entry, no temporary folder left
      // The next start loads exactly what was there.
      Registry next(dir);
      loaded.clear();
      skipped.clear();
      ASSERT_TRUE(next.LoadAll(&loaded, &skipped).ok());
      EXPECT_EQ(loaded, std::vector<std::string>{"kept v1"});
      EXPECT_TRUE(skipped.empty());
    }
    // And with a healthy disk the same registration goes through.
    Registry r(dir);
    ASSERT_TRUE(r.LoadAll(nullptr, nullptr).ok());
    ASSERT_TRUE(r.Register(Entry("new", basis), nullptr).ok());
    fs::remove_all(dir);
    fs::remove_all(scratch);
  }
}

TEST(RegistryFaults, BrokenEntriesAreSkippedAndReportedTheRestLoads) {
  const std::string dir = TempDir();
  {
    Registry r(dir);
    for (const char* m : {"good", "truncated", "garbage", "typed", "unreadable"})
      ASSERT_TRUE(r.Register(Entry(m, std::string(m) != "typed"), nullptr).ok());
  }
  const fs::path d(dir);
  fs::resize_file(d / "truncated/v1/basis.safetensors", 100);
  std::ofstream(d / "garbage/v1/manifest.json") << "\x01\x02 not json";
  std::ofstream(d / "typed/v1/codec.json") << R"({"key_bits": "2"})";
  FaultyEnv env;
  env.fail_reads = "unreadable";
  Registry r(dir, &env);
  std::vector<std::string> loaded, skipped;
  ASSERT_TRUE(r.LoadAll(&loaded, &skipped).ok());
  EXPECT_EQ(loaded, std::vector<std::string>{"good v1"});
  ASSERT_EQ(skipped.size(), 4u);
  std::string all;
  for (const auto& s : skipped) all += s + "\n";
  for (const char* m : {"truncated", "garbage", "typed", "unreadable"})
    EXPECT_NE(all.find(absl::StrCat(m, "/v1: ")), std::string::npos) << m << " in\n" << all;
  EXPECT_NE(all.find("key_bits"), std::string::npos) << all;
  EXPECT_NE(all.find("injected: read"), std::string::npos) << all;
  EXPECT_TRUE(r.Get("good", 1).ok());
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kvq::core
