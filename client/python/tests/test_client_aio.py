"""kvq.aio.Client against real servers: the same calls and errors as kvq.Client, as
coroutines (run with asyncio.run; no pytest plugin needed)."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

import kvq
import kvq.aio

from conftest import random_basis

KV, QH, D = 2, 4, 64


def rand(shape, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


INFO = {"model": "tiny", "version": 1, "layers": 2, "kv_heads": KV, "q_heads": QH,
        "head_dim": D, "basis_rank": 8, "kind": "random", "codec": kvq.CodecSettings(rank=4)}


def test_aio_round_trip_equals_the_sync_client(kvq_server_factory):
    a, b = kvq_server_factory(name="a"), kvq_server_factory(name="b")
    servers = [a.address, b.address]
    ids = [f"aio-{i}" for i in range(8)]
    q = rand((QH, 2, D), 5)

    async def run():
        async with kvq.aio.Client(servers, tenant="t") as c:
            assert await c.health() == [(a.address, True), (b.address, True)]
            reg = await c.register_basis(INFO, random_basis(2, KV, D, 8, seed=1))
            assert reg.model.has_basis
            assert [m.model for m in await c.list_models(shard=1)] == ["tiny"]
            assert (await c.get_model("tiny")).basis_rank == 8
            basis = await c.get_basis("tiny", shard=1)
            assert basis.info.fingerprint == (await c.get_model("tiny", shard=1)).fingerprint
            assert len(basis.basis) == 2 and tuple(basis.basis[0].shape) == (KV, D, 8)
            appends = [kvq.Append(sid, 0, 0, rand((KV, 16 + i, D), i, np.float16),
                                  rand((KV, 16 + i, D), i + 50, np.float16), model="tiny")
                       for i, sid in enumerate(ids)]
            put = await c.put_blocks(appends)
            assert put.tokens_written == sum(16 + i for i in range(len(ids)))
            att = await c.attend([kvq.AttendItem(sid, 0, q, observe=False) for sid in ids])
            sc = await c.score([kvq.ScoreItem(sid, 0, q) for sid in ids])
            ro = await c.readout([kvq.ReadoutItem(sid, 0, np.full((QH, 2, 16 + i), 0.1, np.float32))
                                  for i, sid in enumerate(ids)])
            blocks = [blk async for blk in c.get_blocks(ids[2], max_tokens_per_message=8)]
            st = await c.stats()
            assert await c.echo(b"aio") == b"aio"
            with pytest.raises(kvq.KvqError) as e:
                await c.get_model("nope")
            assert e.value.code == grpc.StatusCode.NOT_FOUND
            missing = await c.attend([kvq.AttendItem("missing", 0, q)], check=False)
            assert missing[0].code == grpc.StatusCode.NOT_FOUND
            with pytest.raises(kvq.KvqError) as e:
                _ = [blk async for blk in c.get_blocks("missing")]
            assert e.value.code == grpc.StatusCode.NOT_FOUND
            freed = await c.delete_sequence(ids[0])
            return att, sc, ro, blocks, st, freed

    att, sc, ro, blocks, st, freed = asyncio.run(run())
    assert st.sequences == len(ids) and freed > 0
    assert [blk.start for blk in blocks] == [0, 8, 16] and blocks[0].layer_tokens == 18
    with kvq.Client(servers, tenant="t") as c:
        for i, sid in enumerate(ids[1:], start=1):
            want = c.attend([kvq.AttendItem(sid, 0, q, observe=False)])[0]
            np.testing.assert_array_equal(att[i].outputs, want.outputs)
            assert sc[i].outputs.shape == (QH, 2, 16 + i) and ro[i].tokens == 16 + i
        assert c.stats().sequences == len(ids) - 1


def test_aio_retries_exactly_the_idempotent_calls(kvq_server_factory):
    s = kvq_server_factory()
    s.kill()
    attempts = []

    async def run():
        async with kvq.aio.Client(s.address, max_attempts=3, initial_backoff=0.001, max_backoff=0.01,
                                  on_attempt=lambda m, a, sh, code: attempts.append((m, code))) as c:
            for call in (c.stats(), c.delete_sequence("x"),
                         c.attend([kvq.AttendItem("x", 0, rand((QH, 1, D)))]),
                         c.attend([kvq.AttendItem("x", 0, rand((QH, 1, D)), observe=False)])):
                with pytest.raises(kvq.KvqError) as e:
                    await call
                assert e.value.code == grpc.StatusCode.UNAVAILABLE

    asyncio.run(run())
    methods = [m for m, _ in attempts]
    assert methods == ["Stats"] * 3 + ["DeleteSequence"] + ["Attend"] + ["Attend"] * 3
    assert {code for _, code in attempts} == {grpc.StatusCode.UNAVAILABLE}
