"""CodecSettings' fields are proto3 `optional`: a 0 set explicitly travels and reaches the
sequence as 0, while the client's own CodecSettings (0: the model's default, -1: a real 0)
sends exactly the bytes it sent before presence."""

from __future__ import annotations

import numpy as np

import kvq
from kvq._proto.kvq.v1 import kvq_pb2
from kvq.client import _codec_pb

KV, D = 2, 64  # the tiny model of conftest.register_tiny


def test_the_dataclass_leaves_zeros_unset_as_before():
    assert _codec_pb(kvq.CodecSettings(), "codec", "PutBlocks").SerializeToString() == b""
    pb = _codec_pb(kvq.CodecSettings(rank=-1, window=64, rotate_keys=False), "codec", "PutBlocks")
    assert pb.HasField("rank") and pb.HasField("window") and pb.HasField("rotate_keys")
    assert not pb.HasField("sink_tokens") and not pb.HasField("key_bits")
    # Field 3 (rank) as varint -1, then rotate_keys -1 and window 64: what a client without
    # presence writes for the same settings.
    old_form = (b"\x18" + b"\xff" * 9 + b"\x01") + (b"\x50\x40") + (b"\x58" + b"\xff" * 9 + b"\x01")
    assert pb.SerializeToString() == old_form


def test_an_explicit_zero_rank_reaches_the_sequence(client, register_model):
    register_model(client)  # the model's default rank: 4
    k = np.random.default_rng(7).standard_normal((KV, 512, D)).astype(np.float16)

    def bytes_of(seq, codec):
        client.put_blocks([kvq.Append(seq, 0, 0, k, k, model="tiny", codec=codec)])
        return client.delete_sequence(seq)

    default = bytes_of("unset", kvq.CodecSettings())
    explicit_zero = bytes_of("zero", kvq_pb2.CodecSettings(rank=0))
    legacy_zero = bytes_of("legacy", kvq.CodecSettings(rank=-1))
    assert kvq_pb2.CodecSettings(rank=0).SerializeToString() == b"\x18\x00"
    # Rank 0 stores no side code: fewer bytes than the model's rank 4, the same as -1.
    assert explicit_zero == legacy_zero < default
    # The dataclass's 0 is still "the model's default".
    assert bytes_of("dataclass-zero", kvq.CodecSettings(rank=0)) == default
