"""Plain request and result types of the kvq client (dataclasses over numpy arrays).

Tensors ("array" below) are numpy arrays (float16, float32, or uint16 holding bfloat16 bits)
or torch tensors (float16, bfloat16, float32, on any device); see kvq.tensors for the rules.
Shapes follow proto/kvq/v1/kvq.proto: keys/values [kv_heads, n, head_dim], queries
[q_heads, n_q, head_dim] (or [q_heads, head_dim] for one query).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, List, Mapping, Optional, Sequence, Union

import grpc

from ._proto.kvq.v1 import kvq_pb2
from .errors import KvqError
from .tensors import Array

__all__ = [
    "CodecSettings",
    "Append",
    "AnyAppend",
    "AttendItem",
    "ScoreItem",
    "ReadoutItem",
    "ItemResult",
    "Block",
    "PrefixMatch",
    "OutputDType",
]

# "f32" | "f16" | "bf16": the dtype of decoded outputs the server sends back.
OutputDType = str


@dataclass
class CodecSettings:
    """Codec settings for a new sequence (or a model's defaults): a field left None keeps the
    receiver's value (the model's default); a field set is sent as it is, 0 and False
    included, and the server refuses a value out of range with INVALID_ARGUMENT naming the
    field and its limit.

    key_bits 2/3/4/8; key_group (G) 32/64/128; rank 0..basis rank (0: KIVI-like); side_bits
    4/8; value_bits 1/2/3/4/8; value_group channels per value scale (1..head_dim, at most 64
    groups a head: >= 2 at head_dim 128, the kernels' limit); value_policy "uniform" | "a2";
    value_budget (A2) 1.0..4.0 bits; sink_tokens (A2) positions kept at 4 bits, 0..1024;
    window (R) recent tokens kept at arrival precision, 0..65536; rotate_keys / rotate_values
    (Walsh-Hadamard rotation before quantization, head_dim a power of two); metric_rounding
    (keys rounded in the query metric; the basis must carry query moments); fp16_sinks 0..16:
    a sequence's first positions kept exact at fp16 beside its first blocks; sparse_keys /
    sparse_values 0..100: per mille of each key / value block's elements kept exact beside the
    codes. Fields and names are codec.json's and the wire's (one table in the server,
    core/codec_schema.h; a test holds this class to it).
    """

    key_bits: Optional[int] = None
    key_group: Optional[int] = None
    rank: Optional[int] = None
    side_bits: Optional[int] = None
    value_bits: Optional[int] = None
    value_group: Optional[int] = None
    value_policy: Optional[str] = None
    value_budget: Optional[float] = None
    sink_tokens: Optional[int] = None
    window: Optional[int] = None
    rotate_keys: Optional[bool] = None
    rotate_values: Optional[bool] = None
    metric_rounding: Optional[bool] = None
    fp16_sinks: Optional[int] = None
    sparse_keys: Optional[int] = None
    sparse_values: Optional[int] = None

    @classmethod
    def from_codec_json(cls, d: Mapping[str, Any]) -> CodecSettings:
        """The settings of a registry folder's codec.json object, as they are (absent fields
        stay None: the server's defaults). Unknown keys are a ValueError naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"codec.json: unknown field(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        return cls(**dict(d))


@dataclass
class Append:
    """Tokens [start, start + n) of one layer of one sequence.

    keys/values: [kv_heads, n, head_dim], post-RoPE, same dtype. Both None with token_ids
    given: an attach (take the longest indexed prefix run for those ids, no data sent).
    model/basis_version/codec: used when the append creates the sequence (basis_version
    None or 0: the latest version, then pinned; model None: the sequence's, for an append to
    an existing one).
    probe_weights: optional f32 [kv_heads, n] A^2 weights (value policy A2).
    token_ids: optional uint32 ids of the n tokens (prefix sharing).
    """

    sequence_id: str
    layer: int
    start: int
    keys: Any = None
    values: Any = None
    token_ids: Optional[Union[Sequence[int], Array]] = None
    model: Optional[str] = None
    basis_version: Optional[int] = None
    codec: Optional[CodecSettings] = None
    probe_weights: Any = None


# What put_blocks takes: an Append, or a kvq_pb2.Append built elsewhere (kvq.codes'
# EncodedLayer.to_appends: codes on the wire), sent as it is.
AnyAppend = Union[Append, "kvq_pb2.Append"]


@dataclass
class AttendItem:
    """One fused attention (score + softmax + readout) over a layer's cached tokens.

    causal_offset: query i sees tokens [0, causal_offset + i]; None: every cached token.
    scale: None (or 0) means 1/sqrt(head_dim). observe: None (server default: True) records
    A^2 statistics; False makes the item read-only (and the call retryable when every item is
    read-only). basis_version: None (or 0) any; else it must be the sequence's. append: a
    decode step's new tokens, appended before attending.
    """

    sequence_id: str
    layer: int
    queries: Any
    causal_offset: Optional[int] = None
    scale: Optional[float] = None
    observe: Optional[bool] = None
    output_dtype: OutputDType = "f32"
    basis_version: Optional[int] = None
    append: Optional[Append] = None


@dataclass
class ScoreItem:
    """Logits of queries against every cached token of a layer ([q_heads, n_q, tokens]).

    scale and basis_version as AttendItem's (None: 1/sqrt(head_dim); any version).
    """

    sequence_id: str
    layer: int
    queries: Any
    scale: Optional[float] = None
    corrections_only: bool = False
    basis_version: Optional[int] = None
    append: Optional[Append] = None


@dataclass
class ReadoutItem:
    """The weighted sum of a layer's cached values; weights f32 [q_heads, n_q, tokens].
    basis_version: None (or 0) any; else it must be the sequence's."""

    sequence_id: str
    layer: int
    weights: Any
    weights_are_logits: bool = False
    output_dtype: OutputDType = "f32"
    basis_version: Optional[int] = None


@dataclass
class ItemResult:
    """The outcome of one item of a batched call.

    code: grpc.StatusCode (OK on success); message: the server's message for a failed item;
    tokens: cached tokens the item read; outputs: numpy array (None when the item failed):
    Score logits f32 [q_heads, n_q, tokens], Attend/Readout [q_heads, n_q, head_dim] in the
    item's output dtype (float32, float16, or uint16 bfloat16 bits). method and index (the
    item's position in the call; None: unknown) name the item in raise_for_status's error.
    """

    code: grpc.StatusCode
    message: str
    tokens: int
    outputs: Optional[Array]
    method: str = field(default="", repr=False, compare=False)
    index: Optional[int] = field(default=None, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return bool(self.code == grpc.StatusCode.OK)

    def raise_for_status(self) -> ItemResult:
        """Raises KvqError when the item failed; returns self otherwise."""
        if not self.ok:
            # The server's item messages name the item already ("items[3]: ..."); a shard
            # failure's ("server X: ...") does not.
            where = f"items[{self.index}]" if self.index is not None and self.index >= 0 else ""
            msg = self.message if not where or self.message.startswith(where) else f"{where}: {self.message}"
            raise KvqError(self.method or "item", self.code, msg)
        return self


@dataclass
class Block:
    """A chunk of a sequence's cached K/V as attention sees them (GetBlocks).

    keys/values: [kv_heads, n, head_dim] numpy arrays ([n, kv_heads, head_dim] from a
    token_major read) of float32, float16, or uint16 bfloat16 bits, per the requested dtype;
    start: the position of the first token; layer_tokens: tokens cached in the layer.
    """

    layer: int
    start: int
    keys: Array
    values: Array
    layer_tokens: int
    basis_version: int


@dataclass
class PrefixMatch:
    """What a server could give back for a prompt (Client.match_prefix), read-only.

    indexed_tokens: tokens of the longest run of whole groups the tenant's prefix index holds
    for the token ids in every layer (what attaching them to a new sequence would take now);
    sequence_tokens: per asked sequence id, the fewest tokens of its layers (0: absent).
    """

    indexed_tokens: int
    sequence_tokens: List[int]
