"""kvq: a Python client of the kvq KV-cache server (HeadQ codes over gRPC)."""

from .client import Client, ClientOptions
from .errors import KvqError
from .paged import PagedLayout
from .types import (
    Append,
    AttendItem,
    Block,
    CodecSettings,
    ItemResult,
    PrefixMatch,
    ReadoutItem,
    ScoreItem,
)

__all__ = [
    "Client",
    "ClientOptions",
    "KvqError",
    "Append",
    "AttendItem",
    "Block",
    "CodecSettings",
    "ItemResult",
    "PagedLayout",
    "PrefixMatch",
    "ReadoutItem",
    "ScoreItem",
]

__version__ = "0.1.0"
