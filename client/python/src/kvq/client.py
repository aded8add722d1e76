"""kvq.Client: typed, synchronous calls to one or several kvq servers.

Mirrors the C++ client (client/lib/src/client.cc):
* a deadline on every attempt (`deadline`, seconds; each method takes `deadline=` too);
* retries on UNAVAILABLE, with full-jitter backoff, of the idempotent calls only: PutBlocks
  (appends carry their start, so a re-sent range is a duplicate), Score, Readout, Attend when
  every item has observe=False, GetBlocks until its first chunk, RegisterBasis, ListModels,
  GetModel, Stats, Echo and health checks. DeleteSequence and observing Attend calls are
  never retried: a second attempt would not be a no-op;
* several servers: sequences sharded by kvq.ring.HashRing over (tenant, sequence id);
  batched calls are split by shard, sent concurrently and merged back in request order; a
  failed shard's items get its status (message naming the server), and the call itself
  fails only when every shard it needed failed;
* router mode (router=True): one address, a routing proxy (deploy/haproxy) that picks each
  call's shard from its `x-kvq-route` header, set to route_key(sequence id); batched calls
  are split by routing key instead of by shard (the proxy hashes with its own functions, so
  one sequence must always be reached through the same path);
* TLS (CA, client certificate) and a bearer token (`authorization: Bearer <t>`), or the
  tenant as `x-kvq-tenant` when no token is set;
* messages up to 256 MiB each way (the server's default limit).
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import grpc
import numpy as np

from ._proto.kvq.v1 import kvq_pb2, kvq_pb2_grpc
from .errors import KvqError, code_from_int
from .ring import HashRing, key_of
from .tensors import dtype_enum, from_tensor, to_tensor
from .types import (
    Append,
    AttendItem,
    Block,
    CodecSettings,
    ItemResult,
    ReadoutItem,
    ScoreItem,
)

__all__ = ["Client", "split_servers", "MAX_MESSAGE_BYTES", "ROUTE_HEADER"]

# Router mode's routing header (deploy/haproxy/haproxy.cfg balances on it).
ROUTE_HEADER = "x-kvq-route"
# Most sub-calls of one batched call in flight at once in router mode (one per routing key).
_ROUTER_PARALLEL = 16

# Called after every attempt of every call: (method, attempt from 1, shard, grpc.StatusCode).
AttemptHook = Callable[[str, int, int, grpc.StatusCode], None]

# The server's default --max-message-bytes; gRPC's own default (4 MiB) would refuse a prefill.
MAX_MESSAGE_BYTES = 256 << 20
_HEALTH_CHECK = "/grpc.health.v1.Health/Check"
_POLICIES = {
    "uniform": kvq_pb2.CodecSettings.VALUE_POLICY_UNIFORM,
    "a2": kvq_pb2.CodecSettings.VALUE_POLICY_A2,
}


def split_servers(servers: Union[str, Sequence[str]]) -> List[str]:
    """"host:port,host:port" (or a sequence) -> list, blanks dropped, whitespace trimmed."""
    parts = servers.split(",") if isinstance(servers, str) else list(servers)
    return [s.strip() for s in parts if s and s.strip()]


def _read_pem(value: Optional[Union[bytes, str]], what: str) -> Optional[bytes]:
    """PEM bytes as given, or the contents of the file a str names."""
    if value is None:
        return None
    if isinstance(value, bytes):
        return value
    if value.lstrip().startswith("-----BEGIN"):
        return value.encode()
    try:
        with open(value, "rb") as f:
            return f.read()
    except OSError as e:
        raise KvqError.invalid("Client", f"{what}: cannot read '{value}': {e.strerror}") from None


# -- request building (shared with kvq.aio) -------------------------------------------------

def _codec_pb(c: Optional[CodecSettings], field: str, method: str) -> Optional[kvq_pb2.CodecSettings]:
    """The wire form of codec settings: the fields that are not None, each sent as it is (the
    server checks ranges and names the field); a kvq_pb2.CodecSettings is sent as it is."""
    if c is None:
        return None
    if isinstance(c, kvq_pb2.CodecSettings):
        return c
    if isinstance(c, Mapping):
        c = CodecSettings(**c)
    values = {f.name: getattr(c, f.name) for f in dataclasses.fields(CodecSettings)
              if getattr(c, f.name) is not None}
    if "value_policy" in values:
        policy = _POLICIES.get(str(values["value_policy"]).lower())
        if policy is None:
            raise KvqError.invalid(method, f"{field}.value_policy: {values['value_policy']!r} is not uniform or a2")
        values["value_policy"] = policy
    for name in ("rotate_keys", "rotate_values", "metric_rounding"):
        if name in values and not isinstance(values[name], bool):
            raise KvqError.invalid(method, f"{field}.{name}: {values[name]!r} must be True or False (None: the model's)")
    return kvq_pb2.CodecSettings(**values)


def append_pb(a: Append, field: str, method: str,
              out: Optional[kvq_pb2.Append] = None) -> kvq_pb2.Append:
    """kvq_pb2.Append for an Append (checks shapes client-side; field names it in errors).
    out: fill this message (a field of the request being built) instead of a new one."""
    if not isinstance(a, Append):
        raise KvqError.invalid(method, f"{field}: expected kvq.Append, got {type(a).__name__}")
    if not a.sequence_id:
        raise KvqError.invalid(method, f"{field}.sequence_id: empty")
    if out is None:
        out = kvq_pb2.Append()
    out.sequence_id = a.sequence_id
    out.layer = int(a.layer)
    out.start = int(a.start)
    out.model = a.model or ""
    out.basis_version = int(a.basis_version)
    if (a.keys is None) != (a.values is None):
        missing = "values" if a.values is None else "keys"
        raise KvqError.invalid(method, f"{field}.{missing}: missing (keys and values go together)")
    if a.keys is not None:
        k = to_tensor(a.keys, f"{field}.keys", method, ndims=(3,), out=out.keys)
        v = to_tensor(a.values, f"{field}.values", method, ndims=(3,), out=out.values)
        if list(k.shape) != list(v.shape):
            raise KvqError.invalid(
                method,
                f"{field}.values: shape {list(v.shape)} differs from keys {list(k.shape)} "
                "(both [kv_heads, n, head_dim])",
            )
        if k.dtype != v.dtype:
            raise KvqError.invalid(method, f"{field}.values: dtype differs from keys'")
    elif a.token_ids is None:
        raise KvqError.invalid(
            method, f"{field}: neither keys/values nor token_ids (an attach needs token_ids)"
        )
    if a.token_ids is not None:
        ids = np.asarray(a.token_ids)
        if ids.ndim != 1:
            raise KvqError.invalid(method, f"{field}.token_ids: expected one dimension")
        if ids.size and (ids.min() < 0 or ids.max() > 0xFFFFFFFF):
            raise KvqError.invalid(method, f"{field}.token_ids: ids must be uint32")
        out.token_ids.extend(ids.astype(np.uint64).tolist())
    if a.probe_weights is not None:
        to_tensor(a.probe_weights, f"{field}.probe_weights", method, ndims=(2,), f32_only=True,
                  out=out.probe_weights)
    codec = _codec_pb(a.codec, f"{field}.codec", method)
    if codec is not None:
        out.codec.CopyFrom(codec)
    return out


def put_requests(messages: Sequence[Sequence[Append]], by_shard: Callable[[Sequence[str]], Any],
                 method: str = "PutBlocks") -> Dict[int, List[kvq_pb2.PutBlocksRequest]]:
    """The PutBlocks messages per shard: each message split by shard, order kept."""
    per_shard: Dict[int, List[kvq_pb2.PutBlocksRequest]] = {}
    for m, msg in enumerate(messages):
        prefix = f"messages[{m}].appends" if len(messages) > 1 else "appends"
        _, groups = by_shard([getattr(a, "sequence_id", "") for a in msg])
        for s, idx in (groups or {0: []}).items():
            req = kvq_pb2.PutBlocksRequest()
            for i in idx:
                append_pb(msg[i], f"{prefix}[{i}]", method, out=req.appends.add())
            per_shard.setdefault(s, []).append(req)
    return dict(sorted(per_shard.items()))


def attend_request(items: Sequence[AttendItem], method: str = "Attend") -> kvq_pb2.AttendRequest:
    req = kvq_pb2.AttendRequest()
    for i, it in enumerate(items):
        f = f"items[{i}]"
        if not isinstance(it, AttendItem):
            raise KvqError.invalid(method, f"{f}: expected kvq.AttendItem, got {type(it).__name__}")
        p = req.items.add(
            sequence_id=it.sequence_id,
            layer=int(it.layer),
            basis_version=int(it.basis_version),
            scale=float(it.scale),
            output_dtype=dtype_enum(it.output_dtype, f"{f}.output_dtype", method),
        )
        to_tensor(it.queries, f"{f}.queries", method, ndims=(2, 3), out=p.queries)
        if it.causal_offset is not None:
            p.causal_offset = int(it.causal_offset)
        if it.observe is not None:
            p.observe = bool(it.observe)
        if it.append is not None:
            append_pb(it.append, f"{f}.append", method, out=p.append)
    return req


def score_request(items: Sequence[ScoreItem], method: str = "Score") -> kvq_pb2.ScoreRequest:
    req = kvq_pb2.ScoreRequest()
    for i, it in enumerate(items):
        f = f"items[{i}]"
        if not isinstance(it, ScoreItem):
            raise KvqError.invalid(method, f"{f}: expected kvq.ScoreItem, got {type(it).__name__}")
        p = req.items.add(
            sequence_id=it.sequence_id,
            layer=int(it.layer),
            basis_version=int(it.basis_version),
            scale=float(it.scale),
            corrections_only=bool(it.corrections_only),
        )
        to_tensor(it.queries, f"{f}.queries", method, ndims=(2, 3), out=p.queries)
        if it.append is not None:
            append_pb(it.append, f"{f}.append", method, out=p.append)
    return req


def readout_request(items: Sequence[ReadoutItem], method: str = "Readout") -> kvq_pb2.ReadoutRequest:
    req = kvq_pb2.ReadoutRequest()
    for i, it in enumerate(items):
        f = f"items[{i}]"
        if not isinstance(it, ReadoutItem):
            raise KvqError.invalid(method, f"{f}: expected kvq.ReadoutItem, got {type(it).__name__}")
        p = req.items.add(
            sequence_id=it.sequence_id,
            layer=int(it.layer),
            basis_version=int(it.basis_version),
            weights_are_logits=bool(it.weights_are_logits),
            output_dtype=dtype_enum(it.output_dtype, f"{f}.output_dtype", method),
        )
        to_tensor(it.weights, f"{f}.weights", method, ndims=(3,), f32_only=True, out=p.weights)
    return req


def model_info_pb(info: Union[kvq_pb2.ModelInfo, Mapping[str, Any]]) -> kvq_pb2.ModelInfo:
    if isinstance(info, kvq_pb2.ModelInfo):
        return info
    if not isinstance(info, Mapping):
        raise KvqError.invalid("RegisterBasis", "info: expected kvq_pb2.ModelInfo or a dict")
    fields = dict(info)
    codec = fields.pop("codec", None)
    try:
        out = kvq_pb2.ModelInfo(**fields)
    except (ValueError, TypeError) as e:
        raise KvqError.invalid("RegisterBasis", f"info: {e}") from None
    c = _codec_pb(codec, "info.codec", "RegisterBasis")
    if c is not None:
        out.codec.CopyFrom(c)
    return out


def register_request(
    info: Union[kvq_pb2.ModelInfo, Mapping[str, Any]], basis: Sequence[Any],
    encode_basis: Sequence[Any] = (), query_moment: Sequence[Any] = (),
) -> kvq_pb2.RegisterBasisRequest:
    req = kvq_pb2.RegisterBasisRequest(info=model_info_pb(info))
    for name, tensors in (("basis", basis), ("encode_basis", encode_basis),
                          ("query_moment", query_moment)):
        for l, t in enumerate(tensors):
            to_tensor(t, f"{name}[{l}]", "RegisterBasis", ndims=(3,), f32_only=True,
                      out=getattr(req, name).add())
    return req


def item_results(method: str, results: Sequence[Any], field: str, bf16: str = "uint16") -> List[ItemResult]:
    """ItemResults from the proto results (outputs decoded to numpy)."""
    out = []
    for i, r in enumerate(results):
        code = code_from_int(r.status.code)
        arr = None
        if code == grpc.StatusCode.OK and r.HasField(field):
            arr = from_tensor(getattr(r, field), bf16=bf16, field=f"results[{i}].{field}", method=method)
        out.append(ItemResult(code, r.status.message, int(r.tokens), arr, method=method, index=i))
    return out


def check_results(results: List[ItemResult]) -> List[ItemResult]:
    """Raises KvqError for the first failed item (message "items[i]: ...")."""
    for r in results:
        r.raise_for_status()
    return results


def merge_stats(parts: Sequence[kvq_pb2.StatsResponse]) -> kvq_pb2.StatsResponse:
    """The sum of several servers' Stats: counts summed, bits per element weighted by tokens,
    uptime the shortest; names (tenant, pool, backend) from the first server."""
    if len(parts) == 1:
        return parts[0]
    out = kvq_pb2.StatsResponse()
    out.CopyFrom(parts[0])
    for name in (
        "sequences", "tokens", "stored_bytes", "quota_bytes", "evictions", "prefix_blocks",
        "prefix_bytes", "retained_prefix_bytes", "shared_tokens", "server_stored_bytes",
        "server_capacity_bytes",
    ):
        setattr(out, name, sum(getattr(p, name) for p in parts))
    tokens = sum(p.tokens for p in parts)
    for name in ("k_bits_per_element", "v_bits_per_element"):
        if tokens > 0:
            setattr(out, name, sum(getattr(p, name) * p.tokens for p in parts) / tokens)
    out.uptime_seconds = min(p.uptime_seconds for p in parts)
    return out


def merge_put(parts: Sequence[kvq_pb2.PutBlocksResponse]) -> kvq_pb2.PutBlocksResponse:
    out = kvq_pb2.PutBlocksResponse()
    for p in parts:
        out.messages += p.messages
        out.appends += p.appends
        out.tokens_written += p.tokens_written
        out.tokens_duplicate += p.tokens_duplicate
        out.tokens_shared += p.tokens_shared
        out.lengths.extend(p.lengths)
    return out


def parse_health(raw: bytes) -> bool:
    """True when a grpc.health.v1.HealthCheckResponse says SERVING (field 1, value 1)."""
    return raw == b"\x08\x01"


def block_of(chunk: kvq_pb2.GetBlocksResponse, bf16: str, method: str = "GetBlocks") -> Block:
    return Block(
        layer=int(chunk.layer),
        start=int(chunk.start),
        keys=from_tensor(chunk.keys, bf16=bf16, field="keys", method=method),
        values=from_tensor(chunk.values, bf16=bf16, field="values", method=method),
        layer_tokens=int(chunk.layer_tokens),
        basis_version=int(chunk.basis_version),
    )


class _Options:
    """Validated connection settings (shared with kvq.aio)."""

    def __init__(
        self,
        servers: Union[str, Sequence[str]],
        tenant: Optional[str],
        token: Optional[str],
        tls: bool,
        root_certificates: Optional[Union[bytes, str]],
        private_key: Optional[Union[bytes, str]],
        certificate_chain: Optional[Union[bytes, str]],
        deadline: float,
        max_attempts: int,
        initial_backoff: float,
        max_backoff: float,
        backoff_multiplier: float,
        virtual_nodes: int,
        tls_server_name: Optional[str],
        allow_insecure_token: bool,
        on_attempt: Optional[AttemptHook],
        router: bool = False,
    ) -> None:
        m = "Client"
        self.servers = split_servers(servers)
        if not self.servers:
            raise KvqError.invalid(m, "servers: no server address given")
        if len(set(self.servers)) != len(self.servers):
            raise KvqError.invalid(m, "servers: an address is listed twice")
        if router and len(self.servers) != 1:
            raise KvqError.invalid(
                m, "servers: router mode takes exactly one address (the routing proxy)")
        if not deadline or deadline <= 0:
            raise KvqError.invalid(m, f"deadline: must be > 0 seconds, got {deadline}")
        if max_attempts < 1:
            raise KvqError.invalid(m, f"max_attempts: must be >= 1, got {max_attempts}")
        if backoff_multiplier < 1.0:
            raise KvqError.invalid(m, f"backoff_multiplier: must be >= 1, got {backoff_multiplier}")
        if initial_backoff < 0 or max_backoff < 0:
            raise KvqError.invalid(m, "initial_backoff/max_backoff: must be >= 0")
        if virtual_nodes < 1:
            raise KvqError.invalid(m, f"virtual_nodes: must be >= 1, got {virtual_nodes}")
        if token and not tls and not allow_insecure_token:
            raise KvqError.invalid(
                m,
                "token: refusing to send a bearer token over plaintext: turn TLS on (or "
                "allow_insecure_token=True for loopback testing)",
            )
        if not tls and (root_certificates or private_key or certificate_chain):
            raise KvqError.invalid(m, "tls: certificates given but TLS is off")
        if bool(private_key) != bool(certificate_chain):
            raise KvqError.invalid(
                m, "private_key/certificate_chain: a client certificate needs both"
            )
        self.tenant = tenant or ""
        self.token = token or ""
        self.tls = tls
        self.deadline = float(deadline)
        self.max_attempts = int(max_attempts)
        self.initial_backoff = float(initial_backoff)
        self.max_backoff = float(max_backoff)
        self.backoff_multiplier = float(backoff_multiplier)
        self.on_attempt = on_attempt
        self.ring = HashRing(self.servers, virtual_nodes)
        # The tenant part of the shard key, as in C++: tenant, else token, else "default".
        self.shard_tenant = self.tenant or self.token or "default"
        self.router = bool(router)
        self.default_route = self.route_key("")
        if self.token:
            self.metadata: Tuple[Tuple[str, str], ...] = (("authorization", f"Bearer {self.token}"),)
        elif self.tenant:
            self.metadata = (("x-kvq-tenant", self.tenant),)
        else:
            self.metadata = ()
        self.channel_options: List[Tuple[str, Any]] = [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            # A restarted server is found again within 2 s (gRPC's default waits up to 120 s).
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 2000),
        ]
        if tls and tls_server_name:
            self.channel_options.append(("grpc.ssl_target_name_override", tls_server_name))
        self.credentials: Optional[grpc.ChannelCredentials] = None
        if tls:
            self.credentials = grpc.ssl_channel_credentials(
                root_certificates=_read_pem(root_certificates, "root_certificates"),
                private_key=_read_pem(private_key, "private_key"),
                certificate_chain=_read_pem(certificate_chain, "certificate_chain"),
            )
        self._rng = random.Random()
        self._rng_lock = threading.Lock()

    def backoff(self, retry: int) -> float:
        """Seconds before retry `retry` (>= 1): uniform in [0, min(max, initial * mult^(k-1))]."""
        cap = min(self.max_backoff, self.initial_backoff * self.backoff_multiplier ** (retry - 1))
        with self._rng_lock:
            return self._rng.uniform(0.0, max(0.0, cap))

    def attempts(self, idempotent: bool) -> int:
        return self.max_attempts if idempotent else 1

    def timeout(self, deadline: Optional[float]) -> float:
        if deadline is None:
            return self.deadline
        if deadline <= 0:
            raise KvqError.invalid("Client", f"deadline: must be > 0 seconds, got {deadline}")
        return float(deadline)

    def note(self, method: str, attempt: int, shard: int, code: grpc.StatusCode) -> None:
        if self.on_attempt is not None:
            self.on_attempt(method, attempt, shard, code)

    def route_key(self, sequence_id: str) -> str:
        """Router mode's x-kvq-route: 16 hex digits of key_of(identity, sequence_id)."""
        return f"{key_of(self.shard_tenant, sequence_id):016x}"

    def metadata_for(self, route: Optional[str]) -> Tuple[Tuple[str, str], ...]:
        """The call metadata; in router mode with x-kvq-route (None: the default route)."""
        if not self.router:
            return self.metadata
        return self.metadata + ((ROUTE_HEADER, route or self.default_route),)

    def label(self, shard: int, route: Optional[str] = None) -> str:
        """The server named in errors (router mode: the proxy and the routing key)."""
        if not self.router:
            return self.servers[shard]
        return f"{self.servers[shard]} ({ROUTE_HEADER} {route or self.default_route})"

    @staticmethod
    def target(group: Union[int, str]) -> Tuple[int, Optional[str]]:
        """(shard, route) of a by_shard group: a shard index, or a routing key (router mode)."""
        return (0, group) if isinstance(group, str) else (group, None)

    def by_shard(self, ids: Sequence[str]) -> Tuple[List[Any], Dict[Any, List[int]]]:
        """Group of each id, and the indices per group: shards (in increasing order), or in
        router mode routing keys (in order of first appearance)."""
        if self.router:
            keys = [self.route_key(sid) for sid in ids]
            by_key: Dict[Any, List[int]] = {}
            for i, k in enumerate(keys):
                by_key.setdefault(k, []).append(i)
            return keys, by_key
        n = len(self.servers)
        if n == 1:
            return [0] * len(ids), ({0: list(range(len(ids)))} if ids else {})
        shard_of = [self.ring.shard_of(self.shard_tenant, sid) for sid in ids]
        groups: Dict[int, List[int]] = {}
        for i, s in enumerate(shard_of):
            groups.setdefault(s, []).append(i)
        return shard_of, dict(sorted(groups.items()))


