"""vLLM's CPU paged KV cache, read and written token by token.

Each attention layer's cache is one tensor [num_blocks, kv_heads, block_size, 2 * head_size]:
per block and head, the first block_size * head_size elements hold K, the rest V, each packed
for the ISA the CPU attention kernel runs on ("amx": VNNI tiles, K [t/16][d/2][16][2] and V
[d/16][t/2][16][2]; "vec"/"vec16"/...: K transposed [d][t], V token-major [t][d]). The packing
is whatever vLLM's own writer (torch.ops._C.cpu_attn_reshape_and_cache) does for that ISA, so
it is learned from that writer, not restated: CpuBlockLayout.probe writes tokens whose every
element encodes its own position (t, then d: integers below 256, exact in bf16, fp16 and fp32)
into a scratch block and reads back where each landed. The result is one index per half
([block_size, head_size] -> flat offset in the half), which gather reads through, so what is
read is exactly what the kernel wrote, and what kvq writes through it (`paged`: the layout as
kvq.PagedLayout, which Client.get_blocks_into decodes straight into) is what the kernel reads.
Tested against the documented AMX and vector formulas (client/python/tests/with_vllm/).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..paged import PagedLayout

__all__ = ["CpuBlockLayout"]


@dataclass(frozen=True)
class CpuBlockLayout:
    """Where token t, channel d of K (and of V) sits in one block of one head.

    k_index, v_index: int64 [block_size, head_size], offsets into the block's K half and V
    half (each block_size * head_size elements) of the flattened [2 * block_size * head_size].
    """

    isa: str
    block_size: int
    head_size: int
    k_index: torch.Tensor
    v_index: torch.Tensor

    @classmethod
    def probe(cls, isa: str, block_size: int, head_size: int, dtype: torch.dtype) -> CpuBlockLayout:
        """Learns the layout from vLLM's writer for this ISA, block size, head size and dtype."""
        if head_size > 256 or block_size > 256:
            raise ValueError(f"head_size {head_size} / block_size {block_size}: the probe encodes positions "
                             "as integers below 256 (exact in bf16); larger is not supported")
        from vllm import _custom_ops as ops

        t = torch.arange(block_size, dtype=torch.float32)[:, None].expand(block_size, head_size)
        d = torch.arange(head_size, dtype=torch.float32)[None, :].expand(block_size, head_size)
        where: dict[str, torch.Tensor] = {}
        for name, value in (("t", t), ("d", d)):
            cache = torch.full((1, 1, block_size * 2, head_size), -1.0, dtype=dtype)
            key_cache, value_cache = cache.chunk(2, dim=2)
            kv = value.to(dtype).reshape(block_size, 1, head_size).contiguous()
            slots = torch.arange(block_size, dtype=torch.int64)
            ops.cpu_attn_reshape_and_cache(kv, kv, key_cache, value_cache, slots, isa)
            where[name] = cache.reshape(2, block_size * head_size).to(torch.int64)
        if bool((where["t"] < 0).any()):
            raise RuntimeError(f"vLLM's CPU KV writer (isa {isa}) left part of the block unwritten: "
                               "the layout is not a permutation; kvq.vllm does not support it")
        halves = []
        for half in range(2):
            code = where["t"][half] * head_size + where["d"][half]  # flat offset -> t * D + d
            index = torch.empty(block_size * head_size, dtype=torch.int64)
            index[code] = torch.arange(block_size * head_size, dtype=torch.int64)
            if not bool(torch.equal(torch.sort(code).values, torch.arange(block_size * head_size))):
                raise RuntimeError(f"vLLM's CPU KV writer (isa {isa}) does not store each (token, channel) once")
            halves.append(index.reshape(block_size, head_size))
        return cls(isa, block_size, head_size, halves[0], halves[1])

    def paged(self, kv_heads: int) -> PagedLayout:
        """This layout as kvq's PagedLayout of a cache [num_blocks, kv_heads, block_size, 2 *
        head_size] (what Client.get_blocks_into decodes straight into)."""
        half = self.block_size * self.head_size
        return PagedLayout(block_size=self.block_size, head_dim=self.head_size, block_stride=kv_heads * 2 * half,
                           head_stride=2 * half, key_index=self.k_index.numpy(),
                           value_index=(self.v_index + half).numpy())

    def gather(self, cache: torch.Tensor, block_ids: Sequence[int], n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the first n_tokens held by block_ids (in order) of one layer's cache
        [num_blocks, kv_heads, block_size, 2 * head_size]: each [kv_heads, n_tokens, head_size]."""
        blocks = self._blocks(cache, block_ids, n_tokens)  # [nb, H, 2, bs*D]
        k = blocks[:, :, 0].index_select(-1, self.k_index.reshape(-1))  # [nb, H, bs*D], token-major
        v = blocks[:, :, 1].index_select(-1, self.v_index.reshape(-1))
        return self._tokens(k, n_tokens), self._tokens(v, n_tokens)

    def _blocks(self, cache: torch.Tensor, block_ids: Sequence[int], n_tokens: int) -> Any:
        need = -(-n_tokens // self.block_size)
        if need > len(block_ids):
            raise ValueError(f"{n_tokens} tokens need {need} blocks, {len(block_ids)} given")
        return _flat(cache)[list(block_ids[:need])]

    def _tokens(self, x: torch.Tensor, n_tokens: int) -> torch.Tensor:
        """[nb, H, bs*D] token-major blocks -> [H, n_tokens, D]."""
        nb, heads = int(x.shape[0]), int(x.shape[1])
        return x.view(nb, heads, self.block_size, self.head_size).transpose(0, 1).reshape(
            heads, nb * self.block_size, self.head_size)[:, :n_tokens]


def _flat(cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, kv_heads, bs, 2*D] viewed as [num_blocks, kv_heads, 2, bs*D] (K half, V half)."""
    nb, heads, bs, two_d = (int(s) for s in cache.shape)
    return cache.view(nb, heads, 2, bs * two_d // 2)
