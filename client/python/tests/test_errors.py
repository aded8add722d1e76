"""Every error path of the client raises kvq.KvqError with the code and the server's message;
retries happen exactly for the calls the C++ client retries (counted through on_attempt)."""

from __future__ import annotations

import signal
import socket
from collections import Counter

import grpc
import numpy as np
import pytest

import kvq
from kvq.errors import code_from_int

KV, QH, D = 2, 4, 64


def rand(shape, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_error_str_and_fields():
    e = kvq.KvqError("Attend", grpc.StatusCode.NOT_FOUND, "sequence 'x' not found")
    assert str(e) == "Attend: NOT_FOUND: sequence 'x' not found"
    assert (e.method, e.code, e.details) == ("Attend", grpc.StatusCode.NOT_FOUND, "sequence 'x' not found")
    assert code_from_int(16) == grpc.StatusCode.UNAUTHENTICATED
    assert code_from_int(999) == grpc.StatusCode.UNKNOWN


@pytest.mark.parametrize("make, field", [
    (lambda: kvq.AttendItem("s", 0, rand((QH, 1, 1, D))), "items[0].queries: shape [4, 1, 1, 64] has 4 dimensions"),
    (lambda: kvq.AttendItem("s", 0, rand((QH, 1, D), dtype=np.float64)), "items[0].queries: dtype float64"),
    (lambda: kvq.AttendItem("s", 0, [[1.0]]), "items[0].queries: expected a numpy array"),
    (lambda: kvq.AttendItem("s", 0, rand((QH, 0, D))), "items[0].queries: shape [4, 0, 64] is empty"),
    (lambda: kvq.AttendItem("s", 0, rand((QH, 1, D)), output_dtype="int8"), "items[0].output_dtype: dtype 'int8'"),
    (lambda: kvq.AttendItem("s", 0, rand((QH, 1, D)),
                            append=kvq.Append("s", 0, 0, rand((KV, 2, D)), rand((KV, 3, D)))),
     "items[0].append.values: shape [2, 3, 64] differs from keys [2, 2, 64]"),
    (lambda: kvq.AttendItem("s", 0, rand((QH, 1, D)), append=kvq.Append("s", 0, 0, rand((KV, 2, D)))),
     "items[0].append.values: missing"),
    (lambda: kvq.AttendItem("s", 0, rand((QH, 1, D)), append=kvq.Append("s", 0, 0)),
     "items[0].append: neither keys/values nor token_ids"),
])
def test_bad_arguments_fail_client_side_naming_the_field(make, field):
    # Nothing listens on this address: the error must come before anything is sent.
    with kvq.Client(f"127.0.0.1:{free_port()}", max_attempts=1) as c:
        with pytest.raises(kvq.KvqError) as e:
            c.attend([make()])
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.method == "Attend"
    assert field in e.value.details, e.value.details


def test_bad_client_options():
    for kw, what in [
        ({"servers": ""}, "servers: no server"),
        ({"servers": "a:1,a:1"}, "listed twice"),
        ({"servers": "a:1", "token": "t"}, "plaintext"),
        ({"servers": "a:1", "deadline": 0}, "deadline"),
        ({"servers": "a:1", "max_attempts": 0}, "max_attempts"),
        ({"servers": "a:1", "root_certificates": b"x"}, "TLS is off"),
        ({"servers": "a:1", "tls": True, "private_key": b"k"}, "needs both"),
        ({"servers": "a:1", "tls": True, "root_certificates": "/nonexistent/ca.pem"}, "cannot read"),
    ]:
        servers = kw.pop("servers")
        with pytest.raises(kvq.KvqError) as e:
            kvq.Client(servers, **kw)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and what in e.value.details, e.value


def test_server_side_invalid_argument_names_the_field(client, register_model):
    register_model(client)
    k = rand((KV, 8, D), 1, np.float16)
    # 3 KV heads for a model with 2: only the server knows the model's shape.
    with pytest.raises(kvq.KvqError) as e:
        client.put_blocks([kvq.Append("s", 0, 0, rand((3, 8, D), 1, np.float16),
                                      rand((3, 8, D), 1, np.float16), model="tiny")])
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.method == "PutBlocks"
    assert "appends[0].keys" in e.value.details, e.value.details
    client.put_blocks([kvq.Append("s", 0, 0, k, k, model="tiny")])
    res = client.attend([kvq.AttendItem("s", 0, rand((QH, 1, 32)))], check=False)
    assert res[0].code == grpc.StatusCode.INVALID_ARGUMENT
    assert "queries" in res[0].message, res[0].message
    with pytest.raises(kvq.KvqError) as e:
        client.readout([kvq.ReadoutItem("s", 0, np.ones((QH, 1, 9), np.float32))])
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION  # 9 weights for 8 tokens
    assert e.value.details.startswith("items[0]: weights.shape[2] 9"), e.value.details
    with pytest.raises(kvq.KvqError) as e:
        list(client.get_blocks("s", from_token=-1))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "from_token" in e.value.details
    with pytest.raises(kvq.KvqError) as e:
        client.register_basis({"model": "bad name!", "version": 1, "layers": 1, "kv_heads": 1,
                               "q_heads": 1, "head_dim": 8})
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "model" in e.value.details


def test_unknown_model_is_not_found(client):
    with pytest.raises(kvq.KvqError) as e:
        client.get_model("no-such-model")
    assert e.value.code == grpc.StatusCode.NOT_FOUND and "no-such-model" in e.value.details
    k = rand((KV, 4, D), 0, np.float16)
    with pytest.raises(kvq.KvqError) as e:
        client.put_blocks([kvq.Append("s", 0, 0, k, k, model="no-such-model")])
    assert e.value.code == grpc.StatusCode.NOT_FOUND and "no-such-model" in e.value.details
    with pytest.raises(kvq.KvqError) as e:
        list(client.get_blocks("never-stored"))
    assert e.value.code == grpc.StatusCode.NOT_FOUND and e.value.method == "GetBlocks"


def test_server_gone_away_is_unavailable_after_exactly_the_cxx_retries(kvq_server_factory, register_model):
    server = kvq_server_factory()
    attempts = Counter()
    codes = []

    def hook(method, attempt, shard, code):
        attempts[method] += 1
        codes.append(code)

    with kvq.Client(server.address, max_attempts=3, initial_backoff=0.001, max_backoff=0.01,
                    deadline=5.0, on_attempt=hook) as c:
        register_model(c)
        k = rand((KV, 4, D), 0, np.float16)
        c.put_blocks([kvq.Append("s", 0, 0, k, k, model="tiny")])
        assert attempts["PutBlocks"] == 1
        server.kill()
        killed_at = len(codes)
        q = rand((QH, 1, D))
        calls = {
            "Stats": lambda: c.stats(),
            "Echo": lambda: c.echo(b"x"),
            "ListModels": lambda: c.list_models(),
            "GetModel": lambda: c.get_model("tiny"),
            "RegisterBasis": lambda: register_model(c),
            "PutBlocks": lambda: c.put_blocks([kvq.Append("s", 0, 4, k, k)]),
            "Score": lambda: c.score([kvq.ScoreItem("s", 0, q)]),
            "Readout": lambda: c.readout([kvq.ReadoutItem("s", 0, np.ones((QH, 1, 4), np.float32))]),
            "GetBlocks": lambda: list(c.get_blocks("s")),
            "DeleteSequence": lambda: c.delete_sequence("s"),
        }
        # Attend is retried only when every item is read-only (observe=False).
        attend_calls = {
            "observe unset": ([kvq.AttendItem("s", 0, q)], 1),
            "observe True": ([kvq.AttendItem("s", 0, q, observe=True)], 1),
            "mixed": ([kvq.AttendItem("s", 0, q, observe=False), kvq.AttendItem("s", 0, q)], 1),
            "all observe=False": ([kvq.AttendItem("s", 0, q, observe=False)] * 2, 3),
        }
        want = {m: 3 for m in calls}
        want["DeleteSequence"] = 1  # never retried: a second attempt would not be a no-op
        before = Counter(attempts)
        for method, call in calls.items():
            with pytest.raises(kvq.KvqError) as e:
                call()
            assert e.value.code == grpc.StatusCode.UNAVAILABLE, (method, e.value)
            assert e.value.method == method
            assert server.address in e.value.details
            assert attempts[method] - before[method] == want[method], method
        for label, (items, n) in attend_calls.items():
            before = attempts["Attend"]
            with pytest.raises(kvq.KvqError) as e:
                c.attend(items)
            assert e.value.code == grpc.StatusCode.UNAVAILABLE
            assert attempts["Attend"] - before == n, label
        assert set(codes[:killed_at]) == {grpc.StatusCode.OK}
        assert set(codes[killed_at:]) == {grpc.StatusCode.UNAVAILABLE}


def test_retry_reaches_a_restarted_server(kvq_server_factory, register_model):
    """A server restarted on the same port answers a retried call (the attempts in between
    see UNAVAILABLE): the retry loop recovers instead of failing."""
    first = kvq_server_factory(name="first")
    port = first.port
    seen = []
    with kvq.Client(first.address, max_attempts=30, initial_backoff=0.05, max_backoff=0.2,
                    on_attempt=lambda m, a, s, code: seen.append((m, a, code))) as c:
        assert c.echo(b"a") == b"a"
        first.kill()
        with pytest.raises(kvq.KvqError) as e:
            kvq.Client(first.address, max_attempts=1).echo(b"b")
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        kvq_server_factory(name="second", port=port)
        assert c.echo(b"c") == b"c"
    assert seen[-1][2] == grpc.StatusCode.OK
    assert all(code == grpc.StatusCode.UNAVAILABLE for _, _, code in seen[1:-1])


def test_deadline_exceeded_is_not_retried(kvq_server, client, register_model):
    register_model(client)
    k = rand((KV, 4096, D), 0, np.float16)
    client.put_blocks([kvq.Append("big", 0, 0, k, k, model="tiny")])
    n = []
    with kvq.Client(client.servers, max_attempts=4, on_attempt=lambda *a: n.append(a)) as c:
        # Connected first (an attempt on a channel still connecting can end as UNAVAILABLE,
        # which is retried), then the server frozen, so that the deadline surely passes: a
        # running server once answered within a 1 us deadline (gRPC rounds deadlines up to
        # the millisecond).
        assert c.echo(b"x") == b"x"
        n.clear()
        kvq_server.proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(kvq.KvqError) as e:
                list(c.get_blocks("big", deadline=0.2))
        finally:
            kvq_server.proc.send_signal(signal.SIGCONT)
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    # One GetBlocks attempt, and no call attempted twice (reading codes may first fetch the
    # basis with GetBasis, within the same deadline).
    assert [a[3] for a in n if a[0] == "GetBlocks"] == [grpc.StatusCode.DEADLINE_EXCEEDED]
    assert all(attempt == 1 for _, attempt, *_ in n), n
