"""Consistent hashing of (tenant, sequence id) onto servers, exactly as the C++ client.

client/lib/src/hash_ring.cc: each server owns `virtual_nodes` points at XXH3-64("addr#v");
a key (XXH3-64 of tenant '\\0' hashtag(sequence_id)) belongs to the first point at or after
it, wrapping around. Hash tags as in Redis Cluster: when an id holds "{tag}" (the first '{'
and the next '}', with something between), only the tag is hashed, so that sequences meant
to share a prompt prefix land on one server. tests/test_ring.py checks 10,000 ids against the
C++ ring.
"""

from __future__ import annotations

import bisect
from typing import List, Sequence, Tuple, Union

import xxhash

__all__ = ["HashRing", "hash_tag", "key_of"]


def _bytes(s: Union[str, bytes]) -> bytes:
    return s.encode("utf-8") if isinstance(s, str) else bytes(s)


def hash_tag(sequence_id: Union[str, bytes]) -> bytes:
    """The part of a sequence id that is hashed: the tag inside its first "{...}", else all."""
    sid = _bytes(sequence_id)
    open_ = sid.find(b"{")
    if open_ < 0:
        return sid
    close = sid.find(b"}", open_ + 1)
    if close < 0 or close == open_ + 1:
        return sid
    return sid[open_ + 1 : close]


def key_of(tenant: Union[str, bytes], sequence_id: Union[str, bytes]) -> int:
    """XXH3-64 of tenant '\\0' hash_tag(sequence_id)."""
    return xxhash.xxh3_64_intdigest(_bytes(tenant) + b"\0" + hash_tag(sequence_id))


class HashRing:
    """A ring of `virtual_nodes` points per server address."""

    def __init__(self, servers: Sequence[str], virtual_nodes: int = 128) -> None:
        self.servers: List[str] = list(servers)
        vn = max(1, int(virtual_nodes))
        points: List[Tuple[int, bytes, int]] = []
        for s, addr in enumerate(self.servers):
            a = _bytes(addr)
            for v in range(vn):
                points.append((xxhash.xxh3_64_intdigest(a + b"#" + str(v).encode()), a, s))
        # Ties (astronomically rare) are broken by address, as in C++ (std::string <).
        points.sort(key=lambda p: (p[0], p[1]))
        self._hashes = [p[0] for p in points]
        self._owners = [p[2] for p in points]

    def __len__(self) -> int:
        return len(self.servers)

    def lookup(self, key: int) -> int:
        """Index into servers of the owner of a 64-bit key."""
        if not self._hashes:
            raise ValueError("the ring has no server")
        i = bisect.bisect_left(self._hashes, key)
        if i == len(self._hashes):
            i = 0
        return self._owners[i]

    def shard_of(self, tenant: Union[str, bytes], sequence_id: Union[str, bytes]) -> int:
        return self.lookup(key_of(tenant, sequence_id))
