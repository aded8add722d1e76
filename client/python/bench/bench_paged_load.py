#!/usr/bin/env python3
"""The CPU cost of a vLLM load's decode and write, the two ways kvq.vllm can do it, on one
core: HeadQ codes decoded to token-major tensors and then written by vLLM's own writer
(cpu_attn_reshape_and_cache), against the same codes decoded straight into the paged cache
through the layout learned from that writer (ModelCodes.decode_into, what Client.get_blocks_into
and the connector use). No server and no engine: every layer of one prompt encoded here with
the model's shape and the server's default codec (a random orthonormal basis; the cost does
not depend on the basis values), then each way timed over --reps passes; the figure is the
median and the ratio of the two, measured in the same run.

Usage: bench_paged_load.py [--model smollm2-135m|qwen2.5-coder-0.5b] [--tokens 8064]
                           [--reps 5] [--isa vec] [--json FILE]
Run with the vLLM venv's python (scripts/vllm-venv.sh).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch

import kvq.codes
from kvq._proto.kvq.v1 import kvq_pb2

# The evaluation models' attention shapes (docs/MODEL.md): layers, KV heads, query heads, head size.
SHAPES = {"smollm2-135m": (30, 3, 9, 64), "qwen2.5-coder-0.5b": (24, 2, 14, 64)}
BLOCK = 128  # vLLM's CPU block size


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(SHAPES), default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=8064, help="tokens per layer (default 8064)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--isa", default="vec", help="vLLM's CPU KV layout to write (vec, vec16, amx)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    if args.tokens <= 0 or args.tokens % BLOCK or args.reps <= 0:
        ap.error(f"--tokens must be a positive multiple of {BLOCK} and --reps positive")
    from vllm import _custom_ops as ops

    from kvq.vllm.layout import CpuBlockLayout

    layers, kv, q, d = SHAPES[args.model]
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    basis = [np.linalg.qr(rng.standard_normal((kv, d, 4)))[0].astype(np.float32) for _ in range(layers)]
    codes = kvq.codes.ModelCodes.from_basis({"model": args.model, "version": 1, "layers": layers, "kv_heads": kv,
                                             "q_heads": q, "head_dim": d, "basis_rank": 4}, basis)
    codec = codes.default_codec
    msgs = []
    for layer in range(layers):
        print(f"\rencoding layer {layer + 1}/{layers}", end="", file=sys.stderr, flush=True)
        k, v = (rng.standard_normal((kv, args.tokens, d)).astype(np.float32) for _ in range(2))
        msg = kvq_pb2.GetBlocksResponse(layer=layer, start=0, layer_tokens=args.tokens)
        msg.encoded.CopyFrom(codes.encode(layer, k, v, codec).encoded_pb())
        msgs.append(msg)
    print(file=sys.stderr)
    blocks = args.tokens // BLOCK
    layout = CpuBlockLayout.probe(args.isa, BLOCK, d, torch.bfloat16)
    paged = layout.paged(kv)
    ids = list(range(blocks))[::-1]  # any order
    offsets = paged.block_offsets(ids)
    slots = (torch.tensor(ids)[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)
    by_writer = [torch.zeros(blocks, kv, BLOCK, 2 * d, dtype=torch.bfloat16) for _ in range(layers)]
    by_kvq = [torch.zeros_like(c) for c in by_writer]

    def through_writer() -> None:
        for m in msgs:
            k, v = codes.decode(m, codec, dtype="bf16", token_major=True)
            key_cache, value_cache = by_writer[m.layer].view(blocks, kv, 2 * BLOCK, d).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(torch.from_numpy(k).view(torch.bfloat16),
                                           torch.from_numpy(v).view(torch.bfloat16), key_cache, value_cache,
                                           slots, args.isa)

    def straight_in() -> None:
        for m in msgs:
            codes.decode_into(m, codec, by_kvq[m.layer], paged, offsets)

    times: dict[str, list[float]] = {"writer": [], "into": []}
    for rep in range(args.reps):
        print(f"\rpass {rep + 1}/{args.reps}", end="", file=sys.stderr, flush=True)
        for name, run in (("writer", through_writer), ("into", straight_in)):
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    print(file=sys.stderr)
    if not all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(by_writer, by_kvq)):
        print("bench_paged_load: the two ways wrote different bytes", file=sys.stderr)
        return 1
    writer, into = statistics.median(times["writer"]), statistics.median(times["into"])
    elements = 2 * layers * kv * args.tokens * d
    print(f"{args.model}, {args.tokens} tokens x {layers} layers, codec {codec}, isa {args.isa}, one core:")
    print(f"  decode + vLLM's writer  {1e3 * writer:7.1f} ms  ({1e9 * writer / elements:.2f} ns/element)")
    print(f"  decode_into             {1e3 * into:7.1f} ms  ({1e9 * into / elements:.2f} ns/element)")
    print(f"  decode_into / writer    {into / writer:.2f}x  (the same bytes in the cache)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "tokens": args.tokens, "layers": layers, "isa": args.isa,
                       "codec": str(codec), "writer_s": times["writer"], "into_s": times["into"],
                       "ratio": into / writer}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
