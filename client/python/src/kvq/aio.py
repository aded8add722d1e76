"""kvq.aio.Client: the kvq.Client surface as coroutines on grpc.aio.

Same arguments, same retries (asyncio.sleep between attempts), same sharding (the parts of a
batched call run concurrently with asyncio.gather), same errors (kvq.KvqError): both clients
run the same plans (kvq._core), only the I/O differs. get_blocks is an async iterator.
Channels are opened on the first call, in the running event loop; use
`async with kvq.aio.Client(...) as c:` or `await c.close()`.
"""

from __future__ import annotations

import asyncio
from typing import (
    Any,
    AsyncIterator,
    Awaitable,
    Callable,
    ContextManager,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    Union,
)

import grpc
import grpc.aio

from ._core import HEALTH_CHECK, ROUTER_PARALLEL, Call, ClientCore, Done, Plan, StreamDecoder, T, Tries, advance
from ._core import ClientOptions as ClientOptions
from ._proto.kvq.v1 import kvq_pb2, kvq_pb2_grpc
from .errors import KvqError
from .paged import PagedLayout
from .types import AnyAppend, AttendItem, Block, ItemResult, PrefixMatch, ReadoutItem, ScoreItem

__all__ = ["Client", "ClientOptions"]


class Client(ClientCore):
    """Asynchronous client of one or several kvq servers; arguments and methods as
    kvq.Client's (the methods are coroutines)."""

    def _start(self) -> None:
        # Router mode: sub-calls of one batched call in flight at once (one per routing key).
        self._router_slots: Optional[asyncio.Semaphore] = None
        self._channels: List[grpc.aio.Channel] = []
        self._stubs: List[kvq_pb2_grpc.KvqStub] = []
        self._health: List[Any] = []

    def _open(self) -> None:
        if self._channels:
            return
        s = self._s
        for addr in s.servers:
            if s.credentials is not None:
                ch = grpc.aio.secure_channel(addr, s.credentials, options=s.channel_options)
            else:
                ch = grpc.aio.insecure_channel(addr, options=s.channel_options)
            self._channels.append(ch)
            self._stubs.append(kvq_pb2_grpc.KvqStub(ch))  # type: ignore[no-untyped-call]
            self._health.append(ch.unary_unary(HEALTH_CHECK))

    async def close(self) -> None:
        """Closes every channel."""
        channels, self._channels, self._stubs, self._health = self._channels, [], [], []
        await asyncio.gather(*(ch.close() for ch in channels))

    async def __aenter__(self) -> Client:
        self._open()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # -- the transport ----------------------------------------------------------------------
    async def _run(self, call: Call) -> Any:
        """One call with its retries (asyncio.sleep between attempts); raises KvqError."""
        self._open()
        if self._s.router and call.route is not None:
            if self._router_slots is None:
                self._router_slots = asyncio.Semaphore(ROUTER_PARALLEL)
            async with self._router_slots:
                return await self._attempts(call)
        return await self._attempts(call)

    async def _attempts(self, call: Call) -> Any:
        fn = self._health[call.shard] if call.method == "Health" else getattr(self._stubs[call.shard], call.method)
        tries = Tries(self._s, call)
        for _ in tries:
            try:
                result = await fn(call.payload(), timeout=tries.timeout, metadata=tries.metadata)
            except grpc.RpcError as e:
                await asyncio.sleep(tries.failed(e))
                continue
            return tries.ok(result)
        raise AssertionError("unreachable")

    async def _gather(self, calls: Sequence[Call]) -> List[Any]:
        """Runs calls concurrently; returns results or KvqErrors (other exceptions raise)."""
        out = await asyncio.gather(*(self._run(c) for c in calls), return_exceptions=True)
        for r in out:
            if isinstance(r, BaseException) and not isinstance(r, KvqError):
                raise r
        return list(out)

    async def _drive(self, plan: Plan[T]) -> T:
        step = advance(plan, None)
        while not isinstance(step, Done):
            step = advance(plan, await self._gather(step))
        return step.value

    # -- the calls (documented on kvq.Client) ------------------------------------------------
    async def health(self, *, deadline: Optional[float] = None) -> List[Tuple[str, bool]]:
        return await self._drive(self._health_plan(deadline))

    async def register_basis(self, info: Union[kvq_pb2.ModelInfo, Mapping[str, Any]], basis: Sequence[Any] = (), *,
                             encode_basis: Sequence[Any] = (), query_moment: Sequence[Any] = (),
                             deadline: Optional[float] = None) -> kvq_pb2.RegisterBasisResponse:
        return await self._drive(self._register_basis(info, basis, encode_basis, query_moment, deadline))

    async def list_models(self, *, shard: int = 0, deadline: Optional[float] = None) -> List[kvq_pb2.ModelInfo]:
        return await self._drive(self._list_models(shard, deadline))

    async def get_model(self, model: str, version: Optional[int] = None, *, shard: int = 0,
                        deadline: Optional[float] = None) -> kvq_pb2.ModelInfo:
        return await self._drive(self._get_model(model, version, shard, deadline))

    async def get_basis(self, model: str, version: Optional[int] = None, *, shard: int = 0,
                        deadline: Optional[float] = None) -> kvq_pb2.RegisterBasisRequest:
        return await self._drive(self._get_basis(model, version, shard, deadline))

    async def put_blocks(self, appends: Sequence[AnyAppend] = (), *,
                         messages: Optional[Sequence[Sequence[AnyAppend]]] = None,
                         deadline: Optional[float] = None) -> kvq_pb2.PutBlocksResponse:
        return await self._drive(self._put_blocks(appends, messages, deadline))

    async def score(self, items: Sequence[ScoreItem], *, check: bool = True,
                    deadline: Optional[float] = None) -> List[ItemResult]:
        return await self._drive(self._score(items, check, deadline))

    async def readout(self, items: Sequence[ReadoutItem], *, check: bool = True,
                      deadline: Optional[float] = None) -> List[ItemResult]:
        return await self._drive(self._readout(items, check, deadline))

    async def attend(self, items: Sequence[AttendItem], *, check: bool = True,
                     deadline: Optional[float] = None) -> List[ItemResult]:
        return await self._drive(self._attend(items, check, deadline))

    async def get_blocks(self, sequence_id: str, layers: Optional[Sequence[int]] = None, *, dtype: str = "f32",
                         from_token: int = 0, to_token: Optional[int] = None,
                         max_tokens_per_message: Optional[int] = None, basis_version: Optional[int] = None,
                         bf16: str = "uint16", codes: Optional[bool] = None, token_major: bool = False,
                         deadline: Optional[float] = None) -> AsyncIterator[Block]:
        """Async iterator of Blocks; retried only until the first chunk arrived."""
        call, tries = self._get_blocks_call(sequence_id, layers, dtype, from_token, to_token,
                                            max_tokens_per_message, basis_version, codes, deadline)

        async def handle(decoder: StreamDecoder, chunk: kvq_pb2.GetBlocksResponse) -> List[Block]:
            return decoder.blocks(chunk, bf16)

        async for block in self._stream_decoded(call, tries, token_major, handle, lambda d: d.finish()):
            yield block

    async def get_blocks_into(self, sequence_id: str, caches: Mapping[int, Any], layout: PagedLayout,
                              block_ids: Sequence[int], *, from_token: int = 0, to_token: Optional[int] = None,
                              dtype: str = "f32", writing: Optional[Callable[[], ContextManager[Any]]] = None,
                              deadline: Optional[float] = None) -> AsyncIterator[Tuple[int, int]]:
        """Client.get_blocks_into as an async iterator of (layer, tokens written): each message
        written on a worker thread (the native decode releases the GIL), not in the event loop;
        retried only until the first message was written."""
        call, tries, write = self._paged_writer(sequence_id, caches, layout, block_ids, from_token, to_token,
                                                dtype, writing, deadline)

        async def handle(decoder: StreamDecoder, chunk: kvq_pb2.GetBlocksResponse) -> List[Tuple[int, int]]:
            return [await asyncio.to_thread(write, decoder, chunk)]

        async for item in self._stream_decoded(call, tries, False, handle, lambda d: []):
            yield item

    async def _stream_decoded(self, call: Call, tries: Tries, token_major: bool,
                              handle: Callable[[StreamDecoder, kvq_pb2.GetBlocksResponse], Awaitable[List[T]]],
                              finish: Callable[[StreamDecoder], List[T]]) -> AsyncIterator[T]:
        """A GetBlocks stream's messages through `handle` (a model's basis fetched when its
        codes are first met), then `finish`; retried only until the first item was yielded."""
        self._open()
        for _ in tries:
            decoder = StreamDecoder(self._wire, call.request, token_major)
            stream = self._stubs[call.shard].GetBlocks(call.request, timeout=tries.timeout, metadata=tries.metadata)
            try:
                async for chunk in stream:
                    need = decoder.needs(chunk)
                    if need is not None:  # codes of a model met for the first time: its basis
                        self._wire.add_model(need, await self.get_basis(*need, shard=call.shard))
                    for item in await handle(decoder, chunk):
                        yield tries.got(item)
                for item in finish(decoder):
                    yield tries.got(item)
            except grpc.RpcError as e:
                await asyncio.sleep(tries.failed(e))
                continue
            finally:
                stream.cancel()
            tries.ok(None)
            return

    async def delete_sequence(self, sequence_id: str, *, deadline: Optional[float] = None) -> int:
        return await self._drive(self._delete_sequence(sequence_id, deadline))

    async def match_prefix(self, token_ids: Any = None, *, sequence_ids: Sequence[str] = (), model: str = "",
                           codec: Any = None, basis_version: Optional[int] = None,
                           deadline: Optional[float] = None) -> PrefixMatch:
        return await self._drive(self._match_prefix(token_ids, sequence_ids, model, codec, basis_version, deadline))

    async def stats(self, *, shard: Optional[int] = None, deadline: Optional[float] = None) -> kvq_pb2.StatsResponse:
        return await self._drive(self._stats(shard, deadline))

    async def echo(self, payload: bytes, *, shard: int = 0, deadline: Optional[float] = None) -> bytes:
        return await self._drive(self._echo(payload, shard, deadline))
