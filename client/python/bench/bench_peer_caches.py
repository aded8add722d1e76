"""The quantized KV caches a transformers user would pick instead of kvq, on kvq's protocol:
transformers' QuantizedCache with the quanto backend (2 and 4 bits) and the HQQ backend (2, 3
and 4 bits), at transformers' defaults (q_group_size 64, residual_length 128, axis_key 0,
axis_value 0), and TurboQuant (random rotation + Lloyd-Max codebook; the PyPI package
turboquant 0.2.0's TurboQuantCache, pure torch, 3 and 4 bits, its 128-token residual), beside
the dense cache and, given a kvq-calibrate-hf entry, kvq's codecs through the same forward pass
(kvq.hf.codec_choice.codec_perplexity: kvq's native codec in-process).

Protocol (docs/RESULTS.md's): WikiText-2 wiki.test.raw from token 0 (kvq.hf's read_tokens:
the GGUF's tokenizer in transformers), --windows consecutive windows of --window-len tokens,
each a fresh sequence, the second half of each window scored (llama.cpp's). Decode-faithful:
QuantizedCache quantizes the first token at its first call and re-quantizes everything it holds
whenever its full-precision residual reaches residual_length tokens, so each window is fed as
1 token, then pieces of residual_length tokens, which are the points where token-by-token
decoding re-quantizes: every query sees the quantized / full-precision split decoding would
give it. Bits: every stored tensor of every layer at the end of the window (the quantized
codes at their stored width, scales and zero points, the full-precision residual rows),
floating tensors counted at 16 bits (a fp16/bf16 deployment; this run keeps them in float32),
per K/V element; "bits/elem" is (K + V) / 2 as kvq's rows. TurboQuantCache stores its b-bit
indices one per uint8 and its per-token norms in float32: counted so (16 bits for the norms),
and also with the indices packed at b bits (packed_bits_per_element, the method's own count).

Needs optimum-quanto, hqq and turboquant in the venv (`pip install optimum-quanto==0.2.7
hqq==0.2.8.post1 turboquant==0.2.0 ninja einops termcolor scipy`, with --no-deps for the first
three so that the venv's torch and transformers stay; quanto compiles its CPU extension on
first use).

    python client/python/bench/bench_peer_caches.py MODEL.gguf [--entry DIR --kvq A,B] [--json FILE]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

REPO = Path(__file__).resolve().parents[3]
PEERS = {"quanto-int2": ("quanto", 2), "quanto-int4": ("quanto", 4), "hqq-2": ("hqq", 2), "hqq-3": ("hqq", 3),
         "hqq-4": ("hqq", 4), "turboquant-3": ("turboquant", 3), "turboquant-4": ("turboquant", 4)}
TURBOQUANT_RESIDUAL = 128  # turboquant 0.2.0's TurboQuantLayer default (residual_len)


def pieces(window_len: int, residual: int) -> List[Tuple[int, int]]:
    """(position, length) of the feed of one window's first window_len - 1 tokens: 1 token, then
    residual_length at a time (the points where QuantizedCache re-quantizes in decoding)."""
    out, pos, end = [(0, 1)], 1, window_len - 1
    while pos < end:
        out.append((pos, min(residual, end - pos)))
        pos += residual
    return out


def sliding_pieces(window_len: int, residual: int) -> List[Tuple[int, int]]:
    """TurboQuantCache's feed: its first `residual` tokens at once (none is quantized before the
    window of full-precision rows overflows), then one token at a time, because it quantizes
    the oldest rows as soon as they leave the window, before the new ones attend."""
    return [(0, min(residual, window_len - 1))] + [(p, 1) for p in range(residual, window_len - 1)]


def turboquant_bits(cache: Any, bits: int, batch: int, kv_heads: int, head_dim: int) -> Tuple[float, float, float]:
    """K and V bits per element as stored (indices in uint8, norms float, residual rows at 16
    bits), and K+V / 2 with the indices packed at `bits` (what the method's bit count assumes)."""
    kb = vb = packed = elements = 0
    for layer in cache.layers:
        k = tensors_bits(layer._key_indices, set()) + tensors_bits(layer._key_norms, set())
        v = tensors_bits(layer._value_indices, set()) + tensors_bits(layer._value_norms, set())
        r = tensors_bits(layer._residual_keys, set())
        kb += k + r
        vb += v + r
        idx = layer._key_indices.numel() + layer._value_indices.numel()
        packed += idx * bits + 16 * (layer._key_norms.numel() + layer._value_norms.numel()) + 2 * r
        elements += batch * kv_heads * layer._total_len * head_dim
    return kb / elements, vb / elements, packed / (2 * elements)


def tensors_bits(obj: Any, seen: set) -> int:
    """Bits of every tensor reachable from obj (attributes, dicts, lists), floats counted at 16
    bits, integers at their stored width."""
    import torch

    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor) and hasattr(obj, "__tensor_flatten__"):  # quanto's packed tensors
        names, _ = obj.__tensor_flatten__()
        return sum(tensors_bits(getattr(obj, n), seen) for n in names)
    if isinstance(obj, torch.Tensor):
        return obj.numel() * (16 if obj.is_floating_point() else obj.element_size() * 8)
    if isinstance(obj, dict):
        items: Sequence[Any] = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif hasattr(obj, "__dict__"):
        items = list(vars(obj).values())
    else:
        return 0
    return sum(tensors_bits(x, seen) for x in items)


