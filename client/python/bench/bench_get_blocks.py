"""GetBlocks through the Python client: a long sequence read back as HeadQ codes decoded in the
client (kvq.Client's default) and as rows decoded by the server, seconds and GB/s of fp16 K+V;
and, as "stream", the same codes only received (grpc's stub, every message parsed and none
decoded): what the server and the transport cost apart from the client's decode.

What kvq.vllm's loads cost before vLLM's own writer: one sequence of --tokens tokens on every
layer of SmolLM2-135M's shape (30 layers, 3 KV heads, head_dim 64; random K/V, the calibrated
rank-4 basis tests/fixtures/frontend/basis-r4, the server's default codec) is put once, then
read back --reps times each way, alternated, in --dtype. Starts its own kvq-server
(build/bin/kvq-server unless --server-bin) on a free loopback port, the basis preloaded from
its registry folder; prints one line per way and, with --json, writes the figures.

    python client/python/bench/bench_get_blocks.py [--tokens 8000] [--reps 3] [--dtype bf16]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_hf_decode import start_server  # noqa: E402  kvq-server on a free loopback port

BASIS = REPO / "tests/fixtures/frontend/basis-r4"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8000, help="tokens per layer (8000)")
    p.add_argument("--reps", type=int, default=3, help="reads each way (3; the median is reported)")
    p.add_argument("--dtype", default="bf16", choices=["f32", "f16", "bf16"], help="dtype read back (bf16)")
    p.add_argument("--server-bin", default=str(REPO / "build/bin/kvq-server"))
    p.add_argument("--json", metavar="FILE", help="also write the figures here")
    args = p.parse_args()

    import grpc

    import kvq
    import kvq.codes
    from kvq._proto.kvq.v1 import kvq_pb2, kvq_pb2_grpc
    from kvq.tensors import dtype_enum

    manifest = json.loads((BASIS / "manifest.json").read_text())
    layers, heads, dim = manifest["layers"], manifest["kv_heads"], manifest["head_dim"]
    fp16_bytes = layers * args.tokens * heads * dim * 2 * 2
    with tempfile.TemporaryDirectory(prefix="kvq-bench-get.") as tmp:
        shutil.copytree(BASIS, Path(tmp, "registry", manifest["model"], "v1"))
        server, address = start_server(args.server_bin, tmp)
        try:
            with kvq.Client(address) as c:
                rng = np.random.default_rng(0)
                shape = (heads, args.tokens, dim)
                c.put_blocks([kvq.Append("s", layer, 0, model=manifest["model"],
                                         keys=rng.standard_normal(shape, dtype=np.float32).astype(np.float16),
                                         values=rng.standard_normal(shape, dtype=np.float32).astype(np.float16))
                              for layer in range(layers)])
                seconds: dict[str, list[float]] = {"codes": [], "rows": [], "stream": []}
                stub = kvq_pb2_grpc.KvqStub(grpc.insecure_channel(address))
                raw = kvq_pb2.GetBlocksRequest(sequence_id="s", dtype=dtype_enum(args.dtype, "dtype", "bench"),
                                               codes=True, max_block_version=kvq.codes.BLOCK_VERSION_MAX)
                for _ in range(args.reps):
                    for way in seconds:
                        t0 = time.monotonic()
                        if way == "stream":
                            got = sum(m.layer_tokens if m.start == 0 else 0 for m in stub.GetBlocks(raw))
                        else:
                            got = sum(int(b.keys.shape[1]) for b in
                                      c.get_blocks("s", dtype=args.dtype, codes=way == "codes"))
                        seconds[way].append(time.monotonic() - t0)
                        assert got == layers * args.tokens, (way, got)
        finally:
            server.terminate()
            server.wait()
    out = {"tokens": args.tokens, "layers": layers, "kv_heads": heads, "head_dim": dim, "dtype": args.dtype,
           "fp16_bytes": fp16_bytes}
    for way, ts in seconds.items():
        med = statistics.median(ts)
        out[way] = {"seconds": ts, "median_s": med, "gb_per_s": fp16_bytes / med / 1e9}
        print(f"{way:5s} {args.tokens} tokens x {layers} layers to {args.dtype}: median {med:.3f} s "
              f"({', '.join(f'{t:.3f}' for t in ts)}), {fp16_bytes / med / 1e9:.2f} GB/s of fp16 K+V")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
