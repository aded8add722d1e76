"""kvq.ClientOptions and the core both clients share (kvq._core), without a server: the
constructors take every option as a keyword and as options=, one validation, and the plan
of a split batched call (split by shard, merged back in order, a failed shard's items
carrying its status) run against answers made up here."""

from __future__ import annotations

import dataclasses
import inspect

import grpc
import numpy as np
import pytest

import kvq
import kvq.aio
from kvq._core import Call, ClientCore, Done, advance
from kvq._proto.kvq.v1 import kvq_pb2


@pytest.mark.parametrize("cls", [kvq.Client, kvq.aio.Client])
def test_constructors_take_every_option_as_a_keyword(cls):
    params = inspect.signature(cls.__init__).parameters
    names = [p for p in params if p not in ("self", "servers", "options")]
    assert names == [f.name for f in dataclasses.fields(kvq.ClientOptions) if f.name != "servers"]
    assert all(params[n].kind is inspect.Parameter.KEYWORD_ONLY for n in names + ["options"])
    assert all(params[n].default is None for n in names)


@pytest.mark.parametrize("cls", [kvq.Client, kvq.aio.Client])
def test_keywords_override_options(cls):
    base = kvq.ClientOptions(deadline=5.0, tenant="acme", max_attempts=2)
    c = cls("a:1, b:2", options=base, max_attempts=3)
    assert c.options == dataclasses.replace(base, servers="a:1, b:2", max_attempts=3)
    assert c.servers == ("a:1", "b:2")
    assert base.max_attempts == 2  # frozen: the given options are not changed
    c = cls(options=kvq.ClientOptions(servers=["x:1"]))
    assert c.servers == ("x:1",) and c.options.deadline == 30.0
    assert cls("a:1").options == kvq.ClientOptions(servers="a:1")
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.deadline = 1.0  # type: ignore[misc]


@pytest.mark.parametrize("cls", [kvq.Client, kvq.aio.Client])
@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({}, "servers"),
        ({"options": {"deadline": 1}}, "options"),
        ({"servers": "a:1", "deadline": -1}, "deadline"),
        ({"servers": "a:1", "max_attempts": 0}, "max_attempts"),
        ({"servers": "a:1", "token": "t"}, "token"),
        ({"servers": "a:1,a:1"}, "servers"),
        ({"servers": "a:1,b:2", "router": True}, "servers"),
    ],
)
def test_one_validation_for_both_clients(cls, kwargs, field):
    with pytest.raises(kvq.KvqError) as e:
        cls(**kwargs)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and f"{field}:" in e.value.details


def _drive(core: ClientCore, plan, answer):
    """Runs a plan with answer(call) standing in for each RPC (KvqErrors are returned)."""
    step = advance(plan, None)
    while not isinstance(step, Done):
        step = advance(plan, [answer(c) for c in step])
    return step.value


def _score_answer(failing_shard):
    def answer(call: Call):
        assert isinstance(call, Call) and call.method == "Score" and call.idempotent
        if call.shard == failing_shard:
            return kvq.KvqError("Score", grpc.StatusCode.UNAVAILABLE, "down")
        out = kvq_pb2.ScoreResponse()
        for _ in call.request.items:  # tokens: the shard, to tell the answers apart
            out.results.add(tokens=call.shard)
        return out

    return answer


def test_split_and_merge_in_the_items_order():
    core = ClientCore("a:1,b:2", tenant="acme")
    ids = [f"seq-{i}" for i in range(16)]
    owners = [core.shard_of(s) for s in ids]
    assert set(owners) == {0, 1}
    q = np.zeros((1, 4), np.float32)
    items = [kvq.ScoreItem(s, 0, q) for s in ids]
    resp = _drive(core, core._batched("Score", kvq.client.score_request(items), True, None), _score_answer(None))
    assert [r.tokens for r in resp.results] == owners

    # One shard down: its items carry its status, the others their results.
    results = _drive(core, core._score(items, False, None), _score_answer(1))
    for r, owner in zip(results, owners, strict=True):
        if owner == 1:
            assert r.code == grpc.StatusCode.UNAVAILABLE and r.message == "server b:2: down"
        else:
            assert r.ok and r.tokens == 0
    # Every shard down: the call fails.
    with pytest.raises(kvq.KvqError):
        _drive(core, core._score(items[:1], True, None), _score_answer(owners[0]))
