// Command-line flags for the client tools (kvq, kvq-load): a small parser where every flag
// can also come from an environment variable (KVQ_<NAME>, '-' -> '_'; flags win), and the
// connection flags shared by the tools, mapped onto ClientOptions.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "kvq/client/client.h"

namespace kvq::client {

class FlagSet {
 public:
  using Setter = std::function<bool(const std::string&)>;
  // A flag taking a value (--name VALUE or --name=VALUE).
  void Add(std::string name, std::string value_name, std::string help, Setter set);
  // A boolean flag (--name, --name=true|false).
  void AddBool(std::string name, std::string help, bool* value);

  // Applies environment variables, then argv[first..argc). Arguments not starting with "--"
  // are returned in `positional` (in order); "--" ends the flags. Errors name the flag.
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

// Parsers for the tools' value types.
bool ParseDurationFlag(const std::string& s, absl::Duration* out);  // "10s", "500ms", "2m"
bool ParseIntFlag(const std::string& s, int* out);
bool ParseInt64Flag(const std::string& s, int64_t* out);
bool ParseDoubleFlag(const std::string& s, double* out);

// The connection flags: --server (comma list), --timeout, --retries, --tls, --tls-ca,
// --tls-cert, --tls-key, --tls-server-name, --token, --token-file, --tenant,
// --allow-insecure-token. The help shows the defaults in *options at the time of the call.
// Call ResolveClientFlags after Parse.
struct ClientFlags {
  std::string servers = "localhost:50051";
  std::string token_file;
};
void AddClientFlags(FlagSet* flags, ClientOptions* options, ClientFlags* extra);
absl::Status ResolveClientFlags(const ClientFlags& extra, ClientOptions* options);

}  // namespace kvq::client
