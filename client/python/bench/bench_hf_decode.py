#!/usr/bin/env python3
"""Decode tokens/s of a transformers model (SmolLM2-135M GGUF) with attention through kvq
(kvq.hf: one Attend per layer and step carrying the new token's K/V) against transformers'
own sdpa attention with its DynamicCache, in the same process; the share of the decode time
spent inside the Attend calls; the bytes sent and received per decode step.

Bytes: gRPC has no byte counter, so the bench wraps the client's Attend stub and adds up the
serialized sizes of every request and response message (protobuf ByteSize: the payload gRPC
frames; HTTP/2 and gRPC framing, about 5-9 bytes a message plus headers, are not counted).

Both paths decode the same greedy tokens from the same prompt: first the prompt's prefill
(not timed), then --new-tokens single-token forwards, timed as a whole. Repeated --reps
times, alternating sdpa and kvq; the medians are reported.

Usage: bench_hf_decode.py [--server ADDR | --server-bin PATH] [--model GGUF] [--basis DIR]
                          [--config NAME] [--prompt-tokens N] [--new-tokens N] [--batch B]
                          [--reps R] [--threads T] [--json FILE]
Without --server it starts kvq-server (build/bin/kvq-server, or --server-bin) on a free
loopback port with a temporary registry, and stops it at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def start_server(binary: str, workdir: str):
    log = open(os.path.join(workdir, "server.log"), "wb")
    reg = os.path.join(workdir, "registry")
    os.makedirs(reg, exist_ok=True)
    p = subprocess.Popen([binary, "--grpc-address", "127.0.0.1", "--grpc-port", "0",
                          "--metrics-port", "-1", "--registry", reg, "--memory", "host",
                          "--workers", "2", "--capacity", "1G"], stdout=log, stderr=subprocess.STDOUT)
    end = time.monotonic() + 30
    pat = re.compile(r"serving gRPC on [^ ]+:([0-9]+)")
    while time.monotonic() < end:
        m = pat.search(open(log.name, errors="replace").read())
        if m:
            return p, f"127.0.0.1:{m.group(1)}"
        if p.poll() is not None:
            break
        time.sleep(0.05)
    p.kill()
    raise SystemExit(f"kvq-server did not start: {open(log.name).read()}")


class ByteCounter:
    """Wraps a stub's Attend: serialized request/response bytes per call."""

    def __init__(self, stub):
        self.sent = self.received = self.calls = 0
        inner = stub.Attend

        def attend(req, **kw):
            resp = inner(req, **kw)
            self.sent += req.ByteSize()
            self.received += resp.ByteSize()
            self.calls += 1
            return resp

        stub.Attend = attend

    def reset(self):
        self.sent = self.received = self.calls = 0


