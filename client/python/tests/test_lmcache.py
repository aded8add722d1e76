"""LMCache's own engine on CPU storing and retrieving chunks in a real kvq server through kvq.lmcache.
Helpers first (the engine, the engine-side KV copy LMCache has no CPU version of, the codec's
error budget), then the tests.

Where LMCache 0.5.6 stops on a CPU-only machine: everything from LMCacheEngine down (token
database, StorageManager, LocalCPUBackend, RemoteBackend, the plugin loader, the connector)
runs; the serving-engine side does not: every GPUConnectorInterface it ships
(VLLMPagedMemGPUConnectorV2/V3, the layerwise ones, SGLangGPUConnector) asserts a CUDA
device and creates torch.cuda streams, and lmcache/cuda_ops.so does not even load against
torch 2.15 (undefined symbol c10::cuda::c10_cuda_check_implementation). DenseCPUKV below
takes that place: the same from_gpu/to_gpu contract over one dense CPU tensor instead of
vLLM's paged GPU buffer, so the engine's own store/lookup/retrieve paths are the real ones.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
import uuid
from typing import Any, Dict

# LMCache reports usage to stats.lmcache.ai from every engine unless told not to (its
# usage_telemetry/identity.py); tests never phone out. Set before lmcache is imported.
os.environ["LMCACHE_TRACK_USAGE"] = "false"

import numpy as np
import pytest
import torch
from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.connector import CreateConnector

import kvq
from kvq.lmcache import KvqConnector, PluginConfigError

from conftest import data_file, metric, metric_at_least

CHUNK = 256
PLUGIN = "kvq"


class DenseCPUKV(GPUConnectorInterface):
    """The serving engine's KV buffer as one CPU tensor kvcache [layers, 2, tokens, H*D]
    (passed as the kvcache= keyword of store/retrieve); copies token ranges to and from
    LMCache's KV_2LTD memory objects [2, layers, n, H*D]."""

    def __init__(self, layers: int, hidden: int) -> None:
        self.layers, self.hidden = layers, hidden

    def from_gpu(self, memory_obj, start, end, **kw):
        memory_obj.tensor.copy_(kw["kvcache"][:, :, start:end].transpose(0, 1))

    def to_gpu(self, memory_obj, start, end, **kw):
        kw["kvcache"][:, :, start:end].copy_(memory_obj.tensor.transpose(0, 1))

    def batched_from_gpu(self, memory_objs, starts, ends, **kw):
        for m, s, e in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(m, s, e, **kw)

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kw):
        for m, s, e in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(m, s, e, **kw)

    def get_shape(self, num_tokens):
        return torch.Size([2, self.layers, num_tokens, self.hidden])


def plugin_extra(server: str, model: str, **settings: Any) -> Dict[str, Any]:
    """extra_config loading kvq.lmcache as remote-storage plugin "kvq"."""
    extra = {
        f"remote_storage_plugin.{PLUGIN}.module_path": "kvq.lmcache",
        f"remote_storage_plugin.{PLUGIN}.class_name": "KvqConnector",
        f"remote_storage_plugin.{PLUGIN}.server": server,
        f"remote_storage_plugin.{PLUGIN}.model": model,
    }
    extra.update({f"remote_storage_plugin.{PLUGIN}.{k}": v for k, v in settings.items()})
    return extra


def engine_config(extra: Dict[str, Any]) -> LMCacheEngineConfig:
    return LMCacheEngineConfig.from_dict({
        "chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": 0.1,
        "remote_storage_plugins": [PLUGIN], "remote_serde": "naive",
        "save_unfull_chunk": True, "extra_config": extra,
    })