def cache_bits(cache: Any, batch: int, kv_heads: int, head_dim: int) -> Tuple[float, float]:
    """K and V bits per element of a QuantizedCache at its current length: the quantized part
    and the full-precision residual rows."""
    kb = vb = elements = 0
    for layer in cache.layers:
        kb += tensors_bits(layer._quantized_keys, set()) + tensors_bits(layer.keys, set())
        vb += tensors_bits(layer._quantized_values, set()) + tensors_bits(layer.values, set())
        elements += batch * kv_heads * layer.cumulative_length * head_dim
    return kb / elements, vb / elements


def quantized_bits(cache: Any, batch: int, kv_heads: int, head_dim: int) -> float:
    """Bits per element of the quantized part alone (codes, scales, zero points), K and V
    together: what the cache costs once the context is long enough for the residual not to
    count."""
    bits = elements = 0
    for layer in cache.layers:
        bits += tensors_bits(layer._quantized_keys, set()) + tensors_bits(layer._quantized_values, set())
        held = layer.cumulative_length - (layer.keys.shape[-2] if layer.keys.dim() == 4 else 0)
        elements += 2 * batch * kv_heads * held * head_dim
    return bits / elements


def perplexity(lm: Any, toks: Any, make_cache: Any, feed: List[Tuple[int, int]],
               batch: int) -> Tuple[float, Any, int]:
    """Perplexity over the windows of toks [windows, window_len], each fed as `feed` into a fresh
    cache; returns it with the last cache and its batch size."""
    import torch

    windows, window_len = toks.shape
    first = window_len // 2
    nll, last, last_batch = 0.0, None, 0
    with torch.inference_mode():
        for w0 in range(0, windows, batch):
            nb = min(batch, windows - w0)
            cache = make_cache()
            for pos, ln in feed:
                end = pos + ln
                keep = max(1, end - max(pos, first))
                out = lm(input_ids=toks[w0:w0 + nb, pos:end], past_key_values=cache, use_cache=True,
                         logits_to_keep=keep)
                if end > first:
                    lp = torch.log_softmax(out.logits[:, -keep:].double(), dim=-1)
                    tgt = toks[w0:w0 + nb, end - keep + 1:end + 1]
                    nll -= float(lp.gather(-1, tgt.unsqueeze(-1)).sum())
            last, last_batch = cache, nb
    return math.exp(nll / (windows * (window_len - 1 - first))), last, last_batch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="checkpoint folder or .gguf file (loaded as kvq-calibrate-hf loads it)")
    p.add_argument("--text", help="default: $KVQ_DATA_DIR/wikitext-2/wiki.test.raw (../shared/data)")
    p.add_argument("--windows", type=int, default=32)
    p.add_argument("--window-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=8, help="windows per forward pass (8)")
    p.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated, of {', '.join(PEERS)}")
    p.add_argument("--entry", help="a kvq-calibrate-hf entry: also evaluate kvq's codecs of --kvq on it")
    p.add_argument("--kvq", default="", help="comma-separated kvq-eval config names (with --entry)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument("--json", metavar="FILE", help="also write the rows here")
    args = p.parse_args()

    import torch
    from transformers import DynamicCache, QuantizedCache

    from kvq.hf.calibration import load_checkpoint, read_tokens

    if args.threads:
        torch.set_num_threads(args.threads)
    data = Path(os.environ.get("KVQ_DATA_DIR") or REPO.parent / "shared/data")
    text = args.text or str(data / "wikitext-2/wiki.test.raw")
    # Recorded without this machine's folders: the model's file name, the text under $KVQ_DATA_DIR.
    shown_text = "$KVQ_DATA_DIR/wikitext-2/wiki.test.raw" if not args.text else Path(args.text).name
    config, tokenizer, lm = load_checkpoint(args.model, None, "float32", "cpu")
    ids = read_tokens(tokenizer, text, args.windows * args.window_len)[: args.windows * args.window_len]
    toks = torch.tensor(np.asarray(ids, dtype=np.int64)).view(args.windows, args.window_len)
    kv_heads = int(config.num_key_value_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    rows: List[Dict[str, Any]] = []

    def report(row: Dict[str, Any]) -> None:
        dense = rows[0]["ppl"] if rows else row["ppl"]
        row["vs_dense"] = row["ppl"] / dense - 1
        rows.append(row)
        print(f"{row['name']:40s} bits/elem {row.get('bits_per_element', 16):6.3f} ppl {row['ppl']:.4f} "
              f"({row['vs_dense']:+.1%}) {row['seconds']:.0f} s", flush=True)
        if args.json:  # after every row: a long run stopped early keeps what it measured
            Path(args.json).write_text(json.dumps({"model": Path(args.model).name, "text": shown_text,
                                                   "windows": args.windows, "window_len": args.window_len,
                                                   "rows": rows}, indent=1) + "\n")

    t0 = time.monotonic()
    ppl, _, _ = perplexity(lm, toks, DynamicCache, [(0, args.window_len - 1)], args.batch)
    report({"name": "dense (transformers, fp32)", "ppl": ppl, "seconds": time.monotonic() - t0})
    for name in [n for n in args.peers.split(",") if n]:
        backend, nbits = PEERS[name]
        t0 = time.monotonic()
        if backend == "turboquant":
            from turboquant.cache import TurboQuantCache

            ppl, cache, nb = perplexity(lm, toks, functools.partial(TurboQuantCache, bits=nbits),
                                        sliding_pieces(args.window_len, TURBOQUANT_RESIDUAL), args.batch)
            kb, vb, packed = turboquant_bits(cache, nbits, nb, kv_heads, head_dim)
            report({"name": name, "backend": backend, "nbits": nbits, "residual_length": TURBOQUANT_RESIDUAL,
                    "ppl": ppl, "k_bits": kb, "v_bits": vb, "bits_per_element": (kb + vb) / 2,
                    "packed_bits_per_element": packed, "seconds": time.monotonic() - t0})
            continue
        make = functools.partial(QuantizedCache, backend=backend, config=config, nbits=nbits)
        residual = make().layers[0].residual_length
        ppl, cache, nb = perplexity(lm, toks, make, pieces(args.window_len, residual), args.batch)
        kb, vb = cache_bits(cache, nb, kv_heads, head_dim)
        report({"name": name, "backend": backend, "nbits": nbits, "residual_length": residual,
                "q_group_size": cache.layers[0].q_group_size, "ppl": ppl, "k_bits": kb, "v_bits": vb,
                "bits_per_element": (kb + vb) / 2,
                "quantized_part_bits_per_element": quantized_bits(cache, nb, kv_heads, head_dim),
                "seconds": time.monotonic() - t0})
    if args.entry:
        from kvq.hf.codec_choice import codec_of_name, codec_perplexity, entry_codes, plan_rows

        codes = entry_codes(args.entry)
        names = [n for n in args.kvq.split(",") if n]
        shape = (int(codes.info.kv_heads), int(codes.info.q_heads), int(codes.info.head_dim))
        # kvq's bits as its search counts them: blocks at their bytes, the fp16 sinks' rows at
        # this window length.
        planned = {r.name: r for r in plan_rows(names, shape, int(codes.info.basis_rank), 1e9, args.window_len)}
        for name in names:
            t0 = time.monotonic()
            settings, _ = codec_of_name(name)
            ppl = codec_perplexity(lm, codes, codes.codec(settings), ids, args.windows, args.window_len,
                                   batch=args.batch)
            r = planned[name]
            report({"name": f"kvq {name}", "ppl": ppl, "k_bits": r.k_bits, "v_bits": r.v_bits,
                    "bits_per_element": r.bits, "seconds": time.monotonic() - t0})
    return 0


if __name__ == "__main__":
    sys.exit(main())
