"""HeadQ codes on the wire for Python clients (docs/API.md, "Codes on the wire").

A model's encoder and decoder, made from its GetBasis answer, running kvq's own C++ codec (the
native module kvq._codes: core's LayerCache to encode, core::DecodeMessage to decode, as the C++
client's kvq::client::ModelCodes does), so that the blocks made here are the server's byte for
byte and the rows decoded here are GetBlocks' decoded rows bit for bit.

    basis = client.get_basis("tiny")
    codes = kvq.codes.ModelCodes(basis)
    enc = codes.encode(layer, keys, values)              # keys/values [kv_heads, n, head_dim]
    client.stub().PutBlocks(iter([kvq_pb2.PutBlocksRequest(appends=enc.to_appends("seq"))]))
    req = kvq_pb2.GetBlocksRequest(sequence_id="seq", codes=True,
                                   max_block_version=kvq.codes.BLOCK_VERSION_MAX)
    for block in codes.decode_stream(client.stub().GetBlocks(req), dtype="f16"): ...

Arrays in: numpy float32 / float16 arrays, numpy uint16 arrays taken as bfloat16 bit patterns
(numpy has no bfloat16; kvq.tensors' convention), torch tensors of float32 / float16 / bfloat16
on any device (copied to the CPU). Arrays out: numpy, float32, float16, or uint16 bfloat16 bits.
Errors: KvqError with the codec's status code (INVALID_ARGUMENT naming the field, DATA_LOSS for
a corrupted block, FAILED_PRECONDITION for a run of another basis or model). The codec runs
without the GIL; a ModelCodes is immutable and thread-safe, a LayerEncoder serialises its
appends.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple, Union

import grpc
import numpy as np

from . import _codes
from ._proto.kvq.v1 import kvq_pb2
from .errors import KvqError, code_from_int
from .paged import PagedLayout
from .tensors import Array, _torch_to_numpy, dtype_enum, is_torch
from .types import Block, CodecSettings

__all__ = [
    "BLOCK_VERSION_MIN",
    "BLOCK_VERSION_MAX",
    "Codec",
    "EncodedLayer",
    "LayerEncoder",
    "ModelCodes",
]

# The block-format versions the codec reads and writes: GetBlocksRequest.max_block_version is
# BLOCK_VERSION_MAX; a server's ModelInfo.block_version_min/max must overlap them.
BLOCK_VERSION_MIN: int = _codes.BLOCK_VERSION_MIN
BLOCK_VERSION_MAX: int = _codes.BLOCK_VERSION_MAX

# The settings' values as the native module takes them.
_Settings = Dict[str, Union[int, float, bool, str]]
_POLICY_NAMES = {
    kvq_pb2.CodecSettings.VALUE_POLICY_UNIFORM: "uniform",
    kvq_pb2.CodecSettings.VALUE_POLICY_A2: "a2",
}
_POLICY_ENUMS = {name: enum for enum, name in _POLICY_NAMES.items()}
_LITTLE = sys.byteorder == "little"
_DTYPE_NAMES = {kvq_pb2.DTYPE_F32: "f32", kvq_pb2.DTYPE_F16: "f16", kvq_pb2.DTYPE_BF16: "bf16"}
_NO_END = 2**62  # decode_into's to_token when the range runs to the end
_WIRE_NUMPY: Dict[int, np.dtype[Any]] = {
    kvq_pb2.DTYPE_F32: np.dtype("<f4"), kvq_pb2.DTYPE_F16: np.dtype("<f2"), kvq_pb2.DTYPE_BF16: np.dtype("<u2"),
}
# What ModelCodes.codec and the encoders take as a codec.
CodecLike = Union[None, "Codec", CodecSettings, kvq_pb2.CodecSettings, Mapping[str, Any]]


def _error(method: str, e: _codes.Error) -> KvqError:
    """The native module's error as the client's."""
    code, message = e.args
    return KvqError(method, code_from_int(int(code)), str(message))


def _settings_of(settings: Union[None, CodecSettings, kvq_pb2.CodecSettings, Mapping[str, Any]],
                 method: str) -> _Settings:
    """{name: value} of the settings that are set: a kvq_pb2.CodecSettings' fields with presence
    (value_policy as "uniform" / "a2"; VALUE_POLICY_DEFAULT set is INVALID_ARGUMENT, as on the
    wire), a CodecSettings' (or a mapping of its fields') that are not None."""
    if settings is None:
        return {}
    out: _Settings = {}
    if isinstance(settings, kvq_pb2.CodecSettings):
        for f, value in settings.ListFields():
            if f.name == "value_policy":
                name = _POLICY_NAMES.get(value)
                if name is None:
                    raise KvqError.invalid(method, f"codec.value_policy = {value}: must be "
                                                   "VALUE_POLICY_UNIFORM (1) or VALUE_POLICY_A2 (2)")
                out[f.name] = name
            else:
                out[f.name] = value
        return out
    if isinstance(settings, Mapping):
        unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(CodecSettings)})
        if unknown:
            raise KvqError.invalid(method, f"codec: no setting named {', '.join(map(str, unknown))}")
        settings = CodecSettings(**settings)
    for f in dataclasses.fields(CodecSettings):
        value = getattr(settings, f.name)
        if value is not None:
            out[f.name] = str(value).lower() if f.name == "value_policy" else value
    return out


def _f32_tensors(tensors: Iterable[kvq_pb2.Tensor], field: str, method: str) -> List[Array]:
    """Each F32 tensor as a numpy float32 array of its shape (the native module checks the
    shapes against the model's)."""
    out = []
    for i, t in enumerate(tensors):
        shape = tuple(t.shape)
        data = t.data
        if t.dtype != kvq_pb2.DTYPE_F32 or len(shape) != 3 or math.prod(shape) * 4 != len(data):
            raise KvqError.invalid(method, f"{field}[{i}]: must be DTYPE_F32 of 3 dimensions, "
                                           f"{len(data)} bytes for shape {list(shape)}")
        out.append(np.frombuffer(data, dtype="<f4").reshape(shape).astype(np.float32, copy=False))
    return out


def _rows_in(x: Any, field: str, method: str) -> Array:
    """keys or values given to an encoder: a C-contiguous numpy array of float32, float16 or
    uint16 (bfloat16 bits) in native byte order."""
    if is_torch(x):
        arr, _ = _torch_to_numpy(x, field, method)
    elif isinstance(x, np.ndarray):
        arr = x
    else:
        raise KvqError.invalid(method, f"{field}: expected a numpy array or torch tensor, got {type(x).__name__}")
    kind = (arr.dtype.kind, arr.dtype.itemsize)
    if kind not in (("f", 4), ("f", 2), ("u", 2)):
        raise KvqError.invalid(method, f"{field}: dtype {arr.dtype} is not float32, float16 or bfloat16 "
                                       "(a uint16 array of bfloat16 bits)")
    if arr.ndim != 3:
        raise KvqError.invalid(method, f"{field}: shape {list(arr.shape)} is not [kv_heads, n, head_dim]")
    return np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("="))


