#!/usr/bin/env python3
"""Attend latency of the Python client (kvq.Client) against the C++ client (kvq-load).

Both run closed loop, one stream, against the same kvq-server (started here on a free
loopback port unless --server is given), on the same shape as kvq-load's defaults: a
synthetic model of 2 layers, 32 query heads, 8 KV heads, head_dim 128, HeadQ basis rank 16
(kvq-load registers it; the Python side uses that same registered model), --context cached
tokens per layer of random N(0,1) K/V, one f16 decode query per call ([32, 1, 128]), f16
outputs, observe=false, layers alternating. Request and response bytes are the same on both
sides (printed). Rounds alternate C++ and Python so that drift hits both.

Rows: "cpp" kvq-load's own p50/p99 (its latency includes building the request);
"python" kvq.Client.attend (numpy query in, numpy output out: request building, gRPC,
decoding); "python-stub" the generated stub with a request built once (the floor of
grpcio's Python path). Ratios are python / cpp.

Usage: bench_attend.py [--build-dir build] [--context 4096] [--requests 2000] [--rounds 2]
       [--server ADDR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import kvq

REPO = Path(__file__).resolve().parents[3]
LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM, RANK = 2, 32, 8, 128, 16
MODEL = f"kvq-load-l{LAYERS}-q{Q_HEADS}-kv{KV_HEADS}-d{HEAD_DIM}-r{RANK}"  # kvq-load's name


def percentile(samples, p):
    """Nearest rank, as kvq-load's report."""
    v = sorted(samples)
    rank = max(1, min(len(v), int(np.ceil(p / 100.0 * len(v)))))
    return v[rank - 1]


def start_server(binary: Path, workdir: Path):
    log_path = workdir / "server.log"
    (workdir / "registry").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVQ_")}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [str(binary), "--grpc-address", "127.0.0.1", "--grpc-port", "0", "--metrics-port", "-1",
             "--registry", str(workdir / "registry"), "--capacity", "2G", "--scrub-period", "0"],
            stdout=log, stderr=subprocess.STDOUT, env=env)
    import re
    end = time.monotonic() + 30
    while time.monotonic() < end:
        m = re.search(r"serving gRPC on [^ ]+:([0-9]+);", log_path.read_text())
        if m:
            return proc, f"127.0.0.1:{m.group(1)}"
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    sys.exit(f"kvq-server did not start:\n{log_path.read_text()}")


