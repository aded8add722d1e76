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

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, ContextManager, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import grpc

from ._core import HEALTH_CHECK, ROUTER_PARALLEL, Call, ClientCore, Done, Plan, StreamDecoder, T, Tries, advance
from ._core import MAX_MESSAGE_BYTES as MAX_MESSAGE_BYTES
from ._core import ROUTE_HEADER as ROUTE_HEADER
from ._core import AttemptHook as AttemptHook
from ._core import ClientOptions as ClientOptions
from ._core import split_servers as split_servers
from ._proto.kvq.v1 import kvq_pb2, kvq_pb2_grpc
from ._requests import _codec_pb as _codec_pb
from ._requests import append_pb as append_pb
from ._requests import attend_request as attend_request
from ._requests import block_of as block_of
from ._requests import check_results as check_results
from ._requests import item_results as item_results
from ._requests import merge_put as merge_put
from ._requests import merge_stats as merge_stats
from ._requests import model_info_pb as model_info_pb
from ._requests import parse_health as parse_health
from ._requests import put_requests as put_requests
from ._requests import readout_request as readout_request
from ._requests import register_request as register_request
from ._requests import score_request as score_request
from .errors import KvqError
from .paged import PagedLayout
from .types import AnyAppend, AttendItem, Block, ItemResult, PrefixMatch, ReadoutItem, ScoreItem

__all__ = ["Client", "ClientOptions", "split_servers", "MAX_MESSAGE_BYTES", "ROUTE_HEADER"]


