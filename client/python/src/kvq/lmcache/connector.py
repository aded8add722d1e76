"""kvq as an LMCache remote store: a RemoteConnector that keeps each chunk as HeadQ codes.

One LMCache chunk (key -> KV_2LTD tensor [2, layers, n, kv_heads*head_dim], n <= chunk_size)
is one kvq sequence in the caller's tenant, id `sequence_prefix + key.to_string()` (hashed
when over 256 bytes). A put sends every layer as one Append in a single PutBlocks message, so
the server applies a chunk whole or not at all; a get reads it back with GetBlocks in the
chunk's dtype (keys as attention sees them: base code plus side code) and reassembles
LMCache's layout. Both ways the chunk travels as HeadQ codes where the server takes them
(kvq.Client's default, ClientOptions.codes: encoded and decoded here, the same bits as the
server's; plugin option `codes: false` sends fp16). exists asks GetBlocks (in rows) for the
empty range at the end of the last layer: the server answers one header-only message (n = 0,
layer_tokens) and reads no block. A chunk
kvq does not hold (never stored, deleted, evicted) is a miss: None / False, never an error.

Loaded through LMCache's plugin framework (lmcache/v1/storage_backend/connector/__init__.py,
ConnectorManager._remote_adapters_plugin_launcher), e.g. in the LMCache YAML:

    remote_storage_plugins: ["kvq"]
    extra_config:
      remote_storage_plugin.kvq.module_path: kvq.lmcache
      remote_storage_plugin.kvq.class_name: KvqConnector
      remote_storage_plugin.kvq.server: 127.0.0.1:50051
      remote_storage_plugin.kvq.model: smollm2-135m

The RPCs are blocking gRPC calls; they run on a small thread pool so that LMCache's event
loop (which drives every backend) is never blocked by one of them.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, List, Optional

import grpc
import numpy as np
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext, extract_plugin_type
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

from ..client import Client
from ..errors import KvqError
from ..types import Append
from .config import PluginConfig, PluginConfigError, parse_plugin_config
from .layout import sequence_id_for, split_layers, write_layer

__all__ = ["KvqConnector", "KvqConnectorAdapter"]

logger = logging.getLogger(__name__)

MODULE_PATH = "kvq.lmcache"

# The kvq wire dtype of each KV dtype LMCache can hand us; the chunk comes back in the same.
_WIRE_DTYPE = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}

# An empty range past any layer's end: the server clamps it to the layer's length and answers
# one message with n = 0 and layer_tokens, reading no block (proto/kvq/v1/kvq.proto GetBlocks).
_PAST_END = 1 << 62


def _find_plugin_name(config: LMCacheEngineConfig) -> str:
    """The name this connector was listed under in remote_storage_plugins.

    LMCache's DynamicConnectorAdapter constructs a RemoteConnector subclass with (loop,
    local_cpu_backend, config) only, so the instance finds its own name: the one plugin whose
    module_path is kvq.lmcache. With several kvq plugins, KvqConnectorAdapter (which LMCache
    gives the name) must be the class_name."""
    extra = config.extra_config or {}
    names = [p for p in (config.remote_storage_plugins or [])
             if extra.get(f"remote_storage_plugin.{p}.module_path") == MODULE_PATH]
    if len(names) == 1:
        return names[0]
    if not names:
        raise PluginConfigError(
            "remote_storage_plugins",
            f"no plugin with remote_storage_plugin.<name>.module_path = {MODULE_PATH}")
    raise PluginConfigError(
        "remote_storage_plugins",
        f"several kvq plugins ({', '.join(names)}): set their class_name to KvqConnectorAdapter")


class KvqConnector(RemoteConnector):
    """LMCache remote connector storing chunks in kvq (see the module docstring)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        local_cpu_backend: LocalCPUBackend,
        config: Optional[LMCacheEngineConfig],
        plugin_name: Optional[str] = None,
    ) -> None:
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        cfg_src = config if config is not None else local_cpu_backend.config
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.settings: PluginConfig = parse_plugin_config(
            plugin_name or _find_plugin_name(cfg_src), cfg_src.extra_config)
        s = self.settings

        if self.meta_fmt != MemoryFormat.KV_2LTD or len(self.meta_shapes) != 1:
            raise PluginConfigError(
                s.key("model"),
                f"kvq stores K/V chunks in one layer group (KV_2LTD); this engine hands "
                f"{self.meta_fmt.name} with {len(self.meta_shapes)} group(s) (MLA and hybrid "
                f"layer groups are not supported)")
        if cfg_src.use_layerwise:
            raise PluginConfigError("use_layerwise", "the kvq plugin stores whole chunks; set use_layerwise: false")
        self.kv_dtype: torch.dtype = self.meta_dtypes[0]
        if self.kv_dtype not in _WIRE_DTYPE:
            raise PluginConfigError(s.key("model"), f"KV dtype {self.kv_dtype} is not float16, bfloat16 or float32")
        _, self.layers, self.chunk_size, hidden = (int(x) for x in self.meta_shapes[0])

        self.client = Client(
            list(s.servers), tenant=s.tenant, token=s.token, tls=s.tls,
            root_certificates=s.root_certificates, certificate_chain=s.certificate_chain,
            private_key=s.private_key, deadline=s.deadline_s, codes=s.codes)
        try:
            info = self.client.get_model(s.model, s.basis_version)
        except KvqError as e:
            self.client.close()
            if e.code == grpc.StatusCode.NOT_FOUND:
                raise PluginConfigError(
                    s.key("basis_version" if s.basis_version else "model"),
                    f"model {s.model!r} (version {s.basis_version or 'latest'}) is not registered "
                    f"on {s.servers[0]}: {e.details}") from None
            raise
        if info.layers != self.layers or info.kv_heads * info.head_dim != hidden:
            self.client.close()
            raise PluginConfigError(
                s.key("model"),
                f"model {s.model!r} has {info.layers} layers x {info.kv_heads} KV heads x "
                f"head_dim {info.head_dim}, but LMCache's chunks are {self.layers} layers x "
                f"{hidden} (= KV heads x head_dim of this worker; with tensor parallelism "
                f"register one model per rank's head count)")
        self.kv_heads = int(info.kv_heads)
        self.head_dim = int(info.head_dim)
        # Pin every chunk to the version the config resolved now, so that a later basis
        # registration does not mix versions within one deployment's chunks.
        self.basis_version = int(info.version)
        self.wire_dtype = _WIRE_DTYPE[self.kv_dtype]
        try:
            self._check_codec()
        except BaseException:
            self.client.close()
            raise
        self._pool = ThreadPoolExecutor(max_workers=s.max_workers, thread_name_prefix="kvq-lmcache")
        logger.info("kvq connector %s: model %s v%d (%d layers, %d KV heads, d=%d), servers %s",
                    s.plugin_name, s.model, self.basis_version, self.layers, self.kv_heads,
                    self.head_dim, ",".join(s.servers))

    def _check_codec(self) -> None:
        """Creates and drops a one-token sequence with the configured model, version and codec,
        so that settings the server refuses (e.g. key_bits 5, a rank above the basis) fail
        here, naming the config key, instead of failing every later put."""
        s = self.settings
        sid = f"{s.sequence_prefix}.codec-check/{uuid.uuid4().hex}"
        zeros = torch.zeros(self.kv_heads, 1, self.head_dim, dtype=self.kv_dtype)
        try:
            self.client.put_blocks([Append(sequence_id=sid, layer=0, start=0, keys=zeros, values=zeros,
                                           model=s.model, basis_version=self.basis_version, codec=s.codec)])
        except KvqError as e:
            if e.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
                raise PluginConfigError(
                    s.key("codec"), f"the kvq server refused these codec settings: {e.details}") from None
            raise
        self._delete_id(sid)

    # -- helpers ----------------------------------------------------------------------------
    def sequence_id(self, key: CacheEngineKey) -> str:
        return sequence_id_for(key.to_string(), self.settings.sequence_prefix)

    async def _offload(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _appends(self, key: CacheEngineKey, memory_obj: MemoryObj) -> List[Append]:
        t = memory_obj.tensor
        if t is None:
            raise ValueError(f"kvq connector: memory object of {key.to_string()} holds no tensor")
        sid = self.sequence_id(key)
        out = []
        for layer, (k, v) in enumerate(split_layers(t, self.kv_heads, self.head_dim)):
            out.append(Append(sequence_id=sid, layer=layer, start=0, keys=k, values=v,
                              model=self.settings.model, basis_version=self.basis_version,
                              codec=self.settings.codec))
        return out

    def _put_messages(self, messages: List[List[Append]]) -> None:
        try:
            self.client.put_blocks(messages=messages)
        except KvqError as e:
            # The same chunk key stored earlier with other bytes (a non-deterministic
            # prefill): the stored copy answers for the key, as a cache should.
            if e.code != grpc.StatusCode.ALREADY_EXISTS:
                raise
            if len(messages) > 1:
                # One chunk's conflict must not drop the others: send them one by one.
                for m in messages:
                    self._put_messages([m])

    def _probe(self, key: CacheEngineKey) -> bool:
        try:
            for b in self.client.get_blocks(self.sequence_id(key), layers=[self.layers - 1],
                                            dtype=self.wire_dtype, from_token=_PAST_END, to_token=_PAST_END,
                                            codes=False):
                return b.layer_tokens > 0
            return False  # the layer is empty: no message
        except KvqError as e:
            if e.code == grpc.StatusCode.NOT_FOUND:
                return False
            raise

    def _read(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        sid = self.sequence_id(key)
        try:
            blocks = list(self.client.get_blocks(sid, dtype=self.wire_dtype))
        except KvqError as e:
            if e.code == grpc.StatusCode.NOT_FOUND:
                return None
            raise
        if not blocks:
            return None
        n = int(blocks[0].layer_tokens)
        if n <= 0 or n > self.chunk_size or any(int(b.layer_tokens) != n for b in blocks) or \
                {b.layer for b in blocks} != set(range(self.layers)):
            # Not a chunk this connector wrote (puts are whole): treat as absent.
            logger.warning("kvq connector: %s is not a whole chunk (%d layers seen, %d tokens); a miss",
                           sid, len({b.layer for b in blocks}), n)
            return None
        shape = torch.Size([2, self.layers, n, self.kv_heads * self.head_dim])
        obj = self.local_cpu_backend.allocate([shape], [self.kv_dtype], self.meta_fmt)
        if obj is None:
            logger.debug("kvq connector: no local CPU memory for %s", sid)
            return None
        try:
            chunk = obj.tensor
            assert chunk is not None and tuple(chunk.shape) == tuple(shape)
            for b in blocks:
                write_layer(chunk, b.layer, int(b.start), self._to_torch(b.keys), self._to_torch(b.values))
        except BaseException:
            obj.ref_count_down()
            raise
        return obj

    def _to_torch(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(a))
        if self.kv_dtype == torch.bfloat16:
            return t.view(torch.bfloat16)  # the server's bf16 comes as uint16 bit patterns
        return t

    def _delete(self, key: CacheEngineKey) -> bool:
        return self._delete_id(self.sequence_id(key))

    def _delete_id(self, sid: str) -> bool:
        try:
            self.client.delete_sequence(sid)
            return True
        except KvqError as e:
            if e.code == grpc.StatusCode.NOT_FOUND:
                return False
            raise

    # -- RemoteConnector --------------------------------------------------------------------
    async def exists(self, key: CacheEngineKey) -> bool:
        return await self._offload(self._probe, key)

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self._probe(key)

    async def get(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        return await self._offload(self._read, key)

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        # The head-major copy and the RPC both run off the event loop and finish before this
        # returns, so LMCache may reuse the memory object then; its ref count is LMCache's
        # (the InstrumentedRemoteConnector wrapper drops it after the put).
        await self._offload(lambda: self._put_messages([self._appends(key, memory_obj)]))

    async def list(self) -> List[str]:
        # kvq has no key listing (sequences are listed by nobody but their tenant's Stats
        # count); LMCache uses list() only for diagnostics.
        return []

    async def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.client.close()

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        def echo() -> int:
            try:
                return 0 if self.client.echo(b"lmcache") == b"lmcache" else 1
            except KvqError as e:
                return int(e.code.value[0]) or 1
        return await self._offload(echo)

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: List[CacheEngineKey], memory_objs: List[MemoryObj]) -> None:
        # One PutBlocks stream per server, one message per chunk: each chunk stays atomic.
        if not keys:
            return
        try:
            await self._offload(lambda: self._put_messages(
                [self._appends(k, m) for k, m in zip(keys, memory_objs, strict=True)]))
        except Exception as e:
            # LMCache's batched put callback neither logs nor counts a failure: say it here.
            logger.error("kvq connector: batched put of %d chunks failed: %s", len(keys), e)
            raise

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: List[CacheEngineKey]) -> List[Optional[MemoryObj]]:
        return list(await asyncio.gather(*(self.get(k) for k in keys)))

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: List[CacheEngineKey]) -> int:
        """Chunks held, counted from the first until the first miss (LMCache's prefix rule)."""
        for i, k in enumerate(keys):
            if not self._probe(k):
                return i
        return len(keys)

    async def batched_async_contains(self, lookup_id: str, keys: List[CacheEngineKey], pin: bool = False) -> int:
        return await self._offload(self.batched_contains, keys)

    def remove_sync(self, key: CacheEngineKey) -> bool:
        return self._delete(key)

    def __repr__(self) -> str:
        s = self.settings
        return f"<KvqConnector {s.plugin_name} {','.join(s.servers)} model={s.model}>"


class KvqConnectorAdapter(ConnectorAdapter):
    """The adapter form of the plugin (class_name: KvqConnectorAdapter): LMCache passes it
    the plugin's name, so several kvq plugins (e.g. kvq.a, kvq.b) can be configured side by
    side, each with its own remote_storage_plugin.<name>.* keys."""

    def __init__(self) -> None:
        super().__init__("plugin://kvq")

    def can_parse(self, url: str) -> bool:
        return url.startswith("plugin://") and extract_plugin_type(url[len("plugin://"):]) == "kvq"

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        return KvqConnector(context.loop, context.local_cpu_backend, context.config,
                            plugin_name=context.plugin_name or "kvq")
