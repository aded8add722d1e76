"""Agreement of kvq.calibrate (transformers) with kvq-calibrate (kvq's C++ frontend) on one
GGUF model and the same calibration text.

Both fit the rank-R query PCA on the first --tokens tokens of --text in windows of
--window-len. kvq-calibrate's basis (GGUF channel order) is mapped into transformers' order
with kvq.hf.to_model_order; then, per (layer, KV head), on the post-RoPE queries of the
--held-out tokens that follow the calibration tokens (captured from transformers' forward):

* the captured query energy tr(U^T M U) / tr(M) of each basis (M: held-out E[q q^T]);
* the principal angles between the two rank-R subspaces.

With --server ADDRESS (a running kvq-server), also the decode-faithful perplexity through
kvq.hf (kvq.hf.eval.decode_perplexity) of --ppl-config (headq-kv2) with each basis, and of
kivi-kv2 (no side code) for scale, on --ppl-windows x --ppl-window-len tokens of --eval-text.

Usage (one core):
  OMP_NUM_THREADS=1 python bench/calibrate_agreement.py --model MODEL.gguf \\
      --kvq-calibrate build/bin/kvq-calibrate [--tokens 32768] [--held-out 8192] [--rank 8] \\
      [--server 127.0.0.1:50051 --eval-text $KVQ_DATA_DIR/wikitext-2/wiki.test.raw]
Prints a summary and writes the per-head numbers with --json FILE. Exit 1 when a run fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Optional

import numpy as np


def perplexities(lm, tokenizer, config, fitted, cpp_dir: str, a: argparse.Namespace, workdir: str) -> dict:
    """{label: perplexity} through kvq.hf on the server at a.server: a.ppl_config with the
    Python basis and with kvq-calibrate's, and kivi-kv2."""
    import kvq
    import kvq.hf
    from kvq.hf.calibration import read_tokens
    from kvq.hf.eval import decode_perplexity, parse_config

    py_dir = os.path.join(workdir, "py")
    kvq.hf.write_basis(py_dir, {"model": f"agreement-py-{os.getpid()}", "version": 1,
                                "q_heads": int(config.num_attention_heads), "rope_layout": "halves",
                                "channel_order": "hf", "kind": fitted.kind,
                                "calibration_tokens": fitted.calibration_tokens, "calibration_text": a.text},
                       fitted.u, fitted.query_moment)
    ids = read_tokens(tokenizer, a.eval_text, a.ppl_windows * a.ppl_window_len)
    out = {}
    with kvq.Client(a.server, deadline=120.0) as client:
        infos = {"python": kvq.hf.register_basis(client, py_dir, config=config, check=False),
                 "kvq-calibrate": kvq.hf.register_basis(client, cpp_dir, config=config, check=False,
                                                        name=f"agreement-cpp-{os.getpid()}")}
        kvq.hf.enable(lm)
        try:
            for label, info, cfg in ((f"{a.ppl_config} python basis", infos["python"], a.ppl_config),
                                     (f"{a.ppl_config} kvq-calibrate basis", infos["kvq-calibrate"], a.ppl_config),
                                     ("kivi-kv2", infos["python"], "kivi-kv2")):
                r = decode_perplexity(lm, client, info, ids, a.ppl_windows, a.ppl_window_len, parse_config(cfg),
                                      batch=a.ppl_windows)
                out[label] = r["ppl"]
        finally:
            kvq.hf.disable(lm)
    return out


def compare(model: str, kvq_calibrate: str, text: str, tokens: int, held_out: int, rank: int,
            window_len: int, batch: int, workdir: str, ppl_args: Optional[argparse.Namespace] = None) -> dict:
    import torch

    from kvq.hf.basis import read_basis, to_model_order
    from kvq.hf.calibration import collect_query_stats, load_checkpoint, model_shape, read_tokens
    from kvq.hf.query_stats import QueryStats, principal_angles

    cpp_dir = os.path.join(workdir, "cpp")
    t0 = time.monotonic()
    subprocess.run([kvq_calibrate, "--model", model, "--text", text, "--tokens", str(tokens),
                    "--window-len", str(window_len), "--rank", str(rank), "--threads",
                    str(torch.get_num_threads()), "--out", cpp_dir], check=True, capture_output=True)
    cpp_seconds = time.monotonic() - t0
    config, tokenizer, lm = load_checkpoint(model, None, "float32", "cpu")
    ids = read_tokens(tokenizer, text, tokens + held_out)
    shape = model_shape(config)
    t1 = time.monotonic()
    calib = collect_query_stats(lm, ids[:tokens], QueryStats(*shape), window_len=window_len, batch=batch)
    py_seconds = time.monotonic() - t1
    held = collect_query_stats(lm, ids[tokens:], QueryStats(*shape), window_len=window_len, batch=batch)
    fitted = calib.fit(rank)
    py = fitted.u
    cpp = to_model_order(read_basis(cpp_dir), config).u
    ppl = perplexities(lm, tokenizer, config, fitted, cpp_dir, ppl_args, workdir) if ppl_args else {}
    e_py, e_cpp = held.captured_energy(py), held.captured_energy(cpp)
    angles = np.array([[principal_angles(cpp[layer][h], py[layer][h]) for h in range(shape[2])]
                       for layer in range(shape[0])])  # [layers, kv_heads, rank]
    return {
        "model": model, "text": text, "tokens": tokens, "held_out": held_out, "rank": rank,
        "window_len": window_len, "cpp_seconds": cpp_seconds, "py_seconds": py_seconds,
        "perplexity": ppl,
        "energy_py": e_py.tolist(), "energy_cpp": e_cpp.tolist(), "angles_deg": angles.tolist(),
        "summary": {
            "energy_py_mean": float(e_py.mean()), "energy_cpp_mean": float(e_cpp.mean()),
            "energy_diff_max_abs": float(np.abs(e_py - e_cpp).max()),
            "largest_angle_median_deg": float(np.median(angles[..., -1])),
            "largest_angle_max_deg": float(angles[..., -1].max()),
            "leading_angle_max_deg": float(angles[..., 0].max()),
            "mean_angle_deg": float(angles.mean()),
        },
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="GGUF file (llama or qwen2: what kvq-calibrate runs)")
    p.add_argument("--kvq-calibrate", required=True, help="the kvq-calibrate binary")
    p.add_argument("--text", default=os.path.join(os.environ.get("KVQ_DATA_DIR") or "../shared/data",
                                                  "wikitext-2/wiki.valid.tokens"))
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--held-out", type=int, default=8192)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--window-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--json", help="write every number here")
    p.add_argument("--server", help="a kvq-server address: also compare perplexity through kvq.hf")
    p.add_argument("--eval-text", default=os.path.join(os.environ.get("KVQ_DATA_DIR") or "../shared/data",
                                                       "wikitext-2/wiki.test.raw"))
    p.add_argument("--ppl-windows", type=int, default=4)
    p.add_argument("--ppl-window-len", type=int, default=256)
    p.add_argument("--ppl-config", default="headq-kv2")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        r = compare(a.model, a.kvq_calibrate, a.text, a.tokens, a.held_out, a.rank, a.window_len, a.batch, d,
                    a if a.server else None)
    print(json.dumps({k: v for k, v in r.items() if k not in ("energy_py", "energy_cpp", "angles_deg")}, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
