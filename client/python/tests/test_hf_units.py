"""kvq.hf pieces that need no server or model: the decode-faithful prefill pieces, the GGUF
-> transformers channel map, the kvq-eval config names, basis file checks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import kvq  # noqa: E402
import kvq.hf  # noqa: E402
from kvq._proto.kvq.v1 import kvq_pb2  # noqa: E402
from kvq.hf.eval import parse_config  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
FIXTURE_BASIS = REPO / "tests/fixtures/frontend/basis-r4"


def cache_with(G: int, R: int, faithful: bool = True):
    info = kvq_pb2.ModelInfo(model="m", version=1, layers=2, kv_heads=1, q_heads=1, head_dim=8)
    info.codec.key_group = 32
    return kvq.hf.KvqCache(None, info, codec=kvq.CodecSettings(key_group=G, window=R), faithful=faithful)


def encoded(t: int, G: int, R: int) -> int:
    """The codec's encoded tokens after t one-token appends (a group goes once R + G wait)."""
    e = 0
    for n in range(1, t + 1):
        if n - e >= R + G:
            e += G
    return e


@pytest.mark.parametrize("G,R,start,m", [(32, 0, 0, 100), (32, 8, 0, 200), (64, 0, 96, 300),
                                         (32, 0, 31, 1), (128, 4096, 0, 3000)])
def test_pieces_never_straddle_an_encode(G, R, start, m):
    pieces = cache_with(G, R).chunks(start, m)
    assert pieces[0][0] == start and sum(n for _, n in pieces) == m
    for (p, n), (q, _) in zip(pieces, pieces[1:]):
        assert p + n == q
    for p, n in pieces:
        assert 1 <= n <= 1024
        # Query i of the piece sees the cache at count i + 1 after the whole piece is
        # appended; decoding it alone it would see count i + 1 with encoded(i + 1) groups.
        # The piece holds all its rows at once, so encoded(p + n) must equal encoded(i + 1)
        # for every i in [p, p + n): no encode inside the piece except by its first token.
        assert encoded(p + n, G, R) == encoded(p + 1, G, R), (p, n)


def test_pieces_match_the_cpp_boundaries():
    # ForwardDecodeFaithful with R = 0, G = 32: [0, 31), [31, 63), [63, 95), ...
    assert cache_with(32, 0).chunks(0, 100) == [(0, 31), (31, 32), (63, 32), (95, 5)]
    # After an attach of 96 tokens the next piece starts there and stops before 127.
    assert cache_with(32, 0).chunks(96, 40) == [(96, 31), (127, 9)]
    assert cache_with(32, 0, faithful=False).chunks(0, 100) == [(0, 100)]


def test_hf_channel_order_is_the_gguf_loader_inverse():
    d = 64
    perm = kvq.hf.hf_channel_order(d)
    assert sorted(perm) == list(range(d))
    # transformers' _reverse_permute_weights on row indices: reshape(dim/2, 2).swapaxes.
    rows = np.arange(d)
    hf_rows = rows.reshape(1, d // 2, 2).swapaxes(2, 1).reshape(d)
    assert list(perm) == list(hf_rows)
    with pytest.raises(kvq.hf.BasisOrderError, match="odd"):
        kvq.hf.hf_channel_order(7)


def test_parse_config_names():
    c = parse_config("headq-kv2")
    assert (c.key_bits, c.key_group, c.rank, c.side_bits, c.value_bits, c.value_group, c.window) == \
        (2, 32, 4, 8, 2, 32, 0)
    c = parse_config("headq-kv3-g128-s4-v2-r8-w64")
    assert (c.key_bits, c.key_group, c.side_bits, c.value_bits, c.rank, c.window) == (3, 128, 4, 2, 8, 64)
    assert parse_config("kivi-kv2").rank == 0
    with pytest.raises(ValueError, match="a2"):
        parse_config("headq-kv2-a2")


def test_read_basis_checks_the_fingerprint(tmp_path):
    files = kvq.hf.read_basis(str(FIXTURE_BASIS))
    assert len(files.u) == 30 and files.u[0].shape == (3, 64, 4)
    d = tmp_path / "b"
    shutil.copytree(FIXTURE_BASIS, d)
    raw = bytearray((d / "basis.safetensors").read_bytes())
    raw[-1] ^= 0x01
    (d / "basis.safetensors").write_bytes(bytes(raw))
    with pytest.raises(kvq.KvqError, match="fingerprint"):
        kvq.hf.read_basis(str(d))
    m = json.loads((FIXTURE_BASIS / "manifest.json").read_text())
    m["layers"] = 29
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(kvq.KvqError, match="the manifest implies"):
        kvq.hf.read_basis(str(d))


def test_shape_mismatch_with_the_model_is_refused():
    from transformers import LlamaConfig

    files = kvq.hf.read_basis(str(FIXTURE_BASIS))
    cfg = LlamaConfig(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                      hidden_size=576, head_dim=64)
    assert kvq.hf.to_model_order(files, cfg).manifest["channel_order"] == "hf"
    cfg.num_key_value_heads = 9
    with pytest.raises(kvq.hf.BasisOrderError, match="kv_heads = 3 but the model has kv_heads = 9"):
        kvq.hf.to_model_order(files, cfg)
    cfg = LlamaConfig(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                      hidden_size=576, head_dim=64)
    cfg.model_type = "gemma"
    with pytest.raises(kvq.hf.BasisOrderError, match="model_type 'gemma'"):
        kvq.hf.to_model_order(files, cfg)
