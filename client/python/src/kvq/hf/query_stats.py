"""Streaming query statistics per (layer, KV head) and the HeadQ basis fitted from them: the
Python twin of core::QueryStats (core/include/kvq/core/calibration.h).

Each KV head pools the post-RoPE queries of every query head that reads it (grouped-query
attention: query head h reads KV head h // (q_heads / kv_heads), transformers' repeat_kv
order). Only the sums are kept, in float64: sum q q^T [d, d], sum q [d] and the count, so
memory is layers * kv_heads * d * (d + 1) doubles whatever the text length.

The basis of a head is the top-`rank` eigenvectors (descending eigenvalue, orthonormal
columns) of the uncentred second moment E[q q^T], whose quadratic form e^T E[q q^T] e is the
mean squared score error of a key residual e (docs/HEADQ.md, section 2); centred=True
diagonalises the covariance instead (the ablation kvq-calibrate --variants writes as
"centred"). The query moment kept beside the basis is always the uncentred E[q q^T], as
kvq-calibrate stores it (the metric of the codec's metric rounding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List

import numpy as np

__all__ = ["FittedBasis", "QueryStats", "principal_angles"]


@dataclass
class FittedBasis:
    kind: str  # "query_pca_uncentred" or "query_pca_centred" (kvq-calibrate's names)
    u: List[np.ndarray]  # per layer, f32 [kv_heads, head_dim, rank], orthonormal columns
    query_moment: List[np.ndarray]  # per layer, f32 [kv_heads, head_dim, head_dim]: E[q q^T]
    calibration_tokens: int  # tokens per head (queries / (layers * q_heads))


class QueryStats:
    def __init__(self, layers: int, q_heads: int, kv_heads: int, head_dim: int):
        if layers < 1 or kv_heads < 1 or head_dim < 1 or q_heads < kv_heads or q_heads % kv_heads:
            raise ValueError(
                f"QueryStats: layers={layers}, q_heads={q_heads}, kv_heads={kv_heads}, "
                f"head_dim={head_dim}: q_heads must be a positive multiple of kv_heads")
        import torch

        self.layers, self.q_heads, self.kv_heads, self.head_dim = layers, q_heads, kv_heads, head_dim
        self.m2 = torch.zeros(layers, kv_heads, head_dim, head_dim, dtype=torch.float64)
        self.m1 = torch.zeros(layers, kv_heads, head_dim, dtype=torch.float64)
        self.n = np.zeros((layers, kv_heads), dtype=np.int64)

    def add(self, layer: int, query: Any) -> None:
        """Adds one attention call's queries, as transformers' attention interface gets them:
        [batch, q_heads, tokens, head_dim] (any float dtype; every row counts, so the caller
        sends no padding)."""
        b, hq, n, d = query.shape
        if hq != self.q_heads or d != self.head_dim or not 0 <= layer < self.layers:
            raise ValueError(
                f"QueryStats.add: layer {layer} query of shape {tuple(query.shape)}; expected "
                f"layer < {self.layers}, [batch, {self.q_heads}, tokens, {self.head_dim}]")
        g = hq // self.kv_heads
        # [B, kv, g, n, d] -> [kv, B * g * n, d]: every query row of a KV head's group.
        x = query.detach().reshape(b, self.kv_heads, g, n, d).transpose(0, 1).reshape(self.kv_heads, -1, d)
        x = x.to(dtype=self.m2.dtype, device="cpu")
        self.m2[layer] += x.transpose(1, 2) @ x
        self.m1[layer] += x.sum(dim=1)
        self.n[layer] += x.shape[1]

    def fit(self, rank: int, *, centred: bool = False) -> FittedBasis:
        """The basis of every head (errors name the head that saw no query, or the rank)."""
        import torch

        if not 1 <= rank <= self.head_dim:
            raise ValueError(f"rank = {rank}: must be in [1, {self.head_dim}] (head_dim)")
        empty = np.argwhere(self.n == 0)
        if len(empty):
            layer, head = (int(v) for v in empty[0])
            raise RuntimeError(
                f"no calibration queries for layer {layer} kv head {head}: the model's attention "
                "did not go through transformers' attention interface for that layer")
        n = torch.from_numpy(self.n).to(torch.float64)[..., None, None]
        moment = self.m2 / n
        m = moment
        if centred:
            mu = self.m1 / n[..., 0]
            m = moment - mu[..., :, None] * mu[..., None, :]
        # eigh: ascending eigenvalues, so the last `rank` columns reversed are the top ones.
        _, vecs = torch.linalg.eigh(m)
        top = vecs[..., :, -rank:].flip(-1)
        u = [top[layer].to(torch.float32).numpy().copy() for layer in range(self.layers)]
        qm = [moment[layer].to(torch.float32).numpy().copy() for layer in range(self.layers)]
        tokens = int(self.n.sum()) // (self.layers * self.kv_heads) // (self.q_heads // self.kv_heads)
        return FittedBasis("query_pca_centred" if centred else "query_pca_uncentred", u, qm, tokens)

    def captured_energy(self, u: List[np.ndarray]) -> np.ndarray:
        """Per (layer, KV head): tr(U^T M U) / tr(M) with M the accumulated uncentred second
        moment, the fraction of query energy the basis captures (core's CapturedEnergy)."""
        import torch

        out = np.zeros((self.layers, self.kv_heads))
        for layer in range(self.layers):
            ul = torch.from_numpy(np.asarray(u[layer], dtype=np.float64))
            m2 = self.m2[layer]
            cap = torch.einsum("hdr,hde,her->h", ul, m2, ul)
            tr = torch.diagonal(m2, dim1=-2, dim2=-1).sum(-1)
            out[layer] = (cap / tr.clamp_min(1e-300)).numpy()
        return out


def principal_angles(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Principal angles in degrees (ascending) between the column spans of a and b, [d, r]
    each: arccos of the singular values of Qa^T Qb (orthonormalised first)."""
    qa, _ = np.linalg.qr(np.asarray(a, dtype=np.float64))
    qb, _ = np.linalg.qr(np.asarray(b, dtype=np.float64))
    s = np.linalg.svd(qa.T @ qb, compute_uv=False)
    return np.degrees(np.arccos(np.clip(s, -1.0, 1.0)))
