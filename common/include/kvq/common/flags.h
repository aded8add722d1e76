// Command-line flags for kvq's programs (kvq-server, kvq, kvq-load): a small parser where
// every flag can also come from an environment variable (KVQ_<NAME>, upper case, '-' -> '_';
// a flag on the command line wins).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace kvq::common {

class FlagSet {
 public:
  using Setter = std::function<bool(const std::string&)>;
  // A flag taking a value (--name VALUE or --name=VALUE); `set` returns false on a bad value.
  void Add(std::string name, std::string value_name, std::string help, Setter set);
  // A boolean flag (--name, --name=true|false, also 1|0, yes|no, on|off).
  void AddBool(std::string name, std::string help, bool* value);

  // Applies environment variables (a flag named "help" has none), then argv[first..argc).
  // Flag names may use '_' for '-'. Arguments not starting with "--" (and "-") are returned
  // in `positional`, in order; "--" ends the flags. Errors name the flag or the variable.
  absl::Status Parse(int argc, char** argv, int first, std::vector<std::string>* positional);
  // One paragraph per flag, with its environment variable.
  std::string Help() const;

  static std::string EnvName(const std::string& flag);

 private:
  struct Flag {
    std::string name, value_name, help;
    Setter set;
    bool is_bool = false;
  };
  std::vector<Flag> flags_;
};

// Parsers for common value types.
bool ParseDurationFlag(const std::string& s, absl::Duration* out);  // "10s", "500ms", "2m", "3"
bool ParseIntFlag(const std::string& s, int* out);
bool ParseInt64Flag(const std::string& s, int64_t* out);
bool ParseDoubleFlag(const std::string& s, double* out);

}  // namespace kvq::common
