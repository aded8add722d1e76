// kvq::client::Client: typed calls to one or several kvq servers over the generated stubs.
//
// * Every call has a deadline (ClientOptions::timeout, per attempt).
// * Idempotent calls are retried on UNAVAILABLE with exponential backoff and full jitter:
//   PutBlocks (appends carry explicit start positions, so a re-sent range is accepted as a
//   duplicate), Score, Readout, Attend when every item has observe=false, GetBlocks before
//   its first message, RegisterBasis, reads of models/stats/health, and Echo. DeleteSequence
//   and observing Attend calls are never retried: a second attempt would not be a no-op.
// * Several servers: sequences are sharded by consistent hashing of (tenant, sequence id)
//   (see hash_ring.h), so one sequence always lands on one server. Batched calls are split
//   by shard, sent concurrently and merged back in request order. When a shard fails, its
//   items get that shard's status (the message names the server) and the other items still
//   succeed; the call itself fails only when every shard it needed failed.
// * Router mode (ClientOptions::router): one address, a proxy (deploy/haproxy) that picks the
//   shard of each call from its `x-kvq-route` header. The client sets that header to
//   RouteKey(sequence id) and splits batched calls by routing key instead of by shard (one
//   sub-call per distinct key, at most kMaxParallelCalls at once), since only the proxy knows
//   which shard a key lands on. The proxy hashes with its own functions: the two paths place
//   a sequence differently, so one sequence must always be reached through one of them.
// * TLS (server CA, optional client certificate for mTLS) and a bearer token.
//
// Thread-safe: one Client may be shared by any number of threads.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvq/client/hash_ring.h"
#include "kvq/v1/kvq.pb.h"

namespace kvq::client {

struct ClientOptions {
  // Server addresses ("host:port", or any gRPC target such as "dns:///kvq-0.kvq:50051").
  // At least one. With several, sequences are sharded over them; the order does not matter
  // (the ring hashes the addresses), but every client of a deployment must list the same set.
  std::vector<std::string> servers;

  // Deadline of each attempt. Attend/Score at 4k tokens answer in milliseconds; the default
  // leaves room for large prefill PutBlocks streams. Too short turns a slow server into
  // DEADLINE_EXCEEDED errors, which are not retried (the budget is the caller's).
  absl::Duration timeout = absl::Seconds(30);
  // Attempts of an idempotent call (1 = no retries). Only UNAVAILABLE is retried: the
  // server was unreachable, still loading its registry, or shutting down.
  int max_attempts = 4;
  // Backoff before retry k (k >= 1): a uniform random wait in
  // [0, min(max_backoff, initial_backoff * multiplier^(k-1))] ("full jitter"), so that many
  // clients do not retry in lockstep after a server restart.
  absl::Duration initial_backoff = absl::Milliseconds(50);
  absl::Duration max_backoff = absl::Seconds(2);
  double backoff_multiplier = 2.0;

  // TLS. Off: plaintext (loopback, development). On: tls_ca verifies the server ("" uses the
  // system roots); tls_cert + tls_key present a client certificate (mTLS).
  bool tls = false;
  std::string tls_ca;    // PEM file
  std::string tls_cert;  // PEM file
  std::string tls_key;   // PEM file
  // Overrides the name checked against the server certificate (e.g. when dialling an IP).
  std::string tls_server_name;

  // Bearer token (auth on): sent as `authorization: Bearer <token>`; the server maps it to
  // the tenant. Sending a token over plaintext is refused unless allow_insecure_token.
  std::string token;
  bool allow_insecure_token = false;
  // Tenant sent as `x-kvq-tenant` when no token is set (auth off, development only). It is
  // also the tenant part of the shard key; with a token and no tenant, the token is used
  // there instead (so set `tenant` when several tokens of one tenant share sequences).
  std::string tenant;

  // Largest message either way; matches the server's default (--max-message-bytes).
  int64_t max_message_bytes = int64_t{256} << 20;
  // Longest wait between reconnection attempts to a server that went away. gRPC's default
  // (120 s) would keep a restarted shard's sequences failing fast for up to two minutes;
  // shorter means quicker recovery for a few more connection attempts to a dead address.
  absl::Duration max_reconnect_backoff = absl::Seconds(2);
  // Points per server on the hash ring.
  int virtual_nodes = 128;
  // Router mode: `servers` is exactly one address, a routing proxy (deploy/haproxy); every
  // call carries `x-kvq-route` (kRouteHeader): RouteKey(sequence id) for a sequence's calls,
  // RouteKey("") for the others (Stats, ListModels, GetModel, Echo, Health: they reach the
  // one shard the proxy picks for that key). RegisterBasis is refused (FAILED_PRECONDITION):
  // a proxy cannot send it to every shard; register on the shards directly.
  bool router = false;
  // Called after every attempt of every call (method, attempt from 1, server index, status
  // code). A seam for tests and for callers that count retries; must be thread-safe.
  std::function<void(std::string_view method, int attempt, int shard, int code)> on_attempt;
};

// The serving state of one server (grpc.health.v1).
struct ShardHealth {
  std::string server;
  bool serving = false;
  absl::Status status;  // the RPC's status (OK when the server answered)
};

// The routing header of router mode; its value is Client::RouteKey.
inline constexpr char kRouteHeader[] = "x-kvq-route";
// Most sub-calls of one batched call in flight at once (router mode splits by key, which can
// mean one sub-call per item).
inline constexpr int kMaxParallelCalls = 16;

class Client {
 public:
  // Validates the options and opens one channel per server (connections are made lazily,
  // on the first call). Errors: INVALID_ARGUMENT (no server, bad option, unreadable TLS
  // file, a token over plaintext).
  static absl::StatusOr<std::unique_ptr<Client>> Create(ClientOptions options);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  const ClientOptions& options() const { return options_; }
  int num_shards() const { return static_cast<int>(ring_.size()); }
  const std::string& server(int shard) const { return ring_.servers()[shard]; }
  // The server index owning a sequence of this client's tenant (0 in router mode).
  int ShardOf(std::string_view sequence_id) const;
  // The routing key of a sequence (router mode's x-kvq-route): 16 lowercase hex digits of
  // HashRing::KeyOf(identity, sequence id), the identity being the tenant, else the token,
  // else "default" (with auth on the client does not know its tenant's name: its token is
  // its identity). Honours the {tag} rule, so sequences of one tag share a key and a shard.
  std::string RouteKey(std::string_view sequence_id) const;

