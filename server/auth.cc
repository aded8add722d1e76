#include "server/auth.h"

#include <fstream>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace kvq::server {

bool Authenticator::ValidTenant(absl::string_view t) {
  if (t.empty() || t.size() > 64) return false;
  for (char c : t) {
    if (!(absl::ascii_isalnum(c) || c == '.' || c == '_' || c == '-')) return false;
  }
  return true;
}

absl::StatusOr<Authenticator> Authenticator::Load(const std::string& tokens_file,
                                                  const std::string& admin_tenants) {
  Authenticator a;
  for (absl::string_view t : absl::StrSplit(admin_tenants, ',', absl::SkipWhitespace())) {
    t = absl::StripAsciiWhitespace(t);
    if (!ValidTenant(t)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--admin-tenants: '", t, "' is not a tenant name ([A-Za-z0-9._-]{1,64})"));
    }
    a.admins_.insert(std::string(t));
  }
  if (tokens_file.empty()) {
    if (!a.admins_.empty()) {
      return absl::InvalidArgumentError("--admin-tenants needs --auth-tokens");
    }
    return a;
  }
  std::ifstream f(tokens_file);
  if (!f) return absl::NotFoundError(absl::StrCat("cannot read tokens file ", tokens_file));
  a.enabled_ = true;
  std::string line;
  absl::flat_hash_map<std::string, int> first_line;  // token -> the line that listed it
  for (int n = 1; std::getline(f, line); ++n) {
    absl::string_view s = absl::StripAsciiWhitespace(line);
    if (s.empty() || s[0] == '#') continue;
    std::vector<absl::string_view> parts =
        absl::StrSplit(s, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (parts.size() != 2 || parts[0].size() < 16 || !ValidTenant(parts[1])) {
      return absl::InvalidArgumentError(
          absl::StrCat(tokens_file, ":", n, ": expected \"<token of >= 16 chars> <tenant>\""));
    }
    // A token names one tenant: listed for a second one, whoever holds it would get one of
    // the two depending on the order of the lines. The token is a secret: only its position
    // is printed.
    const std::string token(parts[0]);
    auto [first, inserted] = first_line.try_emplace(token, n);
    if (!inserted && a.tenants_[token] != parts[1]) {
      return absl::InvalidArgumentError(absl::StrCat(
          tokens_file, ":", n, ": the token on this line is already listed on line ", first->second,
          " for tenant '", a.tenants_[token], "'; a token must name one tenant"));
    }
    a.tenants_[token] = std::string(parts[1]);
  }
  if (a.tenants_.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(tokens_file, " holds no tokens"));
  }
  return a;
}

absl::StatusOr<std::string> Authenticator::TenantOf(const grpc::ServerContextBase& ctx) const {
  const auto& md = ctx.client_metadata();
  if (enabled_) {
    auto it = md.find("authorization");
    if (it == md.end()) {
      return absl::UnauthenticatedError("missing 'authorization: Bearer <token>' metadata");
    }
    absl::string_view v(it->second.data(), it->second.size());
    if (!absl::StartsWithIgnoreCase(v, "bearer ")) {
      return absl::UnauthenticatedError("authorization metadata must be 'Bearer <token>'");
    }
    auto t = tenants_.find(absl::StripAsciiWhitespace(v.substr(7)));
    if (t == tenants_.end()) return absl::UnauthenticatedError("unknown token");
    return t->second;
  }
  auto it = md.find("x-kvq-tenant");
  if (it == md.end()) return std::string("default");
  std::string t(it->second.data(), it->second.size());
  if (!ValidTenant(t)) {
    return absl::InvalidArgumentError(
        "x-kvq-tenant metadata must be 1..64 characters of [A-Za-z0-9._-]");
  }
  return t;
}

}  // namespace kvq::server
