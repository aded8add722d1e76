"""Agreement of kvq.calibrate (transformers) with kvq-calibrate (kvq's C++ frontend) on one
GGUF model and the same calibration text (issue 32, item 3).

Both fit the rank-R query PCA on the first --tokens tokens of --text in windows of
--window-len. kvq-calibrate's basis (GGUF channel order) is mapped into transformers' order
with kvq.hf.to_model_order; then, per (layer, KV head), on the post-RoPE queries of the
--held-out tokens that follow the calibration tokens (captured from transformers' forward):

* the captured query energy tr(U^T M U) / tr(M) of each basis (M: held-out E[q q^T]);
* the principal angles between the two rank-R subspaces.

Usage (one core):
  OMP_NUM_THREADS=1 python bench/calibrate_agreement.py --model MODEL.gguf \\
      --kvq-calibrate build/bin/kvq-calibrate [--tokens 32768] [--held-out 8192] [--rank 8]
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

import numpy as np


def compare(model: str, kvq_calibrate: str, text: str, tokens: int, held_out: int, rank: int,
            window_len: int, batch: int, workdir: str) -> dict:
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
    py = calib.fit(rank).u
    cpp = to_model_order(read_basis(cpp_dir), config).u
    e_py, e_cpp = held.captured_energy(py), held.captured_energy(cpp)
    angles = np.array([[principal_angles(cpp[layer][h], py[layer][h]) for h in range(shape[2])]
                       for layer in range(shape[0])])  # [layers, kv_heads, rank]
    return {
        "model": model, "text": text, "tokens": tokens, "held_out": held_out, "rank": rank,
        "window_len": window_len, "cpp_seconds": cpp_seconds, "py_seconds": py_seconds,
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
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        r = compare(a.model, a.kvq_calibrate, a.text, a.tokens, a.held_out, a.rank, a.window_len, a.batch, d)
    print(json.dumps({k: v for k, v in r.items() if k not in ("energy_py", "energy_cpp", "angles_deg")}, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
