"""A paged KV cache's addressing: where a serving engine keeps each (token, head, channel) of a
layer's K and V in its own cache tensor, so that Client.get_blocks_into can decode a stream of
codes straight into that memory (no intermediate tensor, no second pass through the engine's
writer). The engine's within-block packing (transposed, tiled, ...) is given as two index
tables, so any layout that is a permutation inside a block fits (kvq.vllm learns vLLM's from
its own writer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from numpy.typing import NDArray

__all__ = ["PagedLayout"]


@dataclass(frozen=True)
class PagedLayout:
    """Channel c of token t, KV head h of a layer's K sits at element

        block_ids[t // block_size] * block_stride + h * head_stride + key_index[t % block_size, c]

    of the layer's cache tensor (C-contiguous, float32/float16/bfloat16), V the same with
    value_index; block_ids name the sequence's blocks in order from its token 0.
    key_index, value_index: [block_size, head_dim] (or flat) non-negative element offsets;
    stored as int32."""

    block_size: int
    head_dim: int
    block_stride: int
    head_stride: int
    key_index: Any
    value_index: Any

    def __post_init__(self) -> None:
        for field in ("block_size", "head_dim"):
            if int(getattr(self, field)) <= 0:
                raise ValueError(f"PagedLayout.{field} must be > 0, got {getattr(self, field)}")
        for field in ("block_stride", "head_stride"):
            if int(getattr(self, field)) < 0:
                raise ValueError(f"PagedLayout.{field} must be >= 0, got {getattr(self, field)}")
        want = int(self.block_size) * int(self.head_dim)
        for field in ("key_index", "value_index"):
            index = np.asarray(getattr(self, field)).reshape(-1)
            if index.size != want:
                raise ValueError(f"PagedLayout.{field}: {index.size} offsets, block_size x head_dim = {want} wanted")
            if index.size and (int(index.min()) < 0 or int(index.max()) >= 2**31):
                raise ValueError(f"PagedLayout.{field}: offsets must be in [0, 2^31)")
            object.__setattr__(self, field, np.ascontiguousarray(index, dtype=np.int32))

    def block_offsets(self, block_ids: Sequence[int]) -> NDArray[np.int64]:
        """Each block's first element in the cache (int64)."""
        return np.asarray(block_ids, dtype=np.int64).reshape(-1) * np.int64(self.block_stride)