class Client(ClientCore):
    """A client of one or several kvq servers (thread-safe).

    Args:
        servers: "host:port", a comma-separated list, or a sequence of addresses (any gRPC
            target); see ClientOptions.servers.
        options: a kvq.ClientOptions (None: the defaults).
        tenant, token, tls, root_certificates, private_key, certificate_chain, deadline,
        max_attempts, initial_backoff, max_backoff, backoff_multiplier, virtual_nodes,
        tls_server_name, allow_insecure_token, on_attempt, router: the ClientOptions fields
            of the same names (documented there), each overriding `options` when not None.
    """

    def _start(self) -> None:
        s = self._s
        self._channels: List[grpc.Channel] = []
        for addr in s.servers:
            if s.credentials is not None:
                ch = grpc.secure_channel(addr, s.credentials, options=s.channel_options)
            else:
                ch = grpc.insecure_channel(addr, options=s.channel_options)
            self._channels.append(ch)
        # The generated kvq_pb2_grpc has no type information (grpcio-tools writes no .pyi for it).
        self._stubs = [kvq_pb2_grpc.KvqStub(ch) for ch in self._channels]  # type: ignore[no-untyped-call]
        self._health = [
            ch.unary_unary(HEALTH_CHECK, request_serializer=None, response_deserializer=None)
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

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def stub(self, shard: int = 0) -> kvq_pb2_grpc.KvqStub:
        """The generated stub of one server, for calls this class does not wrap."""
        return self._stubs[self._shard(shard)]

    # -- the transport ----------------------------------------------------------------------
    def _run(self, call: Call) -> Any:
        """One call with its retries (time.sleep between attempts); raises KvqError."""
        fn = self._health[call.shard] if call.method == "Health" else getattr(self._stubs[call.shard], call.method)
        tries = Tries(self._s, call)
        for _ in tries:
            try:
                result = fn(call.payload(), timeout=tries.timeout, metadata=tries.metadata)
            except grpc.RpcError as e:
                time.sleep(tries.failed(e))
                continue
            return tries.ok(result)
        raise AssertionError("unreachable")

    def _parallel(self, calls: Sequence[Call]) -> List[Any]:
        """Runs calls concurrently (the first on this thread); returns results or KvqErrors."""
        out: List[Any] = []
        futures: List[Future[Any]] = []
        if len(calls) > 1:
            with self._pool_lock:
                if self._pool is None:
                    workers = ROUTER_PARALLEL if self._s.router else max(2, len(self._stubs))
                    self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvq-shard")
            futures = [self._pool.submit(self._run, c) for c in calls[1:]]
        jobs: List[Callable[[], Any]] = [lambda: self._run(calls[0])] if calls else []
        for job in jobs + [f.result for f in futures]:
            try:
                out.append(job())
            except KvqError as e:
                out.append(e)
        return out

    def _drive(self, plan: Plan[T]) -> T:
        step = advance(plan, None)
        while not isinstance(step, Done):
            step = advance(plan, self._parallel(step))
        return step.value

    # -- health and registry ----------------------------------------------------------------
    def health(self, *, deadline: Optional[float] = None) -> List[Tuple[str, bool]]:
        """(server, serving) for every server (grpc.health.v1); never raises for a server
        that does not answer (serving is then False)."""
        return self._drive(self._health_plan(deadline))

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
        return self._drive(self._register_basis(info, basis, encode_basis, query_moment, deadline))

    def list_models(self, *, shard: int = 0, deadline: Optional[float] = None) -> List[kvq_pb2.ModelInfo]:
        """Every registered (model, version) of one server (ModelInfo messages)."""
        return self._drive(self._list_models(shard, deadline))

    def get_model(
        self, model: str, version: Optional[int] = None, *, shard: int = 0, deadline: Optional[float] = None
    ) -> kvq_pb2.ModelInfo:
        """One model version (None or 0: the latest). NOT_FOUND raises KvqError."""
        return self._drive(self._get_model(model, version, shard, deadline))

    def get_basis(
        self, model: str, version: Optional[int] = None, *, shard: int = 0, deadline: Optional[float] = None
    ) -> kvq_pb2.RegisterBasisRequest:
        """One model version's basis tensors as registered (None or 0: the latest): what
        kvq.codes.ModelCodes is made from. NOT_FOUND raises KvqError. Retried."""
        return self._drive(self._get_basis(model, version, shard, deadline))

    # -- writes -----------------------------------------------------------------------------
    def put_blocks(
        self,
        appends: Sequence[AnyAppend] = (),
        *,
        messages: Optional[Sequence[Sequence[AnyAppend]]] = None,
        deadline: Optional[float] = None,
    ) -> kvq_pb2.PutBlocksResponse:
        """Streams appends: one PutBlocks stream per server involved.

        appends: kvq.Append, or kvq_pb2.Append messages built elsewhere, sent as they are
        (kvq.codes' EncodedLayer.to_appends: codes on the wire).
        By default all `appends` go in one message (applied atomically on each server).
        `messages` gives the message boundaries instead (a list of lists of Append; order
        and boundaries are kept within each server). Returns the counts summed over servers
        and every touched (sequence, layer)'s length; raises the first failing server's
        status (the other servers' appends stay applied; re-sending is safe). Retried on
        UNAVAILABLE: appends carry their start, so a re-sent range is a duplicate.
        """
        return self._drive(self._put_blocks(appends, messages, deadline))

    # -- batched reads ----------------------------------------------------------------------
    def score(
        self, items: Sequence[ScoreItem], *, check: bool = True, deadline: Optional[float] = None
    ) -> List[ItemResult]:
        """Logits per item (outputs f32 [q_heads, n_q, tokens]), in the items' order.
        check=True raises KvqError for the first failed item; check=False returns every
        item's status. Retried on UNAVAILABLE."""
        return self._drive(self._score(items, check, deadline))

    def readout(
        self, items: Sequence[ReadoutItem], *, check: bool = True, deadline: Optional[float] = None
    ) -> List[ItemResult]:
        """Attention-weighted sums of each item's cached values (outputs [q_heads, n_q,
        head_dim] in the item's output dtype). Retried on UNAVAILABLE."""
        return self._drive(self._readout(items, check, deadline))

    def attend(
        self, items: Sequence[AttendItem], *, check: bool = True, deadline: Optional[float] = None
    ) -> List[ItemResult]:
        """Fused attention per item (outputs [q_heads, n_q, head_dim] in the item's output
        dtype), in the items' order. Retried only when every item has observe=False (an
        observing call records A^2 statistics: a retry would count them twice)."""
        return self._drive(self._attend(items, check, deadline))

    def get_blocks(
        self,
        sequence_id: str,
        layers: Optional[Sequence[int]] = None,
        *,
        dtype: str = "f32",
        from_token: int = 0,
        to_token: Optional[int] = None,
        max_tokens_per_message: Optional[int] = None,
        basis_version: Optional[int] = None,
        bf16: str = "uint16",
        codes: Optional[bool] = None,
        token_major: bool = False,
        deadline: Optional[float] = None,
    ) -> Iterator[Block]:
        """The sequence's cached K/V as attention sees them, chunk by chunk (Blocks of at
        most max_tokens_per_message tokens; None or 0: the server's 4096). Only tokens
        [from_token, to_token) of each layer (to_token None or 0: to the end). basis_version
        None or 0: any. dtype: of the returned tensors ("f32", "f16", "bf16": uint16 bits,
        or float32 with bf16="f32"). codes: fetch HeadQ codes and decode them here (the same
        bits; None: ClientOptions.codes); False for a call that reads no block (an empty range).
        token_major: Blocks' keys and values [n, kv_heads, head_dim] instead (codes decoded in
        that order, rows transposed: what a paged cache's writer takes).
        The call starts when iteration does; retried only until the first chunk arrived."""
        call, tries = self._get_blocks_call(sequence_id, layers, dtype, from_token, to_token,
                                            max_tokens_per_message, basis_version, codes, deadline)
        return self._stream_blocks(call, tries, bf16, token_major)

    def get_blocks_into(
        self,
        sequence_id: str,
        caches: Mapping[int, Any],
        layout: PagedLayout,
        block_ids: Sequence[int],
        *,
        from_token: int = 0,
        to_token: Optional[int] = None,
        dtype: str = "f32",
        writing: Optional[Callable[[], ContextManager[Any]]] = None,
        deadline: Optional[float] = None,
    ) -> Iterator[Tuple[int, int]]:
        """GetBlocks in codes decoded straight into a serving engine's paged KV cache: tokens
        [from_token, to_token) of each layer in `caches` ({layer: cache tensor}, written in
        place as `layout` says; block_ids: the sequence's blocks from its token 0), bit for
        bit what get_blocks gives in the cache's dtype, with no intermediate tensor. dtype: of
        the window rows on the wire (the cache's, so they arrive exact). Yields (layer, tokens
        written) per message, after its write. writing: a context manager held around each
        write (e.g. a lock that refuses writes once the engine stops waiting). Needs the
        client's codes on (ClientOptions.codes); retried only until the first (layer, tokens)
        was yielded (a retry writes the same bytes again); a refused message (corrupt, another
        basis) raises before writing anything."""
        call, tries, write = self._paged_writer(sequence_id, caches, layout, block_ids, from_token, to_token,
                                                dtype, writing, deadline)
        return self._stream_decoded(call, tries, False, lambda decoder, msg: [write(decoder, msg)],
                                    lambda decoder: [])

    def _stream_blocks(self, call: Call, tries: Tries, bf16: str, token_major: bool) -> Iterator[Block]:
        return self._stream_decoded(call, tries, token_major, lambda decoder, msg: decoder.blocks(msg, bf16),
                                    lambda decoder: decoder.finish())

    def _stream_decoded(self, call: Call, tries: Tries, token_major: bool,
                        handle: Callable[[StreamDecoder, kvq_pb2.GetBlocksResponse], List[T]],
                        finish: Callable[[StreamDecoder], List[T]]) -> Iterator[T]:
        # Messages are handled (decoded) one ahead on a thread of the call's own (the native
        # decode releases the GIL): while the caller uses a message's results, the next is
        # decoded and gRPC receives the one after. One thread, so the decoder's state changes
        # in order.
        ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvq-decode")
        try:
            for _ in tries:
                decoder = StreamDecoder(self._wire, call.request, token_major)
                stream = self._stubs[call.shard].GetBlocks(call.request, timeout=tries.timeout,
                                                           metadata=tries.metadata)
                decoding: Optional[Future[List[T]]] = None
                try:
                    for chunk in stream:
                        following = ahead.submit(self._handle_message, decoder, chunk, handle, call.shard)
                        if decoding is not None:
                            for item in decoding.result():
                                yield tries.got(item)
                        decoding = following
                    if decoding is not None:
                        for item in decoding.result():
                            yield tries.got(item)
                    for item in finish(decoder):
                        yield tries.got(item)
                except grpc.RpcError as e:
                    if decoding is not None:
                        decoding.cancel()
                    time.sleep(tries.failed(e))
                    continue
                finally:
                    stream.cancel()  # a no-op once finished; ends the stream when the caller stops
                tries.ok(None)
                return
        finally:
            ahead.shutdown(wait=True, cancel_futures=True)

    def _handle_message(self, decoder: StreamDecoder, chunk: kvq_pb2.GetBlocksResponse,
                        handle: Callable[[StreamDecoder, kvq_pb2.GetBlocksResponse], List[T]],
                        shard: int) -> List[T]:
        need = decoder.needs(chunk)
        if need is not None:  # codes of a model met for the first time: its basis
            self._wire.add_model(need, self.get_basis(*need, shard=shard))
        return handle(decoder, chunk)

    def delete_sequence(self, sequence_id: str, *, deadline: Optional[float] = None) -> int:
        """Drops a sequence; returns the bytes freed. NOT_FOUND raises. Never retried."""
        return self._drive(self._delete_sequence(sequence_id, deadline))

    def match_prefix(self, token_ids: Any = None, *, sequence_ids: Sequence[str] = (), model: str = "",
                     codec: Any = None, basis_version: Optional[int] = None,
                     deadline: Optional[float] = None) -> PrefixMatch:
        """Read-only prefix lookup, one round trip, no K/V (MatchPrefix): how many of
        token_ids (uint32) the tenant's prefix index holds as whole groups of every layer for a
        new sequence of model/codec/basis_version (what an attach would take now), and how many
        tokens each named sequence holds. Sent to the server (router: the route) of
        sequence_ids[0]; names placed elsewhere raise INVALID_ARGUMENT before sending (give a
        prompt's names one {tag}). Retried on UNAVAILABLE."""
        return self._drive(self._match_prefix(token_ids, sequence_ids, model, codec, basis_version, deadline))

    def stats(self, *, shard: Optional[int] = None, deadline: Optional[float] = None) -> kvq_pb2.StatsResponse:
        """Usage of the caller's tenant: with several servers the sum over them (counts
        summed, bits per element weighted by tokens); shard= asks one server only."""
        return self._drive(self._stats(shard, deadline))

    def echo(self, payload: bytes, *, shard: int = 0, deadline: Optional[float] = None) -> bytes:
        """The diagnostic no-op: sends the payload to one server, returns what came back."""
        return self._drive(self._echo(payload, shard, deadline))
