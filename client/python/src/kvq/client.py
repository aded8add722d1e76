"""kvq.Client: typed, synchronous calls to one or several kvq servers.

Mirrors client/lib (the C++ client): a deadline on every attempt, retries with full-jitter
backoff on UNAVAILABLE for the idempotent calls only, consistent-hash sharding of sequences
over several servers, TLS and bearer tokens. See client/python/README.md.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

import numpy as np

from ._proto.kvq.v1 import kvq_pb2
from .errors import KvqError
from .types import Append, AttendItem, Block, ItemResult, ReadoutItem, ScoreItem

__all__ = ["Client"]

# Called after every attempt of every call: (method, attempt from 1, shard index, code).
AttemptHook = Callable[[str, int, int, Any], None]


class Client:
    """A client of one or several kvq servers (thread-safe).

    Args:
        servers: "host:port", a comma-separated list, or a sequence of addresses. With
            several, sequences are sharded by consistent hashing of (tenant, sequence id);
            every client of a deployment must list the same set (order does not matter).
        tenant: sent as `x-kvq-tenant` when no token is set (auth off); also the tenant part
            of the shard key (default: the token, else "default").
        token: bearer token, sent as `authorization: Bearer <token>`. Refused over
            plaintext unless allow_insecure_token.
        tls: use TLS. root_certificates / private_key / certificate_chain: PEM bytes (or a
            path to a PEM file) of the CA and the client certificate (mTLS).
        deadline: seconds per attempt of each call (each method takes `deadline=` too).
        max_attempts, initial_backoff, max_backoff, backoff_multiplier: retries on
            UNAVAILABLE of the idempotent calls; before retry k a uniform random wait in
            [0, min(max_backoff, initial_backoff * multiplier**(k-1))].
        virtual_nodes: points per server on the hash ring.
        tls_server_name: name checked against the server certificate.
        allow_insecure_token: allow a token over plaintext (loopback tests only).
        on_attempt: called after every attempt (method, attempt, shard, grpc.StatusCode).
    """

    def __init__(
        self,
        servers: Union[str, Sequence[str]],
        *,
        tenant: Optional[str] = None,
        token: Optional[str] = None,
        tls: bool = False,
        root_certificates: Optional[Union[bytes, str]] = None,
        private_key: Optional[Union[bytes, str]] = None,
        certificate_chain: Optional[Union[bytes, str]] = None,
        deadline: float = 30.0,
        max_attempts: int = 4,
        initial_backoff: float = 0.05,
        max_backoff: float = 2.0,
        backoff_multiplier: float = 2.0,
        virtual_nodes: int = 128,
        tls_server_name: Optional[str] = None,
        allow_insecure_token: bool = False,
        on_attempt: Optional[AttemptHook] = None,
    ) -> None:
        raise NotImplementedError

    # -- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Closes every channel."""
        raise NotImplementedError

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- topology ---------------------------------------------------------------------------
    @property
    def servers(self) -> Sequence[str]:
        """The server addresses, in the order given."""
        raise NotImplementedError

    def shard_of(self, sequence_id: str) -> int:
        """Index into servers of the server owning a sequence of this client's tenant."""
        raise NotImplementedError

    # -- registry ---------------------------------------------------------------------------
    def register_basis(
        self,
        info: Union[kvq_pb2.ModelInfo, Mapping[str, Any]],
        basis: Sequence[Any] = (),
        *,
        deadline: Optional[float] = None,
    ) -> kvq_pb2.RegisterBasisResponse:
        """Registers a model (and its basis: one f32 [kv_heads, head_dim, rank] per layer) on
        every server; returns the first server's answer. Retried (idempotent)."""
        raise NotImplementedError

    def list_models(self, *, deadline: Optional[float] = None) -> list:
        """Every registered (model, version) of the first server (ModelInfo messages)."""
        raise NotImplementedError

    def get_model(
        self, model: str, version: int = 0, *, deadline: Optional[float] = None
    ) -> kvq_pb2.ModelInfo:
        """One model version (0: the latest). NOT_FOUND raises KvqError."""
        raise NotImplementedError

    # -- writes -----------------------------------------------------------------------------
    def put_blocks(
        self,
        appends: Sequence[Append],
        *,
        messages: Optional[Sequence[Sequence[Append]]] = None,
        deadline: Optional[float] = None,
    ) -> kvq_pb2.PutBlocksResponse:
        """Streams appends (one PutBlocks stream per server involved).

        By default all `appends` go in one message (atomic per server). `messages` instead
        gives the message boundaries explicitly (a list of lists of Append). Returns the
        counts summed over servers. Retried on UNAVAILABLE (re-sent ranges are duplicates).
        """
        raise NotImplementedError

    # -- batched reads ----------------------------------------------------------------------
    def score(
        self, items: Sequence[ScoreItem], *, check: bool = True, deadline: Optional[float] = None
    ) -> list:
        """Logits per item (outputs f32 [q_heads, n_q, tokens]); list[ItemResult] in order.
        check=True raises KvqError for the first failed item. Retried."""
        raise NotImplementedError

    def readout(
        self, items: Sequence[ReadoutItem], *, check: bool = True, deadline: Optional[float] = None
    ) -> list:
        """Weighted sums of values per item (outputs [q_heads, n_q, head_dim]). Retried."""
        raise NotImplementedError

    def attend(
        self, items: Sequence[AttendItem], *, check: bool = True, deadline: Optional[float] = None
    ) -> list:
        """Fused attention per item (outputs [q_heads, n_q, head_dim]); list[ItemResult].
        Retried only when every item has observe=False."""
        raise NotImplementedError

    def get_blocks(
        self,
        sequence_id: str,
        layers: Optional[Sequence[int]] = None,
        *,
        dtype: str = "f32",
        from_token: int = 0,
        to_token: int = 0,
        max_tokens_per_message: int = 0,
        basis_version: int = 0,
        deadline: Optional[float] = None,
    ) -> Iterator[Block]:
        """The sequence's cached K/V as attention sees them, chunk by chunk. Retried only
        until the first chunk arrived."""
        raise NotImplementedError

    def delete_sequence(self, sequence_id: str, *, deadline: Optional[float] = None) -> int:
        """Drops a sequence; returns the bytes freed. Never retried."""
        raise NotImplementedError

    def stats(self, *, deadline: Optional[float] = None) -> kvq_pb2.StatsResponse:
        """Usage of the caller's tenant; with several servers the counts are summed."""
        raise NotImplementedError

    def echo(self, payload: bytes, *, shard: int = 0, deadline: Optional[float] = None) -> bytes:
        """The diagnostic no-op: returns what the server sent back."""
        raise NotImplementedError
