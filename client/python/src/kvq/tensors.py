"""numpy / torch arrays <-> kvq.v1.Tensor.

In: numpy float16 or float32 arrays, numpy uint16 arrays (taken as bfloat16 bit patterns),
and torch tensors of float16, bfloat16 or float32 on any device (moved to the CPU; torch is
imported only when a torch tensor is passed). F32-only fields (readout weights, A^2 probe
weights, a basis) also take other float dtypes, converted to float32.
Out: numpy arrays, float32 for DTYPE_F32, float16 for DTYPE_F16, and for DTYPE_BF16 either
the uint16 bit patterns (the default: no precision is invented) or float32 (bf16="f32").
Bytes are little-endian and dense, as the proto requires.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Dict, Optional, Sequence, Tuple

import grpc
import numpy as np
import numpy.typing as npt

from ._proto.kvq.v1 import kvq_pb2
from .errors import KvqError

__all__ = [
    "Array",
    "DTYPES",
    "dtype_enum",
    "to_tensor",
    "from_tensor",
    "f32_to_bf16",
    "bf16_to_f32",
    "is_torch",
]

# A numpy array of any dtype and shape.
Array = npt.NDArray[Any]

_LITTLE = sys.byteorder == "little"
# Little-endian numpy dtypes sent without conversion.
_FAST = {"<f4": kvq_pb2.DTYPE_F32, "<f2": kvq_pb2.DTYPE_F16, "<u2": kvq_pb2.DTYPE_BF16}

# Names accepted for output / transfer dtypes.
DTYPES: Dict[str, kvq_pb2.DType] = {"f32": kvq_pb2.DTYPE_F32, "f16": kvq_pb2.DTYPE_F16, "bf16": kvq_pb2.DTYPE_BF16}
_ALIASES = {
    "float32": "f32", "fp32": "f32", "f32": "f32",
    "float16": "f16", "fp16": "f16", "half": "f16", "f16": "f16",
    "bfloat16": "bf16", "bf16": "bf16",
}


def dtype_enum(name: str, field: str, method: str = "") -> kvq_pb2.DType:
    """kvq_pb2.DType for "f32" / "f16" / "bf16" (and the usual aliases)."""
    enum = DTYPES.get(name) if isinstance(name, str) else None
    if enum is not None:
        return enum
    key = _ALIASES.get(str(name).lower())
    if key is None:
        raise KvqError.invalid(method, f"{field}: dtype '{name}' is not one of f32, f16, bf16")
    return DTYPES[key]


def is_torch(x: Any) -> bool:
    """True for a torch.Tensor, without importing torch."""
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def f32_to_bf16(x: Array) -> Array:
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest even; NaN stays NaN."""
    u = np.ascontiguousarray(x, dtype="<f4").view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    out = rounded.astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    return out


def bf16_to_f32(bits: Array) -> Array:
    """bfloat16 bit patterns (uint16) -> float32 (exact)."""
    return (np.ascontiguousarray(bits, dtype="<u2").astype(np.uint32) << np.uint32(16)).view(
        np.float32
    )


def _torch_to_numpy(x: Any, field: str, method: str) -> Tuple[Array, kvq_pb2.DType]:
    import torch  # only reached for torch tensors

    t = x.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dtype == torch.float32:
        return t.numpy(), kvq_pb2.DTYPE_F32
    if t.dtype == torch.float16:
        return t.numpy(), kvq_pb2.DTYPE_F16
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16), kvq_pb2.DTYPE_BF16
    raise KvqError.invalid(
        method, f"{field}: torch dtype {t.dtype} is not float32, float16 or bfloat16"
    )


