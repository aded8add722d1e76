"""The one implementation behind kvq.Client (threads) and kvq.aio.Client (asyncio).

Everything but the I/O lives here: the options (ClientOptions) and their validation, the
connection settings derived from them (metadata, credentials, the hash ring, backoff), the
retry policy of one call (Tries), and each call's plan: a generator that checks the
arguments, builds the requests, splits them by shard or routing key, yields the sub-calls
(a list of Call) to the transport, and merges what comes back. A transport (ClientCore's
subclasses) only opens channels, runs a list of Calls concurrently (each with its retry
loop: time.sleep or asyncio.sleep between attempts) and streams GetBlocks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import threading
from dataclasses import dataclass
from typing import (
    Any,
    Callable,
    ContextManager,
    Dict,
    Generator,
    Generic,
    Iterator,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    TypeVar,
    Union,
)

import grpc
import numpy as np

from ._proto.kvq.v1 import kvq_pb2
from ._requests import (
    _RESPONSE,
    _codec_pb,
    attend_request,
    check_results,
    item_results,
    merge_put,
    merge_stats,
    parse_health,
    put_requests,
    readout_request,
    register_request,
    score_request,
)
from ._wire_codes import StreamDecoder as StreamDecoder
from ._wire_codes import WireCodes
from .errors import KvqError
from .paged import PagedLayout
from .ring import HashRing, key_of
from .tensors import dtype_enum
from .types import AnyAppend, AttendItem, ItemResult, PrefixMatch, ReadoutItem, ScoreItem

__all__ = ["ClientOptions", "AttemptHook", "split_servers", "MAX_MESSAGE_BYTES", "ROUTE_HEADER"]

T = TypeVar("T")
_ItemT = TypeVar("_ItemT", AttendItem, ScoreItem)  # items that may carry an append

# Router mode's routing header (deploy/haproxy/haproxy.cfg balances on it).
ROUTE_HEADER = "x-kvq-route"
# Most sub-calls of one batched call in flight at once in router mode (one per routing key).
ROUTER_PARALLEL = 16
# The server's default --max-message-bytes; gRPC's own default (4 MiB) would refuse a prefill.
MAX_MESSAGE_BYTES = 256 << 20
# The grpc.health.v1 method (Call.rpc of health checks).
HEALTH_CHECK = "/grpc.health.v1.Health/Check"

# Called after every attempt of every call: (method, attempt from 1, shard, grpc.StatusCode).
AttemptHook = Callable[[str, int, int, grpc.StatusCode], None]
# Metadata of one call: (key, value) pairs.
Metadata = Tuple[Tuple[str, str], ...]


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


@dataclass(frozen=True)
class ClientOptions:
    """How a client reaches its servers (kvq.Client and kvq.aio.Client take the same).

    Every field is also a keyword argument of both constructors (`kvq.Client(addr,
    deadline=5)`); `options=` passes a whole set, and keywords given beside it override its
    fields. The values are checked when a client is made (KvqError INVALID_ARGUMENT naming
    the field), not here. The C++ client's kvq::client::ClientOptions has the same fields.
    """

    # "host:port", a comma-separated list, or a sequence of addresses (any gRPC target). With
    # several, sequences are sharded by consistent hashing of (tenant, sequence id); every
    # client of a deployment must list the same set. The constructors' first argument.
    servers: Union[str, Sequence[str]] = ()
    # Sent as `x-kvq-tenant` when no token is set (auth off); also the tenant part of the
    # shard key. None: the token stands in for it there, else "default".
    tenant: Optional[str] = None
    # Bearer token, sent as `authorization: Bearer <token>`; refused over plaintext unless
    # allow_insecure_token. None: no token.
    token: Optional[str] = None
    # Use TLS. Off: plaintext (loopback, development).
    tls: bool = False
    # PEM bytes, or the path of a PEM file, of the CA that signed the server's certificate
    # (None: the system roots); needs tls.
    root_certificates: Optional[Union[bytes, str]] = None
    # The client certificate (mTLS): both or neither, PEM bytes or paths; need tls.
    private_key: Optional[Union[bytes, str]] = None
    certificate_chain: Optional[Union[bytes, str]] = None
    # Seconds per attempt of each call (> 0; each method takes `deadline=` too). The default
    # leaves room for large prefill PutBlocks streams; too short turns a slow server into
    # DEADLINE_EXCEEDED errors, which are not retried.
    deadline: float = 30.0
    # Attempts of an idempotent call (>= 1; 1: no retries). Only UNAVAILABLE is retried.
    max_attempts: int = 4
    # Before retry k a uniform random wait in [0, min(max_backoff, initial_backoff *
    # backoff_multiplier**(k-1))] seconds ("full jitter"), so that many clients do not retry
    # in lockstep after a server restart. Both >= 0; the multiplier >= 1.
    initial_backoff: float = 0.05
    max_backoff: float = 2.0
    backoff_multiplier: float = 2.0
    # Points per server on the hash ring (>= 1).
    virtual_nodes: int = 128
    # The name checked against the server certificate (when dialling an IP). None: the
    # address's host.
    tls_server_name: Optional[str] = None
    # Allow a token over plaintext (loopback tests only).
    allow_insecure_token: bool = False
    # Called after every attempt (method, attempt from 1, shard, grpc.StatusCode): a seam for
    # counting retries; must be thread-safe with kvq.Client.
    on_attempt: Optional[AttemptHook] = None
    # `servers` is one routing proxy (deploy/haproxy): every call carries x-kvq-route
    # (route_key of its sequence; of "" for calls of no sequence, which reach the one shard
    # the proxy picks for it), batched calls are split by routing key. register_basis is
    # refused (the proxy reaches one shard per call): register on the shards directly.
    router: bool = False
    # HeadQ codes on the wire where the server takes them (docs/API.md, "Codes on the wire"):
    # puts of appends that complete groups go as codes encoded here, GetBlocks fetches codes
    # and decodes them here; the server holds and returns the same bits either way. False:
    # fp16 rows both ways (the server encodes and decodes).
    codes: bool = True
    # Layers whose encoder a client keeps so that later appends to them can go as codes
    # (>= 0; least recently used dropped, their later appends then go as rows).
    encoders: int = 1024


_OPTION_NAMES = tuple(f.name for f in dataclasses.fields(ClientOptions))


def merge_options(options: Optional[ClientOptions], given: Mapping[str, Any]) -> ClientOptions:
    """`options` (None: the defaults) with the keywords of `given` that are not None."""
    if options is None:
        options = ClientOptions()
    elif not isinstance(options, ClientOptions):
        raise KvqError.invalid("Client", f"options: expected kvq.ClientOptions, got {type(options).__name__}")
    changes = {k: v for k, v in given.items() if k in _OPTION_NAMES and v is not None}
    return dataclasses.replace(options, **changes) if changes else options


class Settings:
    """The checked options and what the calls derive from them (shared by both clients)."""

    def __init__(self, o: ClientOptions) -> None:
        m = "Client"
        self.options = o
        self.servers = split_servers(o.servers)
        if not self.servers:
            raise KvqError.invalid(m, "servers: no server address given")
        if len(set(self.servers)) != len(self.servers):
            raise KvqError.invalid(m, "servers: an address is listed twice")
        if o.router and len(self.servers) != 1:
            raise KvqError.invalid(m, "servers: router mode takes exactly one address (the routing proxy)")
        if not o.deadline or o.deadline <= 0:
            raise KvqError.invalid(m, f"deadline: must be > 0 seconds, got {o.deadline}")
        if o.max_attempts < 1:
            raise KvqError.invalid(m, f"max_attempts: must be >= 1, got {o.max_attempts}")
        if o.backoff_multiplier < 1.0:
            raise KvqError.invalid(m, f"backoff_multiplier: must be >= 1, got {o.backoff_multiplier}")
        if o.initial_backoff < 0 or o.max_backoff < 0:
            raise KvqError.invalid(m, "initial_backoff/max_backoff: must be >= 0")
        if o.virtual_nodes < 1:
            raise KvqError.invalid(m, f"virtual_nodes: must be >= 1, got {o.virtual_nodes}")
        if o.encoders < 0:
            raise KvqError.invalid(m, f"encoders: must be >= 0, got {o.encoders}")
        if o.token and not o.tls and not o.allow_insecure_token:
            raise KvqError.invalid(
                m,
                "token: refusing to send a bearer token over plaintext: turn TLS on (or "
                "allow_insecure_token=True for loopback testing)",
            )
        if not o.tls and (o.root_certificates or o.private_key or o.certificate_chain):
            raise KvqError.invalid(m, "tls: certificates given but TLS is off")
        if bool(o.private_key) != bool(o.certificate_chain):
            raise KvqError.invalid(m, "private_key/certificate_chain: a client certificate needs both")
        self.tenant = o.tenant or ""
        self.token = o.token or ""
        self.deadline = float(o.deadline)
        self.max_attempts = int(o.max_attempts)
        self.initial_backoff = float(o.initial_backoff)
        self.max_backoff = float(o.max_backoff)
        self.backoff_multiplier = float(o.backoff_multiplier)
        self.on_attempt = o.on_attempt
        self.ring = HashRing(self.servers, o.virtual_nodes)
        # The tenant part of the shard key, as in C++: tenant, else token, else "default".
        self.shard_tenant = self.tenant or self.token or "default"
        self.router = bool(o.router)
        self.default_route = self.route_key("")
        self.metadata: Metadata = ()
        if self.token:
            self.metadata = (("authorization", f"Bearer {self.token}"),)
        elif self.tenant:
            self.metadata = (("x-kvq-tenant", self.tenant),)
        self.channel_options: List[Tuple[str, Any]] = [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            # A restarted server is found again within 2 s (gRPC's default waits up to 120 s).
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 2000),
        ]
        if o.tls and o.tls_server_name:
            self.channel_options.append(("grpc.ssl_target_name_override", o.tls_server_name))
        self.credentials: Optional[grpc.ChannelCredentials] = None
        if o.tls:
            self.credentials = grpc.ssl_channel_credentials(
                root_certificates=_read_pem(o.root_certificates, "root_certificates"),
                private_key=_read_pem(o.private_key, "private_key"),
                certificate_chain=_read_pem(o.certificate_chain, "certificate_chain"),
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

    def metadata_for(self, route: Optional[str]) -> Metadata:
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


def code_of(err: grpc.RpcError) -> grpc.StatusCode:
    try:
        code: grpc.StatusCode = err.code()
        return code
    except Exception:  # noqa: BLE001 - an RpcError that is not a Call
        return grpc.StatusCode.UNKNOWN


@dataclass(frozen=True)
class Call:
    """One RPC to one server, as a plan asks a transport to run it (with retries)."""

    method: str  # the RPC's name, in errors and for on_attempt ("Health" for health checks)
    shard: int  # index into the servers
    route: Optional[str]  # router mode's x-kvq-route (None: the default route)
    request: Any  # the request message; a list: the messages of a client stream (PutBlocks)
    idempotent: bool  # retried on UNAVAILABLE
    deadline: Optional[float]  # seconds per attempt (None: the client's)

    def payload(self) -> Any:
        """What one attempt sends: the message, or a fresh iterator over a stream's."""
        return iter(self.request) if isinstance(self.request, list) else self.request


