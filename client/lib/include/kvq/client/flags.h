// Command-line flags for the client tools (kvq, kvq-load): the connection flags shared by the
// tools, mapped onto ClientOptions, over the parser of kvq/common/flags.h (every flag can also
// come from an environment variable, KVQ_<NAME>).
#pragma once

#include <string>

#include "absl/status/status.h"
#include "kvq/client/client.h"
#include "kvq/common/flags.h"

namespace kvq::client {

// The parser lives in kvq_flags (shared with kvq-server); these names keep the tools' code.
using common::FlagSet;
using common::ParseDoubleFlag;
using common::ParseDurationFlag;
using common::ParseInt64Flag;
using common::ParseIntFlag;

// The connection flags: --server (comma list), --timeout, --retries, --tls, --tls-ca,
// --tls-cert, --tls-key, --tls-server-name, --token, --token-file, --tenant,
// --allow-insecure-token, --router. The help shows the defaults in *options at the time of
// the call. Call ResolveClientFlags after Parse.
struct ClientFlags {
  std::string servers = "localhost:50051";
  std::string token_file;
};
void AddClientFlags(FlagSet* flags, ClientOptions* options, ClientFlags* extra);
absl::Status ResolveClientFlags(const ClientFlags& extra, ClientOptions* options);

}  // namespace kvq::client