def run_cpp(load_bin: Path, server: str, context: int, requests: int, workdir: Path, rnd: int):
    out = workdir / f"load-{rnd}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVQ_")}
    cmd = [str(load_bin), "--server", server, "--concurrency", "1", "--context", str(context),
           "--requests", str(requests), "--mix", "attend", "--dtype", "f16", "--queries", "1",
           "--batch", "1", "--progress", "0", "--json", str(out), "--run-id", f"bench{rnd}"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"kvq-load failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    m = json.loads(out.read_text())["methods"]["attend"]
    return {"p50_ms": m["p50_ms"], "p99_ms": m["p99_ms"], "requests": m["requests"]}, " ".join(cmd)


def setup_python(c: kvq.Client, context: int, seq: str):
    rng = np.random.default_rng(7)
    chunk = min(context, 1024)
    k = rng.standard_normal((KV_HEADS, chunk, HEAD_DIM)).astype(np.float16)
    v = rng.standard_normal((KV_HEADS, chunk, HEAD_DIM)).astype(np.float16)
    msgs = []
    for layer in range(LAYERS):
        for t0 in range(0, context, chunk):
            n = min(chunk, context - t0)
            msgs.append([kvq.Append(seq, layer, t0, k[:, :n], v[:, :n],
                                    model=MODEL if (layer == 0 and t0 == 0) else "")])
    c.put_blocks(messages=msgs)
    return rng.standard_normal((Q_HEADS, 1, HEAD_DIM)).astype(np.float16)


def run_python(c: kvq.Client, seq: str, q: np.ndarray, requests: int, warmup: int = 50):
    lat = []
    for i in range(warmup + requests):
        item = kvq.AttendItem(seq, i % LAYERS, q, observe=False, output_dtype="f16")
        t0 = time.perf_counter()
        res = c.attend([item])
        dt = time.perf_counter() - t0
        assert res[0].outputs.shape == (Q_HEADS, 1, HEAD_DIM)
        if i >= warmup:
            lat.append(dt)
    return {"p50_ms": percentile(lat, 50) * 1e3, "p99_ms": percentile(lat, 99) * 1e3, "requests": requests}


def run_stub(c: kvq.Client, seq: str, q: np.ndarray, requests: int, warmup: int = 50):
    stub = c.stub(0)
    reqs = [kvq.client.attend_request([kvq.AttendItem(seq, l, q, observe=False, output_dtype="f16")])
            for l in range(LAYERS)]
    lat = []
    for i in range(warmup + requests):
        t0 = time.perf_counter()
        stub.Attend(reqs[i % LAYERS], timeout=10)
        dt = time.perf_counter() - t0
        if i >= warmup:
            lat.append(dt)
    return {"p50_ms": percentile(lat, 50) * 1e3, "p99_ms": percentile(lat, 99) * 1e3, "requests": requests}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--build-dir", default=str(REPO / "build"), help="C++ build folder (bin/kvq-server, bin/kvq-load)")
    ap.add_argument("--server", help="an already running kvq-server (default: start one)")
    ap.add_argument("--context", type=int, default=4096, help="cached tokens per layer (default 4096)")
    ap.add_argument("--requests", type=int, default=2000, help="measured calls per side and round (default 2000)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating C++/Python rounds (default 2)")
    ap.add_argument("--json", help="also write the results as JSON")
    a = ap.parse_args()
    bindir = Path(a.build_dir) / "bin"
    work = Path(tempfile.mkdtemp(prefix="kvq-bench-attend-"))
    proc = None
    server = a.server
    if server is None:
        proc, server = start_server(bindir / "kvq-server", work)
    try:
        rows = {"cpp": [], "python": [], "python-stub": []}
        cmd = ""
        with kvq.Client(server, deadline=30) as c:
            seq = None
            for rnd in range(a.rounds):
                r, cmd = run_cpp(bindir / "kvq-load", server, a.context, a.requests, work, rnd)
                rows["cpp"].append(r)
                if seq is None:  # the model exists now (kvq-load registered it)
                    seq = "bench-python"
                    q = setup_python(c, a.context, seq)
                    req = kvq.client.attend_request([kvq.AttendItem(seq, 0, q, observe=False, output_dtype="f16")])
                    resp = c.stub(0).Attend(req, timeout=10)
                    print(f"shape: {LAYERS} layers, q_heads {Q_HEADS}, kv_heads {KV_HEADS}, head_dim {HEAD_DIM}, "
                          f"rank {RANK}, context {a.context}, f16; Attend request {req.ByteSize()} B, "
                          f"response {resp.ByteSize()} B")
                rows["python"].append(run_python(c, seq, q, a.requests))
                rows["python-stub"].append(run_stub(c, seq, q, a.requests))
            c.delete_sequence(seq)
        print(f"C++ side: {cmd}")
        print(f"{'client':<12} {'round':>5} {'p50 ms':>8} {'p99 ms':>8}")
        for name, rs in rows.items():
            for i, r in enumerate(rs):
                print(f"{name:<12} {i:>5} {r['p50_ms']:8.3f} {r['p99_ms']:8.3f}")
        med = {n: (float(np.median([r["p50_ms"] for r in rs])), float(np.median([r["p99_ms"] for r in rs])))
               for n, rs in rows.items()}
        for n in ("python", "python-stub"):
            print(f"ratio {n}/cpp: p50 {med[n][0] / med['cpp'][0]:.2f}x, p99 {med[n][1] / med['cpp'][1]:.2f}x "
                  f"(medians over {a.rounds} rounds of {a.requests} calls)")
        if a.json:
            Path(a.json).write_text(json.dumps({"rows": rows, "medians": med, "context": a.context}, indent=2))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
