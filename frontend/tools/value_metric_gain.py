#!/usr/bin/env python3
"""What value metric rounding (`-vmr`) can gain at most, from a GGUF model's attn_output
weights alone: per layer and KV head, the metric M in which a value error reaches the layer
output, its condition number, and the ratio of the expected M-weighted error of sequential
rounding with error feedback (GPTQ's rule, as the codec runs it: 1% damping) to nearest
rounding's, for independent rounding noise of equal variance on every channel and no
clamping (an idealization: real 2- and 3-bit codes clamp at their group's range).

For that noise, nearest rounding's expected error is sigma^2 tr(M) and the sequential rule's
sigma^2 sum_c 1 / U_cc^2 (U the upper Cholesky factor of M^-1, GPTQ's loss per column), so a
ratio near 1 says no error feedback in this metric can help much.

Two metrics, the extremes of how the group's query heads attend to a token:
  independent  M = sum_q W_o,q^T W_o,q   (what kvq-calibrate --value-metric stores and
                                          LlamaModel::OutputProjectionMetric computes)
  together     M = (sum_q W_o,q)^T (sum_q W_o,q)   (all heads with the same attention)

Usage: value_metric_gain.py GGUF [GGUF ...]   (needs numpy and gguf-py, e.g. the project's
venv: ~/.cache/kvq/venv/bin/python)
"""
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def feedback_ratio(m):
    """Expected M-error of sequential rounding over nearest rounding's (damped M)."""
    md = m + 0.01 * np.trace(m) / m.shape[0] * np.eye(m.shape[0])
    u = np.linalg.cholesky(np.linalg.inv(md)).T
    return float(np.sum(1.0 / np.diag(u) ** 2) / np.trace(md))


def field(reader, suffix):
    for name, f in reader.fields.items():
        if name.endswith(suffix):
            return int(f.parts[f.data[0]][0])
    raise KeyError(suffix)


def main():
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        return 0 if len(sys.argv) > 1 else 2
    for path in sys.argv[1:]:
        r = GGUFReader(path)
        q_heads = field(r, ".attention.head_count")
        kv_heads = field(r, ".attention.head_count_kv")
        hidden = field(r, ".embedding_length")
        d, group = hidden // q_heads, q_heads // kv_heads
        rows = {"independent": ([], []), "together": ([], [])}
        for t in r.tensors:
            if not t.name.endswith("attn_output.weight"):
                continue
            w = dequantize(t.data, t.tensor_type).reshape(-1, q_heads * d).astype(np.float64)
            for h in range(kv_heads):
                blocks = [w[:, q * d:(q + 1) * d] for q in range(h * group, (h + 1) * group)]
                s = sum(blocks)
                for kind, m in (("independent", sum(b.T @ b for b in blocks)),
                                ("together", s.T @ s)):
                    ev = np.linalg.eigvalsh(m)
                    rows[kind][0].append(ev[-1] / max(ev[0], 1e-30))
                    rows[kind][1].append(feedback_ratio(m))
        print(f"{path}: {q_heads} query heads, {kv_heads} KV heads, head_dim {d}")
        for kind, (cond, ratio) in rows.items():
            print(f"  {kind:11s} cond(M) median {np.median(cond):7.1f} max {np.max(cond):8.1f}"
                  f" | feedback/nearest M-error median {np.median(ratio):.3f}"
                  f" min {np.min(ratio):.3f} max {np.max(ratio):.3f}"
                  f" ({len(ratio)} heads)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
