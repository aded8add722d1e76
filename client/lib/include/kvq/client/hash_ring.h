// Consistent hashing of (tenant, sequence) onto server addresses.
//
// Each server owns `virtual_nodes` points on a 64-bit ring, placed by XXH3 of its address, so
// a server's points depend only on its own address: adding or removing one of N servers moves
// only the keys that land on (or leave) that server, about 1/N of them, and never moves a key
// between two servers that stay. A key belongs to the first point at or after its hash.
//
// Hash tags (as in Redis Cluster): when a sequence id contains "{tag}" (the first '{' and the
// next '}', with something between), only the tag is hashed, so that sequences meant to
// share a prompt prefix ("{sysprompt-7}conv-1", "{sysprompt-7}conv-2") land on the same
// server, where prefix sharing can find one another's groups.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kvq::client {

class HashRing {
 public:
  // servers: distinct addresses (the identity that is hashed; "host:port" as given).
  // virtual_nodes: points per server; 128 keeps the load within a few percent of even for
  // up to tens of servers at a ring of a few thousand points (lookup is a binary search).
  explicit HashRing(std::vector<std::string> servers, int virtual_nodes = 128);

  // Index into servers() of the server owning the key. The ring must not be empty.
  int Lookup(uint64_t key) const;
  int ShardOf(std::string_view tenant, std::string_view sequence_id) const {
    return Lookup(KeyOf(tenant, sequence_id));
  }
  // The hashed key of (tenant, sequence): XXH3-64 of tenant '\0' HashTag(sequence).
  static uint64_t KeyOf(std::string_view tenant, std::string_view sequence_id);
  // The part of a sequence id that is hashed: the tag inside its first "{...}", else all.
  static std::string_view HashTag(std::string_view sequence_id);

  const std::vector<std::string>& servers() const { return servers_; }
  size_t size() const { return servers_.size(); }

 private:
  std::vector<std::string> servers_;
  std::vector<std::pair<uint64_t, int>> points_;  // sorted by hash
};

}  // namespace kvq::client
