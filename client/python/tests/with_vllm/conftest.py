"""Fixtures of kvq.vllm's tests, which run in the vLLM venv (scripts/test-vllm.sh makes it and
runs them); the parent folder's conftest (real kvq-server processes) applies too.

* vllm_model: the SmolLM2-135M transformers folder vLLM serves ($KVQ_VLLM_MODEL, set by
  scripts/test-vllm.sh from scripts/vllm-model.sh).
* engine_run(tmp_path, prompts, model=None, **flags): runs engine_run.py in its own process
  (on `model`, default vllm_model), returns its JSON (generated ids, num_cached_tokens,
  connector counters) and its log ("log").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import pytest

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def vllm_model() -> Path:
    folder = os.environ.get("KVQ_VLLM_MODEL")
    if not folder or not (Path(folder) / "config.json").is_file():
        pytest.fail(f"KVQ_VLLM_MODEL={folder!r} is not a transformers folder: run scripts/test-vllm.sh "
                    "(scripts/vllm-model.sh converts the GGUF once)")
    return Path(folder)


@pytest.fixture
def engine_run(vllm_model: Path) -> Callable[..., Dict[str, Any]]:
    def run(workdir: Path, prompts: List[List[int]], model: Optional[Path] = None, **flags: Any) -> Dict[str, Any]:
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "prompts.json").write_text(json.dumps(prompts))
        args = [sys.executable, str(HERE / "engine_run.py"), "--model", str(model or vllm_model),
                "--prompts", str(workdir / "prompts.json"), "--out", str(workdir / "out.json")]
        for k, v in flags.items():
            args += [f"--{k.replace('_', '-')}", v if isinstance(v, str) else json.dumps(v)]
        with open(workdir / "engine.log", "wb") as log:
            rc = subprocess.run(args, stdout=log, stderr=subprocess.STDOUT, timeout=600).returncode
        if rc != 0:
            tail = (workdir / "engine.log").read_text(errors="replace")[-4000:]
            pytest.fail(f"engine_run.py exited {rc}:\n{tail}")
        out: Dict[str, Any] = json.loads((workdir / "out.json").read_text())
        out["log"] = (workdir / "engine.log").read_text(errors="replace")
        return out

    return run
