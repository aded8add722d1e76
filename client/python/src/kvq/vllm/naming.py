"""Names of the kvq sequences that hold vLLM prompts' K/V.

A prompt's first k * block_size tokens (k whole vLLM blocks) are stored, when stored, as one
kvq sequence named after them: a chained hash over the blocks' token ids (XXH3-128 of the
previous block's key and this block's ids, as uint32), rooted in a seed over everything that
makes K/V differ for the same ids (the kvq model, the codec settings, the cache dtype and the
block size). Equal names mean equal token prefixes under equal settings, in any engine
instance, so instances share what one stored (per tenant: kvq sequences never cross tenants).
The first block's key is also the id's hash tag ("{...}"), so that on a sharded kvq every
prompt that starts the same way lands on one server and shares its prefix index there.
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

    @staticmethod
    def attach_name(names: Sequence[str]) -> str:
        """A fresh name for a sequence that attaches a prompt's indexed groups (its first
        block's hash tag kept, so that a sharded kvq routes it to the server of names[0])."""
        return f"{names[0]}.attach.{uuid.uuid4().hex}"
