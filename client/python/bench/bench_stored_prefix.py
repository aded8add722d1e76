#!/usr/bin/env python3
"""What a codec costs a remote KV store's user, beside what it costs when kvq serves attention:
the perplexity of text that follows a prefix whose K/V were computed exactly and then stored as
HeadQ codes (a serving engine loading a prefix from kvq, as kvq.vllm or LMCache do: the
continuation computed in full precision over the decoded prefix), against docs/RESULTS.md's
decode-faithful protocol (every token attends over codes from its first layer on, the prefix's
own forward included) and the dense cache, on the same windows and the same scored tokens.

Protocol: WikiText-2 wiki.test.raw from token 0 (kvq.hf's read_tokens), --windows windows of
--window-len tokens, each a fresh sequence; the first half of a window is the prefix, the second
half is scored (llama.cpp's protocol: positions L/2 .. L-2 predict the next token).
  dense           transformers' DynamicCache;
  stored prefix   kvq.hf.codec_choice.stored_prefix_perplexity: the prefix computed with a dense
                  cache, every layer's K/V then encoded and decoded in-process by the codec
                  (kvq.codes: the server's blocks byte for byte, decoded as GetBlocks decodes
                  them), the scored half computed over that, its own K/V exact (what the engine
                  holds for the tokens it computes);
  decode-faithful kvq.hf.codec_choice.codec_perplexity (the codec choice's own criterion).
The basis: a kvq-calibrate output folder (GGUF or transformers channel order), registered with a
kvq-server this script starts (kvq.hf.register_basis maps it to the model's order) and read back
as kvq.codes.ModelCodes. The model runs in float32 on the CPU.

    python client/python/bench/bench_stored_prefix.py MODEL.gguf --basis DIR
        [--codecs default,headq-kv3-g128-s4-v2] [--windows 8] [--window-len 1024] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

import numpy as np

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_hf_decode import start_server  # noqa: E402  kvq-server on a free loopback port


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="checkpoint folder or .gguf file (loaded as kvq-calibrate-hf loads it)")
    p.add_argument("--basis", required=True, help="kvq-calibrate output folder (manifest.json, basis.safetensors)")
    p.add_argument("--codecs", default="default", help="comma-separated: default (the registry's) or kvq-eval names")
    p.add_argument("--text", help="default: $KVQ_DATA_DIR/wikitext-2/wiki.test.raw (../shared/data)")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--window-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4, help="windows per forward pass (4)")
    p.add_argument("--server-bin", default=str(REPO / "build/bin/kvq-server"))
    p.add_argument("--json", metavar="FILE", help="also write the rows here")
    args = p.parse_args()
    if args.windows <= 0 or args.window_len < 4 or args.batch <= 0:
        p.error("--windows and --batch must be positive, --window-len at least 4")

    import torch

    import kvq
    import kvq.codes
    import kvq.hf
    from kvq.hf.calibration import load_checkpoint, read_tokens
    from kvq.hf.codec_choice import codec_of_name, codec_perplexity, stored_prefix_perplexity

    data = Path(os.environ.get("KVQ_DATA_DIR") or REPO.parent / "shared/data")
    text = args.text or str(data / "wikitext-2/wiki.test.raw")
    config, tokenizer, lm = load_checkpoint(args.model, None, "float32", "cpu")
    ids = read_tokens(tokenizer, text, args.windows * args.window_len)[: args.windows * args.window_len]
    toks = torch.tensor(np.asarray(ids, dtype=np.int64)).view(args.windows, args.window_len)
    with tempfile.TemporaryDirectory(prefix="kvq-bench-stored.") as tmp:
        server, address = start_server(args.server_bin, tmp)
        try:
            with kvq.Client(address) as c:
                info = kvq.hf.register_basis(c, args.basis, config=config)
                codes = kvq.codes.ModelCodes(c.get_basis(info.model))
        finally:
            server.terminate()
            server.wait()
    half = args.window_len // 2

    def progress(done: int) -> None:
        print(f"\r  windows {done}/{args.windows}", end="" if done < args.windows else "\n", file=sys.stderr,
              flush=True)

    rows: List[Dict[str, Any]] = []
    t0 = time.monotonic()
    dense = stored_prefix_perplexity(lm, toks, half, batch=args.batch, on_window=progress)
    print(f"dense {dense:.4f} ({time.monotonic() - t0:.0f} s)", flush=True)
    for name in [n for n in args.codecs.split(",") if n]:
        codec = codes.default_codec if name == "default" else codes.codec(codec_of_name(name)[0])
        t0 = time.monotonic()
        stored = stored_prefix_perplexity(lm, toks, half, codes, codec, batch=args.batch, on_window=progress)
        faithful = codec_perplexity(lm, codes, codec, ids, args.windows, args.window_len, batch=args.batch)
        rows.append({"codec": name, "settings": str(codec), "dense": dense, "stored_prefix": stored,
                     "decode_faithful": faithful, "stored_vs_dense": stored / dense - 1,
                     "faithful_vs_dense": faithful / dense - 1})
        print(f"{name} ({codec}): stored prefix {stored:.4f} ({stored / dense - 1:+.2%}), decode-faithful "
              f"{faithful:.4f} ({faithful / dense - 1:+.2%}) ({time.monotonic() - t0:.0f} s)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model": Path(args.model).name, "basis": Path(args.basis).name,
            "text": "$KVQ_DATA_DIR/wikitext-2/wiki.test.raw" if not args.text else Path(args.text).name,
            "windows": args.windows, "window_len": args.window_len, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
