"""Sharding over two real kvq-server processes: every sequence on the server the ring names,
batched calls split by shard and merged back in order, stats summed, a dead shard failing
only its own items."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

import kvq

KV, QH, D = 2, 4, 64


def rand(shape, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


@pytest.fixture
def two(kvq_server_factory, register_model):
    a, b = kvq_server_factory(name="a"), kvq_server_factory(name="b")
    with kvq.Client([a.address, b.address], tenant="acme", deadline=10) as c:
        register_model(c)  # on every server
        yield a, b, c


def test_sequences_land_on_the_ring_server(two):
    a, b, c = two
    ids = [f"seq-{i}" for i in range(24)] + ["{conv}-1", "{conv}-2", "{conv}-3"]
    owner = {sid: c.shard_of(sid) for sid in ids}
    assert set(owner.values()) == {0, 1}, "24 ids should reach both servers"
    assert len({owner["{conv}-1"], owner["{conv}-2"], owner["{conv}-3"]}) == 1  # hash tag
    k = rand((KV, 10, D), 1, np.float16)
    r = c.put_blocks([kvq.Append(sid, 0, 0, k, k, model="tiny") for sid in ids])
    assert r.appends == len(ids) and r.tokens_written == 10 * len(ids)
    assert sorted(l.sequence_id for l in r.lengths) == sorted(ids)
    for shard, srv in enumerate((a, b)):
        with kvq.Client(srv.address, tenant="acme") as one:
            st = one.stats()
            mine = [sid for sid in ids if owner[sid] == shard]
            assert st.sequences == len(mine)
            for sid in ids:
                got = one.attend([kvq.AttendItem(sid, 0, rand((QH, 1, D)))], check=False)[0]
                assert got.ok == (owner[sid] == shard), sid
    total = c.stats()
    assert total.sequences == len(ids) and total.tokens == 10 * len(ids)
    assert total.server_capacity_bytes == 2 * (256 << 20)
    assert c.stats(shard=0).sequences + c.stats(shard=1).sequences == len(ids)


def test_batched_calls_are_merged_in_request_order(two):
    _, _, c = two
    ids = [f"b-{i}" for i in range(12)]
    assert {c.shard_of(s) for s in ids} == {0, 1}
    for i, sid in enumerate(ids):
        k = rand((KV, 20 + i, D), i, np.float16)
        c.put_blocks([kvq.Append(sid, 0, 0, k, k, model="tiny")])
    q = rand((QH, 1, D), 99)
    batch = c.attend([kvq.AttendItem(sid, 0, q, observe=False) for sid in ids])
    scores = c.score([kvq.ScoreItem(sid, 0, q) for sid in ids])
    for i, sid in enumerate(ids):
        alone = c.attend([kvq.AttendItem(sid, 0, q, observe=False)])[0]
        assert batch[i].tokens == 20 + i and scores[i].outputs.shape == (QH, 1, 20 + i)
        np.testing.assert_array_equal(batch[i].outputs, alone.outputs)
    w = [np.full((QH, 1, 20 + i), 1.0 / (20 + i), np.float32) for i in range(len(ids))]
    ro = c.readout([kvq.ReadoutItem(sid, 0, w[i]) for i, sid in enumerate(ids)])
    assert [r.tokens for r in ro] == [20 + i for i in range(len(ids))]
    blocks = list(c.get_blocks(ids[3]))
    assert blocks[0].layer_tokens == 23
    assert sum(c.delete_sequence(sid) > 0 for sid in ids) == len(ids)
    assert c.stats().sequences == 0


def test_a_dead_shard_fails_only_its_items(two):
    a, b, c = two
    ids = [f"d-{i}" for i in range(10)]
    k = rand((KV, 8, D), 0, np.float16)
    c.put_blocks([kvq.Append(sid, 0, 0, k, k, model="tiny") for sid in ids])
    b.kill()
    with kvq.Client([a.address, b.address], tenant="acme", max_attempts=2,
                    initial_backoff=0.001, max_backoff=0.005) as c2:
        res = c2.attend([kvq.AttendItem(sid, 0, rand((QH, 1, D)), observe=False) for sid in ids],
                        check=False)
        for sid, r in zip(ids, res):
            if c2.shard_of(sid) == 0:
                assert r.ok and r.tokens == 8
            else:
                assert r.code == grpc.StatusCode.UNAVAILABLE
                assert r.message.startswith(f"server {b.address}: ")
        with pytest.raises(kvq.KvqError) as e:
            c2.attend([kvq.AttendItem(sid, 0, rand((QH, 1, D))) for sid in ids])
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        only_b = [sid for sid in ids if c2.shard_of(sid) == 1]
        with pytest.raises(kvq.KvqError) as e:  # every shard the call needed failed
            c2.score([kvq.ScoreItem(sid, 0, rand((QH, 1, D))) for sid in only_b])
        assert e.value.code == grpc.StatusCode.UNAVAILABLE and b.address in e.value.details
        with pytest.raises(kvq.KvqError):
            c2.stats()
