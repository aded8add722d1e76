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

The oblique pair (fit_oblique, kind "oblique_rrr") also needs the base quantizer's key residual:
add_residual sums e e^T per head, e the key minus its 2-bit G = 32 KIVI code (the residual a
side code corrects), and the pair is core::QueryStats::Basis's reduced-rank regression of the
score error: with Se = E[e e^T] (plus a small ridge) and R = Se^1/2, w the top-`rank`
eigenvectors of R M R, the decode basis B = R w (unit columns) and the encode basis A = R^-1 w
(scaled so that A^T B = I).

Every fit fixes its columns' signs as kvq-calibrate does (canonical_signs: each column's entry
of largest magnitude positive, an encode column flipped with its decode column), so that the two
tools give one basis, not one subspace with columns of either sign.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Tuple

import numpy as np

__all__ = ["FittedBasis", "QueryStats", "canonical_signs", "principal_angles"]


@dataclass
class FittedBasis:
    kind: str  # "query_pca_uncentred", "query_pca_centred" or "oblique_rrr" (kvq-calibrate's names)
    # per layer, f32 [kv_heads, head_dim, rank]: orthonormal columns (the decode basis B, with
    # unit columns, of an oblique pair)
    u: List[np.ndarray]
    query_moment: List[np.ndarray]  # per layer, f32 [kv_heads, head_dim, head_dim]: E[q q^T]
    calibration_tokens: int  # tokens per head (queries / (layers * q_heads))
    encode: List[np.ndarray] = field(default_factory=list)  # an oblique pair's A, like u


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
        self.res_m2 = torch.zeros(layers, kv_heads, head_dim, head_dim, dtype=torch.float64)
        self.n_res = np.zeros((layers, kv_heads), dtype=np.int64)

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

    def add_residual(self, layer: int, residual: Any) -> None:
        """Adds key residuals e [kv_heads, tokens, head_dim] of one layer (the key minus its
        base code, as kvq's codec decodes it) to the sums the oblique pair is fitted from."""
        kv, n, d = residual.shape
        if kv != self.kv_heads or d != self.head_dim or not 0 <= layer < self.layers:
            raise ValueError(
                f"QueryStats.add_residual: layer {layer} residual of shape {tuple(residual.shape)}; "
                f"expected layer < {self.layers}, [{self.kv_heads}, tokens, {self.head_dim}]")
        import torch

        e = torch.as_tensor(residual).to(dtype=self.res_m2.dtype, device="cpu")
        self.res_m2[layer] += e.transpose(1, 2) @ e
        self.n_res[layer] += n

    def _moment(self) -> Any:
        """E[q q^T] per layer and head, float64 [layers, kv, d, d] (errors name an empty head)."""
        import torch

        empty = np.argwhere(self.n == 0)
        if len(empty):
            layer, head = (int(v) for v in empty[0])
            raise RuntimeError(
                f"no calibration queries for layer {layer} kv head {head}: the model's attention "
                "did not go through transformers' attention interface for that layer")
        return self.m2 / torch.from_numpy(self.n).to(torch.float64)[..., None, None]

    def _tokens(self) -> int:
        return int(self.n.sum()) // (self.layers * self.kv_heads) // (self.q_heads // self.kv_heads)

    def _check_rank(self, rank: int) -> None:
        if not 1 <= rank <= self.head_dim:
            raise ValueError(f"rank = {rank}: must be in [1, {self.head_dim}] (head_dim)")

    def fit(self, rank: int, *, centred: bool = False) -> FittedBasis:
        """The basis of every head (errors name the head that saw no query, or the rank)."""
        import torch

        self._check_rank(rank)
        moment = self._moment()
        n = torch.from_numpy(self.n).to(torch.float64)[..., None, None]
        m = moment
        if centred:
            mu = self.m1 / n[..., 0]
            m = moment - mu[..., :, None] * mu[..., None, :]
        # eigh: ascending eigenvalues, so the last `rank` columns reversed are the top ones.
        _, vecs = torch.linalg.eigh(m)
        top, _ = canonical_signs(vecs[..., :, -rank:].flip(-1))
        u = [top[layer].to(torch.float32).numpy().copy() for layer in range(self.layers)]
        qm = [moment[layer].to(torch.float32).numpy().copy() for layer in range(self.layers)]
        return FittedBasis("query_pca_centred" if centred else "query_pca_uncentred", u, qm, self._tokens())

    def fit_oblique(self, rank: int) -> FittedBasis:
        """The oblique pair of every head (see the module docstring; core::QueryStats::Basis
        with oblique set, the same ridge and normalisation). Needs add_residual's sums."""
        import torch

        self._check_rank(rank)
        moment = self._moment()
        empty = np.argwhere(self.n_res == 0)
        if len(empty):
            layer, head = (int(v) for v in empty[0])
            raise RuntimeError(f"no residual statistics for layer {layer} kv head {head}: the oblique pair "
                               "needs the keys' residuals (add_residual)")
        d = self.head_dim
        se = self.res_m2 / torch.from_numpy(self.n_res).to(torch.float64)[..., None, None]
        # A small ridge keeps R^-1 bounded along directions the residual never takes.
        trace = torch.diagonal(se, dim1=-2, dim2=-1).sum(-1)
        se = se + torch.eye(d, dtype=se.dtype) * (1e-4 * trace / d + 1e-20)[..., None, None]
        lam, vec = torch.linalg.eigh(se)
        sq = lam.clamp_min(0).sqrt()
        r = vec @ torch.diag_embed(sq) @ vec.transpose(-1, -2)
        r_inv = vec @ torch.diag_embed(1 / sq) @ vec.transpose(-1, -2)
        _, w = torch.linalg.eigh(r @ moment @ r)
        w = w[..., :, -rank:].flip(-1)  # the top `rank` eigenvectors, descending
        dec, enc = r @ w, r_inv @ w
        s = dec.norm(dim=-2, keepdim=True)  # unit decode columns; A^T B = I is kept
        dec, enc = canonical_signs(dec / s, enc * s)
        u = [dec[layer].to(torch.float32).numpy().copy() for layer in range(self.layers)]
        a = [enc[layer].to(torch.float32).numpy().copy() for layer in range(self.layers)]
        qm = [moment[layer].to(torch.float32).numpy().copy() for layer in range(self.layers)]
        return FittedBasis("oblique_rrr", u, qm, self._tokens(), a)

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

    def score_error_left(self, decode: List[np.ndarray], encode: List[np.ndarray]) -> np.ndarray:
        """Per (layer, KV head): the share of the base code's mean squared score error that a
        side code on the pair (A = encode, B = decode; A = B for an orthonormal basis) leaves,
        tr(M P Se P^T) / tr(M Se) with P = I - B A^T, M = E[q q^T] and Se = E[e e^T] from the
        accumulated sums: the oblique pair's objective, read on these statistics (held-out
        ones compare two fits where their subspaces differ only in near-degenerate directions)."""
        import torch

        m = self._moment()
        se = self.res_m2 / torch.from_numpy(self.n_res).to(torch.float64).clamp_min(1)[..., None, None]
        out = np.zeros((self.layers, self.kv_heads))
        eye = torch.eye(self.head_dim, dtype=torch.float64)
        for layer in range(self.layers):
            b = torch.from_numpy(np.asarray(decode[layer], dtype=np.float64))
            a = torch.from_numpy(np.asarray(encode[layer], dtype=np.float64))
            p = eye - b @ a.transpose(-1, -2)
            left = torch.einsum("hij,hjk,hik->h", m[layer] @ p, se[layer], p)
            full = torch.einsum("hij,hji->h", m[layer], se[layer])
            out[layer] = (left / full.clamp_min(1e-300)).numpy()
        return out


def canonical_signs(u: Any, along: Any = None) -> Tuple[Any, Any]:
    """u [..., d, r] (torch) with each column's sign fixed so that its entry of largest magnitude
    is positive (the first of equal ones), and `along` (the oblique pair's encode columns, or
    None) flipped with it: kvq-calibrate's convention (core::QueryStats::Basis), so that the two
    tools' fits of one subspace give one basis in either channel order."""
    import torch

    at = u.abs().argmax(dim=-2, keepdim=True)
    sign = torch.where(torch.gather(u, -2, at) < 0, -1.0, 1.0).to(u.dtype)
    return u * sign, None if along is None else along * sign


def principal_angles(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Principal angles in degrees (ascending) between the column spans of a and b, [d, r]
    each: arccos of the singular values of Qa^T Qb (orthonormalised first)."""
    qa, _ = np.linalg.qr(np.asarray(a, dtype=np.float64))
    qb, _ = np.linalg.qr(np.asarray(b, dtype=np.float64))
    s = np.linalg.svd(qa.T @ qb, compute_uv=False)
    return np.degrees(np.arccos(np.clip(s, -1.0, 1.0)))
