"""kvq.codes against a real kvq-server: HeadQ blocks encoded in Python (kvq._codes, core's own
codec) are the server's byte for byte, decodes are GetBlocks' decoded rows bit for bit, a put in
codes reads back as a put of rows, for several codecs (registered explicitly with each model);
numpy and torch inputs; a corrupted block is refused (DATA_LOSS) by the server and the decoder.
"""

from __future__ import annotations

import ast
import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Tuple

import grpc
import numpy as np
import pytest
import torch

import kvq
import kvq.aio
import kvq.codes
from kvq import _codes
from kvq._proto.kvq.v1 import kvq_pb2

from conftest import metric, metric_at_least, random_basis

LAYERS, KV, Q, D, RANK = 2, 2, 4, 64, 8

# name -> the codec the model is registered with (every field the server's default otherwise).
CODECS: Dict[str, kvq.CodecSettings] = {
    # The registry's default codec (k3 g128 r4 s4 v2 g32).
    "default": kvq.CodecSettings(),
    # A side code of rank 8 at 4 bits, 4-bit keys in groups of 64, 3-bit values in groups of 16,
    # a window of 40 rows, both rotations (block version 3).
    "rank8-side4": kvq.CodecSettings(key_bits=4, key_group=64, rank=8, side_bits=4, value_bits=3,
                                     value_group=16, window=40, rotate_keys=True, rotate_values=True),
    # The attention sinks kept at fp16 and the A^2 value policy.
    "sinks-a2": kvq.CodecSettings(key_group=32, fp16_sinks=4, value_policy="a2", value_budget=2.5,
                                  sink_tokens=8),
    # Dense-and-sparse keys and values.
    "sparse": kvq.CodecSettings(key_bits=2, key_group=32, rank=4, side_bits=8, sparse_keys=20,
                                sparse_values=10),
    # Keys rounded in the query metric (the basis carries query moments).
    "metric": kvq.CodecSettings(key_group=32, metric_rounding=True, window=8),
}


def register(client: kvq.Client, name: str, codec: kvq.CodecSettings) -> kvq.codes.ModelCodes:
    """Registers model `name` (random orthonormal basis of rank 8, query moments) with `codec`
    as its defaults and returns its codes, made from its GetBasis answer."""
    rng = np.random.default_rng(11)
    moments = []
    for _ in range(LAYERS):
        q = rng.standard_normal((KV, 256, D)).astype(np.float32)
        moments.append(np.einsum("hni,hnj->hij", q, q).astype(np.float32) / 256)
    info = {"model": name, "version": 1, "layers": LAYERS, "kv_heads": KV, "q_heads": Q,
            "head_dim": D, "basis_rank": RANK, "kind": "random", "codec": codec}
    client.register_basis(info, random_basis(LAYERS, KV, D, RANK, seed=3), query_moment=moments)
    return kvq.codes.ModelCodes(client.get_basis(name))


