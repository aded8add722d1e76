"""The README's Python example, run as written against a real kvq-server.

The code block after the `readme-example` marker in the repository's README.md is executed in
a fresh interpreter from the repository root (its basis path is relative to it), with
KVQ_ADDRESS naming the test's server; only the model path is swapped for the fixture's when
the model lives elsewhere. So the example a user copies is the one that is tested.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import kvq

from conftest import metric_at_least

REPO = Path(__file__).resolve().parents[3]
DEFAULT_GGUF = 'os.path.expanduser("~/.cache/kvq/models/SmolLM2-135M-Instruct.Q4_1.gguf")'
PROMPT = "The capital of France is"


def readme_example() -> str:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    m = re.search(r"<!-- readme-example[^>]*-->\s*```python\n(.*?)```", text, re.S)
    assert m, "README.md has no python block after a readme-example marker"
    return m.group(1)


def test_readme_example_generates_through_kvq(kvq_server_factory, smollm2_gguf):
    kvq_server = kvq_server_factory(metrics=True)
    code = readme_example()
    assert DEFAULT_GGUF in code, "the example's model path changed: update this test"
    code = code.replace(DEFAULT_GGUF, repr(str(smollm2_gguf)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVQ_")}
    env["KVQ_ADDRESS"] = kvq_server.address
    env["OMP_NUM_THREADS"] = "1"  # torch on one thread: two cores are shared with the server
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    lines = run.stdout.strip().splitlines()
    assert lines and lines[0].startswith(PROMPT), run.stdout
    assert len(run.stdout.strip()) > len(PROMPT) + 8, "no tokens generated"
    # Attention ran in the server: one Attend per layer for each forward (the prompt, then
    # each decode step until 32 tokens or the end-of-turn token; this prompt gives 30), the
    # basis the example registered is in the registry, and leaving the `with` block deleted
    # the sequence.
    layers = 30
    attends = metric_at_least(kvq_server, layers * 16, "kvq_requests_total", method="Attend",
                              code="OK")
    assert attends >= layers * 16 and attends % layers == 0, attends
    with kvq.Client(kvq_server.address) as c:
        assert any(m.has_basis for m in c.list_models())
        assert c.stats().sequences == 0
