"""kvq.vllm's save queue (the connector's save_buffer_mb > 0) against a real kvq-server that is
stopped (SIGSTOP) and resumed: handing a save over never waits, the pending K/V stay within the
bound, saves past it are dropped and counted, the queued ones land once the server answers, and
a failing save is counted without stopping the queue. Needs no vLLM (kvq.vllm imports the
connector only on first use)."""

from __future__ import annotations

import signal
import time

import numpy as np

import kvq
from kvq.vllm.save_queue import SaveQueue

KV, D, TOKENS = 2, 64, 256


def appends_of(name: str, seed: int):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((KV, TOKENS, D)).astype(np.float16)
    v = rng.standard_normal((KV, TOKENS, D)).astype(np.float16)
    return [kvq.Append(name, layer, 0, k, v, model="tiny") for layer in (0, 1)]


def stored_tokens(client: kvq.Client, name: str) -> int:
    """Tokens kvq holds in layer 0 of sequence `name` (0: no such sequence)."""
    try:
        return max((b.layer_tokens for b in client.get_blocks(name, [0], to_token=1)), default=0)
    except kvq.KvqError as e:
        assert e.code.name == "NOT_FOUND", e
        return 0


def test_saves_never_wait_stay_bounded_and_land_after_a_stop(kvq_server, client, register_model):
    register_model(client)
    saver_client = kvq.Client(kvq_server.address, deadline=30.0)
    one = sum(a.keys.nbytes + a.values.nbytes for a in appends_of("x", 0))
    queue = SaveQueue(limit_bytes=3 * one)
    try:
        kvq_server.proc.send_signal(signal.SIGSTOP)
        accepted, waited = [], 0.0
        for i in range(6):
            name = f"p{i}"
            batch = appends_of(name, i)
            t0 = time.monotonic()
            ok = queue.submit(lambda b=batch: saver_client.put_blocks(b), one)
            waited = max(waited, time.monotonic() - t0)
            if ok:
                accepted.append(name)
            assert queue.pending_bytes <= 3 * one
        # The first save blocks on the stopped server; two more wait behind it; three are dropped.
        assert accepted == ["p0", "p1", "p2"]
        assert queue.counts["dropped"] == 3 and queue.counts["submitted"] == 3
        assert waited < 0.5, f"a submit waited {waited:.3f} s on a stopped server"
        assert not queue.flush(timeout=0.3), "saves finished while the server was stopped"
    finally:
        kvq_server.proc.send_signal(signal.SIGCONT)
    assert queue.flush(timeout=30.0)
    assert queue.counts["done"] == 3 and queue.counts["failed"] == 0
    assert queue.counts["peak_bytes"] == 3 * one and queue.pending_bytes == 0
    for i in range(6):
        want = TOKENS if f"p{i}" in accepted else 0
        assert stored_tokens(client, f"p{i}") == want, f"p{i}"

    # A save that fails (a model kvq does not have) is counted; the next one still lands.
    bad = [kvq.Append("bad", 0, 0, appends_of("bad", 9)[0].keys, appends_of("bad", 9)[0].values,
                      model="no-such-model")]
    assert queue.submit(lambda: saver_client.put_blocks(bad), one)
    assert queue.submit(lambda: saver_client.put_blocks(appends_of("after", 7)), one)
    assert queue.close(timeout=30.0)
    assert queue.counts["failed"] == 1 and queue.counts["done"] == 4
    assert stored_tokens(client, "after") == TOKENS
    saver_client.close()


def test_a_save_larger_than_the_bound_runs_alone_and_only_alone(kvq_server, client, register_model):
    register_model(client)
    one = sum(a.keys.nbytes + a.values.nbytes for a in appends_of("x", 0))
    queue = SaveQueue(limit_bytes=one // 2)
    try:
        kvq_server.proc.send_signal(signal.SIGSTOP)
        assert queue.submit(lambda: client.put_blocks(appends_of("big0", 1)), one)
        assert not queue.submit(lambda: client.put_blocks(appends_of("big1", 2)), one)
    finally:
        kvq_server.proc.send_signal(signal.SIGCONT)
    assert queue.close(timeout=30.0)
    assert stored_tokens(client, "big0") == TOKENS and stored_tokens(client, "big1") == 0