  // Health of every server (never fails as a whole; see each entry's status).
  std::vector<ShardHealth> Health();
  // Usage of the caller's tenant on one server.
  absl::StatusOr<v1::StatsResponse> Stats(int shard = 0);
  absl::StatusOr<v1::ListModelsResponse> ListModels(int shard = 0);
  absl::StatusOr<v1::ModelInfo> GetModel(const std::string& model, int version = 0, int shard = 0);
  // A model version's basis tensors (what ModelCodes, kvq/client/codes.h, is made from).
  absl::StatusOr<v1::RegisterBasisRequest> GetBasis(const std::string& model, int version = 0,
                                                    int shard = 0);
  // Registers on every server (each must know the model of the sequences it holds).
  // Returns the first server's answer; fails when any server fails.
  // Router mode: FAILED_PRECONDITION (a proxy reaches one shard per call).
  absl::StatusOr<v1::RegisterBasisResponse> RegisterBasis(const v1::RegisterBasisRequest& req);

  // Streams the messages' appends, split by shard (one stream per shard, message order and
  // boundaries kept within a shard: each message is atomic on each server). Returns the
  // merged counts and lengths; the first failing shard's status otherwise (the other shards'
  // appends stay applied; re-sending is safe).
  absl::StatusOr<v1::PutBlocksResponse> PutBlocks(const std::vector<v1::PutBlocksRequest>& msgs);

  // One sequence's appends streamed as they are made, so that making the next message (e.g.
  // encoding its codes) overlaps sending the previous ones: `next` fills one message and
  // returns true, false at the end, or an error (which ends the call with it). `next` runs on
  // a thread of the call's own, one call at a time, up to 8 messages ahead of the writes; it
  // is not called again after it returned false or an error. Every append must be of
  // `sequence_id` (its shard, or its route in router mode). Retried on UNAVAILABLE as
  // PutBlocks is: the messages made so far are sent again (they are kept until the call
  // ends), then the stream continues with the next ones.
  absl::StatusOr<v1::PutBlocksResponse> PutBlocksStream(
      const std::string& sequence_id,
      const std::function<absl::StatusOr<bool>(v1::PutBlocksRequest*)>& next);

  // Batched reads; results in the order of the request's items.
  absl::StatusOr<v1::ScoreResponse> Score(const v1::ScoreRequest& req);
  absl::StatusOr<v1::ReadoutResponse> Readout(const v1::ReadoutRequest& req);
  absl::StatusOr<v1::AttendResponse> Attend(const v1::AttendRequest& req);

  // Streams a sequence's K/V; on_chunk is called for each message (return false to stop
  // early, which is OK). Retried only until the first message arrived.
  absl::Status GetBlocks(const v1::GetBlocksRequest& req,
                         const std::function<bool(const v1::GetBlocksResponse&)>& on_chunk);

  absl::StatusOr<v1::DeleteSequenceResponse> DeleteSequence(const std::string& sequence_id);

  // Read-only prefix lookup (one round trip, no K/V): sent to the shard (or route) of
  // sequence_ids(0) (without ids, of ""), whose prefix index it matches; every sequence id
  // must be placed there too (give one prompt's names one {tag}), else INVALID_ARGUMENT
  // before anything is sent. Retried on UNAVAILABLE.
  absl::StatusOr<v1::MatchPrefixResponse> MatchPrefix(const v1::MatchPrefixRequest& req);

  // The diagnostic no-op: sends the payload to one server, returns what came back.
  absl::StatusOr<std::string> Echo(const std::string& payload, int shard = 0);

  struct Impl;
  // Where the items of a batched call go: groups of item indices, each with its channel and
  // routing key ("" = none). By shard (client-side hashing), or by RouteKey (router mode).
  struct Placement {
    std::vector<int> group_of;              // per item
    std::vector<std::vector<int>> members;  // per group: item indices, in request order
    std::vector<int> shard;                 // per group
    std::vector<std::string> route;         // per group
  };

 private:
  Placement Place(const std::function<std::string_view(int)>& id_of, int n) const;
  template <class Req>
  Placement PlaceItems(const Req& req) const;
  Client(ClientOptions options, std::unique_ptr<Impl> impl);
  ClientOptions options_;
  HashRing ring_;
  std::string shard_tenant_;
  std::unique_ptr<Impl> impl_;
};

// "host:port,host:port" -> list (blank entries dropped, whitespace trimmed).
std::vector<std::string> SplitServers(std::string_view list);

// The gRPC status code's canonical name ("NOT_FOUND"), or "CODE_<n>".
std::string StatusCodeName(int code);

}  // namespace kvq::client