def _rows_out(t: kvq_pb2.Tensor, field: str, method: str) -> Optional[Array]:
    """A GetBlocksResponse's window rows ([kv_heads, n, head_dim]) as a read-only numpy array
    over the message's bytes, or None when it holds none."""
    shape = tuple(t.shape)
    if not shape or math.prod(shape) == 0:
        return None
    dt = _WIRE_NUMPY.get(t.dtype)
    data = t.data
    if dt is None or len(shape) != 3 or math.prod(shape) * dt.itemsize != len(data):
        raise KvqError(method, grpc.StatusCode.INTERNAL,
                       f"{field}: server sent {len(data)} bytes of dtype {t.dtype} for shape {list(shape)}")
    arr = np.frombuffer(data, dtype=dt).reshape(shape)
    return arr if _LITTLE else arr.astype(dt.newbyteorder("="))


class Codec:
    """A sequence's codec, validated against its model (ModelCodes.codec): every setting has a
    value (the model's default where none was given)."""

    def __init__(self, native: _codes.Codec) -> None:
        self._native = native

    @property
    def native(self) -> _codes.Codec:
        """The native module's codec."""
        return self._native

    @property
    def head_dim(self) -> int:
        return self._native.head_dim

    @property
    def key_group(self) -> int:
        """G: tokens per encoded group."""
        return self._native.key_group

    @property
    def rank(self) -> int:
        """The HeadQ side code's rank (0: none)."""
        return self._native.rank

    @property
    def fp16_sinks(self) -> int:
        return self._native.fp16_sinks

    @property
    def window(self) -> int:
        return self._native.window

    def settings(self) -> CodecSettings:
        """Every setting as a CodecSettings (no field None)."""
        return CodecSettings(**self._native.settings())  # type: ignore[arg-type]

    def to_pb(self) -> kvq_pb2.CodecSettings:
        """Every setting as a kvq_pb2.CodecSettings (every field set): what an append that
        creates a sequence names so that the server takes exactly this codec."""
        values: Dict[str, Any] = dict(self._native.settings())
        values["value_policy"] = _POLICY_ENUMS[str(values["value_policy"])]
        return kvq_pb2.CodecSettings(**values)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and (self.head_dim, self._native.settings()) == (
            other.head_dim, other._native.settings())

    def __hash__(self) -> int:
        return hash(str(self))

    def __str__(self) -> str:
        return str(self._native)

    def __repr__(self) -> str:
        return f"Codec({self})"


