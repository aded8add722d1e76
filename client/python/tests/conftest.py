"""Fixtures of the Python tests: real kvq-server processes on free loopback ports.

* kvq_server_bin: the server binary ($KVQ_SERVER_BIN, else <repo>/build/bin/kvq-server);
  fails (never skips) when it is missing.
* kvq_server: one server with a fresh registry folder in tmp_path, waited for through
  grpc.health.v1 (SERVING), stopped with SIGTERM at the end of the test.
* kvq_server_factory: start(*extra_flags, metrics=False, port=0, client_kwargs=None) for
  tests that need several servers or server flags (auth tokens, TLS); every server it
  started is stopped at the end. client_kwargs: how to reach it for the health check.
  .metrics_port is None unless metrics=True.
* register_model: registers a small model with a random orthonormal basis (numpy QR).
* smollm2_gguf: the real SmolLM2-135M GGUF ($KVQ_MODEL or ~/.cache/kvq/models/...), failing
  when missing unless KVQ_ALLOW_NO_MODEL=1 (then the test is skipped).
* kvq_build_dir: the C++ build folder ($KVQ_BUILD_DIR, else the folder above the server's bin/).
* data_file(name): a file of the evaluation data folder ($KVQ_DATA_DIR, else the repository's
  sibling shared/data: the WikiText files), failing with the setting's name when it is missing.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional

import numpy as np
import pytest

import kvq

REPO = Path(__file__).resolve().parents[3]
_SERVING = re.compile(r"serving gRPC on [^ ]+:([0-9]+);(?: metrics on [^ ]+:([0-9]+)/metrics)?")
DEFAULT_MODEL = Path.home() / ".cache/kvq/models/SmolLM2-135M-Instruct.Q4_1.gguf"


def data_file(name: str) -> Path:
    """$KVQ_DATA_DIR/name (KVQ_DATA_DIR default: <repo>/../shared/data, as the C++ tests and
    tools find it); fails naming the setting when the file is not there."""
    folder = Path(os.environ.get("KVQ_DATA_DIR") or REPO.parent / "shared/data")
    path = folder / name
    if not path.is_file():
        pytest.fail(f"{path} not found: set KVQ_DATA_DIR to the data folder that holds "
                    f"wikitext-2/ (default <repo>/../shared/data)")
    return path


@dataclass
class ServerProcess:
    """A kvq-server child process listening on 127.0.0.1:port."""

    proc: subprocess.Popen
    port: int
    metrics_port: Optional[int]
    registry: Path
    log_path: Path
    args: List[str] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM (graceful drain) and wait; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL: the server goes away without draining."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def start_server(binary: Path, workdir: Path, *extra: str, capacity: str = "256M",
                 metrics: bool = False, port: int = 0, client_kwargs: Optional[dict] = None,
                 timeout: float = 30.0) -> ServerProcess:
    """Starts kvq-server (port 0: it prints the port it took) and waits until SERVING.

    metrics: also serve /metrics on a free port (off by default: its HTTP server adds
    about 1.5 s to every shutdown)."""
    workdir.mkdir(parents=True, exist_ok=True)
    registry = workdir / "registry"
    registry.mkdir(exist_ok=True)
    log_path = workdir / "server.log"
    args = [
        str(binary), "--grpc-address", "127.0.0.1", "--grpc-port", str(port),
        "--metrics-address", "127.0.0.1", "--metrics-port", "0" if metrics else "-1",
        "--registry", str(registry), "--capacity", capacity, "--workers", "2",
        "--scrub-period", "0", "--shutdown-grace", "200ms", *extra,
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVQ_")}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    end = time.monotonic() + timeout
    port = metrics = None
    while port is None:
        m = _SERVING.search(log_path.read_text(errors="replace"))
        if m:
            port = int(m.group(1))
            metrics = int(m.group(2)) if m.group(2) else None
            break
        if proc.poll() is not None or time.monotonic() > end:
            proc.kill()
            raise RuntimeError(f"kvq-server did not start ({args}):\n{log_path.read_text()}")
        time.sleep(0.02)
    server = ServerProcess(proc, port, metrics, registry, log_path, args)
    kwargs = dict(client_kwargs or {})
    kwargs.setdefault("deadline", 5.0)
    with kvq.Client(server.address, **kwargs) as c:
        while True:
            if all(serving for _, serving in c.health(deadline=2.0)):
                return server
            if proc.poll() is not None or time.monotonic() > end:
                server.kill()
                raise RuntimeError(f"kvq-server never SERVING:\n{server.log}")
            time.sleep(0.05)


@pytest.fixture(scope="session")
def kvq_server_bin() -> Path:
    path = Path(os.environ.get("KVQ_SERVER_BIN") or REPO / "build/bin/kvq-server")
    if not path.is_file() or not os.access(path, os.X_OK):
        pytest.fail(f"kvq-server not found at {path}: build it (scripts/test.sh) or set "
                    "KVQ_SERVER_BIN")
    return path


@pytest.fixture(scope="session")
def kvq_build_dir(kvq_server_bin: Path) -> Path:
    """The C++ build folder: $KVQ_BUILD_DIR, else the one holding the server's bin/."""
    d = os.environ.get("KVQ_BUILD_DIR")
    return Path(d) if d else kvq_server_bin.parent.parent


