"""kvq.vllm.KvqConnector on a third architecture in vLLM's real engine: Qwen3 (per-head RMSNorm
of q and k before RoPE), which kvq's own frontend does not run.

No Qwen3 checkpoint can be had from the package registries here (tests/test_third_architecture.py
lists what was tried), so the model is a small randomly initialised Qwen3 made by transformers
with SmolLM2's tokenizer: plumbing, not quality. A repeated 384-token prompt (three whole
blocks): the first request stores them in kvq, the second takes two from it (vLLM computes a
prompt's last token itself), and with a codec whose window keeps every token exact both
generate exactly the tokens of an engine run without the connector. The calibrate-register-
serve path of the same architecture through kvq.hf is tests/test_third_architecture.py.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm.config", reason="vllm is not installed in this venv: scripts/test-vllm.sh makes "
                    "the vLLM venv and runs these tests")

import torch  # noqa: E402
import transformers  # noqa: E402

import kvq  # noqa: E402
import kvq.hf  # noqa: E402

LAYERS = 2


def test_qwen3_prefix_from_kvq_matches_recompute(vllm_model, kvq_server, engine_run, tmp_path):
    tok = transformers.AutoTokenizer.from_pretrained(vllm_model)
    config = transformers.Qwen3Config(vocab_size=len(tok), hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True)
    torch.manual_seed(0)
    folder = tmp_path / "qwen3-tiny"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    with kvq.Client(kvq_server.address) as c:
        info = kvq.hf.register_model(c, transformers.AutoConfig.from_pretrained(folder), "qwen3-window",
                                     codec=kvq.CodecSettings(window=4096))
    assert (info.layers, info.q_heads, info.kv_heads, info.head_dim) == (LAYERS, 4, 2, 64)
    readme = os.path.join(os.path.dirname(__file__), "../../../../README.md")
    with open(readme) as f:
        prompt = list(tok(f.read()).input_ids[:384])
    base = engine_run(tmp_path / "recompute", [prompt], model=folder)["results"][0]
    run = engine_run(tmp_path / "kvq", [prompt, prompt], model=folder, kvq=kvq_server.address,
                     kvq_model="qwen3-window")
    first, second = run["results"]
    assert first["num_cached_tokens"] == 0 and second["num_cached_tokens"] == 383
    worker = run["connector"]["worker"]
    assert worker["saved_tokens"] == 384 and worker["loaded_tokens"] == 383 and worker["load_errors"] == 0
    with kvq.Client(kvq_server.address) as c:
        assert c.stats().tokens == 384 * LAYERS
    assert first["tokens"] == base["tokens"] and second["tokens"] == base["tokens"]