@dataclass(frozen=True, eq=False)
class EncodedLayer:
    """What an encoder gives for one append: the groups encoded since its previous append (a run
    of `groups` groups from token `start`, docs/CODEC.md "Codes on the wire") and the rows that
    stay rows (the incomplete group and the window, tokens [encoded_tokens, tokens), in the
    arrival dtype): exactly what an Append with `encoded` carries (fill_append, to_appends).

    blocks: the groups' blocks (for each group and KV head its key block then its value block);
    block_bytes: each block's size, uint32 [2 * kv_heads * groups]; sink_keys / sink_values:
    the fp16 sinks' exact rows, float16 [kv_heads, fp16_sinks, head_dim], only with group 0
    under a codec with fp16_sinks (else None); basis_fingerprint: the basis the side codes were
    made with ("" at rank 0); keys / values: the rows, [kv_heads, tokens - encoded_tokens,
    head_dim] of rows_dtype ("f32", "f16" or "bf16": uint16 bits); tokens: every token the
    encoder holds; encoded_tokens: those in groups.
    """

    model: str
    basis_version: int
    layer: int
    codec: Codec
    start: int
    groups: int
    blocks: bytes
    block_bytes: Array
    sink_keys: Optional[Array]
    sink_values: Optional[Array]
    basis_fingerprint: str
    keys: Array
    values: Array
    rows_dtype: str
    tokens: int
    encoded_tokens: int

    @property
    def rows(self) -> int:
        """Tokens sent as rows (after the groups)."""
        return self.tokens - self.encoded_tokens

    def encoded_pb(self, first: int = 0, last: Optional[int] = None) -> kvq_pb2.EncodedGroups:
        """Groups [first, last) of the run (None: to its end) as a kvq_pb2.EncodedGroups, with
        the sinks when the slice starts at the sequence's group 0."""
        last = self.groups if last is None else last
        if not 0 <= first <= last <= self.groups:
            raise KvqError.invalid("encode", f"groups [{first}, {last}) of a run of {self.groups}")
        per = int(self.block_bytes.size // self.groups) if self.groups else 0
        offsets = np.concatenate(([0], np.cumsum(self.block_bytes, dtype=np.int64)))
        out = kvq_pb2.EncodedGroups(
            blocks=self.blocks[int(offsets[first * per]):int(offsets[last * per])],
            block_bytes=self.block_bytes[first * per:last * per].tolist(),
            basis_fingerprint=self.basis_fingerprint,
        )
        if first == 0 and self.start == 0:
            for sinks, tensor in ((self.sink_keys, out.sink_keys), (self.sink_values, out.sink_values)):
                if sinks is not None:
                    tensor.dtype = kvq_pb2.DTYPE_F16
                    tensor.shape[:] = sinks.shape
                    tensor.data = np.ascontiguousarray(sinks, dtype="<f2").tobytes()
        return out

    def fill_append(self, out: kvq_pb2.Append, sequence_id: str, *, create: Optional[bool] = None) -> kvq_pb2.Append:
        """Fills `out` (e.g. a field of a PutBlocksRequest being built) with the whole run and
        the rows: sequence_id, layer, start, encoded (when there are groups), keys and values
        (when there are rows). create: also name the model, its basis version and the codec
        (every field), as the append that creates the sequence must (None: when the run
        starts at token 0). Returns `out`."""
        if self.groups == 0 and self.rows == 0:
            raise KvqError.invalid("encode", "nothing to append: no group and no row")
        return self._fill(out, sequence_id, 0, self.groups, True, self.start == 0 if create is None else create)

    def to_appends(self, sequence_id: str, *, max_tokens: Optional[int] = None,
                   create: Optional[bool] = None) -> List[kvq_pb2.Append]:
        """The run as appends of at most max_tokens tokens of whole groups each (at least one
        group; None: one append), the last one also carrying the rows; the first names the
        model and codec when `create` (None: when the run starts at token 0). Empty when
        there is nothing to send. An append with encoded groups must be the first append of
        its layer in a PutBlocks message: send several of one layer in messages of their own
        (Client.put_blocks(messages=[[a] for a in appends]))."""
        if self.groups == 0 and self.rows == 0:
            return []
        create = self.start == 0 if create is None else create
        G = self.codec.key_group
        per = max(1, self.groups if max_tokens is None else max_tokens // G)
        out: List[kvq_pb2.Append] = []
        for g in range(0, max(self.groups, 1), per):
            last = min(self.groups, g + per)
            out.append(self._fill(kvq_pb2.Append(), sequence_id, g, last, last == self.groups, create and g == 0))
        return out

    def _fill(self, a: kvq_pb2.Append, sequence_id: str, first: int, last: int, rows: bool,
              create: bool) -> kvq_pb2.Append:
        G = self.codec.key_group
        a.sequence_id = sequence_id
        a.layer = self.layer
        a.start = self.start + first * G
        if create:
            a.model = self.model
            a.basis_version = self.basis_version
            a.codec.CopyFrom(self.codec.to_pb())
        if last > first:
            a.encoded.CopyFrom(self.encoded_pb(first, last))
        if rows and self.rows > 0:
            enum = dtype_enum(self.rows_dtype, "keys", "encode")
            for arr, t in ((self.keys, a.keys), (self.values, a.values)):
                t.dtype = enum
                t.shape[:] = arr.shape
                t.data = np.ascontiguousarray(arr, dtype=_WIRE_NUMPY[enum]).tobytes()
        return a


class LayerEncoder:
    """One layer of one sequence encoded on the client (ModelCodes.encoder): each append adds
    tokens after those appended before (the first at token 0) and gives the groups that became
    whole since the previous append with the rows after them, so that a chunked put sends, each
    time, the groups from the layer's encoded end on (window rows of the previous chunk that a
    group now covers are replaced by it on the server)."""

    def __init__(self, codes: ModelCodes, layer: int, codec: Codec) -> None:
        self._codes = codes
        self._codec = codec
        try:
            self._native = codes.native.encoder(layer, codec.native)
        except _codes.Error as e:
            raise _error("encode", e) from None

    @property
    def layer(self) -> int:
        return self._native.layer

    @property
    def codec(self) -> Codec:
        return self._codec

    @property
    def tokens(self) -> int:
        """Tokens appended so far."""
        return self._native.tokens

    @property
    def encoded_tokens(self) -> int:
        """Of those, the tokens in encoded groups."""
        return self._native.encoded_tokens

    def append(self, keys: Any, values: Any) -> EncodedLayer:
        """Appends keys and values ([kv_heads, n, head_dim], one dtype) and encodes every group
        that became whole (the codec's window rule: tokens are encoded a group at a time once
        more than window + G - 1 wait)."""
        k = _rows_in(keys, "keys", "encode")
        v = _rows_in(values, "values", "encode")
        try:
            r = self._native.append(k, v)
        except _codes.Error as e:
            raise _error("encode", e) from None
        info = self._codes.info
        return EncodedLayer(
            model=info.model, basis_version=info.version, layer=self.layer, codec=self._codec,
            start=r.first_group * self._codec.key_group, groups=r.groups, blocks=r.blocks,
            block_bytes=r.block_bytes, sink_keys=r.sink_keys, sink_values=r.sink_values,
            basis_fingerprint=r.basis_fingerprint, keys=r.keys, values=r.values,
            rows_dtype=r.rows_dtype, tokens=r.tokens, encoded_tokens=r.encoded_tokens,
        )


class ModelCodes:
    """A model's encoder and decoder, from its GetBasis answer (a kvq_pb2.RegisterBasisRequest:
    the model's ModelInfo, codec included, and its basis tensors) for the model version the
    sequences are pinned to."""

    def __init__(self, basis: kvq_pb2.RegisterBasisRequest) -> None:
        method = "ModelCodes"
        info = basis.info
        if info.block_version_max and (info.block_version_max < BLOCK_VERSION_MIN or
                                       info.block_version_min > BLOCK_VERSION_MAX):
            raise KvqError(method, grpc.StatusCode.FAILED_PRECONDITION,
                           f"the server reads and writes block-format versions {info.block_version_min} to "
                           f"{info.block_version_max}; this codec {BLOCK_VERSION_MIN} to {BLOCK_VERSION_MAX}")
        self._info = kvq_pb2.ModelInfo()
        self._info.CopyFrom(info)
        try:
            self._native = _codes.Model(
                info.model, info.version, info.layers, info.kv_heads, info.q_heads, info.head_dim,
                info.basis_rank, info.fingerprint, _settings_of(info.codec, method),
                _f32_tensors(basis.basis, "basis", method),
                _f32_tensors(basis.encode_basis, "encode_basis", method),
                _f32_tensors(basis.query_moment, "query_moment", method),
            )
            self._default = Codec(self._native.default_codec())
        except _codes.Error as e:
            raise _error(method, e) from None

    @classmethod
    def from_basis(cls, info: Mapping[str, Any], basis: Any = (), encode_basis: Any = (),
                   query_moment: Any = ()) -> ModelCodes:
        """A model's encoder and decoder without a server: `info` and the tensors as RegisterBasis
        takes them (kvq.client.register_request), e.g. a basis fitted here before it is
        registered."""
        from ._requests import register_request

        return cls(register_request(info, basis, encode_basis, query_moment))

    @property
    def native(self) -> _codes.Model:
        """The native module's model."""
        return self._native

    @property
    def info(self) -> kvq_pb2.ModelInfo:
        """The model's ModelInfo as GetBasis sent it (a copy: do not change it)."""
        return self._info

    @property
    def default_codec(self) -> Codec:
        """The model's codec defaults (ModelInfo.codec over the registry's defaults)."""
        return self._default

    def codec(self, settings: CodecLike = None) -> Codec:
        """A sequence's codec: `settings` (those set) over the model's defaults, checked as the
        server checks a new sequence's (KvqError INVALID_ARGUMENT naming the field; rank beyond
        the basis rank; metric_rounding without query moments: FAILED_PRECONDITION). A
        GetBlocksResponse's codec (every field set) gives the sequence's codec exactly."""
        if isinstance(settings, Codec):
            return settings
        try:
            return Codec(self._native.codec(_settings_of(settings, "codec")))
        except _codes.Error as e:
            raise _error("codec", e) from None

    def encoder(self, layer: int, codec: CodecLike = None) -> LayerEncoder:
        """An encoder for one layer of a new sequence (codec: as ModelCodes.codec; None: the
        model's defaults)."""
        return LayerEncoder(self, layer, self.codec(codec))

    def encode(self, layer: int, keys: Any, values: Any, codec: CodecLike = None) -> EncodedLayer:
        """Tokens [0, n) of one layer of a new sequence encoded (keys, values [kv_heads, n,
        head_dim]): the whole groups as a run from token 0 and the rows after them, in the
        arrival dtype. The blocks are those the server makes from the same rows, byte for
        byte."""
        return self.encoder(layer, codec).append(keys, values)

    def decode(self, msg: kvq_pb2.GetBlocksResponse, codec: Union[None, Codec, kvq_pb2.CodecSettings] = None,
               *, dtype: str = "f32", token_major: bool = False) -> Tuple[Array, Array]:
        """One GetBlocks message in codes (GetBlocksRequest.codes): its tokens [start, start +
        n), the groups decoded then the window rows, as keys and values [kv_heads, n,
        head_dim] ([n, kv_heads, head_dim] with token_major) in `dtype` ("f32", "f16" or
        "bf16": uint16 bits): bit for bit what GetBlocks without codes sends in that dtype.
        codec: the sequence's, which the first message of each layer names (msg.codec; None:
        that one, so later messages need it passed).
        The run is checked as untrusted first (DATA_LOSS for a corrupted block; a run of
        another basis or a message of another model version: FAILED_PRECONDITION)."""
        method = "decode"
        name = _DTYPE_NAMES[dtype_enum(dtype, "dtype", method)]
        c, sinks = self._message_codec(msg, codec, method)
        enc = msg.encoded
        try:
            return self._native.decode(
                msg.layer, c.native, msg.start, enc.blocks, np.asarray(enc.block_bytes, dtype=np.uint32),
                sinks[0], sinks[1], enc.basis_fingerprint, _rows_out(msg.keys, "keys", method),
                _rows_out(msg.values, "values", method), name, token_major,
            )
        except _codes.Error as e:
            raise _error(method, e) from None

    def decode_into(self, msg: kvq_pb2.GetBlocksResponse, codec: Union[None, Codec, kvq_pb2.CodecSettings],
                    cache: Any, layout: PagedLayout, block_offsets: Any, from_token: int = 0,
                    to_token: Optional[int] = None) -> int:
        """decode's message written straight into a paged KV cache instead: `cache` (a
        C-contiguous CPU torch tensor or numpy array of float32, float16 or bfloat16, written
        in place) holds the layer as `layout` says, block_offsets (layout.block_offsets of the
        sequence's block ids) naming its blocks from token 0. Only tokens [from_token,
        to_token) are written (None: to the end), bit for bit what decode gives in the cache's
        dtype; every other element is left as it is. Returns the tokens written. Everything is
        checked before the first write (the run as untrusted, every offset inside the cache):
        a refused message writes nothing."""
        method = "decode_into"
        c, sinks = self._message_codec(msg, codec, method)
        enc = msg.encoded
        offsets = np.ascontiguousarray(np.asarray(block_offsets, dtype=np.int64).reshape(-1))
        try:
            return int(self._native.decode_into(
                msg.layer, c.native, msg.start, enc.blocks, np.asarray(enc.block_bytes, dtype=np.uint32),
                sinks[0], sinks[1], enc.basis_fingerprint, _rows_out(msg.keys, "keys", method),
                _rows_out(msg.values, "values", method), cache, layout.key_index, layout.value_index,
                offsets, int(layout.head_stride), int(layout.block_size), int(from_token),
                _NO_END if to_token is None or to_token <= 0 else int(to_token),
            ))
        except _codes.Error as e:
            raise _error(method, e) from None

    def _message_codec(self, msg: kvq_pb2.GetBlocksResponse, codec: Union[None, Codec, kvq_pb2.CodecSettings],
                       method: str) -> Tuple[Codec, List[bytes]]:
        """A message's codec (given, or the one it names) and its fp16 sinks' bytes, once it is
        checked to be of this model and version."""
        info = self._info
        if msg.model and msg.model != info.model or msg.basis_version and msg.basis_version != info.version:
            raise KvqError(method, grpc.StatusCode.FAILED_PRECONDITION,
                           f"the message is of model '{msg.model}' version {msg.basis_version}; these codes are "
                           f"model '{info.model}' version {info.version}'s")
        if codec is None:
            if not msg.HasField("codec"):
                raise KvqError.invalid(method, "codec: only a layer's first message names it; pass the layer's codec")
            codec = msg.codec
        c = codec if isinstance(codec, Codec) else self.codec(codec)
        sinks = []
        for field, t in (("sink_keys", msg.encoded.sink_keys), ("sink_values", msg.encoded.sink_values)):
            if t.data and t.dtype != kvq_pb2.DTYPE_F16:
                raise KvqError.invalid(method, f"encoded.{field}.dtype must be DTYPE_F16")
            sinks.append(t.data)
        return c, sinks

    def decode_encoded(self, enc: EncodedLayer, *, dtype: str = "f32") -> Tuple[Array, Array]:
        """What an encoder's append gives (its run of groups and the rows after them) decoded
        as attention sees it: keys and values [kv_heads, tokens - start, head_dim] in `dtype`,
        the groups decoded then the rows, bit for bit what GetBlocks would send for tokens
        [start, tokens) of a sequence appended the same way (in-process evaluation of a codec,
        kvq.hf.codec_choice)."""
        method = "decode"
        name = _DTYPE_NAMES[dtype_enum(dtype, "dtype", method)]
        sinks = [b"" if s is None else np.ascontiguousarray(s, dtype="<f2").tobytes()
                 for s in (enc.sink_keys, enc.sink_values)]
        rows = (enc.keys, enc.values) if enc.rows > 0 else (None, None)
        try:
            return self._native.decode(
                enc.layer, enc.codec.native, enc.start, enc.blocks, np.asarray(enc.block_bytes, dtype=np.uint32),
                sinks[0], sinks[1], enc.basis_fingerprint, rows[0], rows[1], name,
            )
        except _codes.Error as e:
            raise _error(method, e) from None

    def decode_stream(self, messages: Iterable[kvq_pb2.GetBlocksResponse], *, dtype: str = "f32") -> Iterator[Block]:
        """A GetBlocks stream in codes decoded message by message, as Blocks (what
        Client.get_blocks yields for the same request without codes, bit for bit); each
        layer's codec is taken from its first message."""
        codecs: Dict[int, Codec] = {}
        for msg in messages:
            if msg.HasField("codec"):
                codecs[msg.layer] = self.codec(msg.codec)
            codec = codecs.get(msg.layer)
            if codec is None:
                raise KvqError.invalid("decode", f"layer {msg.layer}: its first message (naming the codec) is missing")
            keys, values = self.decode(msg, codec, dtype=dtype)
            yield Block(msg.layer, msg.start, keys, values, msg.layer_tokens, msg.basis_version)
