"""Fixtures of kvq.vllm's tests, which run in the vLLM venv (scripts/test-vllm.sh makes it and
runs them); the parent folder's conftest (real kvq-server processes) applies too.

* vllm_model: the SmolLM2-135M transformers folder vLLM serves ($KVQ_VLLM_MODEL, set by
  scripts/test-vllm.sh from scripts/vllm-model.sh).
* engine_run(tmp_path, prompts, model=None, faults=None, **flags): runs engine_run.py in its own
  process (on `model`, default vllm_model), returns its JSON (generated ids, num_cached_tokens,
  connector counters) and its log ("log"). faults: {request index: callable}, each called
  while the engine waits before that request (engine_run.py --pause-before).
* readme_ids(n): the first n token ids of a fixed English text (this repository's README).
* register_window_model(address): registers SmolLM2 as "smollm2-window" (no basis; a window of
  4096 keeps every token exact, so a hit generates the tokens of recomputing).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
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
    def run(workdir: Path, prompts: List[Any], model: Optional[Path] = None,
            faults: Optional[Dict[int, Callable[[], None]]] = None, **flags: Any) -> Dict[str, Any]:
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "prompts.json").write_text(json.dumps(prompts))
        args = [sys.executable, str(HERE / "engine_run.py"), "--model", str(model or vllm_model),
                "--prompts", str(workdir / "prompts.json"), "--out", str(workdir / "out.json")]
        for k, v in flags.items():
            args += [f"--{k.replace('_', '-')}", v if isinstance(v, str) else json.dumps(v)]
        todo = dict(faults or {})
        if todo:
            args += ["--pause-before", ",".join(map(str, sorted(todo))), "--handshake", str(workdir)]
        with open(workdir / "engine.log", "wb") as log:
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
            end = time.monotonic() + 600
            try:
                while proc.poll() is None:
                    for i in [i for i in todo if (workdir / f"ready-{i}").exists()]:
                        todo.pop(i)()
                        (workdir / f"go-{i}").touch()
                    if time.monotonic() > end:
                        pytest.fail("engine_run.py ran past 600 s")
                    time.sleep(0.05)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        rc = proc.returncode
        if rc != 0:
            tail = (workdir / "engine.log").read_text(errors="replace")[-4000:]
            pytest.fail(f"engine_run.py exited {rc}:\n{tail}")
        out: Dict[str, Any] = json.loads((workdir / "out.json").read_text())
        out["log"] = (workdir / "engine.log").read_text(errors="replace")
        return out

    return run


@pytest.fixture
def readme_ids(vllm_model: Path) -> Callable[[int], List[int]]:
    def ids(n: int) -> List[int]:
        from transformers import AutoTokenizer

        text = (HERE.parents[3] / "README.md").read_text()
        got = AutoTokenizer.from_pretrained(vllm_model)(text).input_ids
        assert len(got) >= n
        return list(got[:n])

    return ids


@pytest.fixture
def register_window_model(vllm_model: Path) -> Callable[[str], None]:
    def register(address: str) -> None:
        from transformers import AutoConfig

        import kvq
        import kvq.hf

        with kvq.Client(address) as c:
            kvq.hf.register_model(c, AutoConfig.from_pretrained(vllm_model), "smollm2-window",
                                  codec=kvq.CodecSettings(window=4096))

    return register
