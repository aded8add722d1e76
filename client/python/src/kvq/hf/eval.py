"""Perplexity of a transformers model attending through kvq, with kvq-eval's protocol.

The protocol of `kvq-eval --kv remote=ADDR` (frontend/README.md, llama.cpp's):
consecutive windows of L tokens from token 0, each a fresh sequence with no BOS; the logits
at positions L/2 .. L-2 score the next token (L/2 - 1 tokens per window). Decoded token by
token (one forward per position, as kvq-eval's default `--kv-decode token`), so every query
sees the encoded / arrival-precision split of one-token-at-a-time decoding; the windows of
a batch go in lockstep, one Attend per layer and step for all of them. K/V go as fp16, as
kvq-eval sends them.

    python -m kvq.hf.eval --server ADDR --basis DIR --tokens FILE --windows 2 --window-len 256

`--tokens` is a file of token ids, one per line: `kvq-eval --dump-tokens F` writes the ids of
its text, so both implementations score the very same tokens (the tokenizers are not what
is compared).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

__all__ = ["decode_perplexity", "parse_config", "main"]


def parse_config(name: str):
    """The kvq-eval configuration names this tool reproduces: headq-kv<bits>[-r<N>][-g<G>]
    [-vg<N>][-w<R>][-s<bits>] and kivi-kv<bits>[...] (uniform values; defaults G=32, vg=32,
    R=0, s=8, rank 4 for headq). Returns kvq.CodecSettings as kvq-eval sends them."""
    from ..types import CodecSettings

    parts = name.split("-")
    if len(parts) < 2 or parts[0] not in ("headq", "kivi") or not parts[1].startswith("kv"):
        raise ValueError(f"config '{name}': expected headq-kv<bits>[...] or kivi-kv<bits>[...]")
    bits = int(parts[1][2:])
    c: Dict[str, Any] = dict(key_bits=bits, key_group=32, rank=4 if parts[0] == "headq" else 0, side_bits=8,
                             value_bits=bits, value_group=32, value_policy="uniform", window=0)
    for p in parts[2:]:
        for prefix, key in (("vg", "value_group"), ("r", "rank"), ("g", "key_group"),
                            ("w", "window"), ("s", "side_bits"), ("v", "value_bits")):
            if p.startswith(prefix) and p[len(prefix):].isdigit():
                c[key] = int(p[len(prefix):])
                break
        else:
            raise ValueError(f"config '{name}': option '{p}' is not reproduced here")
    return CodecSettings(**c)


def decode_perplexity(
    model: Any,
    client: Any,
    info: Any,
    tokens: Sequence[int],
    windows: int,
    window_len: int,
    codec: Any,
    *,
    batch: int = 8,
    kv_dtype: str = "f16",
    progress: bool = False,
) -> Dict[str, Any]:
    """Token-by-token perplexity through kvq (see the module docstring). Returns
    {"ppl", "nll" (per window, summed), "scored", "seconds", "steps", "rpc_seconds"}."""
    import torch

    from .attention import cache_kwarg
    from .cache import KvqCache

    cache_arg = cache_kwarg(model)
    if windows * window_len > len(tokens):
        raise ValueError(f"text has {len(tokens)} tokens, need {windows * window_len}")
    first = window_len // 2
    nll = [0.0] * windows
    toks = torch.tensor(np.asarray(tokens[: windows * window_len], dtype=np.int64)).view(windows, window_len)
    t0 = time.perf_counter()
    rpc = 0.0
    steps = 0
    for w0 in range(0, windows, batch):
        nb = min(batch, windows - w0)
        with KvqCache(client, info, batch_size=nb, codec=codec, kv_dtype=kv_dtype) as cache, torch.no_grad():
            for p in range(window_len - 1):
                out = model(input_ids=toks[w0 : w0 + nb, p : p + 1], use_cache=True, **{cache_arg: cache})
                steps += 1
                if p >= first:
                    lp = torch.log_softmax(out.logits[:, -1].double(), dim=-1)
                    for b in range(nb):
                        nll[w0 + b] -= float(lp[b, toks[w0 + b, p + 1]])
            rpc += cache.stats.rpc_seconds
        if progress:
            print(f"windows {w0 + nb}/{windows}: ppl so far "
                  f"{math.exp(sum(nll[: w0 + nb]) / ((w0 + nb) * (window_len - 1 - first))):.4f}",
                  file=sys.stderr, flush=True)
    scored = windows * (window_len - 1 - first)
    return {"ppl": math.exp(sum(nll) / scored), "nll": nll, "scored": scored,
            "seconds": time.perf_counter() - t0, "steps": steps, "rpc_seconds": rpc}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m kvq.hf.eval",
        description="Perplexity of a GGUF model in transformers whose attention runs on a kvq "
                    "server, with kvq-eval --kv remote's protocol (token-by-token decode, fp16 K/V).")
    ap.add_argument("--server", required=True, help="kvq server address (host:port)")
    ap.add_argument("--model", default=os.environ.get("KVQ_MODEL") or os.path.expanduser(
        "~/.cache/kvq/models/SmolLM2-135M-Instruct.Q4_1.gguf"), help="GGUF file")
    ap.add_argument("--basis", help="kvq-calibrate output folder (needed by headq configs)")
    ap.add_argument("--tokens", required=True, help="token ids, one per line (kvq-eval --dump-tokens)")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--window-len", type=int, default=256)
    ap.add_argument("--config", default="headq-kv2", help="kvq-eval configuration name")
    ap.add_argument("--batch", type=int, default=8, help="windows decoded in lockstep")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    a = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    import kvq

    from . import enable, register_basis, register_model

    torch.set_num_threads(a.threads)
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(os.path.abspath(a.model)),
                                                 gguf_file=os.path.basename(a.model))
    model.eval()
    codec = parse_config(a.config)
    with open(a.tokens) as f:
        tokens = [int(x) for x in f.read().split()]
    with kvq.Client(a.server, deadline=60.0) as client:
        if a.basis:
            info = register_basis(client, a.basis, model)
        else:
            info = register_model(client, model.config, "hf-eval-nobasis")
        enable(model)
        r = decode_perplexity(model, client, info, tokens, a.windows, a.window_len, codec,
                              batch=a.batch, progress=True)
    print(f"{a.config}: ppl {r['ppl']:.4f} over {a.windows} x {a.window_len} "
          f"({r['scored']} scored tokens), {r['steps']} steps in {r['seconds']:.1f} s, "
          f"rpc {r['rpc_seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