def rows(n: int, seed: int, dtype=np.float16) -> Tuple[np.ndarray, np.ndarray]:
    """Keys and values [KV, n, D] with outliers: the first tokens (attention sinks) and a few
    channels large."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((KV, n, D)).astype(np.float32)
    v = rng.standard_normal((KV, n, D)).astype(np.float32)
    k[:, :4] *= 30
    v[:, :4] *= 10
    k[:, :, 5] *= 12
    v[:, rng.integers(0, n, 8), 9] = 40
    return k.astype(dtype), v.astype(dtype)


def codes_stream(client: kvq.Client, seq: str, dtype=kvq_pb2.DTYPE_F16,
                 max_tokens: int = 0) -> List[kvq_pb2.GetBlocksResponse]:
    req = kvq_pb2.GetBlocksRequest(sequence_id=seq, codes=True, dtype=dtype, max_tokens_per_message=max_tokens,
                                   max_block_version=kvq.codes.BLOCK_VERSION_MAX)
    return list(client.stub().GetBlocks(req))


def server_run(msgs: List[kvq_pb2.GetBlocksResponse], layer: int) -> Tuple[bytes, List[int], kvq_pb2.GetBlocksResponse]:
    """A layer's groups as the server sends them (its messages' blocks concatenated) and its
    first message."""
    mine = [m for m in msgs if m.layer == layer]
    return (b"".join(m.encoded.blocks for m in mine), [b for m in mine for b in m.encoded.block_bytes], mine[0])


def per_layer(blocks) -> Dict[int, Tuple[np.ndarray, np.ndarray]]:
    """Blocks (Client.get_blocks or ModelCodes.decode_stream) joined per layer in token order."""
    out: Dict[int, List] = {}
    for b in blocks:
        out.setdefault(b.layer, []).append(b)
    return {layer: (np.concatenate([b.keys for b in bs], axis=1), np.concatenate([b.values for b in bs], axis=1))
            for layer, bs in out.items()}


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("name", CODECS)
def test_python_blocks_are_the_servers(client, name):
    codes = register(client, name, CODECS[name])
    n = 300 + 7
    data = [rows(n, seed=layer) for layer in range(LAYERS)]
    client.put_blocks([kvq.Append("rows", layer, 0, k, v, model=name) for layer, (k, v) in enumerate(data)])
    msgs = codes_stream(client, "rows")
    for layer, (k, v) in enumerate(data):
        blocks, sizes, first = server_run(msgs, layer)
        # The codec the server names is the model's, every field set.
        codec = codes.codec(first.codec)
        assert codec == codes.default_codec
        assert codec.to_pb() == first.codec
        enc = codes.encode(layer, k, v)
        G = codec.key_group
        assert enc.start == 0 and enc.groups * G == enc.encoded_tokens and enc.tokens == n
        assert enc.groups == len(sizes) // (2 * KV) and enc.groups > 0
        assert enc.blocks == blocks
        assert enc.block_bytes.tolist() == sizes
        assert enc.basis_fingerprint == first.encoded.basis_fingerprint
        if codec.rank > 0:
            assert enc.basis_fingerprint == codes.info.fingerprint
        if codec.fp16_sinks:
            assert enc.sink_keys is not None and enc.sink_values is not None
            assert enc.sink_keys.shape == (KV, codec.fp16_sinks, D) and enc.sink_keys.dtype == np.float16
            assert enc.sink_keys.tobytes() == first.encoded.sink_keys.data
            assert enc.sink_values.tobytes() == first.encoded.sink_values.data
        else:
            assert enc.sink_keys is None and not first.encoded.HasField("sink_keys")
        # The rows after the groups: the server's window rows, in the arrival dtype.
        last = [m for m in msgs if m.layer == layer][-1]
        assert enc.rows == n - enc.encoded_tokens and enc.rows_dtype == "f16"
        assert enc.keys.dtype == np.float16 and enc.keys.shape == (KV, enc.rows, D)
        assert enc.keys.tobytes() == last.keys.data and enc.values.tobytes() == last.values.data
        assert same_bits(enc.keys, k[:, enc.encoded_tokens:]) and same_bits(enc.values, v[:, enc.encoded_tokens:])


@pytest.mark.parametrize("name", ["default", "rank8-side4", "sinks-a2", "sparse"])
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_decodes_are_get_blocks_rows_bit_for_bit(client, name, dtype):
    codes = register(client, name, CODECS[name])
    data = [rows(300, seed=10 + layer, dtype=np.float32) for layer in range(LAYERS)]
    client.put_blocks([kvq.Append("s", layer, 0, k, v, model=name) for layer, (k, v) in enumerate(data)])
    want = per_layer(client.get_blocks("s", dtype=dtype, max_tokens_per_message=64))
    # One group a message: only each layer's first names the codec.
    msgs = codes_stream(client, "s", dtype=kvq.tensors.DTYPES[dtype], max_tokens=1)
    assert len(msgs) > 2 * LAYERS and sum(m.HasField("codec") for m in msgs) == LAYERS
    got = per_layer(codes.decode_stream(msgs, dtype=dtype))
    assert sorted(got) == sorted(want) == list(range(LAYERS))
    for layer in range(LAYERS):
        assert same_bits(got[layer][0], want[layer][0]) and same_bits(got[layer][1], want[layer][1])
    # One message decoded into another dtype: its groups as the server decodes them into it.
    first = msgs[0]
    k32, _ = codes.decode(first, dtype="f32")
    k16, _ = codes.decode(first, dtype="f16")
    assert same_bits(k16, k32.astype(np.float16))


@pytest.mark.parametrize("name", ["default", "sinks-a2"])
def test_token_major_reads_are_the_same_rows_transposed(client, name):
    codes = register(client, name, CODECS[name])
    data = [rows(300, seed=30 + layer, dtype=np.float32) for layer in range(LAYERS)]
    client.put_blocks([kvq.Append("s", layer, 0, k, v, model=name) for layer, (k, v) in enumerate(data)])
    for use_codes in (True, False):  # decoded here in that order, or the server's rows transposed
        kw = dict(dtype="bf16", from_token=70, to_token=290, max_tokens_per_message=64, codes=use_codes)
        heads = list(client.get_blocks("s", **kw))
        tokens = list(client.get_blocks("s", token_major=True, **kw))
        assert [(b.layer, b.start) for b in tokens] == [(b.layer, b.start) for b in heads]
        for h, t in zip(heads, tokens):
            assert t.keys.shape == (h.keys.shape[1], KV, D) and t.keys.flags["C_CONTIGUOUS"]
            assert same_bits(t.keys, h.keys.transpose(1, 0, 2)) and same_bits(t.values, h.values.transpose(1, 0, 2))
    msg = codes_stream(client, "s")[0]
    k, v = codes.decode(msg, dtype="f16")
    tk, tv = codes.decode(msg, dtype="f16", token_major=True)
    assert same_bits(tk, k.transpose(1, 0, 2)) and same_bits(tv, v.transpose(1, 0, 2))


def transposed_layout(block_size: int) -> kvq.PagedLayout:
    """A vector CPU backend's block: per head K transposed [D][t], then V token-major [t][D]."""
    t = np.arange(block_size)[:, None]
    c = np.arange(D)[None, :]
    return kvq.PagedLayout(block_size=block_size, head_dim=D, block_stride=KV * 2 * block_size * D,
                           head_stride=2 * block_size * D, key_index=c * block_size + t,
                           value_index=block_size * D + t * D + c)