class Tries:
    """The attempts of one Call: iterate; after an attempt, ok(result) or failed(error)."""

    def __init__(self, settings: Settings, call: Call) -> None:
        self._s = settings
        self._call = call
        self.timeout = settings.timeout(call.deadline)
        self.metadata = settings.metadata_for(call.route)
        self._attempts = settings.attempts(call.idempotent)
        self._attempt = 0
        self.received = False  # a stream delivered something: no retry after that

    def __iter__(self) -> Iterator[int]:
        for a in range(1, self._attempts + 1):
            self._attempt = a
            self.received = False
            yield a

    def got(self, item: T) -> T:
        """Marks that a stream delivered `item` (so a later failure is not retried)."""
        self.received = True
        return item

    def ok(self, result: T) -> T:
        self._s.note(self._call.method, self._attempt, self._call.shard, grpc.StatusCode.OK)
        return result

    def failed(self, err: grpc.RpcError) -> float:
        """The seconds to wait before the next attempt; raises KvqError with the call's
        status when it is not retried (not UNAVAILABLE, the last attempt, or a stream that
        delivered already). Call it inside the `except` clause."""
        c = self._call
        code = code_of(err)
        self._s.note(c.method, self._attempt, c.shard, code)
        if code != grpc.StatusCode.UNAVAILABLE or self.received or self._attempt >= self._attempts:
            raise KvqError.from_rpc_error(c.method, err, self._s.label(c.shard, c.route)) from None
        return self._s.backoff(self._attempt)


