"""CodecSettings' fields have presence (proto3 optional), the only "unset": the dataclass sends
the fields that are not None, 0 and False included, and the server takes each as sent."""

from __future__ import annotations

import numpy as np
import pytest

import kvq
from kvq._proto.kvq.v1 import kvq_pb2
from kvq.client import _codec_pb

KV, D = 2, 64  # the tiny model of conftest.register_tiny


def test_none_is_unset_and_set_values_are_sent_as_they_are():
    assert _codec_pb(kvq.CodecSettings(), "codec", "PutBlocks").SerializeToString() == b""
    pb = _codec_pb(kvq.CodecSettings(rank=0, window=64, rotate_keys=False), "codec", "PutBlocks")
    assert pb.HasField("rank") and pb.HasField("window") and pb.HasField("rotate_keys")
    assert not pb.HasField("sink_tokens") and not pb.HasField("key_bits")
    # Field 3 (rank) 0, field 10 (window) 64, field 11 (rotate_keys) false.
    assert pb.SerializeToString() == b"\x18\x00" + b"\x50\x40" + b"\x58\x00"
    with pytest.raises(kvq.KvqError, match="rotate_keys"):
        _codec_pb(kvq.CodecSettings(rotate_keys=1), "codec", "PutBlocks")  # not a bool
    with pytest.raises(kvq.KvqError, match="value_policy"):
        _codec_pb(kvq.CodecSettings(value_policy="default"), "codec", "PutBlocks")


def test_an_explicit_zero_rank_reaches_the_sequence(client, register_model):
    register_model(client)  # the model's default rank: 4
    k = np.random.default_rng(7).standard_normal((KV, 512, D)).astype(np.float16)

    def bytes_of(seq, codec):
        client.put_blocks([kvq.Append(seq, 0, 0, k, k, model="tiny", codec=codec)])
        return client.delete_sequence(seq)

    default = bytes_of("unset", kvq.CodecSettings())
    zero = bytes_of("zero", kvq.CodecSettings(rank=0))
    assert bytes_of("pb-zero", kvq_pb2.CodecSettings(rank=0)) == zero
    # Rank 0 stores no side code: fewer bytes than the model's rank 4.
    assert zero < default
    # The older form of a real 0, -1, is out of range now, named by the server.
    with pytest.raises(kvq.KvqError, match="rank = -1"):
        client.put_blocks([kvq.Append("minus-one", 0, 0, k, k, model="tiny",
                                      codec=kvq.CodecSettings(rank=-1))])