@pytest.mark.parametrize("name", ["default", "sinks-a2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_get_blocks_into_a_paged_cache_writes_get_blocks_rows_there_and_nothing_else(client, name, dtype):
    register(client, name, CODECS[name])
    data = [rows(300, seed=40 + layer, dtype=np.float32) for layer in range(LAYERS)]
    client.put_blocks([kvq.Append("s", layer, 0, k, v, model=name) for layer, (k, v) in enumerate(data)])
    bs, nb = 16, 24
    layout = transposed_layout(bs)
    block_ids = [(7 * b + 5) % nb for b in range(nb)]  # scrambled, as an engine's free list gives them
    wire = {torch.bfloat16: "bf16", torch.float32: "f32"}[dtype]
    lo, hi = 70, 290
    caches = {layer: torch.full((nb, KV, 2 * bs, D), -7.0, dtype=dtype) for layer in range(LAYERS)}
    before = {layer: c.clone() for layer, c in caches.items()}
    got = list(client.get_blocks_into("s", caches, layout, block_ids, from_token=lo, to_token=hi, dtype=wire))
    assert sorted({layer for layer, _ in got}) == list(range(LAYERS))
    assert all(sum(n for layer, n in got if layer == want) == hi - lo for want in range(LAYERS))
    want = per_layer(client.get_blocks("s", dtype=wire, from_token=lo, to_token=hi, codes=False))
    offsets = layout.block_offsets(block_ids)
    for layer in range(LAYERS):
        expect = before[layer].reshape(-1).clone()
        flat = expect.view(torch.int16) if dtype == torch.bfloat16 else expect
        for which, index in ((0, layout.key_index), (1, layout.value_index)):
            rows_ = torch.from_numpy(np.ascontiguousarray(want[layer][which]))  # [KV, n, D]
            if dtype == torch.bfloat16:
                rows_ = rows_.view(torch.int16)
            for i, t in enumerate(range(lo, hi)):
                for h in range(KV):
                    at = offsets[t // bs] + h * layout.head_stride + index.reshape(bs, D)[t % bs]
                    flat[torch.from_numpy(at.astype(np.int64))] = rows_[h, i]
        assert torch.equal(caches[layer].reshape(-1).view(torch.int16) if dtype == torch.bfloat16
                           else caches[layer].reshape(-1), flat), f"layer {layer}"
    # To the end (to_token None): each layer's tokens from lo.
    whole = list(client.get_blocks_into("s", caches, layout, block_ids, from_token=lo, dtype=wire))
    assert all(sum(n for layer, n in whole if layer == want) == 300 - lo for want in range(LAYERS))
    # Too few blocks for the range: refused before anything is written, naming the field.
    fresh = {layer: torch.zeros((nb, KV, 2 * bs, D), dtype=dtype) for layer in range(LAYERS)}
    with pytest.raises(kvq.KvqError) as e:
        list(client.get_blocks_into("s", fresh, layout, block_ids[:3], from_token=lo, to_token=hi, dtype=wire))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "paged.block_ids: 3 blocks" in str(e.value)
    assert all(int(c.count_nonzero()) == 0 for c in fresh.values())
    # A writing guard that refuses (the engine stopped waiting) ends the read before its write.
    class Stop(Exception):
        pass

    def refuse():
        raise Stop()

    with pytest.raises(Stop):
        list(client.get_blocks_into("s", fresh, layout, block_ids, dtype=wire, writing=refuse))
    assert all(int(c.count_nonzero()) == 0 for c in fresh.values())


def test_aio_get_blocks_into_writes_what_the_sync_client_writes(client, kvq_server):
    register(client, "default", CODECS["default"])
    data = [rows(300, seed=50 + layer, dtype=np.float32) for layer in range(LAYERS)]
    client.put_blocks([kvq.Append("s", layer, 0, k, v, model="default") for layer, (k, v) in enumerate(data)])
    bs, nb = 16, 24
    layout = transposed_layout(bs)
    block_ids = [(5 * b + 3) % nb for b in range(nb)]
    by_sync = {layer: torch.zeros((nb, KV, 2 * bs, D), dtype=torch.bfloat16) for layer in range(LAYERS)}
    by_aio = {layer: torch.zeros_like(c) for layer, c in by_sync.items()}
    list(client.get_blocks_into("s", by_sync, layout, block_ids, from_token=70, dtype="bf16"))

    async def run():
        async with kvq.aio.Client(kvq_server.address) as c:
            return [x async for x in c.get_blocks_into("s", by_aio, layout, block_ids, from_token=70, dtype="bf16")]

    got = asyncio.run(run())
    assert all(sum(n for layer, n in got if layer == want) == 300 - 70 for want in range(LAYERS))
    for layer in range(LAYERS):
        assert int(by_aio[layer].count_nonzero()) > 0
        assert torch.equal(by_aio[layer].view(torch.int16), by_sync[layer].view(torch.int16))


def test_get_blocks_into_needs_codes(kvq_server):
    with kvq.Client(kvq_server.address, codes=False) as plain:
        with pytest.raises(kvq.KvqError) as e:
            list(plain.get_blocks_into("s", {}, transposed_layout(16), [0]))
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "ClientOptions.codes" in str(e.value)
    with kvq.Client(kvq_server.address) as codes_on:
        with pytest.raises(kvq.KvqError, match="caches: no layer given"):
            list(codes_on.get_blocks_into("s", {}, transposed_layout(16), [0]))
    with pytest.raises(ValueError, match="PagedLayout.key_index: 3 offsets"):
        kvq.PagedLayout(block_size=16, head_dim=D, block_stride=0, head_stride=0, key_index=[0, 1, 2],
                        value_index=np.zeros(16 * D))


@pytest.mark.parametrize("name", CODECS)
def test_a_put_in_codes_reads_back_as_a_put_of_rows(client, name):
    codes = register(client, name, CODECS[name])
    n = 333
    data = [rows(n, seed=20 + layer) for layer in range(LAYERS)]
    client.put_blocks([kvq.Append("rows", layer, 0, k, v, model=name) for layer, (k, v) in enumerate(data)])
    # The whole layer in appends of at most 64 tokens of groups each, the last with the rows,
    # each the first of its layer in its message.
    appends = [a for layer, (k, v) in enumerate(data)
               for a in codes.encode(layer, k, v).to_appends("codes", max_tokens=64)]
    assert appends[0].model == name and appends[0].codec == codes.default_codec.to_pb()
    resp = client.put_blocks(messages=[[a] for a in appends])
    assert {(x.layer, x.tokens) for x in resp.lengths} == {(layer, n) for layer in range(LAYERS)}
    for dtype in ("f32", "f16"):
        a = per_layer(client.get_blocks("rows", dtype=dtype))
        b = per_layer(client.get_blocks("codes", dtype=dtype))
        for layer in range(LAYERS):
            assert same_bits(a[layer][0], b[layer][0]) and same_bits(a[layer][1], b[layer][1])
    ra, rb = codes_stream(client, "rows"), codes_stream(client, "codes")
    assert [m.SerializeToString() for m in ra] == [m.SerializeToString() for m in rb]
    # Re-sent: a duplicate.
    again = client.put_blocks(messages=[[a] for a in appends])
    assert again.tokens_written == 0


@pytest.mark.parametrize("name", ["default", "rank8-side4", "sinks-a2"])
def test_a_chunked_put_from_one_encoder(client, name):
    """Chunks from one LayerEncoder, each put as it comes (its groups from the layer's encoded
    end on, then the rows after them), read back as one put of every row."""
    codes = register(client, name, CODECS[name])
    k, v = rows(420, seed=5)
    client.put_blocks([kvq.Append("rows", 0, 0, k, v, model=name)])
    enc = codes.encoder(0)
    at = 0
    for size in (1, 40, 100, 3, 150, 126):
        part = enc.append(k[:, at:at + size], v[:, at:at + size])
        at += size
        assert part.tokens == at and enc.tokens == at
        client.put_blocks(part.to_appends("codes", create=at == size))
    assert at == 420 and enc.encoded_tokens > 0
    a, b = per_layer(client.get_blocks("rows", layers=[0])), per_layer(client.get_blocks("codes", layers=[0]))
    assert same_bits(a[0][0], b[0][0]) and same_bits(a[0][1], b[0][1])
    assert [m.encoded.SerializeToString() for m in codes_stream(client, "rows")] == [
        m.encoded.SerializeToString() for m in codes_stream(client, "codes")]


def test_numpy_and_torch_inputs(client):
    codes = register(client, "m", CODECS["default"])
    k32, v32 = rows(200, seed=1, dtype=np.float32)
    tk, tv = torch.from_numpy(k32), torch.from_numpy(v32)
    assert codes.encode(0, tk, tv).blocks == codes.encode(0, k32, v32).blocks
    # A strided numpy view encodes as its contiguous copy.
    wide = np.concatenate([k32, k32], axis=2)[:, :, ::2]
    assert codes.encode(0, wide, v32).blocks == codes.encode(0, np.ascontiguousarray(wide), v32).blocks
    f16 = codes.encode(0, tk.half(), tv.half())
    assert f16.blocks == codes.encode(0, k32.astype(np.float16), v32.astype(np.float16)).blocks
    assert f16.rows_dtype == "f16" and f16.keys.dtype == np.float16
    # bfloat16: torch's, or numpy uint16 bit patterns; rows come back as uint16 bits.
    kb, vb = tk.bfloat16(), tv.bfloat16()
    bf = codes.encode(0, kb, vb)
    bits = (kb.view(torch.int16).numpy().view(np.uint16), vb.view(torch.int16).numpy().view(np.uint16))
    assert bf.blocks == codes.encode(0, *bits).blocks
    assert bf.rows_dtype == "bf16" and same_bits(bf.keys, bits[0][:, bf.encoded_tokens:])
    # The server's blocks for the same bfloat16 rows.
    client.put_blocks([kvq.Append("bf", 0, 0, kb, vb, model="m")])
    blocks, sizes, first = server_run(codes_stream(client, "bf", dtype=kvq_pb2.DTYPE_BF16), 0)
    assert bf.blocks == blocks and bf.block_bytes.tolist() == sizes
    assert bf.keys.tobytes() == first.keys.data


def test_a_corrupted_block_is_refused(client):
    codes = register(client, "m", CODECS["sinks-a2"])
    k, v = rows(100, seed=2)
    enc = codes.encode(0, k, v)
    good = enc.to_appends("good")[0]
    bad = kvq_pb2.Append()
    bad.CopyFrom(good)
    bad.sequence_id = "bad"
    flipped = bytearray(bad.encoded.blocks)
    flipped[enc.block_bytes[0] // 2] ^= 0x10  # a bit inside the first key block's codes
    bad.encoded.blocks = bytes(flipped)
    with pytest.raises(kvq.KvqError) as e:
        client.put_blocks([bad])
    assert e.value.code == grpc.StatusCode.DATA_LOSS and "checksum" in e.value.details
    # A run of another basis.
    other = kvq_pb2.Append()
    other.CopyFrom(good)
    other.encoded.basis_fingerprint = "0123456789abcdef"
    with pytest.raises(kvq.KvqError) as e:
        client.put_blocks([other])
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    client.put_blocks([good])
    # The decoder checks what the server sends the same way.
    msg = codes_stream(client, "good")[0]
    codes.decode(msg)
    msg.encoded.blocks = bytes(flipped)
    with pytest.raises(kvq.KvqError) as e:
        codes.decode(msg)
    assert e.value.code == grpc.StatusCode.DATA_LOSS
    msg.encoded.blocks = enc.blocks
    msg.encoded.basis_fingerprint = "0123456789abcdef"
    with pytest.raises(kvq.KvqError) as e:
        codes.decode(msg)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    msg.encoded.basis_fingerprint = enc.basis_fingerprint
    msg.encoded.block_bytes[0] += 1  # sizes that do not sum to the bytes
    with pytest.raises(kvq.KvqError) as e:
        codes.decode(msg)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_arguments_are_checked(client):
    codes = register(client, "m", CODECS["default"])
    k, v = rows(40, seed=3)

    def code_of(f) -> grpc.StatusCode:
        with pytest.raises(kvq.KvqError) as e:
            f()
        return e.value.code

    invalid = grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: codes.encode(2, k, v)) == invalid  # no layer 2
    assert code_of(lambda: codes.encode(0, k[:, :, :32], v[:, :, :32])) == invalid  # head_dim
    assert code_of(lambda: codes.encode(0, k, v[:, :20])) == invalid  # n differs
    assert code_of(lambda: codes.encode(0, k.astype(np.int32), v)) == invalid
    assert code_of(lambda: codes.encode(0, k, v.astype(np.float32))) == invalid  # one dtype
    assert code_of(lambda: codes.encode(0, [[1.0]], v)) == invalid
    with pytest.raises(kvq.KvqError, match="codec.key_bits = 5"):
        codes.codec(kvq.CodecSettings(key_bits=5))
    with pytest.raises(kvq.KvqError, match="no setting named bits"):
        codes.codec({"bits": 2})
    with pytest.raises(kvq.KvqError, match="exceeds the basis rank 8"):
        codes.codec({"rank": 9})
    with pytest.raises(kvq.KvqError, match="value_policy"):
        codes.codec(kvq_pb2.CodecSettings(value_policy=kvq_pb2.CodecSettings.VALUE_POLICY_DEFAULT))
    with pytest.raises(kvq.KvqError, match="sparse_keys"):
        codes.codec({"sparse_keys": 20, "rotate_keys": True})  # not with a rotation
    # A model registered without query moments refuses metric rounding, as the server does.
    client.register_basis({"model": "plain", "version": 1, "layers": 1, "kv_heads": KV, "q_heads": Q,
                           "head_dim": D, "basis_rank": 4, "kind": "random"}, random_basis(1, KV, D, 4, seed=1))
    plain = kvq.codes.ModelCodes(client.get_basis("plain"))
    assert code_of(lambda: plain.codec({"metric_rounding": True})) == grpc.StatusCode.FAILED_PRECONDITION
    # A message of another model is not decoded with these codes.
    client.put_blocks([kvq.Append("p", 0, 0, k, v, model="plain")])
    msg = codes_stream(client, "p")[0]
    assert code_of(lambda: codes.decode(msg)) == grpc.StatusCode.FAILED_PRECONDITION
    assert code_of(lambda: plain.decode(msg, dtype="f64")) == invalid
    later = kvq_pb2.GetBlocksResponse()
    later.CopyFrom(msg)
    later.ClearField("codec")
    assert code_of(lambda: plain.decode(later)) == invalid  # which codec: not named
    # Nothing to append.
    assert codes.encoder(0).append(k[:, :0], v[:, :0]).to_appends("x") == []
    # A server whose block-format versions this codec neither reads nor writes.
    basis = client.stub().GetBasis(kvq_pb2.GetModelRequest(model="m"))
    basis.info.block_version_min = basis.info.block_version_max = kvq.codes.BLOCK_VERSION_MAX + 1
    assert code_of(lambda: kvq.codes.ModelCodes(basis)) == grpc.StatusCode.FAILED_PRECONDITION
    # A basis whose columns are not orthonormal is refused as the server refuses it.
    basis = client.stub().GetBasis(kvq_pb2.GetModelRequest(model="m"))
    u = np.frombuffer(basis.basis[0].data, dtype="<f4") * 2
    basis.basis[0].data = u.astype("<f4").tobytes()
    assert code_of(lambda: kvq.codes.ModelCodes(basis)) == invalid


def test_encoders_and_decoders_on_several_threads(client):
    """The codec runs without the GIL: several threads encode and decode at once, each getting
    what it gets alone."""
    codes = register(client, "m", CODECS["sparse"])
    data = [rows(500, seed=30 + i) for i in range(4)]
    alone = [codes.encode(i % LAYERS, k, v) for i, (k, v) in enumerate(data)]
    client.put_blocks([kvq.Append("s", 0, 0, *data[0], model="m")])
    msg = codes_stream(client, "s")[0]
    want = codes.decode(msg)
    with ThreadPoolExecutor(4) as pool:
        encoded = list(pool.map(lambda i: codes.encode(i % LAYERS, *data[i]), range(len(data))))
        decoded = list(pool.map(lambda _: codes.decode(msg), range(8)))
    assert [e.blocks for e in encoded] == [e.blocks for e in alone]
    assert all(same_bits(k, want[0]) and same_bits(v, want[1]) for k, v in decoded)


def test_a_model_without_basis(client):
    client.register_basis({"model": "nobasis", "version": 1, "layers": 1, "kv_heads": KV, "q_heads": Q,
                           "head_dim": D, "basis_rank": 0})
    codes = kvq.codes.ModelCodes(client.get_basis("nobasis"))
    assert codes.default_codec.rank == 0
    k, v = rows(300, seed=4)
    client.put_blocks(codes.encode(0, k, v).to_appends("codes"))
    client.put_blocks([kvq.Append("rows", 0, 0, k, v, model="nobasis")])
    a, b = per_layer(client.get_blocks("rows")), per_layer(client.get_blocks("codes"))
    assert same_bits(a[0][0], b[0][0]) and same_bits(a[0][1], b[0][1])
    enc = codes.encode(0, k, v)
    assert enc.basis_fingerprint == "" and enc.blocks == server_run(codes_stream(client, "rows"), 0)[0]


def test_the_module_matches_its_stub_and_the_codec_table():
    # Every codec setting of core's table is a CodecSettings field (proto and dataclass).
    names = _codes.codec_fields()
    assert names == [f.name for f in kvq_pb2.CodecSettings.DESCRIPTOR.fields]
    assert names == [f for f in kvq.CodecSettings.__dataclass_fields__]
    assert (kvq.codes.BLOCK_VERSION_MIN, kvq.codes.BLOCK_VERSION_MAX) == (2, 3)
    # _codes.pyi names what the module has, class by class.
    stub = ast.parse((Path(kvq.__file__).parent / "_codes.pyi").read_text())
    declared = {node.name: {n.name for n in node.body if isinstance(n, ast.FunctionDef)} - {"__init__"}
                for node in stub.body if isinstance(node, ast.ClassDef)}
    top = {n.name for n in stub.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))} | {
        n.target.id for n in stub.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    assert top == {n for n in dir(_codes) if not n.startswith("_")}
    for cls, members in declared.items():
        if cls == "Error":
            continue
        have = {n for n in dir(getattr(_codes, cls)) if not n.startswith("_")}
        assert members == have, cls


@pytest.mark.parametrize("name", ["default", "rank8-side4", "sinks-a2", "sparse"])
def test_the_client_sends_and_fetches_codes_by_default(kvq_server_factory, name):
    """kvq.Client (codes on by default) against one with codes=False, the same appends: a
    prompt's prefill, decode steps, a chunk within the window, more chunks, with token ids. The
    server holds the same blocks and both read back the same bits; the prefill and the long
    chunks go as codes in fewer bytes, the A^2 policy as rows."""
    server = kvq_server_factory(metrics=True)
    sizes = (300, 1, 1, 30, 130, 2, 200)
    k, v = rows(sum(sizes), seed=7)
    ids = np.arange(sum(sizes), dtype=np.uint32) + 1000
    received: Dict[bool, float] = {}
    with kvq.Client(server.address) as c:
        register(c, name, CODECS[name])
    for codes_on in (False, True):
        before = metric(server, "kvq_received_bytes_total", method="PutBlocks")
        with kvq.Client(server.address, codes=codes_on) as c:
            at = 0
            seq = f"s-{int(codes_on)}"
            for size in sizes:
                c.put_blocks([kvq.Append(seq, layer, at, k[:, at:at + size], v[:, at:at + size],
                                         token_ids=ids[at:at + size], model=name if at == 0 else None)
                              for layer in range(LAYERS)])
                at += size
        received[codes_on] = metric_at_least(server, before + 1, "kvq_received_bytes_total",
                                             method="PutBlocks") - before
    with kvq.Client(server.address, codes=False) as rows_client, kvq.Client(server.address) as codes_client:
        for dtype in ("f32", "f16", "bf16"):
            for seq in ("s-0", "s-1"):
                a = per_layer(rows_client.get_blocks(seq, dtype=dtype, max_tokens_per_message=64))
                b = per_layer(codes_client.get_blocks(seq, dtype=dtype, max_tokens_per_message=64))
                for layer in range(LAYERS):
                    assert same_bits(a[layer][0], b[layer][0]) and same_bits(a[layer][1], b[layer][1])
            # The same chunks as rows give, and a range starting inside a group.
            got = [(x.layer, x.start, x.keys.shape[1]) for x in codes_client.get_blocks(
                "s-1", dtype=dtype, from_token=70, to_token=400, max_tokens_per_message=100)]
            assert got == [(layer, s, min(100, 400 - s)) for layer in range(LAYERS) for s in (70, 170, 270, 370)]
        assert [m.encoded.SerializeToString() for m in codes_stream(codes_client, "s-0")] == [
            m.encoded.SerializeToString() for m in codes_stream(codes_client, "s-1")]
    print(f"{name}: PutBlocks bytes received: rows {received[False]:.0f}, codes {received[True]:.0f} "
          f"({received[True] / received[False]:.3f}x)")
    if CODECS[name].value_policy == "a2":
        assert received[True] == received[False]
    else:
        assert received[True] < 0.8 * received[False]


def test_attend_items_carry_their_prefill_as_codes(kvq_server_factory):
    """A frontend that appends inside its Attend items (as kvq.hf does): a prefill chunk goes as
    codes, decode steps as rows, with the outputs of a client that sends rows, bit for bit
    (each item's append is applied before its attention, in codes as in rows)."""
    server = kvq_server_factory(metrics=True)
    with kvq.Client(server.address) as c:
        register(c, "default", CODECS["default"])
    sizes = (300, 1, 1, 1, 200, 1)
    k, v = rows(sum(sizes), seed=8)
    q = np.random.default_rng(9).standard_normal((Q, max(sizes), D)).astype(np.float32)
    outs: Dict[bool, List[np.ndarray]] = {}
    received: Dict[bool, float] = {}
    for codes_on in (False, True):
        before = metric(server, "kvq_received_bytes_total", method="Attend")
        with kvq.Client(server.address, codes=codes_on) as c:
            at, outs[codes_on], seq = 0, [], f"a-{int(codes_on)}"
            for n in sizes:
                model = "default" if at == 0 else None
                items = [kvq.AttendItem(seq, layer, q[:, :n], causal_offset=at, append=kvq.Append(
                    seq, layer, at, k[:, at:at + n], v[:, at:at + n], model=model)) for layer in range(LAYERS)]
                outs[codes_on] += [r.outputs for r in c.attend(items)]
                at += n
        received[codes_on] = metric_at_least(server, before + 1, "kvq_received_bytes_total", method="Attend") - before
    assert all(same_bits(a, b) for a, b in zip(outs[False], outs[True], strict=True))
    print(f"Attend bytes received: rows {received[False]:.0f}, codes {received[True]:.0f} "
          f"({received[True] / received[False]:.3f}x; the fp32 queries travel either way)")
    assert received[True] < 0.9 * received[False]
