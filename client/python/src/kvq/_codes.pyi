"""Types of kvq._codes, the native module (client/python/native/codes_module.cc): HeadQ codes
encoded and decoded by kvq's own codec. Written by hand from nanobind's stubgen output
(python -m nanobind.stubgen -m kvq._codes) with the arrays' dtypes spelled out;
tests/test_codes.py holds it to the module's names. Use kvq.codes, which wraps this module.
"""

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy
from numpy.typing import NDArray

class Error(Exception):
    """A failed codec call: args are (code, message), code the gRPC status code's number."""

BLOCK_VERSION_MIN: int
BLOCK_VERSION_MAX: int

def codec_fields() -> List[str]: ...

class Codec:
    def settings(self) -> Dict[str, Union[int, float, bool, str]]: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def key_group(self) -> int: ...
    @property
    def rank(self) -> int: ...
    @property
    def fp16_sinks(self) -> int: ...
    @property
    def window(self) -> int: ...

class EncodedRun:
    @property
    def first_group(self) -> int: ...
    @property
    def groups(self) -> int: ...
    @property
    def blocks(self) -> bytes: ...
    @property
    def block_bytes(self) -> NDArray[numpy.uint32]: ...
    @property
    def sink_keys(self) -> Optional[NDArray[numpy.float16]]: ...
    @property
    def sink_values(self) -> Optional[NDArray[numpy.float16]]: ...
    @property
    def basis_fingerprint(self) -> str: ...
    @property
    def keys(self) -> NDArray[Any]: ...
    @property
    def values(self) -> NDArray[Any]: ...
    @property
    def rows_dtype(self) -> str: ...
    @property
    def tokens(self) -> int: ...
    @property
    def encoded_tokens(self) -> int: ...

class LayerEncoder:
    def append(self, keys: NDArray[Any], values: NDArray[Any]) -> EncodedRun: ...
    @property
    def layer(self) -> int: ...
    @property
    def tokens(self) -> int: ...
    @property
    def encoded_tokens(self) -> int: ...

class Model:
    def __init__(
        self,
        model: str,
        version: int,
        layers: int,
        kv_heads: int,
        q_heads: int,
        head_dim: int,
        basis_rank: int,
        fingerprint: str,
        codec: Dict[str, Union[int, float, bool, str]],
        basis: Sequence[NDArray[numpy.float32]],
        encode_basis: Sequence[NDArray[numpy.float32]],
        query_moment: Sequence[NDArray[numpy.float32]],
    ) -> None: ...
    def default_codec(self) -> Codec: ...
    def codec(self, settings: Dict[str, Union[int, float, bool, str]]) -> Codec: ...
    def encoder(self, layer: int, codec: Codec) -> LayerEncoder: ...
    def decode(
        self,
        layer: int,
        codec: Codec,
        start: int,
        blocks: bytes,
        block_bytes: NDArray[numpy.uint32],
        sink_keys: bytes,
        sink_values: bytes,
        basis_fingerprint: str,
        keys: Optional[NDArray[Any]],
        values: Optional[NDArray[Any]],
        dtype: str,
        token_major: bool = False,
    ) -> Tuple[NDArray[Any], NDArray[Any]]: ...
    def decode_into(
        self,
        layer: int,
        codec: Codec,
        start: int,
        blocks: bytes,
        block_bytes: NDArray[numpy.uint32],
        sink_keys: bytes,
        sink_values: bytes,
        basis_fingerprint: str,
        keys: Optional[NDArray[Any]],
        values: Optional[NDArray[Any]],
        cache: Any,
        key_index: NDArray[numpy.int32],
        value_index: NDArray[numpy.int32],
        block_offsets: NDArray[numpy.int64],
        head_stride: int,
        block_size: int,
        from_token: int,
        to_token: int,
    ) -> int: ...
