"""kvq.aio.Client: the kvq.Client surface as coroutines on grpc.aio.

Same arguments, same retries (asyncio.sleep between attempts), same sharding (the parts of a
batched call run concurrently with asyncio.gather), same errors (kvq.KvqError). get_blocks is
an async iterator. Channels are opened on the first call, in the running event loop; use
`async with kvq.aio.Client(...) as c:` or `await c.close()`.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, Callable, List, Mapping, Optional, Sequence, Tuple, Union

import grpc
import grpc.aio

from ._proto.kvq.v1 import kvq_pb2, kvq_pb2_grpc
from .client import (
    _HEALTH_CHECK,
    _RESPONSE,
    _ROUTER_PARALLEL,
    AttemptHook,
    _code_of,
    _Options,
    _router_register_error,
    put_requests,
    attend_request,
    block_of,
    check_results,
    item_results,
    merge_put,
    merge_stats,
    parse_health,
    readout_request,
    register_request,
    score_request,
)
from .errors import KvqError
from .tensors import dtype_enum
from .types import Append, AttendItem, Block, ItemResult, ReadoutItem, ScoreItem

__all__ = ["Client"]


class Client:
    """Asynchronous client of one or several kvq servers; arguments as kvq.Client."""

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
        # Router mode: sub-calls of one batched call in flight at once (one per routing key).
        self._router_slots: Optional[asyncio.Semaphore] = None
        self._channels: List[grpc.aio.Channel] = []
        self._stubs: List[kvq_pb2_grpc.KvqStub] = []
        self._health: List[Any] = []

    def _open(self) -> None:
        if self._channels:
            return
        for addr in self._o.servers:
            if self._o.credentials is not None:
                ch = grpc.aio.secure_channel(addr, self._o.credentials, options=self._o.channel_options)
            else:
                ch = grpc.aio.insecure_channel(addr, options=self._o.channel_options)
            self._channels.append(ch)
            self._stubs.append(kvq_pb2_grpc.KvqStub(ch))
            self._health.append(ch.unary_unary(_HEALTH_CHECK))

    async def close(self) -> None:
        """Closes every channel."""
        channels, self._channels, self._stubs, self._health = self._channels, [], [], []
        await asyncio.gather(*(ch.close() for ch in channels))

    async def __aenter__(self) -> "Client":
        self._open()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    @property
    def servers(self) -> Sequence[str]:
        return tuple(self._o.servers)

    def shard_of(self, sequence_id: str) -> int:
        return self._o.ring.shard_of(self._o.shard_tenant, sequence_id)

    def route_key(self, sequence_id: str) -> str:
        return self._o.route_key(sequence_id)

    def _shard(self, shard: int) -> int:
        if not 0 <= shard < len(self._o.servers):
            raise KvqError.invalid("Client", f"shard: {shard} is not in [0, {len(self._o.servers)})")
        return shard

    async def _run(self, method: str, shard: int, idempotent: bool, deadline: Optional[float],
                   fn: Callable[[Any, float, Tuple[Tuple[str, str], ...]], Awaitable[Any]],
                   route: Optional[str] = None) -> Any:
        """fn(stub, timeout, metadata) with retries on UNAVAILABLE (idempotent calls only)."""
        self._open()
        if self._o.router and route is not None:
            if self._router_slots is None:
                self._router_slots = asyncio.Semaphore(_ROUTER_PARALLEL)
            async with self._router_slots:
                return await self._attempts(method, shard, idempotent, deadline, fn, route)
        return await self._attempts(method, shard, idempotent, deadline, fn, route)

    async def _attempts(self, method: str, shard: int, idempotent: bool, deadline: Optional[float],
                        fn: Callable[[Any, float, Tuple[Tuple[str, str], ...]], Awaitable[Any]],
                        route: Optional[str]) -> Any:
        timeout = self._o.timeout(deadline)
        attempts = self._o.attempts(idempotent)
        metadata = self._o.metadata_for(route)
        for a in range(1, attempts + 1):
            try:
                result = await fn(self._stubs[shard], timeout, metadata)
            except grpc.RpcError as e:
                code = _code_of(e)
                self._o.note(method, a, shard, code)
                if code != grpc.StatusCode.UNAVAILABLE or a == attempts:
                    raise KvqError.from_rpc_error(method, e, self._o.label(shard, route)) from None
                await asyncio.sleep(self._o.backoff(a))
                continue
            self._o.note(method, a, shard, grpc.StatusCode.OK)
            return result
        raise AssertionError("unreachable")

    async def _gather(self, coros: Sequence[Awaitable[Any]]) -> List[Any]:
        out = await asyncio.gather(*coros, return_exceptions=True)
        for r in out:
            if isinstance(r, BaseException) and not isinstance(r, KvqError):
                raise r
        return list(out)

    async def _batched(self, method: str, req: Any, idempotent: bool, deadline: Optional[float]) -> Any:
        n = len(req.items)
        if len(self._o.servers) == 1 and not self._o.router:
            group_of, groups = [], {0: []}  # nothing to split
        else:
            group_of, groups = self._o.by_shard([it.sequence_id for it in req.items])
        if len(groups) <= 1:
            s, route = self._o.target(next(iter(groups), 0))
            resp = await self._run(method, s, idempotent, deadline,
                                   lambda st, t, md: getattr(st, method)(req, timeout=t, metadata=md),
                                   route)
            if len(resp.results) != n:
                raise KvqError(method, grpc.StatusCode.INTERNAL,
                               f"server {self._o.label(s, route)} returned {len(resp.results)} "
                               f"results for {n} items")
            return resp
        keys = list(groups)
        parts = {}
        for g in keys:
            part = type(req)()
            part.items.extend(req.items[i] for i in groups[g])
            parts[g] = part

        def one(g: Any) -> Awaitable[Any]:
            s, route = self._o.target(g)
            return self._run(method, s, idempotent, deadline,
                             lambda st, t, md: getattr(st, method)(parts[g], timeout=t, metadata=md),
                             route)

        answers = dict(zip(keys, await self._gather([one(g) for g in keys])))
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

    async def health(self, *, deadline: Optional[float] = None) -> List[Tuple[str, bool]]:
        self._open()
        out = []
        for s in range(len(self._o.servers)):
            try:
                raw = await self._run("Health", s, True, deadline,
                                      lambda st, t, md, s=s: self._health[s](b"", timeout=t, metadata=md))
                out.append((self._o.servers[s], parse_health(raw)))
            except KvqError:
                out.append((self._o.servers[s], False))
        return out

    async def register_basis(self, info: Union[kvq_pb2.ModelInfo, Mapping[str, Any]],
                             basis: Sequence[Any] = (), *, encode_basis: Sequence[Any] = (),
                             query_moment: Sequence[Any] = (), deadline: Optional[float] = None
                             ) -> kvq_pb2.RegisterBasisResponse:
        if self._o.router:
            raise _router_register_error()
        req = register_request(info, basis, encode_basis, query_moment)
        results = await self._gather([
            self._run("RegisterBasis", s, True, deadline,
                      lambda st, t, md: st.RegisterBasis(req, timeout=t, metadata=md))
            for s in range(len(self._o.servers))])
        for r in results:
            if isinstance(r, KvqError):
                raise r
        return results[0]

    async def list_models(self, *, shard: int = 0, deadline: Optional[float] = None) -> List[kvq_pb2.ModelInfo]:
        resp = await self._run("ListModels", self._shard(shard), True, deadline,
                               lambda st, t, md: st.ListModels(kvq_pb2.ListModelsRequest(), timeout=t, metadata=md))
        return list(resp.models)

    async def get_model(self, model: str, version: int = 0, *, shard: int = 0,
                        deadline: Optional[float] = None) -> kvq_pb2.ModelInfo:
        req = kvq_pb2.GetModelRequest(model=model, version=int(version))
        return await self._run("GetModel", self._shard(shard), True, deadline,
                               lambda st, t, md: st.GetModel(req, timeout=t, metadata=md))

    async def put_blocks(self, appends: Sequence[Append] = (), *,
                         messages: Optional[Sequence[Sequence[Append]]] = None,
                         deadline: Optional[float] = None) -> kvq_pb2.PutBlocksResponse:
        method = "PutBlocks"
        if messages is None:
            if not appends:
                raise KvqError.invalid(method, "appends: empty")
            messages = [appends]
        elif appends:
            raise KvqError.invalid(method, "appends/messages: give one of them, not both")
        per_shard = put_requests(messages, self._o.by_shard, method)
        results = await self._gather([
            self._run(method, self._o.target(g)[0], True, deadline,
                      lambda st, t, md, g=g: st.PutBlocks(iter(per_shard[g]), timeout=t, metadata=md),
                      self._o.target(g)[1])
            for g in per_shard])
        for r in results:
            if isinstance(r, KvqError):
                raise r
        return merge_put(results)

    async def score(self, items: Sequence[ScoreItem], *, check: bool = True,
                    deadline: Optional[float] = None) -> List[ItemResult]:
        resp = await self._batched("Score", score_request(items), True, deadline)
        out = item_results("Score", resp.results, "logits")
        return check_results(out) if check else out

    async def readout(self, items: Sequence[ReadoutItem], *, check: bool = True,
                      deadline: Optional[float] = None) -> List[ItemResult]:
        resp = await self._batched("Readout", readout_request(items), True, deadline)
        out = item_results("Readout", resp.results, "outputs")
        return check_results(out) if check else out

    async def attend(self, items: Sequence[AttendItem], *, check: bool = True,
                     deadline: Optional[float] = None) -> List[ItemResult]:
        read_only = bool(items) and all(it.observe is False for it in items)
        resp = await self._batched("Attend", attend_request(items), read_only, deadline)
        out = item_results("Attend", resp.results, "outputs")
        return check_results(out) if check else out

    async def get_blocks(self, sequence_id: str, layers: Optional[Sequence[int]] = None, *,
                         dtype: str = "f32", from_token: int = 0, to_token: int = 0,
                         max_tokens_per_message: int = 0, basis_version: int = 0,
                         bf16: str = "uint16", deadline: Optional[float] = None) -> AsyncIterator[Block]:
        """Async iterator of Blocks; retried only until the first chunk arrived."""
        method = "GetBlocks"
        req = kvq_pb2.GetBlocksRequest(
            sequence_id=sequence_id, layers=[int(l) for l in (layers or [])],
            basis_version=int(basis_version), dtype=dtype_enum(dtype, "dtype", method),
            max_tokens_per_message=int(max_tokens_per_message), from_token=int(from_token),
            to_token=int(to_token))
        s = self.shard_of(sequence_id)
        route = self._o.route_key(sequence_id) if self._o.router else None
        timeout = self._o.timeout(deadline)
        self._open()
        attempts = self._o.attempts(True)
        metadata = self._o.metadata_for(route)
        for a in range(1, attempts + 1):
            received = False
            call = self._stubs[s].GetBlocks(req, timeout=timeout, metadata=metadata)
            try:
                async for chunk in call:
                    received = True
                    yield block_of(chunk, bf16, method)
            except grpc.RpcError as e:
                code = _code_of(e)
                self._o.note(method, a, s, code)
                if code != grpc.StatusCode.UNAVAILABLE or received or a == attempts:
                    raise KvqError.from_rpc_error(method, e, self._o.label(s, route)) from None
                await asyncio.sleep(self._o.backoff(a))
                continue
            finally:
                call.cancel()
            self._o.note(method, a, s, grpc.StatusCode.OK)
            return

    async def delete_sequence(self, sequence_id: str, *, deadline: Optional[float] = None) -> int:
        req = kvq_pb2.DeleteSequenceRequest(sequence_id=sequence_id)
        route = self._o.route_key(sequence_id) if self._o.router else None
        resp = await self._run("DeleteSequence", self.shard_of(sequence_id), False, deadline,
                               lambda st, t, md: st.DeleteSequence(req, timeout=t, metadata=md),
                               route)
        return int(resp.bytes_freed)

    async def stats(self, *, shard: Optional[int] = None, deadline: Optional[float] = None) -> kvq_pb2.StatsResponse:
        shards = [self._shard(shard)] if shard is not None else list(range(len(self._o.servers)))
        results = await self._gather([
            self._run("Stats", s, True, deadline,
                      lambda st, t, md: st.Stats(kvq_pb2.StatsRequest(), timeout=t, metadata=md))
            for s in shards])
        for r in results:
            if isinstance(r, KvqError):
                raise r
        return merge_stats(results)

    async def echo(self, payload: bytes, *, shard: int = 0, deadline: Optional[float] = None) -> bytes:
        req = kvq_pb2.EchoRequest(payload=bytes(payload))
        resp = await self._run("Echo", self._shard(shard), True, deadline,
                               lambda st, t, md: st.Echo(req, timeout=t, metadata=md))
        return bytes(resp.payload)