def to_tensor(
    x: Any,
    field: str,
    method: str = "",
    *,
    ndims: Sequence[int] = (),
    f32_only: bool = False,
    dtype: Optional[str] = None,
    out: Optional[kvq_pb2.Tensor] = None,
) -> kvq_pb2.Tensor:
    """Builds a kvq.v1.Tensor from a numpy array or torch tensor.

    field names the argument in errors ("items[3].queries"); ndims: allowed ranks (empty:
    any); f32_only: convert any float input to float32 (fields the proto types as F32);
    dtype="bf16" marks a uint16 array as bfloat16 explicitly (uint16 is taken as bfloat16
    anyway: it has no other meaning here). out: fill this message (a field of a request
    being built) instead of a new one, saving a copy of the data.
    """
    # The common case first: a dense little-endian array sent as it is (one copy, tobytes).
    if type(x) is np.ndarray and dtype is None and x.flags.c_contiguous and x.size:
        enum = _FAST.get(x.dtype.str)
        if enum is not None and (not f32_only or enum == kvq_pb2.DTYPE_F32) and (
            not ndims or x.ndim in ndims
        ):
            if out is None:
                return kvq_pb2.Tensor(dtype=enum, shape=x.shape, data=x.tobytes())
            out.dtype = enum
            out.shape[:] = x.shape
            out.data = x.tobytes()
            return out
    if x is None:
        raise KvqError.invalid(method, f"{field}: missing")
    if is_torch(x):
        arr, enum = _torch_to_numpy(x, field, method)
    else:
        if not isinstance(x, np.ndarray):
            raise KvqError.invalid(
                method, f"{field}: expected a numpy array or torch tensor, got {type(x).__name__}"
            )
        arr = x
        kind = (arr.dtype.kind, arr.dtype.itemsize)  # any byte order
        if kind == ("f", 4):
            enum = kvq_pb2.DTYPE_F32
        elif kind == ("f", 2):
            enum = kvq_pb2.DTYPE_F16
        elif kind == ("u", 2):
            enum = kvq_pb2.DTYPE_BF16
        elif f32_only and np.issubdtype(arr.dtype, np.floating):
            enum = kvq_pb2.DTYPE_F32
        else:
            raise KvqError.invalid(
                method,
                f"{field}: dtype {arr.dtype} is not float32, float16 or bfloat16 "
                "(a uint16 array of bfloat16 bits)",
            )
    if dtype is not None and dtype_enum(dtype, field, method) != enum:
        want = dtype_enum(dtype, field, method)
        if want == kvq_pb2.DTYPE_BF16 and enum == kvq_pb2.DTYPE_F32:
            arr, enum = f32_to_bf16(arr), kvq_pb2.DTYPE_BF16
        elif want == kvq_pb2.DTYPE_F16 and enum == kvq_pb2.DTYPE_F32:
            arr, enum = arr.astype(np.float16), kvq_pb2.DTYPE_F16
        elif want == kvq_pb2.DTYPE_F32:
            arr = bf16_to_f32(arr) if enum == kvq_pb2.DTYPE_BF16 else arr.astype(np.float32)
            enum = kvq_pb2.DTYPE_F32
        else:
            raise KvqError.invalid(method, f"{field}: cannot send {arr.dtype} as {dtype}")
    if f32_only and enum != kvq_pb2.DTYPE_F32:
        arr = bf16_to_f32(arr) if enum == kvq_pb2.DTYPE_BF16 else arr.astype(np.float32)
        enum = kvq_pb2.DTYPE_F32
    if ndims and arr.ndim not in ndims:
        allowed = " or ".join(str(n) for n in ndims)
        raise KvqError.invalid(
            method, f"{field}: shape {list(arr.shape)} has {arr.ndim} dimensions, expected {allowed}"
        )
    if arr.size == 0:
        raise KvqError.invalid(method, f"{field}: shape {list(arr.shape)} is empty")
    le = {kvq_pb2.DTYPE_F32: "<f4", kvq_pb2.DTYPE_F16: "<f2", kvq_pb2.DTYPE_BF16: "<u2"}[enum]
    arr = np.ascontiguousarray(arr, dtype=le)
    if out is None:
        return kvq_pb2.Tensor(dtype=enum, shape=arr.shape, data=arr.tobytes())
    out.dtype = enum
    out.shape[:] = arr.shape
    out.data = arr.tobytes()
    return out


_NP: Dict[int, np.dtype[Any]] = {kvq_pb2.DTYPE_F32: np.dtype("<f4"), kvq_pb2.DTYPE_F16: np.dtype("<f2"),
       kvq_pb2.DTYPE_BF16: np.dtype("<u2")}


def from_tensor(t: kvq_pb2.Tensor, *, bf16: str = "uint16", field: str = "", method: str = "") -> Array:
    """A kvq.v1.Tensor as a (writable) numpy array in native byte order.

    bf16="uint16" returns bfloat16 tensors as their bit patterns; bf16="f32" widens them.
    """
    dt = _NP.get(t.dtype)
    if dt is None:
        raise KvqError(method, grpc.StatusCode.INTERNAL, f"{field}: server sent dtype {t.dtype}")
    shape = tuple(t.shape)
    data = t.data  # one read: each access copies the bytes out of the message
    if (math.prod(shape) if shape else 0) * dt.itemsize != len(data):
        raise KvqError(
            method,
            grpc.StatusCode.INTERNAL,
            f"{field}: server sent {len(data)} bytes for shape {list(shape)}",
        )
    arr = np.frombuffer(data, dtype=dt).reshape(shape)
    # Writable (frombuffer over bytes is read-only) and in native byte order.
    arr = arr.copy() if _LITTLE else arr.astype(dt.newbyteorder("="))
    if t.dtype == kvq_pb2.DTYPE_BF16 and bf16 == "f32":
        arr = bf16_to_f32(arr).reshape(shape)
    return arr
