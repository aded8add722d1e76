"""kvq.tensors: arrays to kvq.v1.Tensor and back, without a server."""

from __future__ import annotations

import numpy as np
import pytest

import kvq
from kvq._proto.kvq.v1 import kvq_pb2
from kvq.tensors import bf16_to_f32, f32_to_bf16, from_tensor, to_tensor


def test_layouts_and_byte_orders_give_the_same_bytes():
    x = np.random.default_rng(0).standard_normal((3, 5, 4)).astype(np.float32)
    want = to_tensor(x, "x")
    assert (want.dtype, list(want.shape), len(want.data)) == (kvq_pb2.DTYPE_F32, [3, 5, 4], 240)
    nc = np.ascontiguousarray(x.transpose(0, 2, 1)).transpose(0, 2, 1)  # same values, strided
    assert not nc.flags.c_contiguous
    assert to_tensor(nc, "x") == want
    assert to_tensor(x.astype(">f4"), "x") == want  # big-endian input is converted
    np.testing.assert_array_equal(from_tensor(want), x)
    back = from_tensor(want)
    back[0, 0, 0] = 1.0  # writable, owned
    assert to_tensor(x.astype(np.float16), "x").dtype == kvq_pb2.DTYPE_F16


def test_bf16_round_trip_and_rounding():
    x = np.array([1.0, -2.5, 3.14159265, 1e-30, np.inf, -np.inf, 65504.0, 1 + 2 ** -8], np.float32)
    b = f32_to_bf16(x)
    assert b.dtype == np.uint16
    back = bf16_to_f32(b)
    assert back[0] == 1.0 and back[1] == -2.5 and np.isinf(back[4]) and back[5] < 0
    assert abs(back[2] - 3.140625) < 1e-7  # nearest bf16
    assert back[7] == 1.0  # ties go to even
    assert np.isnan(bf16_to_f32(f32_to_bf16(np.array([np.nan], np.float32))))[0]
    t = to_tensor(b, "k")
    assert t.dtype == kvq_pb2.DTYPE_BF16
    np.testing.assert_array_equal(from_tensor(t), b)
    np.testing.assert_array_equal(from_tensor(t, bf16="f32"), back)
    # dtype="bf16" converts float32 explicitly; f32-only fields widen bf16.
    assert to_tensor(x, "k", dtype="bf16") == t
    np.testing.assert_array_equal(from_tensor(to_tensor(b, "w", f32_only=True)), back)


def test_f32_only_fields_convert_other_floats():
    w = np.full((2, 1, 3), 0.25, np.float64)
    t = to_tensor(w, "weights", f32_only=True)
    assert t.dtype == kvq_pb2.DTYPE_F32
    np.testing.assert_array_equal(from_tensor(t), w.astype(np.float32))
    with pytest.raises(kvq.KvqError) as e:
        to_tensor(w, "items[0].queries")
    assert "items[0].queries: dtype float64" in e.value.details


def test_a_short_message_from_the_server_is_internal():
    t = kvq_pb2.Tensor(dtype=kvq_pb2.DTYPE_F32, shape=[2, 2], data=b"\0" * 12)
    with pytest.raises(kvq.KvqError) as e:
        from_tensor(t, field="outputs", method="Attend")
    assert e.value.code.name == "INTERNAL" and "12 bytes for shape [2, 2]" in e.value.details