# A call's plan: yields the Calls to run concurrently, receives each one's result (or its
# KvqError) in the same order, returns the call's result.
Plan = Generator[List[Call], List[Any], T]


@dataclass
class Done(Generic[T]):
    value: T


def advance(plan: Plan[T], answers: Optional[List[Any]]) -> Union[List[Call], Done[T]]:
    """The plan's next Calls (answers: the previous ones' results; None to start), or Done."""
    try:
        return next(plan) if answers is None else plan.send(answers)
    except StopIteration as stop:
        return Done(stop.value)


def _raise_any(results: List[Any]) -> List[Any]:
    """Raises the first KvqError among the results; returns them otherwise."""
    for r in results:
        if isinstance(r, KvqError):
            raise r
    return results


def _one(call: Call) -> Plan[Any]:
    (result,) = yield [call]
    return _raise_any([result])[0]


def router_register_error() -> KvqError:
    return KvqError(
        "RegisterBasis",
        grpc.StatusCode.FAILED_PRECONDITION,
        "router mode: the proxy would register the model on one shard only; register it on "
        "every shard directly (a Client of the shard addresses)",
    )


class ClientCore:
    """Options, topology and every call's plan; kvq.Client and kvq.aio.Client add the I/O.

    Args (both constructors): servers (see ClientOptions.servers), options (a ClientOptions;
    None: the defaults), and every ClientOptions field as a keyword (None: the options'
    value).
    """

    def __init__(
        self,
        servers: Union[str, Sequence[str], None] = None,
        *,
        options: Optional[ClientOptions] = None,
        tenant: Optional[str] = None,
        token: Optional[str] = None,
        tls: Optional[bool] = None,
        root_certificates: Optional[Union[bytes, str]] = None,
        private_key: Optional[Union[bytes, str]] = None,
        certificate_chain: Optional[Union[bytes, str]] = None,
        deadline: Optional[float] = None,
        max_attempts: Optional[int] = None,
        initial_backoff: Optional[float] = None,
        max_backoff: Optional[float] = None,
        backoff_multiplier: Optional[float] = None,
        virtual_nodes: Optional[int] = None,
        tls_server_name: Optional[str] = None,
        allow_insecure_token: Optional[bool] = None,
        on_attempt: Optional[AttemptHook] = None,
        router: Optional[bool] = None,
        codes: Optional[bool] = None,
        encoders: Optional[int] = None,
    ) -> None:
        self._s = Settings(merge_options(options, locals()))
        self._wire = WireCodes(bool(self._s.options.codes), int(self._s.options.encoders))
        self._start()

    def _start(self) -> None:
        """The transport's set-up (kvq.Client opens its channels here)."""

    # -- topology ---------------------------------------------------------------------------
    @property
    def options(self) -> ClientOptions:
        """The options this client was made with (keywords merged in)."""
        return self._s.options

    @property
    def servers(self) -> Sequence[str]:
        """The server addresses, in the order given."""
        return tuple(self._s.servers)

    def shard_of(self, sequence_id: str) -> int:
        """Index into servers of the server owning a sequence of this client's tenant."""
        return self._s.ring.shard_of(self._s.shard_tenant, sequence_id)

    def route_key(self, sequence_id: str) -> str:
        """The x-kvq-route value of a sequence in router mode: 16 hex digits of
        kvq.ring.key_of(identity, sequence_id), identity = tenant, else token, else
        "default" (honours the {tag} rule; the C++ client's Client::RouteKey)."""
        return self._s.route_key(sequence_id)

    def _shard(self, shard: int) -> int:
        if not 0 <= shard < len(self._s.servers):
            raise KvqError.invalid("Client", f"shard: {shard} is not in [0, {len(self._s.servers)})")
        return shard

    def _sequence_call(self, method: str, sequence_id: str, request: Any, idempotent: bool,
                       deadline: Optional[float]) -> Call:
        """A call to the server (router mode: the route) owning a sequence."""
        route = self._s.route_key(sequence_id) if self._s.router else None
        return Call(method, self.shard_of(sequence_id), route, request, idempotent, deadline)

    # -- plans ------------------------------------------------------------------------------
    def _batched(self, method: str, req: Any, idempotent: bool, deadline: Optional[float]) -> Plan[Any]:
        """Splits a batched request by shard (router mode: by routing key), runs the parts
        concurrently, merges the results in the items' order. A failed part's items get its
        status (message naming the server); the call fails only when every part failed."""
        s = self._s
        n = len(req.items)
        group_of: List[Any]
        groups: Dict[Any, List[int]]
        if len(s.servers) == 1 and not s.router:
            group_of, groups = [], {0: []}  # nothing to split
        else:
            group_of, groups = s.by_shard([it.sequence_id for it in req.items])
        if len(groups) <= 1:
            shard, route = s.target(next(iter(groups), 0))
            resp = yield from _one(Call(method, shard, route, req, idempotent, deadline))
            if len(resp.results) != n:
                raise KvqError(method, grpc.StatusCode.INTERNAL,
                               f"server {s.label(shard, route)} returned {len(resp.results)} "
                               f"results for {n} items")
            return resp
        keys = list(groups)
        calls = []
        for g in keys:
            part = type(req)()
            part.items.extend(req.items[i] for i in groups[g])
            calls.append(Call(method, *s.target(g), part, idempotent, deadline))
        answers: Dict[Any, Any] = dict(zip(keys, (yield calls), strict=True))
        for g in keys:
            a = answers[g]
            if not isinstance(a, KvqError) and len(a.results) != len(groups[g]):
                answers[g] = KvqError(method, grpc.StatusCode.INTERNAL,
                                      f"server {s.label(*s.target(g))} returned "
                                      f"{len(a.results)} results for {len(groups[g])} items")
        if all(isinstance(a, KvqError) for a in answers.values()):
            raise answers[keys[0]]
        out: Any = _RESPONSE[method]()
        next_of = {g: 0 for g in keys}
        for i in range(n):
            g = group_of[i]
            a = answers[g]
            r = out.results.add()
            if isinstance(a, KvqError):
                r.status.code = a.code.value[0]
                r.status.message = f"server {s.label(*s.target(g))}: {a.details}"
            else:
                r.CopyFrom(a.results[next_of[g]])
                next_of[g] += 1
        return out

    def _items(self, method: str, req: Any, field: str, idempotent: bool, check: bool,
               deadline: Optional[float], items: Sequence[Any] = ()) -> Plan[List[ItemResult]]:
        """A batched call; items: the request's items when they may carry appends (the layer
        encoders of those that fail are dropped: the server may not hold what they took)."""
        appends = [[it.append] if getattr(it, "append", None) is not None else [] for it in items]
        try:
            resp = yield from self._batched(method, req, idempotent, deadline)
        except KvqError:
            self._wire.forget(appends)
            raise
        self._wire.forget(a for a, r in zip(appends, resp.results, strict=False) if r.status.code)
        out = item_results(method, resp.results, field)
        return check_results(out) if check else out

    def _fetch_bases(self, messages: Sequence[Sequence[AnyAppend]], deadline: Optional[float]) -> Plan[None]:
        """Fetches (once per client) the bases of the models these appends create sequences
        of, so that they can go as codes."""
        wanted = self._wire.models_to_fetch(messages)
        if wanted:
            req = [kvq_pb2.GetModelRequest(model=m, version=v) for m, v in wanted]
            bases = yield [Call("GetBasis", 0, None, r, True, deadline) for r in req]
            for key, basis in zip(wanted, bases, strict=True):
                self._wire.add_model(key, basis)

    def _item_appends(self, items: Sequence[_ItemT], deadline: Optional[float]) -> Plan[List[_ItemT]]:
        """The items with each append in the form it goes in (codes where they pay)."""
        given: List[List[AnyAppend]] = [[it.append] for it in items if it.append is not None]
        if not given or not self._wire.enabled:
            return list(items)
        yield from self._fetch_bases(given, deadline)
        sent = iter(self._wire.encode(given))  # each its own message: the first of its layer
        return [dataclasses.replace(it, append=next(sent)[0]) if it.append is not None else it for it in items]

    def _score(self, items: Sequence[ScoreItem], check: bool, deadline: Optional[float]) -> Plan[List[ItemResult]]:
        items = yield from self._item_appends(items, deadline)
        return (yield from self._items("Score", score_request(items), "logits", True, check, deadline, items))

    def _readout(self, items: Sequence[ReadoutItem], check: bool,
                 deadline: Optional[float]) -> Plan[List[ItemResult]]:
        return self._items("Readout", readout_request(items), "outputs", True, check, deadline)

    def _attend(self, items: Sequence[AttendItem], check: bool, deadline: Optional[float]) -> Plan[List[ItemResult]]:
        # Retried only when every item is read-only: an observing call records A^2
        # statistics, and a retry would count them twice.
        read_only = bool(items) and all(getattr(it, "observe", None) is False for it in items)
        items = yield from self._item_appends(items, deadline)
        return (yield from self._items("Attend", attend_request(items), "outputs", read_only, check, deadline,
                                       items))

    def _health_plan(self, deadline: Optional[float]) -> Plan[List[Tuple[str, bool]]]:
        out = []
        for s, addr in enumerate(self._s.servers):  # one after the other
            (raw,) = yield [Call("Health", s, None, b"", True, deadline)]
            out.append((addr, not isinstance(raw, KvqError) and parse_health(raw)))
        return out

    def _register_basis(self, info: Union[kvq_pb2.ModelInfo, Mapping[str, Any]], basis: Sequence[Any],
                        encode_basis: Sequence[Any], query_moment: Sequence[Any],
                        deadline: Optional[float]) -> Plan[kvq_pb2.RegisterBasisResponse]:
        if self._s.router:
            raise router_register_error()
        req = register_request(info, basis, encode_basis, query_moment)
        results = yield [Call("RegisterBasis", s, None, req, True, deadline) for s in range(len(self._s.servers))]
        first: kvq_pb2.RegisterBasisResponse = _raise_any(results)[0]
        return first

    def _list_models(self, shard: int, deadline: Optional[float]) -> Plan[List[kvq_pb2.ModelInfo]]:
        call = Call("ListModels", self._shard(shard), None, kvq_pb2.ListModelsRequest(), True, deadline)
        resp = yield from _one(call)
        return list(resp.models)

    def _get_model(self, model: str, version: Optional[int], shard: int,
                   deadline: Optional[float]) -> Plan[kvq_pb2.ModelInfo]:
        req = kvq_pb2.GetModelRequest(model=model, version=int(version or 0))
        info: kvq_pb2.ModelInfo = yield from _one(Call("GetModel", self._shard(shard), None, req, True, deadline))
        return info

    def _get_basis(self, model: str, version: Optional[int], shard: int,
                   deadline: Optional[float]) -> Plan[kvq_pb2.RegisterBasisRequest]:
        req = kvq_pb2.GetModelRequest(model=model, version=int(version or 0))
        basis: kvq_pb2.RegisterBasisRequest = yield from _one(
            Call("GetBasis", self._shard(shard), None, req, True, deadline))
        return basis

    def _put_blocks(self, appends: Sequence[AnyAppend], messages: Optional[Sequence[Sequence[AnyAppend]]],
                    deadline: Optional[float]) -> Plan[kvq_pb2.PutBlocksResponse]:
        method = "PutBlocks"
        if messages is None:
            if not appends:
                raise KvqError.invalid(method, "appends: empty")
            messages = [appends]
        elif appends:
            raise KvqError.invalid(method, "appends/messages: give one of them, not both")
        given = [list(m) for m in messages]
        yield from self._fetch_bases(given, deadline)
        sent = self._wire.encode(given)
        per_shard = put_requests(sent, self._s.by_shard, method)
        # Retried: appends carry their start, so a re-sent range is a duplicate.
        results = yield [Call(method, *self._s.target(g), per_shard[g], True, deadline) for g in per_shard]
        if any(isinstance(r, KvqError) for r in results):
            self._wire.forget(given)  # the encoders may hold rows a server did not take
        return merge_put(_raise_any(results))

    def _get_blocks_call(self, sequence_id: str, layers: Optional[Sequence[int]], dtype: str, from_token: int,
                         to_token: Optional[int], max_tokens_per_message: Optional[int],
                         basis_version: Optional[int], codes: Optional[bool],
                         deadline: Optional[float]) -> Tuple[Call, Tries]:
        """The GetBlocks call and its attempts (checked now, before the stream starts)."""
        req = kvq_pb2.GetBlocksRequest(
            sequence_id=sequence_id,
            layers=[int(layer) for layer in (layers or [])],
            basis_version=int(basis_version or 0),
            dtype=dtype_enum(dtype, "dtype", "GetBlocks"),
            max_tokens_per_message=int(max_tokens_per_message or 0),
            from_token=int(from_token or 0),
            to_token=int(to_token or 0),
        )
        if codes is not False:
            self._wire.request_codes(req)
        call = self._sequence_call("GetBlocks", sequence_id, req, True, deadline)
        return call, Tries(self._s, call)

    def _paged_writer(self, sequence_id: str, caches: Mapping[int, Any], layout: PagedLayout,
                      block_ids: Sequence[int], from_token: int, to_token: Optional[int], dtype: str,
                      writing: Optional[Callable[[], ContextManager[Any]]], deadline: Optional[float],
                      ) -> Tuple[Call, Tries, Callable[[StreamDecoder, kvq_pb2.GetBlocksResponse], Tuple[int, int]]]:
        """get_blocks_into's call (checked now, before the stream starts) and the write of one
        message into the caches under the `writing` guard: (its layer, the tokens written)."""
        if not self._wire.enabled:
            raise KvqError("GetBlocks", grpc.StatusCode.FAILED_PRECONDITION,
                           "get_blocks_into decodes codes, and this client has codes off (ClientOptions.codes)")
        layers = sorted(int(layer) for layer in caches)
        if not layers:
            raise KvqError.invalid("GetBlocks", "caches: no layer given")
        call, tries = self._get_blocks_call(sequence_id, layers, dtype, from_token, to_token, None, None, True,
                                            deadline)
        offsets = layout.block_offsets(block_ids)
        guard = writing or contextlib.nullcontext

        def write(decoder: StreamDecoder, msg: kvq_pb2.GetBlocksResponse) -> Tuple[int, int]:
            with guard():
                return decoder.into(msg, caches[msg.layer], layout, offsets)

        return call, tries, write

    def _delete_sequence(self, sequence_id: str, deadline: Optional[float]) -> Plan[int]:
        self._wire.forget_sequence(sequence_id)
        req = kvq_pb2.DeleteSequenceRequest(sequence_id=sequence_id)
        # Never retried: a second attempt would not be a no-op.
        resp = yield from _one(self._sequence_call("DeleteSequence", sequence_id, req, False, deadline))
        return int(resp.bytes_freed)

    def _match_prefix(self, token_ids: Any, sequence_ids: Sequence[str], model: str, codec: Any,
                      basis_version: Optional[int], deadline: Optional[float]) -> Plan[PrefixMatch]:
        method = "MatchPrefix"
        ids = [str(x) for x in sequence_ids]
        first = ids[0] if ids else ""
        for i, sid in enumerate(ids[1:], 1):  # one server answers: every name must be placed there
            if self.shard_of(sid) != self.shard_of(first) or (
                    self._s.router and self._s.route_key(sid) != self._s.route_key(first)):
                raise KvqError.invalid(method, f"sequence_ids[{i}] {sid!r} is placed apart from sequence_ids[0] "
                                       f"{first!r}; a MatchPrefix reaches one shard: give the sequences one {{tag}}")
        req = kvq_pb2.MatchPrefixRequest(model=model, basis_version=int(basis_version or 0), sequence_ids=ids)
        if token_ids is not None:
            req.token_ids.extend(np.asarray(token_ids, dtype=np.uint32).ravel().tolist())
        pb = _codec_pb(codec, "codec", method)
        if pb is not None:
            req.codec.CopyFrom(pb)
        resp = yield from _one(self._sequence_call(method, first, req, True, deadline))
        return PrefixMatch(int(resp.indexed_tokens), [int(x) for x in resp.sequence_tokens])

    def _stats(self, shard: Optional[int], deadline: Optional[float]) -> Plan[kvq_pb2.StatsResponse]:
        shards = [self._shard(shard)] if shard is not None else list(range(len(self._s.servers)))
        results = yield [Call("Stats", s, None, kvq_pb2.StatsRequest(), True, deadline) for s in shards]
        return merge_stats(_raise_any(results))

    def _echo(self, payload: bytes, shard: int, deadline: Optional[float]) -> Plan[bytes]:
        req = kvq_pb2.EchoRequest(payload=bytes(payload))
        resp = yield from _one(Call("Echo", self._shard(shard), None, req, True, deadline))
        return bytes(resp.payload)
