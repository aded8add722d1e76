"""Between LMCache's chunk layout and kvq's per-layer tensors, and chunk keys to sequence ids.

LMCache hands a remote connector one MemoryObj per chunk in MemoryFormat.KV_2LTD: a tensor
[2, num_layers, num_tokens, kv_heads * head_dim] (index 0 keys, 1 values; the last axis is
vLLM's [kv_heads, head_dim] flattened), dtype the engine's KV dtype (float16/bfloat16),
num_tokens = chunk_size (256 by default) or fewer for a request's last chunk. kvq stores per
layer keys and values [kv_heads, n, head_dim]. These functions only reshape; they copy once
(the transpose to head-major) and never change a value.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["split_layers", "write_layer", "sequence_id_for", "MAX_SEQUENCE_ID_BYTES"]

# proto/kvq/v1/kvq.proto: sequence ids are 1..256 bytes.
MAX_SEQUENCE_ID_BYTES = 256


def split_layers(chunk: torch.Tensor, kv_heads: int, head_dim: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[2, L, n, H*D] -> per layer (keys, values), each a contiguous CPU tensor [H, n, D]."""
    if chunk.dim() != 4 or chunk.shape[0] != 2 or chunk.shape[3] != kv_heads * head_dim:
        raise ValueError(
            f"chunk shape {tuple(chunk.shape)} is not [2, layers, tokens, {kv_heads}*{head_dim}] (KV_2LTD)")
    t = chunk.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    layers, n = t.shape[1], t.shape[2]
    # [2, L, n, H, D] -> [2, L, H, n, D]: one copy into kvq's head-major order.
    hm = t.reshape(2, layers, n, kv_heads, head_dim).permute(0, 1, 3, 2, 4).contiguous()
    return [(hm[0, i], hm[1, i]) for i in range(layers)]


def write_layer(chunk: torch.Tensor, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Writes kvq's keys/values [H, m, D] of one layer into chunk[:, layer, start:start+m]."""
    h, m, d = keys.shape
    chunk[0, layer, start:start + m].copy_(keys.permute(1, 0, 2).reshape(m, h * d))
    chunk[1, layer, start:start + m].copy_(values.permute(1, 0, 2).reshape(m, h * d))


def sequence_id_for(key_string: str, prefix: str) -> str:
    """The kvq sequence id of a chunk: prefix + LMCache's key string (model@world@worker@hash@dtype
    [@tags]), or, when that is over 256 bytes (long model names or tags), prefix + "sha256:" +
    the key string's SHA-256, which stays unique and within the limit."""
    sid = prefix + key_string
    if len(sid.encode()) <= MAX_SEQUENCE_ID_BYTES:
        return sid
    return prefix + "sha256:" + hashlib.sha256(key_string.encode()).hexdigest()