def _code_of(err: grpc.RpcError) -> grpc.StatusCode:
    try:
        return err.code()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - an RpcError that is not a Call
        return grpc.StatusCode.UNKNOWN


class Client:
    """A client of one or several kvq servers (thread-safe).

    Args:
        servers: "host:port", a comma-separated list, or a sequence of addresses (any gRPC
            target). With several, sequences are sharded by consistent hashing of (tenant,
            sequence id); every client of a deployment must list the same set.
        tenant: sent as `x-kvq-tenant` when no token is set (auth off); also the tenant part
            of the shard key (default: the token, else "default").
        token: bearer token, sent as `authorization: Bearer <token>`. Refused over
            plaintext unless allow_insecure_token.
        tls: use TLS. root_certificates / private_key / certificate_chain: PEM bytes, or a
            path to a PEM file, of the CA (None: the system roots) and of the client
            certificate (mTLS).
        deadline: seconds per attempt of each call (each method takes `deadline=` too).
        max_attempts, initial_backoff, max_backoff, backoff_multiplier: retries on
            UNAVAILABLE of the idempotent calls; before retry k a uniform random wait in
            [0, min(max_backoff, initial_backoff * multiplier**(k-1))] ("full jitter").
        virtual_nodes: points per server on the hash ring.
        tls_server_name: name checked against the server certificate (dialling an IP).
        allow_insecure_token: allow a token over plaintext (loopback tests only).
        on_attempt: called after every attempt (method, attempt from 1, shard,
            grpc.StatusCode): a seam for counting retries.
        router: `servers` is one routing proxy (deploy/haproxy): every call carries
            x-kvq-route (route_key of its sequence; of "" for calls of no sequence, which
            reach the one shard the proxy picks for it), batched calls are split by routing
            key. register_basis is refused (the proxy reaches one shard per call): register
            on the shards directly.
    """

    def __init__(
        self,
        servers: Union[str, Sequence[str]],
        *,
        tenant: Optional[str] = None,
        token: Optional[str] = None,
        tls: bool = False,
        root_certificates: Optional[Union[bytes, str]] = None,
        private_key: Optional[Union[bytes, str]] = None,
        certificate_chain: Optional[Union[bytes, str]] = None,
        deadline: float = 30.0,
        max_attempts: int = 4,
        initial_backoff: float = 0.05,
        max_backoff: float = 2.0,
        backoff_multiplier: float = 2.0,
        virtual_nodes: int = 128,
        tls_server_name: Optional[str] = None,
        allow_insecure_token: bool = False,
        on_attempt: Optional[AttemptHook] = None,
        router: bool = False,
    ) -> None:
        self._o = _Options(
            servers, tenant, token, tls, root_certificates, private_key, certificate_chain,
            deadline, max_attempts, initial_backoff, max_backoff, backoff_multiplier,
            virtual_nodes, tls_server_name, allow_insecure_token, on_attempt, router,
        )
        self._channels: List[grpc.Channel] = []
        for addr in self._o.servers:
            if self._o.credentials is not None:
                ch = grpc.secure_channel(addr, self._o.credentials, options=self._o.channel_options)
            else:
                ch = grpc.insecure_channel(addr, options=self._o.channel_options)
            self._channels.append(ch)
        self._stubs = [kvq_pb2_grpc.KvqStub(ch) for ch in self._channels]
        self._health = [
            ch.unary_unary(_HEALTH_CHECK, request_serializer=None, response_deserializer=None)
            for ch in self._channels
        ]
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pool_lock = threading.Lock()
        self._closed = False

    # -- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Closes every channel (and the shard thread pool)."""
        if self._closed:
            return
        self._closed = True
        for ch in self._channels:
            ch.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- topology ---------------------------------------------------------------------------
    @property
    def servers(self) -> Sequence[str]:
        """The server addresses, in the order given."""
        return tuple(self._o.servers)

    def shard_of(self, sequence_id: str) -> int:
        """Index into servers of the server owning a sequence of this client's tenant."""
        return self._o.ring.shard_of(self._o.shard_tenant, sequence_id)

    def route_key(self, sequence_id: str) -> str:
        """The x-kvq-route value of a sequence in router mode: 16 hex digits of
        kvq.ring.key_of(identity, sequence_id), identity = tenant, else token, else
        "default" (honours the {tag} rule; the C++ client's Client::RouteKey)."""
        return self._o.route_key(sequence_id)

    def stub(self, shard: int = 0) -> kvq_pb2_grpc.KvqStub:
        """The generated stub of one server, for calls this class does not wrap."""
        return self._stubs[self._shard(shard)]

    # -- the retry loop ---------------------------------------------------------------------
    def _shard(self, shard: int) -> int:
        if not 0 <= shard < len(self._stubs):
            raise KvqError.invalid("Client", f"shard: {shard} is not in [0, {len(self._stubs)})")
        return shard

    def _run(
        self, method: str, shard: int, idempotent: bool, deadline: Optional[float],
        fn: Callable[[float, Tuple[Tuple[str, str], ...]], Any], route: Optional[str] = None,
    ) -> Any:
        """fn(timeout, metadata) until it succeeds, fails other than UNAVAILABLE, or runs out
        of attempts; raises KvqError with the last status. route: router mode's x-kvq-route
        (None: the default route)."""
        timeout = self._o.timeout(deadline)
        attempts = self._o.attempts(idempotent)
        metadata = self._o.metadata_for(route)
        for a in range(1, attempts + 1):
            try:
                result = fn(timeout, metadata)
            except grpc.RpcError as e:
                code = _code_of(e)
                self._o.note(method, a, shard, code)
                if code != grpc.StatusCode.UNAVAILABLE or a == attempts:
                    raise KvqError.from_rpc_error(method, e, self._o.label(shard, route)) from None
                time.sleep(self._o.backoff(a))
                continue
            self._o.note(method, a, shard, grpc.StatusCode.OK)
            return result
        raise AssertionError("unreachable")

    def _parallel(self, jobs: Sequence[Callable[[], Any]]) -> List[Any]:
        """Runs jobs concurrently (the first on this thread); returns results or exceptions."""
        if len(jobs) == 1:
            try:
                return [jobs[0]()]
            except KvqError as e:
                return [e]
        with self._pool_lock:
            if self._pool is None:
                workers = _ROUTER_PARALLEL if self._o.router else max(2, len(self._stubs))
                self._pool = ThreadPoolExecutor(max_workers=workers,
                                                thread_name_prefix="kvq-shard")
        futures = [self._pool.submit(j) for j in jobs[1:]]
        out: List[Any] = []
        try:
            out.append(jobs[0]())
        except KvqError as e:
            out.append(e)
        for f in futures:
            try:
                out.append(f.result())
            except KvqError as e:
                out.append(e)
        return out

    def _batched(self, method: str, req: Any, idempotent: bool, deadline: Optional[float]) -> Any:
        """Splits a batched request by shard (router mode: by routing key), runs the parts
        concurrently, merges in order."""
        n = len(req.items)
        if len(self._o.servers) == 1 and not self._o.router:
            group_of, groups = [], {0: []}  # nothing to split
        else:
            group_of, groups = self._o.by_shard([it.sequence_id for it in req.items])
        if len(groups) <= 1:
            s, route = self._o.target(next(iter(groups), 0))
            call = getattr(self._stubs[s], method)
            resp = self._run(method, s, idempotent, deadline,
                             lambda t, md: call(req, timeout=t, metadata=md), route)
            if len(resp.results) != n:
                raise KvqError(method, grpc.StatusCode.INTERNAL,
                               f"server {self._o.label(s, route)} returned {len(resp.results)} "
                               f"results for {n} items")
            return resp
        parts = {}
        for g, idx in groups.items():
            part = type(req)()
            part.items.extend(req.items[i] for i in idx)
            parts[g] = part

        def job(g: Any) -> Callable[[], Any]:
            s, route = self._o.target(g)
            call = getattr(self._stubs[s], method)
            return lambda: self._run(method, s, idempotent, deadline,
                                     lambda t, md: call(parts[g], timeout=t, metadata=md), route)

        keys = list(groups)
        answers = dict(zip(keys, self._parallel([job(g) for g in keys])))
        for g in keys:
            a = answers[g]
            if not isinstance(a, KvqError) and len(a.results) != len(groups[g]):
                answers[g] = KvqError(method, grpc.StatusCode.INTERNAL,
                                      f"server {self._o.label(*self._o.target(g))} returned "
                                      f"{len(a.results)} results for {len(groups[g])} items")
        if all(isinstance(a, KvqError) for a in answers.values()):
            raise answers[keys[0]]
        out = _RESPONSE[method]()
        next_of = {g: 0 for g in keys}
        for i in range(n):
            g = group_of[i]
            a = answers[g]
            r = out.results.add()
            if isinstance(a, KvqError):
                r.status.code = a.code.value[0]
                r.status.message = f"server {self._o.label(*self._o.target(g))}: {a.details}"
            else:
                r.CopyFrom(a.results[next_of[g]])
                next_of[g] += 1
        return out

    # -- health and registry ----------------------------------------------------------------
    def health(self, *, deadline: Optional[float] = None) -> List[Tuple[str, bool]]:
        """(server, serving) for every server (grpc.health.v1); never raises for a server
        that does not answer (serving is then False)."""
        out = []
        for s, check in enumerate(self._health):
            try:
                raw = self._run("Health", s, True, deadline,
                                lambda t, md, check=check: check(b"", timeout=t, metadata=md))
                out.append((self._o.servers[s], parse_health(raw)))
            except KvqError:
                out.append((self._o.servers[s], False))
        return out

    def register_basis(
        self,
        info: Union[kvq_pb2.ModelInfo, Mapping[str, Any]],
        basis: Sequence[Any] = (),
        *,
        encode_basis: Sequence[Any] = (),
        query_moment: Sequence[Any] = (),
        deadline: Optional[float] = None,
    ) -> kvq_pb2.RegisterBasisResponse:
        """Registers a model (and its basis: one f32 [kv_heads, head_dim, rank] per layer) on
        every server; returns the first server's answer, raises when any server fails.
        `info` is a kvq_pb2.ModelInfo or a dict of its fields (codec may be a CodecSettings).
        encode_basis: an oblique pair's encode basis A (same shapes as basis, which is then the
        decode basis B; A^T B = I); query_moment: E[q q^T] per layer, f32 [kv_heads,
        head_dim, head_dim] (what codec metric_rounding needs). Both optional.
        Retried (idempotent: an identical entry registers again as OK)."""
        if self._o.router:
            raise _router_register_error()
        req = register_request(info, basis, encode_basis, query_moment)
        jobs = [
            (lambda s=s: self._run("RegisterBasis", s, True, deadline,
                                   lambda t, md: self._stubs[s].RegisterBasis(req, timeout=t, metadata=md)))
            for s in range(len(self._stubs))
        ]
        results = self._parallel(jobs)
        for r in results:
            if isinstance(r, KvqError):
                raise r
        return results[0]

    def list_models(self, *, shard: int = 0, deadline: Optional[float] = None) -> List[kvq_pb2.ModelInfo]:
        """Every registered (model, version) of one server (ModelInfo messages)."""
        s = self._shard(shard)
        resp = self._run("ListModels", s, True, deadline,
                         lambda t, md: self._stubs[s].ListModels(kvq_pb2.ListModelsRequest(), timeout=t, metadata=md))
        return list(resp.models)

    def get_model(
        self, model: str, version: int = 0, *, shard: int = 0, deadline: Optional[float] = None
    ) -> kvq_pb2.ModelInfo:
        """One model version (0: the latest). NOT_FOUND raises KvqError."""
        s = self._shard(shard)
        req = kvq_pb2.GetModelRequest(model=model, version=int(version))
        return self._run("GetModel", s, True, deadline,
                         lambda t, md: self._stubs[s].GetModel(req, timeout=t, metadata=md))

    # -- writes -----------------------------------------------------------------------------
    def put_blocks(
        self,
        appends: Sequence[Append] = (),
        *,
        messages: Optional[Sequence[Sequence[Append]]] = None,
        deadline: Optional[float] = None,
    ) -> kvq_pb2.PutBlocksResponse:
        """Streams appends: one PutBlocks stream per server involved.

        By default all `appends` go in one message (applied atomically on each server).
        `messages` gives the message boundaries instead (a list of lists of Append; order
        and boundaries are kept within each server). Returns the counts summed over servers
        and every touched (sequence, layer)'s length; raises the first failing server's
        status (the other servers' appends stay applied; re-sending is safe). Retried on
        UNAVAILABLE: appends carry their start, so a re-sent range is a duplicate.
        """
        method = "PutBlocks"
        if messages is None:
            if not appends:
                raise KvqError.invalid(method, "appends: empty")
            messages = [appends]
        elif appends:
            raise KvqError.invalid(method, "appends/messages: give one of them, not both")
        per_shard = put_requests(messages, self._o.by_shard, method)

        def job(g: Any) -> Callable[[], Any]:
            s, route = self._o.target(g)
            return lambda: self._run(
                method, s, True, deadline,
                lambda t, md: self._stubs[s].PutBlocks(iter(per_shard[g]), timeout=t, metadata=md),
                route)

        results = self._parallel([job(g) for g in per_shard])
        for r in results:
            if isinstance(r, KvqError):
                raise r
        return merge_put(results)

    # -- batched reads ----------------------------------------------------------------------
    def score(
        self, items: Sequence[ScoreItem], *, check: bool = True, deadline: Optional[float] = None
    ) -> List[ItemResult]:
        """Logits per item (outputs f32 [q_heads, n_q, tokens]), in the items' order.
        check=True raises KvqError for the first failed item; check=False returns every
        item's status. Retried on UNAVAILABLE."""
        resp = self._batched("Score", score_request(items), True, deadline)
        out = item_results("Score", resp.results, "logits")
        return check_results(out) if check else out

    def readout(
        self, items: Sequence[ReadoutItem], *, check: bool = True, deadline: Optional[float] = None
    ) -> List[ItemResult]:
        """Attention-weighted sums of each item's cached values (outputs [q_heads, n_q,
        head_dim] in the item's output dtype). Retried on UNAVAILABLE."""
        resp = self._batched("Readout", readout_request(items), True, deadline)
        out = item_results("Readout", resp.results, "outputs")
        return check_results(out) if check else out

    def attend(
        self, items: Sequence[AttendItem], *, check: bool = True, deadline: Optional[float] = None
    ) -> List[ItemResult]:
        """Fused attention per item (outputs [q_heads, n_q, head_dim] in the item's output
        dtype), in the items' order. Retried only when every item has observe=False (an
        observing call records A^2 statistics: a retry would count them twice)."""
        read_only = bool(items) and all(it.observe is False for it in items)
        resp = self._batched("Attend", attend_request(items), read_only, deadline)
        out = item_results("Attend", resp.results, "outputs")
        return check_results(out) if check else out

    def get_blocks(
        self,
        sequence_id: str,
        layers: Optional[Sequence[int]] = None,
        *,
        dtype: str = "f32",
        from_token: int = 0,
        to_token: int = 0,
        max_tokens_per_message: int = 0,
        basis_version: int = 0,
        bf16: str = "uint16",
        deadline: Optional[float] = None,
    ) -> Iterator[Block]:
        """The sequence's cached K/V as attention sees them, chunk by chunk (Blocks of at
        most max_tokens_per_message tokens; 0: the server's 4096). dtype: of the returned
        tensors ("f32", "f16", "bf16": uint16 bits, or float32 with bf16="f32").
        The call starts when iteration does; retried only until the first chunk arrived."""
        method = "GetBlocks"
        req = kvq_pb2.GetBlocksRequest(
            sequence_id=sequence_id,
            layers=[int(l) for l in (layers or [])],
            basis_version=int(basis_version),
            dtype=dtype_enum(dtype, "dtype", method),
            max_tokens_per_message=int(max_tokens_per_message),
            from_token=int(from_token),
            to_token=int(to_token),
        )
        s = self.shard_of(sequence_id)
        route = self._o.route_key(sequence_id) if self._o.router else None
        timeout = self._o.timeout(deadline)
        return self._get_blocks(req, s, timeout, bf16, route)

    def _get_blocks(self, req: kvq_pb2.GetBlocksRequest, s: int, timeout: float, bf16: str,
                    route: Optional[str] = None) -> Iterator[Block]:
        method = "GetBlocks"
        attempts = self._o.attempts(True)
        metadata = self._o.metadata_for(route)
        for a in range(1, attempts + 1):
            received = False
            call = self._stubs[s].GetBlocks(req, timeout=timeout, metadata=metadata)
            try:
                for chunk in call:
                    received = True
                    yield block_of(chunk, bf16, method)
            except grpc.RpcError as e:
                code = _code_of(e)
                self._o.note(method, a, s, code)
                if code != grpc.StatusCode.UNAVAILABLE or received or a == attempts:
                    raise KvqError.from_rpc_error(method, e, self._o.label(s, route)) from None
                time.sleep(self._o.backoff(a))
                continue
            finally:
                call.cancel()  # a no-op once finished; ends the stream when the caller stops
            self._o.note(method, a, s, grpc.StatusCode.OK)
            return

    def delete_sequence(self, sequence_id: str, *, deadline: Optional[float] = None) -> int:
        """Drops a sequence; returns the bytes freed. NOT_FOUND raises. Never retried."""
        s = self.shard_of(sequence_id)
        route = self._o.route_key(sequence_id) if self._o.router else None
        req = kvq_pb2.DeleteSequenceRequest(sequence_id=sequence_id)
        resp = self._run("DeleteSequence", s, False, deadline,
                         lambda t, md: self._stubs[s].DeleteSequence(req, timeout=t, metadata=md),
                         route)
        return int(resp.bytes_freed)

    def stats(self, *, shard: Optional[int] = None, deadline: Optional[float] = None) -> kvq_pb2.StatsResponse:
        """Usage of the caller's tenant: with several servers the sum over them (counts
        summed, bits per element weighted by tokens); shard= asks one server only."""
        shards = [self._shard(shard)] if shard is not None else list(range(len(self._stubs)))

        def job(s: int) -> Callable[[], Any]:
            return lambda: self._run("Stats", s, True, deadline,
                                     lambda t, md: self._stubs[s].Stats(kvq_pb2.StatsRequest(), timeout=t, metadata=md))

        results = self._parallel([job(s) for s in shards])
        for r in results:
            if isinstance(r, KvqError):
                raise r
        return merge_stats(results)

    def echo(self, payload: bytes, *, shard: int = 0, deadline: Optional[float] = None) -> bytes:
        """The diagnostic no-op: sends the payload to one server, returns what came back."""
        s = self._shard(shard)
        req = kvq_pb2.EchoRequest(payload=bytes(payload))
        resp = self._run("Echo", s, True, deadline,
                         lambda t, md: self._stubs[s].Echo(req, timeout=t, metadata=md))
        return bytes(resp.payload)


def _router_register_error() -> KvqError:
    return KvqError(
        "RegisterBasis", grpc.StatusCode.FAILED_PRECONDITION,
        "router mode: the proxy would register the model on one shard only; register it on "
        "every shard directly (a Client of the shard addresses)")


_RESPONSE = {
    "Score": kvq_pb2.ScoreResponse,
    "Readout": kvq_pb2.ReadoutResponse,
    "Attend": kvq_pb2.AttendResponse,
}