def decode(model, ids, cache, n_new, counter=None):
    """Greedy: the prompt's prefill (not timed, its bytes not counted), then n_new
    one-token forwards, timed. Returns (tokens, seconds, seconds inside Attend)."""
    import torch

    stats = getattr(cache, "stats", None)
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        toks = [nxt]
        if counter:
            counter.reset()
        rpc0 = stats.rpc_seconds if stats else 0.0
        t0 = time.perf_counter()
        for _ in range(n_new):
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            toks.append(nxt)
        dt = time.perf_counter() - t0
    return torch.cat(toks, 1), dt, (stats.rpc_seconds - rpc0) if stats else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", help="a running kvq server (host:port); default: start one")
    ap.add_argument("--server-bin", default=str(REPO / "build/bin/kvq-server"))
    ap.add_argument("--model", default=os.environ.get("KVQ_MODEL") or os.path.expanduser(
        "~/.cache/kvq/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--basis", default=str(REPO / "tests/fixtures/frontend/basis-r4"),
                    help="kvq-calibrate output (registered through kvq.hf.register_basis)")
    ap.add_argument("--config", default="headq-kv2", help="codec, as a kvq-eval config name")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--kv-dtype", default="f16", choices=("f16", "bf16", "f32"))
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    import kvq
    import kvq.hf
    from kvq.hf.eval import parse_config

    torch.set_num_threads(a.threads)
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(os.path.abspath(a.model)),
                                                 gguf_file=os.path.basename(a.model))
    model.eval()
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(100, 20000, (a.batch, a.prompt_tokens), generator=g)
    codec = parse_config(a.config)

    proc = None
    tmp = tempfile.mkdtemp(prefix="bench-hf-")
    server = a.server
    if not server:
        proc, server = start_server(a.server_bin, tmp)
    try:
        with kvq.Client(server, deadline=60.0) as client:
            info = kvq.hf.register_basis(client, a.basis, model)
            counter = ByteCounter(client.stub(0))
            res = {"sdpa": [], "kvq": [], "rpc": [], "sent": [], "received": []}
            same = True
            # Warm-up (first-call costs of torch and the channel), not measured.
            kvq.hf.disable(model, "sdpa")
            decode(model, ids, DynamicCache(config=model.config), 2)
            kvq.hf.enable(model)
            with kvq.hf.KvqCache(client, info, batch_size=a.batch, codec=codec) as cache:
                decode(model, ids, cache, 2)
            for r in range(a.reps):
                kvq.hf.disable(model, "sdpa")
                t_ref, dt, _ = decode(model, ids, DynamicCache(config=model.config), a.new_tokens)
                res["sdpa"].append(a.batch * a.new_tokens / dt)
                kvq.hf.enable(model)
                with kvq.hf.KvqCache(client, info, batch_size=a.batch, codec=codec,
                                     kv_dtype=a.kv_dtype) as cache:
                    t_kvq, dt, rpc = decode(model, ids, cache, a.new_tokens, counter)
                res["kvq"].append(a.batch * a.new_tokens / dt)
                res["rpc"].append(rpc / dt)
                res["sent"].append(counter.sent / a.new_tokens)
                res["received"].append(counter.received / a.new_tokens)
                same = same and bool(torch.equal(t_ref, t_kvq))
                print(f"rep {r + 1}: sdpa {res['sdpa'][-1]:.1f} tok/s, kvq {res['kvq'][-1]:.1f} tok/s "
                      f"(RPC {res['rpc'][-1]:.0%}), {res['sent'][-1]:.0f} B sent / "
                      f"{res['received'][-1]:.0f} B received per step", file=sys.stderr, flush=True)
    finally:
        if proc:
            proc.send_signal(signal.SIGTERM)
            proc.wait(15)
    med = {k: statistics.median(v) for k, v in res.items()}
    layers = model.config.num_hidden_layers
    summary = {
        "model": os.path.basename(a.model), "config": a.config, "kv_dtype": a.kv_dtype,
        "batch": a.batch, "prompt_tokens": a.prompt_tokens, "new_tokens": a.new_tokens,
        "reps": a.reps, "threads": a.threads,
        "sdpa_tokens_per_s": med["sdpa"], "kvq_tokens_per_s": med["kvq"],
        "kvq_over_sdpa": med["kvq"] / med["sdpa"], "rpc_share": med["rpc"],
        "bytes_sent_per_step": med["sent"], "bytes_received_per_step": med["received"],
        "attend_calls_per_step": layers, "same_tokens_as_sdpa": same,
    }
    print(f"SmolLM2-135M, {a.config} ({a.kv_dtype} K/V), batch {a.batch}, prompt {a.prompt_tokens}, "
          f"{a.new_tokens} decode steps, median of {a.reps}:")
    print(f"  sdpa (in-process DynamicCache): {med['sdpa']:.1f} tokens/s")
    print(f"  kvq (KvqCache, {layers} Attend calls per step): {med['kvq']:.1f} tokens/s "
          f"({med['kvq'] / med['sdpa']:.2f}x sdpa), {med['rpc']:.0%} of the decode time in Attend")
    print(f"  per decode step: {med['sent']:.0f} bytes sent, {med['received']:.0f} bytes received "
          f"({med['sent'] / layers:.0f} / {med['received'] / layers:.0f} per layer)")
    print(f"  greedy tokens equal to sdpa's: {same} (a lossy codec may change them)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
