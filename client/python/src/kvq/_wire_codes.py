"""A client's codes on the wire (ClientOptions.codes): which appends go as HeadQ codes, and
GetBlocks answers in codes decoded back to rows (docs/API.md, "Codes on the wire").

Puts: each layer a client creates (an Append at token 0 naming its model, with rows) gets a
kvq.codes.LayerEncoder, kept while later appends continue it (at most ClientOptions.encoders
layers, least recently used dropped). The encoder takes every row the client sends and encodes
on the server's schedule; an append goes as codes (the groups from the layer's encoded end on,
then the rows after them) only when the groups it completes cover enough of its new rows to be
fewer bytes than those rows (a prefill or a whole chunk), else as its rows (a decode step),
which the server encodes into the same blocks. Rows always for: the A^2 value policy (its
widths follow the attention the server observes), probe weights, an append that is not the
first of its layer in a message, a layer whose encoder was dropped or is behind, a model whose
basis the server does not give (an older server) or whose block-format versions do not overlap
the native codec's; each reason is logged once per model at INFO.

Gets: GetBlocks asks for codes and decodes the groups here (bit for bit GetBlocks' own decode);
a server that answers rows (an older one) is read as rows.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple, Union

import grpc
import numpy as np
from numpy.typing import NDArray

from ._proto.kvq.v1 import kvq_pb2
from ._requests import block_of
from .errors import KvqError
from .paged import PagedLayout
from .tensors import bf16_to_f32
from .types import AnyAppend, Append, Block

logger = logging.getLogger("kvq")

# (model, version asked for: 0 the latest)
ModelKey = Tuple[str, int]


def _codes_module() -> Optional[object]:
    """kvq.codes, or None when the native module cannot be loaded (a pure-Python install)."""
    try:
        from . import codes
    except ImportError as e:  # pragma: no cover - the package always builds it
        logger.info("kvq: codes on the wire off: the native codec did not load (%s)", e)
        return None
    return codes


@dataclass
class _Layer:
    """One layer's encoder and the token ids of its rows not yet in groups (None: an append
    without ids reached it, so a later append in codes cannot name every token)."""

    encoder: object
    ids: Optional[List[int]] = field(default_factory=list)


class WireCodes:
    """The codes state of one client (thread-safe)."""

    def __init__(self, enabled: bool, max_layers: int) -> None:
        self._codes = _codes_module() if enabled else None
        self._max_layers = max_layers
        self._lock = threading.Lock()
        self._models: Dict[ModelKey, object] = {}  # ModelCodes
        self._rows_reason: Dict[ModelKey, str] = {}
        self._layers: OrderedDict[Tuple[str, int], _Layer] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self._codes is not None

    # -- models -----------------------------------------------------------------------------
    def models_to_fetch(self, messages: Iterable[Iterable[AnyAppend]]) -> List[ModelKey]:
        """The models whose basis a put needs before it can encode (creating appends)."""
        if self._codes is None:
            return []
        want: Set[ModelKey] = set()
        with self._lock:
            for msg in messages:
                for a in msg:
                    key = self._creates(a)
                    if key and key not in self._models and key not in self._rows_reason:
                        want.add(key)
        return sorted(want)

    def add_model(self, key: ModelKey, basis: Union[kvq_pb2.RegisterBasisRequest, KvqError]) -> None:
        """GetBasis's answer for `key` (or its error: the model's appends then go as rows)."""
        assert self._codes is not None
        if isinstance(basis, KvqError):
            if basis.code == grpc.StatusCode.NOT_FOUND:
                return  # the put itself names the missing model
            self._rows(key, f"GetBasis failed: {basis}")
            return
        try:
            codes = self._codes.ModelCodes(basis)  # type: ignore[attr-defined]
        except KvqError as e:
            self._rows(key, str(e.details))
            return
        with self._lock:
            self._models[key] = codes
            self._models[(key[0], int(basis.info.version))] = codes

    def model(self, model: str, version: int) -> Optional[object]:
        with self._lock:
            return self._models.get((model, version))

    def _rows(self, key: ModelKey, reason: str) -> None:
        with self._lock:
            if key in self._rows_reason:
                return
            self._rows_reason[key] = reason
        logger.info("kvq: model %s (version %s) goes as fp16 rows on the wire: %s", key[0], key[1] or "latest", reason)

    @staticmethod
    def _creates(a: AnyAppend) -> Optional[ModelKey]:
        if isinstance(a, Append) and a.start == 0 and a.model and a.keys is not None:
            return (a.model, int(a.basis_version or 0))
        return None

    # -- puts -------------------------------------------------------------------------------
    def encode(self, messages: List[List[AnyAppend]]) -> List[List[AnyAppend]]:
        """Each append in the form it goes in (kvq_pb2.Append in codes, else as given)."""
        if self._codes is None:
            return messages
        out: List[List[AnyAppend]] = []
        for msg in messages:
            seen: Set[Tuple[str, int]] = set()
            row: List[AnyAppend] = []
            for a in msg:
                if not isinstance(a, Append):
                    row.append(a)
                    continue
                key = (a.sequence_id, int(a.layer))
                row.append(self._encode(a, first=key not in seen))
                seen.add(key)
            out.append(row)
        return out

    def _encode(self, a: Append, first: bool) -> AnyAppend:
        key = (a.sequence_id, int(a.layer))
        if a.keys is None or a.values is None:  # an attach: the layer holds rows we never saw
            self.forget_layer(key)
            return a
        state = self._layer_for(a)
        if state is None:
            return a
        enc = state.encoder
        before = enc.tokens  # type: ignore[attr-defined]
        if before != a.start:  # the server holds rows this encoder did not take
            self.forget_layer(key)
            return a
        try:
            run = enc.append(a.keys, a.values)  # type: ignore[attr-defined]
        except KvqError:
            self.forget_layer(key)  # rows the server refuses, naming the field in its terms
            return a
        # Token ids of the encoder's rows [run.start, tokens): those held, then the new ones.
        ids = None if a.token_ids is None else [int(i) for i in np.asarray(a.token_ids).reshape(-1)]
        held = state.ids
        every = None if ids is None or held is None else held + ids
        if every is not None:
            state.ids = every[run.encoded_tokens - run.start:]
        elif ids is not None and run.encoded_tokens >= before:
            state.ids = ids[run.encoded_tokens - before:]  # every held row is in groups now
        else:
            state.ids = None
        covered = run.encoded_tokens - before  # new rows inside the groups
        row_bytes = 2 * run.keys.shape[0] * run.keys.shape[2] * run.keys.dtype.itemsize
        if (not first or a.probe_weights is not None or covered <= 0
                or len(run.blocks) >= covered * row_bytes or (ids is not None and every is None)):
            return a  # the server encodes the groups these rows complete into the same bytes
        pb = kvq_pb2.Append()
        run.fill_append(pb, a.sequence_id, create=a.start == 0)
        if every is not None:
            pb.token_ids[:] = every
        return pb

    def _layer_for(self, a: Append) -> Optional[_Layer]:
        key = (a.sequence_id, int(a.layer))
        with self._lock:
            state = self._layers.get(key)
            if state is not None:
                self._layers.move_to_end(key)
                return state
        if a.start != 0 or not a.model:
            return None
        mkey = (a.model, int(a.basis_version or 0))
        codes = self.model(*mkey)
        if codes is None:
            return None
        try:
            codec = codes.codec(a.codec)  # type: ignore[attr-defined]
        except KvqError:
            return None  # the server names what is wrong with it
        if codec.settings().value_policy == "a2":
            self._rows(mkey, "value policy a2: its widths follow the attention the server observes")
            return None
        state = _Layer(codes.encoder(int(a.layer), codec))  # type: ignore[attr-defined]
        with self._lock:
            self._layers[key] = state
            while len(self._layers) > self._max_layers:
                self._layers.popitem(last=False)
        return state

    def forget_layer(self, key: Tuple[str, int]) -> None:
        with self._lock:
            self._layers.pop(key, None)

    def forget(self, messages: Iterable[Iterable[AnyAppend]]) -> None:
        """Drops the encoders of every layer these appends touch (after a failed put: the
        server may not hold what they took)."""
        for msg in messages:
            for a in msg:
                self.forget_layer((getattr(a, "sequence_id", ""), int(getattr(a, "layer", 0))))

    def forget_sequence(self, sequence_id: str) -> None:
        with self._lock:
            for key in [k for k in self._layers if k[0] == sequence_id]:
                del self._layers[key]

    # -- gets -------------------------------------------------------------------------------
    def request_codes(self, req: kvq_pb2.GetBlocksRequest) -> None:
        """Asks a GetBlocks request for codes (when on)."""
        if self._codes is not None:
            req.codes = True
            req.max_block_version = self._codes.BLOCK_VERSION_MAX  # type: ignore[attr-defined]


class StreamDecoder:
    """One GetBlocks stream's messages as the Blocks a stream of rows gives: codes decoded with
    the model's ModelCodes (the caller fetches a basis when `needs` names one), clipped to the
    range asked for (a range starting inside a group comes from the group's first token) and
    cut into chunks of max_tokens_per_message from the range's start, as the server cuts rows;
    with token_major, keys and values [n, kv_heads, head_dim] (codes decoded so, rows
    transposed)."""

    def __init__(self, wire: WireCodes, req: kvq_pb2.GetBlocksRequest, token_major: bool = False) -> None:
        self._wire = wire
        self._axis = 0 if token_major else 1  # the tokens' axis of the Blocks made
        self._dtype = {kvq_pb2.DTYPE_F16: "f16", kvq_pb2.DTYPE_BF16: "bf16"}.get(req.dtype, "f32")
        self._from = int(req.from_token)
        self._to = int(req.to_token)
        self._chunk = int(req.max_tokens_per_message) or 4096
        self._codecs: Dict[int, object] = {}
        self._model: Optional[Tuple[str, int]] = None
        self._pending: Optional[Block] = None  # decoded tokens of one layer not yet given out

    def needs(self, msg: kvq_pb2.GetBlocksResponse) -> Optional[ModelKey]:
        """The model whose basis decoding `msg` needs and the client lacks, else None."""
        if msg.model:
            self._model = (msg.model, int(msg.basis_version))
        if not msg.HasField("encoded") or self._model is None:
            return None
        return None if self._wire.model(*self._model) is not None else self._model

    def blocks(self, msg: kvq_pb2.GetBlocksResponse, bf16: str) -> List[Block]:
        """The Blocks that `msg` completes (rows messages as they are)."""
        if msg.layer not in self._codecs and not msg.HasField("codec"):
            return self.finish() + [self._rows_block(msg, bf16)]
        out = [] if self._pending is None or self._pending.layer == msg.layer else self.finish()
        got = self._decode(msg, bf16)
        p = self._pending
        a = self._axis
        if p is not None:
            got = Block(p.layer, p.start, np.concatenate([p.keys, got.keys], axis=a),
                        np.concatenate([p.values, got.values], axis=a), got.layer_tokens, got.basis_version)
        if got.keys.shape[a] == 0 and p is None:
            self._pending = None
            return out + [got]  # an empty range: one message naming the layer's length
        n = got.keys.shape[a]
        cut = 0
        while n - cut >= self._chunk:
            out.append(self._slice(got, cut, cut + self._chunk))
            cut += self._chunk
        rest = self._slice(got, cut, n)
        self._pending = rest if rest.keys.shape[a] else None
        return out

    def _slice(self, block: Block, lo: int, hi: int) -> Block:
        """Tokens [lo, hi) of a block (views)."""
        at = (slice(None), slice(lo, hi)) if self._axis == 1 else (slice(lo, hi),)
        return dataclasses.replace(block, start=block.start + lo, keys=block.keys[at], values=block.values[at])

    def _rows_block(self, msg: kvq_pb2.GetBlocksResponse, bf16: str) -> Block:
        """A message of rows as a Block, token-major when asked."""
        block = block_of(msg, bf16)
        if self._axis == 1:
            return block
        return dataclasses.replace(block, keys=np.ascontiguousarray(block.keys.transpose(1, 0, 2)),
                                   values=np.ascontiguousarray(block.values.transpose(1, 0, 2)))

    def finish(self) -> List[Block]:
        """The last Blocks of the layer being read."""
        p, self._pending = self._pending, None
        return [] if p is None else [p]

    def into(self, msg: kvq_pb2.GetBlocksResponse, cache: Any, layout: PagedLayout,
             block_offsets: NDArray[np.int64]) -> Tuple[int, int]:
        """Writes a message of a stream in codes straight into a paged cache (ModelCodes.
        decode_into), clipped to the range asked for: (its layer, the tokens written)."""
        codes = self._stream_codes(msg)
        if msg.layer not in self._codecs:
            raise KvqError("GetBlocks", grpc.StatusCode.INTERNAL,
                           f"layer {msg.layer}: a message in rows or before the one naming the codec")
        written = codes.decode_into(msg, self._codecs[msg.layer], cache, layout,  # type: ignore[attr-defined]
                                    block_offsets, self._from, self._to if self._to > 0 else None)
        return int(msg.layer), int(written)

    def _stream_codes(self, msg: kvq_pb2.GetBlocksResponse) -> object:
        """The ModelCodes of the stream's model; the layer's codec noted from its first message."""
        codes = None if self._model is None else self._wire.model(*self._model)
        if codes is None:
            raise KvqError("GetBlocks", grpc.StatusCode.INTERNAL, "codes of a model the stream did not name")
        if msg.HasField("codec"):
            self._codecs[msg.layer] = codes.codec(msg.codec)  # type: ignore[attr-defined]
        return codes

    def _decode(self, msg: kvq_pb2.GetBlocksResponse, bf16: str) -> Block:
        codes = self._stream_codes(msg)
        if not msg.encoded.block_bytes:  # window rows only (start need not be a group's)
            block = self._rows_block(msg, bf16)
        else:
            keys, values = codes.decode(msg, self._codecs[msg.layer], dtype=self._dtype,  # type: ignore[attr-defined]
                                        token_major=self._axis == 0)
            if self._dtype == "bf16" and bf16 == "f32":
                keys, values = bf16_to_f32(keys), bf16_to_f32(values)
            block = Block(int(msg.layer), int(msg.start), keys, values, int(msg.layer_tokens), int(msg.basis_version))
        # Clipped to the range asked for [from_token, to_token).
        n = int(block.keys.shape[self._axis])
        lo = max(0, self._from - block.start)
        hi = n if self._to <= 0 else max(lo, min(n, self._to - block.start))
        return self._slice(block, lo, hi)
