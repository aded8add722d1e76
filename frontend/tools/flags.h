// Minimal command-line flags for the frontend tools: --name VALUE or --name=VALUE; every flag
// can also come from the environment as KVQ_<TOOL>_<NAME> (upper case, '-' -> '_').
#pragma once

#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>

namespace kvq::frontend {

class Flags {
 public:
  Flags(std::string tool, std::map<std::string, std::string> defaults, std::string help)
      : tool_(std::move(tool)), v_(std::move(defaults)), help_(std::move(help)) {
    for (auto& [k, val] : v_) {
      std::string env = "KVQ_" + tool_ + "_" + k;
      for (auto& c : env) c = c == '-' ? '_' : static_cast<char>(std::toupper(c));
      if (const char* e = std::getenv(env.c_str())) val = e;
    }
  }
  // Returns false (after printing) on --help or an unknown flag; *exit_code says which.
  bool Parse(int argc, char** argv, int* exit_code) {
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      if (a == "--help" || a == "-h") {
        std::fputs(help_.c_str(), stdout);
        *exit_code = 0;
        return false;
      }
      if (a.rfind("--", 0) != 0) return Fail("unexpected argument " + a, exit_code);
      a = a.substr(2);
      std::string val;
      const size_t eq = a.find('=');
      if (eq != std::string::npos) {
        val = a.substr(eq + 1);
        a = a.substr(0, eq);
      }
      auto it = v_.find(a);
      if (it == v_.end()) return Fail("unknown flag --" + a, exit_code);
      if (eq == std::string::npos) {
        if (it->second == "false" || it->second == "true") {
          val = "true";  // boolean flag
        } else if (i + 1 < argc) {
          val = argv[++i];
        } else {
          return Fail("flag --" + a + " needs a value", exit_code);
        }
      }
      it->second = val;
    }
    return true;
  }
  const std::string& Get(const std::string& k) const { return v_.at(k); }
  long GetInt(const std::string& k) const { return std::strtol(v_.at(k).c_str(), nullptr, 10); }
  bool GetBool(const std::string& k) const { return v_.at(k) == "true" || v_.at(k) == "1"; }

 private:
  bool Fail(const std::string& msg, int* exit_code) {
    std::fprintf(stderr, "kvq-%s: %s (see --help)\n", tool_.c_str(), msg.c_str());
    *exit_code = 2;
    return false;
  }
  std::string tool_;
  std::map<std::string, std::string> v_;
  std::string help_;
};

}  // namespace kvq::frontend