def engine_metadata(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> LMCacheMetadata:
    return LMCacheMetadata(model_name="kvq-test", world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=dtype, kv_shape=(layers, 2, CHUNK, kv_heads, head_dim))


class Engine:
    """An LMCacheEngine with kvq as its one remote backend; close() destroys it."""

    def __init__(self, extra: Dict[str, Any], layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
        self.id = f"kvq-test-{uuid.uuid4().hex[:8]}"
        self.layers, self.hidden = layers, kv_heads * head_dim
        self.engine: LMCacheEngine = LMCacheEngineBuilder.get_or_create(
            self.id, engine_config(extra), engine_metadata(layers, kv_heads, head_dim, dtype),
            DenseCPUKV(layers, kv_heads * head_dim), None, None)
        self.engine.post_init()
        backends = self.engine.storage_manager.storage_backends
        self.remote = backends.get(f"RemoteBackend-{PLUGIN}")
        if self.remote is None or self.remote.connection is None:
            raise RuntimeError(f"LMCache created no kvq remote backend (backends: {list(backends)})")
        self.connector: KvqConnector = self.remote.connection.getWrappedConnector()

    def run(self, coro):
        """Runs a connector coroutine on LMCache's event loop (as its backends do)."""
        return asyncio.run_coroutine_threadsafe(coro, self.remote.loop).result(60)

    def store(self, kv: torch.Tensor, client: kvq.Client, chunks: int) -> None:
        """engine.store, then waits until kvq holds `chunks` sequences: LMCache's remote puts
        are asynchronous, and its batched path (the one this connector takes) tracks neither
        the pending keys nor failures (RemoteBackend.batched_put_callback)."""
        self.engine.store(torch.arange(kv.shape[2]), kvcache=kv)
        end = time.monotonic() + 60
        # A sequence shows in Stats as soon as its first append creates it: wait for the
        # tokens of every layer of every chunk too.
        want = (chunks, self.layers * kv.shape[2])
        while (st := client.stats()) and (st.sequences, st.tokens) < want:
            if time.monotonic() > end:
                raise TimeoutError(f"kvq holds {st.sequences} sequences, {st.tokens} tokens; want {want}")
            time.sleep(0.02)

    def drop_local(self) -> None:
        """Empties LMCache's local CPU cache, so that lookups and retrieves go to kvq. clear
        skips a chunk whose memory object a remote put still holds (the put coroutine may
        return just after kvq applied it), so clear until nothing is left."""
        local = self.engine.storage_manager.storage_backends["LocalCPUBackend"]
        end = time.monotonic() + 30
        while True:
            self.engine.clear(locations=["LocalCPUBackend"])
            if len(local.hot_cache) == 0:
                return
            assert time.monotonic() < end, f"{len(local.hot_cache)} chunks stay in LMCache's CPU cache"
            time.sleep(0.02)

    def retrieve(self, n: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.zeros_like(like)
        mask = self.engine.retrieve(torch.arange(n), kvcache=out, req_id=f"r-{uuid.uuid4().hex[:6]}")
        return mask, out

    def close(self) -> None:
        LMCacheEngineBuilder.destroy(self.id)


def synthetic_kv(layers: int, tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """kvcache [layers, 2, tokens, H*D] shaped like real post-RoPE K/V: keys with per-channel
    offsets and scales (the outlier channels that make per-channel key codes necessary),
    values closer to zero-mean."""
    g = torch.Generator().manual_seed(seed)
    shape = (layers, tokens, kv_heads * head_dim)
    k_off = torch.randn(layers, 1, kv_heads * head_dim, generator=g) * 2.0
    k_scale = torch.rand(layers, 1, kv_heads * head_dim, generator=g) * 1.5 + 0.5
    keys = torch.randn(shape, generator=g) * k_scale + k_off
    values = torch.randn(shape, generator=g) * 0.7
    return torch.stack([keys, values], dim=1).to(dtype)


# -- the codec's error budget, computed from the stored data ----------------------------------
# Unit roundoff of the dtype a decoded value comes back in, and of the fp16 scales/zero points.
UNIT_ROUNDOFF = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24}
FP16_U = 2.0 ** -11


def key_error_bound(k: np.ndarray, G: int, bits: int, rank: int, side_bits: int, u_out: float) -> np.ndarray:
    """Bound on ||k_t - k_hat_t||_2 per (head, token) for keys [H, n, D] (float64).

    Base code: per channel c over a group of G tokens, asymmetric `bits`-bit with step
    s_c = range_c / (2^bits - 1), so the residual e_t has |e_ct| <= s_c / 2 and
    ||e_t|| <= E = sqrt(sum_c (s_c/2)^2). HeadQ adds U z_hat with z = U^T e quantized per
    side channel over the group: |z_jt| <= ||e_t|| <= E, so its step is <= 2E / (2^side_bits - 1)
    and k - k_hat = (I - U U^T) e - U dz has norm <= E (1 + sqrt(rank) / (2^side_bits - 1)).
    Rounding: the fp16 scales (bumped up one ulp at most), the fp16 zero point and the output
    dtype add at most (u_out + 2 FP16_U) * ||k_t|| per token. Tokens after the last whole
    group stay in the window at arrival precision: bound 0 (exact)."""
    H, n, D = k.shape
    bound = np.zeros((H, n))
    side = 1.0 + (math.sqrt(rank) / (2 ** side_bits - 1) if rank > 0 else 0.0)
    for g0 in range(0, n - n % G, G):
        x = k[:, g0:g0 + G, :]
        step = (x.max(axis=1) - x.min(axis=1)) / (2 ** bits - 1)          # [H, D]
        E = np.sqrt(((step * (1 + 4 * FP16_U) / 2) ** 2).sum(axis=1))      # [H]
        bound[:, g0:g0 + G] = E[:, None] * side + (u_out + 2 * FP16_U) * np.linalg.norm(x, axis=2)
    return bound


def value_error_bound(v: np.ndarray, G: int, bits: int, group: int, u_out: float) -> np.ndarray:
    """Bound on |v - v_hat| per element for values [H, n, D] (float64): per token, channels in
    groups of `group`, asymmetric `bits`-bit with step s = range / (2^bits - 1): |err| <= s/2,
    plus the fp16 scale/zero and output rounding (u_out + 2 FP16_U) * max|v| of the group.
    Window tokens (after the last whole key group of G tokens): 0."""
    H, n, D = v.shape
    bound = np.zeros_like(v)
    whole = n - n % G
    for c0 in range(0, D, group):
        x = v[:, :whole, c0:c0 + group]
        step = (x.max(axis=2, keepdims=True) - x.min(axis=2, keepdims=True)) / (2 ** bits - 1)
        slack = (u_out + 2 * FP16_U) * np.abs(x).max(axis=2, keepdims=True)
        bound[:, :whole, c0:c0 + group] = step * (1 + 4 * FP16_U) / 2 + slack
    return bound


def heads(layer_kv: torch.Tensor, kv_heads: int, head_dim: int) -> np.ndarray:
    """[n, H*D] of one layer -> float64 [H, n, D]."""
    n = layer_kv.shape[0]
    return layer_kv.float().reshape(n, kv_heads, head_dim).permute(1, 0, 2).double().numpy()


# -- tests ------------------------------------------------------------------------------------
L, H, D = 4, 2, 64          # a small model: 4 layers, 2 KV heads, head_dim 64
TOKENS = 2 * CHUNK + 88      # two full chunks and a partial one (save_unfull_chunk)


@pytest.fixture
def server(kvq_server_factory):
    """A real kvq-server with /metrics (to see what the plugin's reads cost the server)."""
    return kvq_server_factory(metrics=True)


@pytest.fixture
def client(server):
    with kvq.Client(server.address, deadline=10.0) as c:
        yield c


@pytest.fixture
def tiny(client, register_model):
    """The kvq model the plugin encodes for: random orthonormal basis of rank 8, default
    codec k2 g32 + rank-4 8-bit side code, v2 g32 (the server's defaults)."""
    return register_model(client, "lmc-tiny", layers=L, kv_heads=H, head_dim=D, rank=8, codec_rank=4)


@pytest.fixture
def make_engine():
    engines = []

    def make(extra, dtype=torch.float16, layers=L, kv_heads=H, head_dim=D):
        e = Engine(extra, layers, kv_heads, head_dim, dtype)
        engines.append(e)
        return e

    yield make
    for e in engines:
        e.close()


def check_within_budget(stored: torch.Tensor, got: torch.Tensor, n: int, codec, dtype,
                        kv_heads: int = H, head_dim: int = D) -> dict:
    """Asserts every retrieved token of kvcache [L, 2, T, H*D] is within the codec's bound of
    what was stored; returns the worst ratios of error to bound and the summed error."""
    u = UNIT_ROUNDOFF[dtype]
    worst_k = worst_v = 0.0
    err_total = 0.0
    for c0 in range(0, n, CHUNK):            # kvq's key groups restart at every chunk
        c1 = min(n, c0 + CHUNK)
        for layer in range(stored.shape[0]):
            k, kh = (heads(x[layer, 0, c0:c1], kv_heads, head_dim) for x in (stored, got))
            v, vh = (heads(x[layer, 1, c0:c1], kv_heads, head_dim) for x in (stored, got))
            kb = key_error_bound(k, codec.key_group, codec.key_bits, codec.rank, codec.side_bits, u)
            ke = np.linalg.norm(k - kh, axis=2)
            vb = value_error_bound(v, codec.key_group, codec.value_bits, codec.value_group, u)
            ve = np.abs(v - vh)
            assert np.all(ke <= kb), f"keys of tokens {c0}.., layer {layer}: error {ke.max()} over bound"
            assert np.all(ve <= vb), f"values of tokens {c0}.., layer {layer}: error {ve.max()} over bound"
            worst_k = max(worst_k, float((ke / np.where(kb > 0, kb, 1)).max()))
            worst_v = max(worst_v, float((ve / np.where(vb > 0, vb, 1)).max()))
            err_total += float(ke.sum() + ve.sum())
    return {"worst_k": worst_k, "worst_v": worst_v, "err_total": err_total}


@pytest.mark.parametrize("dtype,codec_cfg", [
    (torch.float16, None),                                                   # the model's HeadQ default
    (torch.bfloat16, '{"key_bits": 4, "rank": 0, "value_bits": 4, "value_group": 64}'),  # KIVI-like 4-bit
])
def test_engine_stores_and_retrieves_through_kvq(server, client, tiny, make_engine, dtype, codec_cfg):
    """Synthetic K/V of a small model, two codecs and dtypes."""
    settings = {"codec": codec_cfg} if codec_cfg else {}
    eng = make_engine(plugin_extra(server.address, tiny.name, **settings), dtype=dtype)
    kv = synthetic_kv(L, TOKENS, H, D, dtype, seed=7)
    eng.store(kv, client, chunks=3)
    st = client.stats()
    assert st.sequences == 3                      # one kvq sequence per chunk
    assert st.tokens == L * TOKENS                # every layer of every chunk, nothing else

    eng.drop_local()
    before = metric(server, "kvq_requests_total", method="GetBlocks", code="OK")
    mask, got = eng.retrieve(TOKENS, kv)
    assert int(mask.sum()) == TOKENS              # all three chunks came back ...
    assert metric_at_least(server, before + 3, "kvq_requests_total", method="GetBlocks", code="OK") >= before + 3  # ... from kvq  # noqa: E501

    # The codec's settings as the sequences got them (the model's defaults + overrides).
    codec = kvq.CodecSettings(**{f: getattr(tiny.info.codec, f) for f in
                                 ("key_bits", "key_group", "rank", "side_bits", "value_bits", "value_group")})
    for f, v in json.loads(codec_cfg or "{}").items():
        setattr(codec, f, max(v, 0))      # rank -1: forced to 0 (KIVI-like)
    r = check_within_budget(kv, got, TOKENS, codec, dtype)
    # Lossy, and the bound is not loose: the worst value error uses most of its budget
    # (measured 0.96-0.99), the worst key error a good part (0.65; an L2 bound over 64
    # channels); a retrieve shifted by one token breaks it.
    assert r["err_total"] > 0
    assert r["worst_k"] > 0.3 and r["worst_v"] > 0.5, r
    with pytest.raises(AssertionError):
        check_within_budget(kv, got.roll(1, dims=2), TOKENS, codec, dtype)
    # The partial chunk's last 88 - 64 = 24 tokens are in kvq's window: exact.
    assert torch.equal(got[:, :, TOKENS - 24:], kv[:, :, TOKENS - 24:])


def test_chunks_travel_as_codes_and_read_back_as_rows_do(server, client, tiny, make_engine):
    """The plugin's default (codes both ways) against `codes: false` on the same chunks: the
    same bits come back, for fewer bytes each way."""
    kv = synthetic_kv(L, TOKENS, H, D, torch.float16, seed=9)
    got, put_bytes, get_bytes = {}, {}, {}
    for codes in (False, True):
        eng = make_engine(plugin_extra(server.address, tiny.name, codes=str(codes).lower(),
                                       sequence_prefix=f"lmc-{int(codes)}/"))
        st0 = client.stats()
        p0 = metric(server, "kvq_received_bytes_total", method="PutBlocks")
        eng.engine.store(torch.arange(TOKENS), kvcache=kv)
        end = time.monotonic() + 60
        while (client.stats().sequences - st0.sequences, client.stats().tokens - st0.tokens) < (3, L * TOKENS):
            assert time.monotonic() < end, "the chunks did not reach kvq"
            time.sleep(0.02)
        put_bytes[codes] = metric_at_least(server, p0 + 1, "kvq_received_bytes_total", method="PutBlocks") - p0
        eng.drop_local()
        g0 = metric(server, "kvq_sent_bytes_total", method="GetBlocks")
        mask, got[codes] = eng.retrieve(TOKENS, kv)
        assert int(mask.sum()) == TOKENS
        get_bytes[codes] = metric_at_least(server, g0 + 1, "kvq_sent_bytes_total", method="GetBlocks") - g0
    assert torch.equal(got[False], got[True])
    print(f"lmcache: put {put_bytes[True] / put_bytes[False]:.3f}x, get {get_bytes[True] / get_bytes[False]:.3f}x "
          "the fp16 bytes with codes")
    assert put_bytes[True] < 0.5 * put_bytes[False] and get_bytes[True] < 0.5 * get_bytes[False]


def chunk_keys(eng: Engine, n: int):
    """LMCache's keys of the chunks of tokens 0..n-1 (its token database, as store uses)."""
    return [key for _, _, key in eng.engine.token_database.process_tokens(torch.arange(n))]


def test_contains_answers_without_reading_blocks(server, client, tiny, make_engine):
    eng = make_engine(plugin_extra(server.address, tiny.name))
    kv = synthetic_kv(L, TOKENS, H, D, torch.float16, seed=3)
    eng.store(kv, client, chunks=3)
    eng.drop_local()
    conn, keys = eng.connector, chunk_keys(eng, TOKENS)

    calls0 = metric(server, "kvq_requests_total", method="GetBlocks", code="OK")
    sent0 = metric(server, "kvq_sent_bytes_total", method="GetBlocks")
    assert eng.engine.lookup(torch.arange(TOKENS)) == TOKENS       # LMCache's own lookup path
    assert conn.batched_contains(keys) == 3
    assert eng.run(conn.batched_async_contains("l1", keys)) == 3
    assert all(eng.run(conn.exists(k)) for k in keys) and all(conn.exists_sync(k) for k in keys)
    calls1 = metric_at_least(server, calls0 + 3 * 5, "kvq_requests_total", method="GetBlocks", code="OK")
    probes = calls1 - calls0
    assert probes >= 3 * 5                                         # 5 ways of asking, 3 keys
    sent1 = metric_at_least(server, sent0 + probes * 20, "kvq_sent_bytes_total", method="GetBlocks")
    # Each probe is answered by one header-only message (layer, start, layer_tokens and two
    # empty tensors: 28 bytes measured), never a block: far below one layer of one head.
    assert sent1 - sent0 <= 40 * probes, (sent1 - sent0, probes)
    one_head_layer_fp16 = CHUNK * D * 2
    assert (sent1 - sent0) / probes < one_head_layer_fp16 / 100

    # A retrieve of the same chunks does read them, as HeadQ codes (decoded in the plugin) and
    # the window's rows: 0.32x the fp16 bytes measured, between a tenth and a half of them.
    mask, _ = eng.retrieve(TOKENS, kv)
    assert int(mask.sum()) == TOKENS
    fp16 = kv.numel() * 2
    sent2 = metric_at_least(server, sent1 + fp16 // 10, "kvq_sent_bytes_total", method="GetBlocks")
    assert fp16 // 10 <= sent2 - sent1 <= fp16 // 2, (sent2 - sent1, fp16)


def test_deleted_chunk_is_a_miss(server, client, tiny, make_engine):
    eng = make_engine(plugin_extra(server.address, tiny.name))
    kv = synthetic_kv(L, TOKENS, H, D, torch.float16, seed=4)
    eng.store(kv, client, chunks=3)
    conn, keys = eng.connector, chunk_keys(eng, TOKENS)
    assert client.delete_sequence(conn.sequence_id(keys[1])) > 0
    eng.drop_local()

    assert not conn.exists_sync(keys[1]) and not eng.run(conn.exists(keys[1]))
    assert eng.run(conn.get(keys[1])) is None
    assert conn.batched_contains(keys) == 1                     # the prefix up to the miss
    assert eng.engine.lookup(torch.arange(TOKENS)) == CHUNK
    mask, got = eng.retrieve(TOKENS, kv)
    assert mask[:CHUNK].all() and not mask[CHUNK:].any()        # LMCache stops at the miss
    assert not got[:, :, CHUNK:].any()
    # remove_sync: True when it dropped a chunk, False for one kvq does not hold.
    assert conn.remove_sync(keys[2]) is True
    assert conn.remove_sync(keys[2]) is False
    assert client.stats().sequences == 1


def test_evicted_chunk_is_a_miss(kvq_server_factory, register_model, make_engine):
    # A tenant quota of 2.5 full chunks of this model (117,760 bytes each with the default
    # codec): storing three evicts the least recently used, the first.
    srv = kvq_server_factory("--tenant-quota", "300000")
    with kvq.Client(srv.address, deadline=10.0) as c:
        model = register_model(c, "lmc-evict", layers=L, kv_heads=H, head_dim=D, rank=8, codec_rank=4)
        eng = make_engine(plugin_extra(srv.address, model.name))
        n = 3 * CHUNK
        kv = synthetic_kv(L, n, H, D, torch.float16, seed=5)
        eng.engine.store(torch.arange(n), kvcache=kv)
        end = time.monotonic() + 60
        while c.stats().evictions < 1:
            assert time.monotonic() < end, c.stats()
            time.sleep(0.02)
        st = c.stats()
        assert st.evictions == 1 and st.sequences == 2, st
        conn, keys = eng.connector, chunk_keys(eng, n)
        assert [conn.exists_sync(k) for k in keys] == [False, True, True]
        assert eng.run(conn.get(keys[0])) is None                   # a miss, not an error
        assert eng.run(conn.batched_get(keys))[0] is None
        eng.drop_local()
        assert eng.engine.lookup(torch.arange(n)) == 0              # the prefix starts with the miss
        mask, _ = eng.retrieve(n, kv)
        assert not mask.any()
        got = eng.run(conn.get(keys[2]))
        assert got is not None and tuple(got.tensor.shape) == (2, L, CHUNK, H * D)
        got.ref_count_down()


def test_config_errors_name_the_key(server, client, tiny, register_model, make_engine):
    eng = make_engine(plugin_extra(server.address, tiny.name))
    register_model(client, "lmc-3layers", layers=3, kv_heads=H, head_dim=D, rank=8, codec_rank=4)

    def create(extra):
        """LMCache's own connector factory, as its RemoteBackend calls it."""
        return CreateConnector("plugin://kvq", eng.remote.loop, eng.remote.local_cpu_backend,
                               engine_config(extra), eng.remote.metadata, plugin_name=PLUGIN)

    base = plugin_extra(server.address, tiny.name)
    p = "remote_storage_plugin.kvq."
    cases = [
        ({k: v for k, v in base.items() if k != p + "server"}, p + "server: required"),
        ({**base, p + "server": "localhost"}, p + "server: 'localhost' is not host:port"),
        ({**base, p + "modle": "x"}, p + "modle: unknown setting"),
        ({**base, p + "model": "no-such-model"}, p + "model: model 'no-such-model' (version latest) is not registered"),
        ({**base, p + "basis_version": 7}, p + "basis_version: model 'lmc-tiny' (version 7) is not registered"),
        ({**base, p + "model": "lmc-3layers"}, p + "model: model 'lmc-3layers' has 3 layers x 2 KV heads"),
        ({**base, p + "codec": '{"key_bitz": 2}'}, p + "codec.key_bitz: unknown codec setting"),
        ({**base, p + "codec": '{"key_bits": 2'}, p + "codec: not a JSON object"),
        ({**base, p + "codec": '{"key_bits": 5}'}, p + "codec: the kvq server refused these codec settings"),
        ({**base, p + "codec": '{"rank": 9}'}, p + "codec: the kvq server refused these codec settings"),
        ({**base, p + "deadline_s": "soon"}, p + "deadline_s: expected seconds"),
    ]
    for extra, want in cases:
        with pytest.raises(PluginConfigError) as e:
            create(extra)
        assert str(e.value).startswith(want), (str(e.value), want)
    # The server's own reason travels with it (the field and its limit).
    with pytest.raises(PluginConfigError, match="key_bits"):
        create({**base, p + "codec": '{"key_bits": 5}'})
    # Nothing of the failed checks stayed behind on the server.
    assert client.stats().sequences == 0
    # And a valid configuration through the same factory works (LMCache wraps it).
    ok = create({**base, p + "codec": '{"key_group": 128}'})
    assert ok.getWrappedConnector().settings.codec.key_group == 128
    eng.run(ok.close())


def block_bytes(codec: kvq.CodecSettings, head_dim: int) -> tuple[int, int]:
    """Bytes of one key block and one value block (G tokens of one head), docs/CODEC.md
    "Block format": 16-byte header; keys fp16 scale+zero per channel, codes, and the side
    code's fp16 scale+zero per side channel and codes; values per token fp16 scale+zero per
    channel group and codes."""
    G, d, r = codec.key_group, head_dim, codec.rank
    key = 16 + 4 * d + d * G * codec.key_bits // 8 + 4 * r + r * G * codec.side_bits // 8
    value = 16 + G * (4 * math.ceil(d / codec.value_group) + math.ceil(d * codec.value_bits / 8))
    return key, value


# SmolLM2-135M's attention shape (30 layers, 3 KV heads of 64, 9 query heads), the codecs of
# docs/API.md / docs/RESULTS.md, and a 2-bit setting with coarser groups.
SMOLLM2 = dict(layers=30, kv_heads=3, q_heads=9, head_dim=64)
CODECS = {
    "default k3g128 r4s4 v2g32": {},
    "legacy default k2g32 r4s8 v2g32": {"key_bits": 2, "key_group": 32, "side_bits": 8},
    "k2g128 r4s8 v2g64": {"key_bits": 2, "key_group": 128, "side_bits": 8, "value_group": 64},
}


@pytest.mark.parametrize("name", list(CODECS))
def test_compression_of_a_smollm2_chunk(server, client, register_model, make_engine, name):
    """Bytes kvq holds for one full LMCache chunk (256 tokens, every layer) against the chunk's
    fp16 bytes. Run with -s to see the figures (client/python/README.md, "LMCache")."""
    m = register_model(client, "smollm2-shape", rank=8, codec_rank=4, **SMOLLM2)
    overrides = CODECS[name]
    eng = make_engine(plugin_extra(server.address, m.name, codec=json.dumps(overrides) if overrides else ""),
                      layers=m.layers, kv_heads=m.kv_heads, head_dim=m.head_dim)
    kv = synthetic_kv(m.layers, CHUNK, m.kv_heads, m.head_dim, torch.float16, seed=11)
    eng.store(kv, client, chunks=1)
    st = client.stats()
    fp16 = kv.numel() * 2
    codec = kvq.CodecSettings(**{f: getattr(m.info.codec, f) for f in
                                 ("key_bits", "key_group", "rank", "side_bits", "value_bits", "value_group")})
    for f, v in overrides.items():
        setattr(codec, f, v)
    kb, vb = block_bytes(codec, m.head_dim)
    blocks = m.layers * m.kv_heads * (CHUNK // codec.key_group)
    logical = blocks * (kb + vb)
    # The codec's own accounting matches the block format exactly (all 256 tokens encoded)...
    assert st.k_bits_per_element == pytest.approx(8 * kb / (codec.key_group * m.head_dim), rel=1e-9)
    assert st.v_bits_per_element == pytest.approx(8 * vb / (codec.key_group * m.head_dim), rel=1e-9)
    # ... and the bytes the server holds are those blocks, plus the pool's size-class rounding.
    assert logical <= st.stored_bytes <= logical * 1.25, (st.stored_bytes, logical)
    print(f"\n[lmcache compression] {name}: fp16 chunk {fp16} B, kvq stored_bytes {st.stored_bytes} B "
          f"({fp16 / st.stored_bytes:.2f}x), codec blocks {logical} B ({fp16 / logical:.2f}x), "
          f"K {st.k_bits_per_element:.4f} / V {st.v_bits_per_element:.4f} bits per element")
    assert fp16 / st.stored_bytes > 4.0



@pytest.fixture(scope="module")
def smollm2_kv(smollm2_gguf):
    """Real post-RoPE K/V: SmolLM2-135M (transformers, from the GGUF) over the first 600
    tokens of the WikiText-2 validation text, as kvcache [30, 2, 600, 3*64] fp16 (the layout
    a vLLM worker's KV gives LMCache, per token [kv_heads, head_dim] flattened)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    d, f = str(smollm2_gguf.parent), smollm2_gguf.name
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    text = data_file("wikitext-2/wiki.valid.tokens").read_text()[:20000]
    ids = tok(text, return_tensors="pt").input_ids[:, :TOKENS]
    assert ids.shape[1] == TOKENS
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    # DynamicCache layers: keys/values [1, kv_heads, T, head_dim] -> [T, kv_heads * head_dim]
    layers = [torch.stack([l.keys[0].permute(1, 0, 2).reshape(TOKENS, -1),
                           l.values[0].permute(1, 0, 2).reshape(TOKENS, -1)]) for l in cache.layers]
    return torch.stack(layers).half()


def test_engine_round_trip_of_real_smollm2_kv(server, client, register_model, make_engine, smollm2_kv):
    """The real model's K/V (600 tokens: two full chunks and one of 88) through LMCache's
    engine and kvq's default HeadQ codec: every token within the codec's bound."""
    kv = smollm2_kv
    m = register_model(client, "smollm2-lmc", rank=8, codec_rank=4, **SMOLLM2)
    assert kv.shape == (m.layers, 2, TOKENS, m.kv_heads * m.head_dim)
    eng = make_engine(plugin_extra(server.address, m.name), layers=m.layers, kv_heads=m.kv_heads,
                      head_dim=m.head_dim)
    eng.store(kv, client, chunks=3)
    eng.drop_local()
    mask, got = eng.retrieve(TOKENS, kv)
    assert int(mask.sum()) == TOKENS
    codec = kvq.CodecSettings(**{f: getattr(m.info.codec, f) for f in
                                 ("key_bits", "key_group", "rank", "side_bits", "value_bits", "value_group")})
    r = check_within_budget(kv, got, TOKENS, codec, torch.float16, m.kv_heads, m.head_dim)
    assert r["err_total"] > 0 and r["worst_v"] > 0.5, r
    assert torch.equal(got[:, :, TOKENS - 24:], kv[:, :, TOKENS - 24:])
    # Relative size of the error on real K/V (printed with -s; the bound is the test).
    rel = (got.float() - kv.float()).norm() / kv.float().norm()
    print(f"\n[lmcache real K/V] SmolLM2 600 tokens: relative L2 error of retrieved K/V {rel:.4f}, "
          f"worst key/value error over bound {r['worst_k']:.2f}/{r['worst_v']:.2f}")


def test_plugin_names_and_the_adapter_form(server, client, tiny, make_engine):
    """class_name KvqConnector under any plugin name (the connector finds its own keys), and
    KvqConnectorAdapter for several kvq plugins side by side (LMCache hands it the name)."""
    eng = make_engine(plugin_extra(server.address, tiny.name))

    def create(plugins, extra, name):
        cfg = LMCacheEngineConfig.from_dict({
            "chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": 0.1,
            "remote_storage_plugins": plugins, "remote_serde": "naive", "extra_config": extra})
        return CreateConnector(f"plugin://{name}", eng.remote.loop, eng.remote.local_cpu_backend,
                               cfg, eng.remote.metadata, plugin_name=name).getWrappedConnector()

    def keys(name, cls, **more):
        p = f"remote_storage_plugin.{name}."
        return {p + "module_path": "kvq.lmcache", p + "class_name": cls, p + "server": server.address,
                p + "model": tiny.name, **{p + k: v for k, v in more.items()}}

    c = create(["store"], keys("store", "KvqConnector", sequence_prefix="s/"), "store")
    assert c.settings.plugin_name == "store" and c.settings.sequence_prefix == "s/"
    eng.run(c.close())

    both = {**keys("kvq.a", "KvqConnectorAdapter", sequence_prefix="a/"),
            **keys("kvq.b", "KvqConnectorAdapter", sequence_prefix="b/")}
    for name in ("kvq.a", "kvq.b"):
        c = create(["kvq.a", "kvq.b"], both, name)
        assert c.settings.plugin_name == name and c.settings.sequence_prefix == name[-1] + "/"
        eng.run(c.close())
    # Two plugins of the RemoteConnector form cannot tell which keys are theirs: refused, naming the fix.
    two = {**keys("x", "KvqConnector"), **keys("y", "KvqConnector")}
    with pytest.raises(PluginConfigError, match="^remote_storage_plugins: several kvq plugins .*KvqConnectorAdapter"):
        create(["x", "y"], two, "x")
