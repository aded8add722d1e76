"""Router mode of kvq.Client and kvq.aio.Client without a proxy: one server stands in for
the router (it ignores x-kvq-route). Routing keys are the C++ client's (16 hex digits of
key_of(identity, sequence id), hash tags shared), calls are split into one sub-call per
distinct key and merged back in order, register_basis is refused. That HAProxy routes on
the header: test_router.py."""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc
import numpy as np
import pytest

import kvq
import kvq.aio
from kvq.ring import key_of

D = 64
IDS = ["r-0", "r-1", "r-2", "r-3", "{t}a", "{t}b"]  # 5 routing keys


def appends():
    return [kvq.Append(sid, 0, 0, np.zeros((1, 4 + i, D), np.float16),
                       np.full((1, 4 + i, D), float(i), np.float16), model="tiny")
            for i, sid in enumerate(IDS)]


def items():
    return [kvq.AttendItem(sid, 0, np.zeros((1, 1, D), np.float32), observe=False) for sid in IDS]


@pytest.fixture
def server(kvq_server_factory, register_model):
    s = kvq_server_factory()
    with kvq.Client(s.address, tenant="acme") as direct:
        register_model(direct, layers=1, kv_heads=1, q_heads=1, head_dim=D)
    return s


def test_router_mode_keys_and_options(server):
    with pytest.raises(kvq.KvqError) as e:
        kvq.Client(["a:1", "b:2"], router=True)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with kvq.Client(server.address, router=True, tenant="acme") as c:
        assert c.route_key("seq-1") == f"{key_of('acme', 'seq-1'):016x}"
        assert c.route_key("{t}a") == c.route_key("{t}b") != c.route_key("{u}a")
        with pytest.raises(kvq.KvqError) as e:
            c.register_basis({"model": "x", "version": 1}, [])
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    with kvq.Client(server.address, router=True, token="tok", allow_insecure_token=True) as t:
        assert t.route_key("seq-1") == f"{key_of('tok', 'seq-1'):016x}"  # its own identity


def test_router_mode_splits_by_key(server):
    attempts = Counter()
    with kvq.Client(server.address, router=True, tenant="acme",
                    on_attempt=lambda m, a, s, code: attempts.update([m])) as c:
        put = c.put_blocks(appends())
        assert put.tokens_written == sum(4 + i for i in range(6))
        assert attempts["PutBlocks"] == 5
        res = c.attend(items())
        assert attempts["Attend"] == 5
        assert [r.tokens for r in res] == [4 + i for i in range(6)]
        for i, r in enumerate(res):
            np.testing.assert_allclose(r.outputs, float(i))
        assert c.stats().sequences == 6
        assert sum(b.layer_tokens for b in c.get_blocks("{t}b")) == 9
        assert c.delete_sequence("r-2") > 0
        with pytest.raises(kvq.KvqError) as e:
            c.delete_sequence("r-2")
        assert e.value.code == grpc.StatusCode.NOT_FOUND
        assert c.route_key("r-2") in e.value.details


def test_aio_router_mode_splits_by_key(server):
    attempts = Counter()

    async def run():
        async with kvq.aio.Client(server.address, router=True, tenant="acme",
                                  on_attempt=lambda m, a, s, code: attempts.update([m])) as c:
            await c.put_blocks(appends())
            res = await c.attend(items())
            assert [r.tokens for r in res] == [4 + i for i in range(6)]
            assert c.route_key("{t}a") == c.route_key("{t}b")
            with pytest.raises(kvq.KvqError) as e:
                await c.register_basis({"model": "x", "version": 1}, [])
            assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert await c.delete_sequence("r-0") > 0

    asyncio.run(run())
    assert attempts["PutBlocks"] == 5 and attempts["Attend"] == 5
