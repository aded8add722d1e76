// Who is calling: bearer tokens mapped to tenants (auth on), or the trusted `x-kvq-tenant`
// metadata (auth off, development only).
#pragma once

#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "grpcpp/server_context.h"

namespace kvq::server {

class Authenticator {
 public:
  // tokens_file "" = auth off. Lines: "<token> <tenant>"; blank lines and '#' comments
  // ignored. Tokens are at least 16 characters; tenants 1..64 characters of [A-Za-z0-9._-].
  // A token listed for two different tenants is INVALID_ARGUMENT naming both lines (never
  // the token); listed twice for one tenant it is harmless and accepted.
  // admin_tenants: comma-separated tenants allowed to RegisterBasis when auth is on (the
  // registry is shared by all tenants); empty lets every authenticated tenant register.
  static absl::StatusOr<Authenticator> Load(const std::string& tokens_file,
                                            const std::string& admin_tenants = "");

  bool enabled() const { return enabled_; }
  size_t tokens() const { return tenants_.size(); }
  // The tenant of a call, or UNAUTHENTICATED (auth on: missing/unknown bearer token) or
  // INVALID_ARGUMENT (auth off: a malformed x-kvq-tenant).
  absl::StatusOr<std::string> TenantOf(const grpc::ServerContextBase& ctx) const;

  static bool ValidTenant(absl::string_view t);
  // Whether `tenant` may add models to the shared registry.
  bool MayRegister(const std::string& tenant) const {
    return !enabled_ || admins_.empty() || admins_.contains(tenant);
  }

 private:
  bool enabled_ = false;
  absl::flat_hash_map<std::string, std::string> tenants_;  // token -> tenant
  absl::flat_hash_set<std::string> admins_;
};

}  // namespace kvq::server
