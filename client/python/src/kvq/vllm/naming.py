"""Names of the kvq sequences that hold vLLM prompts' K/V.

The first k * block_size tokens of a prompt (k whole vLLM blocks) are named by a chained hash
over the blocks' token ids (XXH3-128 of the previous block's key and this block's ids, as
uint32), rooted in a seed over everything that makes K/V differ for the same ids (the kvq
model, the codec settings, the cache dtype and the block size). A prompt is stored whole, its
partial last block included, under its `whole` name: the name of its whole blocks when it has
no partial block, else that name continued over the partial block's ids. Equal names mean
equal token prefixes under equal settings, in any engine instance, so instances share what one
stored (per tenant: kvq sequences never cross tenants). The first block's key is also the id's
hash tag ("{...}"), so that on a sharded kvq every prompt that starts the same way lands on one
server and shares its prefix index there.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, List, Mapping, Sequence

import numpy as np
import xxhash

__all__ = ["PrefixNames"]


class PrefixNames:
    """The sequence names of a prompt's block-aligned prefixes."""

    def __init__(self, model: str, block_size: int, settings: Mapping[str, Any]) -> None:
        self.model = model
        self.block_size = block_size
        seed = json.dumps({"model": model, "block_size": block_size, **settings}, sort_keys=True)
        self._seed = xxhash.xxh3_128_digest(seed.encode())

    def chain(self, token_ids: Sequence[int]) -> List[str]:
        """Names of the prefixes of 1, 2, ... whole blocks of token_ids (a trailing partial
        block has none)."""
        bs = self.block_size
        ids = np.asarray(token_ids[: len(token_ids) // bs * bs], dtype=np.uint32)
        names: List[str] = []
        key, tag = self._seed, ""
        for b in range(len(ids) // bs):
            key = xxhash.xxh3_128_digest(key + ids[b * bs:(b + 1) * bs].tobytes())
            if not tag:
                tag = key.hex()[:16]
            names.append(f"vllm.{self.model}.{{{tag}}}.{key.hex()}")
        return names

    def whole(self, token_ids: Sequence[int], names: Sequence[str]) -> str:
        """The name of all of token_ids (names: its chain(), not empty): names[-1] when
        token_ids is whole blocks, else names[-1] continued over the partial block's ids (its
        length in the hash too, so it never equals a whole block's key)."""
        tail = np.asarray(token_ids[len(names) * self.block_size:], dtype=np.uint32)
        if len(tail) == 0:
            return names[-1]
        key = xxhash.xxh3_128_digest(names[-1].encode() + len(tail).to_bytes(4, "little") + tail.tobytes())
        return f"{names[-1]}.{len(tail)}.{key.hex()}"

    @staticmethod
    def attach_name(names: Sequence[str]) -> str:
        """A fresh name for a sequence that attaches a prompt's indexed groups (its first
        block's hash tag kept, so that a sharded kvq routes it to the server of names[0])."""
        return f"{names[0]}.attach.{uuid.uuid4().hex}"
