"""The README's "Use with vLLM" commands, run as written: the model registered in a real
kvq-server, vLLM's OpenAI server started with the connector (its own engine process), a
300-token completion answered, and the whole prompt stored in kvq (Stats). Only the port
is swapped for a free one; KVQ_ADDRESS names the test's server, as the block reads it."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

# Skipped where vllm is not installed (the test venv of scripts/test-python.sh).
pytest.importorskip("vllm.config", reason="vllm is not installed in this venv: scripts/test-vllm.sh makes "
                    "the vLLM venv and runs these tests")

import kvq  # noqa: E402

REPO = Path(__file__).resolve().parents[4]
LAYERS = 30  # SmolLM2-135M


def readme_block() -> str:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    m = re.search(r"<!-- readme-vllm[^>]*-->\s*```sh\n(.*?)```", text, re.S)
    assert m, "README.md has no sh block after a readme-vllm marker"
    return m.group(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return int(r.status)
    except OSError:
        return 0


def test_readme_vllm_commands_serve_and_store_in_kvq(kvq_server, vllm_model, tmp_path):
    port = _free_port()
    code = readme_block()
    assert "--port 8000" in code, "the README's port changed: update this test"
    code = code.replace("--port 8000", f"--port {port}")
    env = dict(os.environ, KVQ_ADDRESS=kvq_server.address)
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", code], cwd=REPO, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        end = time.monotonic() + 600
        while _get(f"http://127.0.0.1:{port}/health") != 200:
            if proc.poll() is not None or time.monotonic() > end:
                pytest.fail(f"the README's vLLM server did not come up:\n{log_path.read_text()[-4000:]}")
            time.sleep(1)
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(vllm_model)((REPO / "README.md").read_text()).input_ids[:300]
        body = json.dumps({"model": str(vllm_model), "prompt": ids, "max_tokens": 4, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            answer = json.loads(r.read())
        assert answer["choices"][0]["text"], answer
        assert answer["usage"]["prompt_tokens"] == 300
        with kvq.Client(kvq_server.address) as c:
            assert [m.model for m in c.list_models()] == ["smollm2"]
            stats = c.stats()
        assert stats.sequences == 1 and stats.tokens == 300 * LAYERS  # the prompt, its partial last block too
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
