"""kvq.vllm.KvqConnector in vLLM's real engine while its real kvq-server is slowed, squeezed,
killed and restarted between requests (engine_run.py pauses before a request while the test
injects the fault). One engine process, one 400-token prompt (three whole blocks and 16 tokens)
asked six times, every answer the tokens of a run without the connector (a codec whose window
keeps every token exact):

0. a miss: computed and stored whole;
1. behind 25 ms of added latency each way (a FaultProxy between engine and server): still a
   hit of all but the last token, loaded within the load deadline;
2. after other sequences filled the server's capacity, which evicted the prompt: a miss,
   recomputed and stored again;
3. with the server killed (SIGKILL): the lookup fails at once and is a miss, the save fails
   and is counted; the request is not held up to any deadline;
4. with the server restarted on the same port (empty): a miss whose save lands again (the
   client reconnects on its own);
5. a hit again.
The stalled load (a server that stops answering mid-stream) is test_engine.py's.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("vllm.config", reason="vllm is not installed in this venv: scripts/test-vllm.sh makes "
                    "the vLLM venv and runs these tests")

import kvq  # noqa: E402

from fault_proxy import FaultProxy  # noqa: E402

LAYERS = 30  # SmolLM2-135M

# Room for one stored prompt and a filler, not for a second filler: 400 tokens x 30 layers x
# 3 KV heads x 64 x (K, V) in bf16 rows (the window codec) are 9.2 MB.
CAPACITY = "24M"
# The client's longest reconnect backoff (kvq.Client's channel options: 2 s, with gRPC's 20%
# jitter): a restarted server is waited on this long, so the next request finds it.
RECONNECT_S = 2.5
LOOKUP_DEADLINE_S, SAVE_DEADLINE_S = 2.0, 10.0


def _fill(address: str, name: str, model: str, tokens: int) -> None:
    """A sequence of random K/V on every layer, as another client's would be."""
    rng = np.random.default_rng(len(name))
    with kvq.Client(address) as c:
        appends = [kvq.Append(name, layer, 0, keys=rng.standard_normal((3, tokens, 64)).astype(np.float16),
                              values=rng.standard_normal((3, tokens, 64)).astype(np.float16), model=model)
                   for layer in range(LAYERS)]
        c.put_blocks(appends)


def test_slow_squeezed_killed_and_restarted_kvq_never_fails_or_stalls_a_request(
        kvq_server_factory, engine_run, readme_ids, register_window_model, tmp_path):
    server = kvq_server_factory(name="server", capacity=CAPACITY)
    port = server.port
    proxy = FaultProxy(server.address)
    register_window_model(server.address)
    prompt = readme_ids(400)
    state = {"server": server}

    def slow() -> None:
        proxy.delay_s = 0.025

    def squeeze() -> None:
        proxy.delay_s = 0.0
        _fill(server.address, "filler-1", "smollm2-window", 400)
        _fill(server.address, "filler-2", "smollm2-window", 400)
        with kvq.Client(server.address) as c:
            assert c.stats().evictions >= 1

    def kill() -> None:
        state["server"].kill()

    def restart() -> None:
        state["server"] = kvq_server_factory(name="server", capacity=CAPACITY, port=port)
        with kvq.Client(state["server"].address) as c:
            assert c.stats().sequences == 0
            c.get_model("smollm2-window")  # the registry folder kept it
        time.sleep(RECONNECT_S)

    try:
        base = engine_run(tmp_path / "recompute", [prompt])["results"][0]
        run = engine_run(tmp_path / "faults", [prompt] * 6, kvq=proxy.address, kvq_model="smollm2-window",
                         extra={"lookup_deadline_s": LOOKUP_DEADLINE_S, "deadline_s": SAVE_DEADLINE_S},
                         faults={1: slow, 2: squeeze, 3: kill, 4: restart})
    finally:
        proxy.close()
    results = run["results"]
    assert [r["num_cached_tokens"] for r in results] == [0, 399, 0, 0, 0, 399]
    assert all(r["tokens"] == base["tokens"] for r in results)
    sched, worker = run["connector"]["scheduler"], run["connector"]["worker"]
    assert sched["lookups"] == 6 and sched["lookup_errors"] == 1  # the killed server's
    assert worker["loads"] == 2 and worker["load_errors"] == 0 and worker["loaded_tokens"] == 2 * 399
    assert worker["saves"] == 3 and worker["save_errors"] == 1  # stored at 0, 2 and 4; refused at 3
    # A dead kvq costs its retries' backoff, not the deadlines (2 s for the lookup, 10 s for
    # the save): the request with the server killed is answered well within them.
    assert results[3]["seconds"] < LOOKUP_DEADLINE_S + SAVE_DEADLINE_S / 2