@pytest.fixture
def kvq_server_factory(kvq_server_bin: Path, tmp_path: Path):
    started: List[ServerProcess] = []

    def start(*extra: str, name: Optional[str] = None, **kw) -> ServerProcess:
        s = start_server(kvq_server_bin, tmp_path / (name or f"server{len(started)}"), *extra, **kw)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


@pytest.fixture
def kvq_server(kvq_server_factory) -> ServerProcess:
    return kvq_server_factory()


@pytest.fixture
def client(kvq_server: ServerProcess):
    with kvq.Client(kvq_server.address, deadline=10.0) as c:
        yield c


@dataclass
class TinyModel:
    """A registered test model and its basis (one [kv_heads, head_dim, rank] per layer)."""

    name: str
    layers: int
    kv_heads: int
    q_heads: int
    head_dim: int
    rank: int
    basis: List[np.ndarray]
    info: object = None


def random_basis(layers: int, kv_heads: int, head_dim: int, rank: int, seed: int) -> List[np.ndarray]:
    """Orthonormal columns per head: Q of the QR factorisation of a Gaussian matrix."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(layers):
        heads = [np.linalg.qr(rng.standard_normal((head_dim, rank)))[0] for _ in range(kv_heads)]
        out.append(np.stack(heads).astype(np.float32))
    return out


def register_tiny(client: kvq.Client, name: str = "tiny", *, layers: int = 2, kv_heads: int = 2,
                  q_heads: int = 4, head_dim: int = 64, rank: int = 8, codec_rank: int = 4,
                  seed: int = 1, codec: Optional[kvq.CodecSettings] = None) -> TinyModel:
    basis = random_basis(layers, kv_heads, head_dim, rank, seed) if rank > 0 else []
    info = {
        "model": name, "version": 1, "layers": layers, "kv_heads": kv_heads,
        "q_heads": q_heads, "head_dim": head_dim, "basis_rank": rank, "kind": "random",
    }
    if codec is not None:
        info["codec"] = codec
    elif rank > 0:
        info["codec"] = kvq.CodecSettings(rank=codec_rank)
    resp = client.register_basis(info, basis)
    return TinyModel(name, layers, kv_heads, q_heads, head_dim, rank, basis, resp.model)


@pytest.fixture
def register_model() -> Callable[..., TinyModel]:
    """register_model(client, name="tiny", layers=2, kv_heads=2, q_heads=4, head_dim=64,
    rank=8, codec_rank=4, seed=1, codec=None) -> TinyModel."""
    return register_tiny


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    path = Path(os.environ.get("KVQ_MODEL") or DEFAULT_MODEL)
    if not path.is_file():
        msg = f"SmolLM2 GGUF not found at {path}: run scripts/fetch-model.sh (or set KVQ_MODEL)"
        if os.environ.get("KVQ_ALLOW_NO_MODEL") == "1":
            pytest.skip(msg)
        pytest.fail(msg)
    return path


# -- Prometheus samples of a server started with metrics=True --------------------------------
def metric(server, name: str, **labels: str) -> float:
    """One Prometheus sample of the server (0 when the series does not exist yet)."""
    assert server.metrics_port is not None, "start the server with metrics=True"
    port = server.metrics_port
    txt = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in txt.splitlines():
        m = re.fullmatch(r"([a-z_]+)(?:\{(.*)\})? (\S+)", line)
        if m and m.group(1) == name and dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")) == labels:
            return float(m.group(3))
    return 0.0


def metric_at_least(server, minimum: float, name: str, **labels: str) -> float:
    """The sample once it reaches `minimum` (or its value after 10 s): the server records a
    call in its metrics when the call finishes on its side, which may be just after the
    client has read the whole reply."""
    end = time.monotonic() + 10
    while (v := metric(server, name, **labels)) < minimum and time.monotonic() < end:
        time.sleep(0.02)
    return v
