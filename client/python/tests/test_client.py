"""Round trips of every RPC through kvq.Client against a real kvq-server process."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

import kvq
from kvq.tensors import bf16_to_f32, f32_to_bf16

KV, QH, D = 2, 4, 64  # the tiny model of conftest.register_tiny (grouped-query: 2 per KV head)


def rand(shape, seed, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def put(client, seq, tokens, *, layer=0, start=0, seed=0, dtype=np.float16, model="tiny", **kw):
    k = rand((KV, tokens, D), seed, dtype)
    v = rand((KV, tokens, D), seed + 1000, dtype)
    client.put_blocks([kvq.Append(seq, layer, start, k, v, model=model, **kw)])
    return k, v


def decoded(client, seq, layer=0):
    ks, vs = [], []
    for b in client.get_blocks(seq, [layer]):
        ks.append(b.keys)
        vs.append(b.values)
    return np.concatenate(ks, axis=1), np.concatenate(vs, axis=1)


def attention(q, k, v, scale=None, causal_offset=None):
    """numpy reference: q [QH, nq, D], k/v [KV, T, D] -> [QH, nq, D] (float64)."""
    qh, nq, d = q.shape
    g = qh // k.shape[0]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    out = np.zeros((qh, nq, d))
    for h in range(qh):
        logits = scale * q[h].astype(np.float64) @ k[h // g].astype(np.float64).T  # [nq, T]
        if causal_offset is not None:
            t = np.arange(k.shape[1])
            logits = np.where(t[None, :] <= causal_offset + np.arange(nq)[:, None], logits, -np.inf)
        w = np.exp(logits - logits.max(axis=1, keepdims=True))
        w /= w.sum(axis=1, keepdims=True)
        out[h] = w @ v[h // g].astype(np.float64)
    return out


def test_register_list_get_model(client, register_model):
    m = register_model(client, rank=8)
    assert m.info.model == "tiny" and m.info.version == 1 and m.info.has_basis
    assert len(m.info.fingerprint) == 16
    again = client.register_basis(
        {"model": "tiny", "version": 1, "layers": 2, "kv_heads": KV, "q_heads": QH,
         "head_dim": D, "basis_rank": 8, "kind": "random", "codec": kvq.CodecSettings(rank=4)},
        m.basis)
    assert again.already_registered
    assert [(x.model, x.version) for x in client.list_models()] == [("tiny", 1)]
    got = client.get_model("tiny")
    assert (got.layers, got.kv_heads, got.q_heads, got.head_dim, got.basis_rank) == (2, KV, QH, D, 8)
    assert got.fingerprint == m.info.fingerprint and got.codec.rank == 4
    assert client.get_model("tiny", 1).version == 1


def test_register_oblique_basis_with_query_moments_and_lever_codec(client, kvq_server):
    """An oblique pair (decode B = U diag(s), encode A = U diag(1/s)) with query moments and
    the lever codec switches: the server keeps all three and says so; switches travel as
    tri-states (True/False accepted as on/off) and come back filled with 1/-1."""
    L, R = 2, 8
    rng = np.random.default_rng(3)
    s = np.array([0.5, 0.75, 1.0, 1.25] * 2, dtype=np.float32)
    u, a, m = [], [], []
    for _ in range(L):
        q = np.stack([np.linalg.qr(rng.standard_normal((D, R)))[0] for _ in range(KV)])
        u.append((q * s).astype(np.float32))
        a.append((q / s).astype(np.float32))
        x = rng.standard_normal((KV, D, 1))
        m.append((np.eye(D)[None] + x @ x.transpose(0, 2, 1)).astype(np.float32))
    info = {"model": "obl", "version": 1, "layers": L, "kv_heads": KV, "q_heads": QH,
            "head_dim": D, "basis_rank": R, "kind": "oblique_rrr",
            "codec": kvq.CodecSettings(rank=4, rotate_keys=True, metric_rounding=True)}
    r = client.register_basis(info, u, encode_basis=a, query_moment=m)
    assert r.model.oblique and r.model.has_query_moment
    assert (r.model.codec.rotate_keys, r.model.codec.rotate_values, r.model.codec.metric_rounding) == \
        (True, False, True)
    assert r.model.codec.HasField("rotate_values")  # responses set every field
    with pytest.raises(kvq.KvqError, match="rotate_values"):
        client.register_basis(dict(info, codec=kvq.CodecSettings(rotate_values=2)), u)
    # codec.json's values as they are; fp16 sinks travel and come back; a response's settings
    # sent back ask for exactly that codec.
    c = kvq.CodecSettings.from_codec_json({"rank": 0, "window": 0, "fp16_sinks": 4, "rotate_keys": False,
                                           "key_group": 128})
    assert (c.rank, c.window, c.fp16_sinks, c.rotate_keys, c.key_group) == (0, 0, 4, False, 128)
    with pytest.raises(ValueError, match="unknown field.*bogus"):
        kvq.CodecSettings.from_codec_json({"bogus": 1})
    r2 = client.register_basis(dict(info, model="obl-sinks", codec=c), u, encode_basis=a, query_moment=m)
    assert (r2.model.codec.fp16_sinks, r2.model.codec.rank, r2.model.codec.key_group) == (4, 0, 128)
    with pytest.raises(kvq.KvqError, match="fp16_sinks = 17: must be in"):
        client.register_basis(dict(info, model="obl-bad", codec=kvq.CodecSettings(fp16_sinks=17)), u)
    # Dense-and-sparse travels too, and its limits are the server's.
    sp = kvq.CodecSettings.from_codec_json({"sparse_keys": 5, "sparse_values": 0, "rotate_keys": False})
    assert (sp.sparse_keys, sp.sparse_values) == (5, 0)
    r3 = client.register_basis(dict(info, model="obl-sparse", codec=sp), u, encode_basis=a, query_moment=m)
    assert (r3.model.codec.sparse_keys, r3.model.codec.sparse_values) == (5, 0)
    with pytest.raises(kvq.KvqError, match="sparse_keys"):
        client.register_basis(dict(info, model="obl-sparse-bad", codec=kvq.CodecSettings(sparse_keys=101)), u)
    # A^T B != I is refused by the server, naming the layer and head.
    bad = [x.copy() for x in a]
    bad[1][0, :, 2] *= 2
    with pytest.raises(kvq.KvqError, match="layer 1 head 0: encode column 2"):
        client.register_basis(dict(info, model="obl2"), u, encode_basis=bad, query_moment=m)
    # kvq.hf reads the entry the server wrote (C++ WriteBasis): the fingerprint chained over U,
    # A and the moments matches, and a GGUF-order entry maps A's rows and M's rows and columns.
    pytest.importorskip("transformers")
    from transformers import LlamaConfig

    from kvq.hf.basis import hf_channel_order, read_basis, to_model_order

    files = read_basis(str(kvq_server.registry / "obl" / "v1"))
    assert files.manifest["fingerprint"] == r.model.fingerprint
    for l in range(L):
        np.testing.assert_array_equal(files.encode[l], a[l])
        np.testing.assert_array_equal(files.query_moment[l], m[l])
    cfg = LlamaConfig(num_hidden_layers=L, num_attention_heads=QH, num_key_value_heads=KV,
                      hidden_size=QH * D, head_dim=D)
    mapped = to_model_order(files, cfg)
    perm = hf_channel_order(D)
    np.testing.assert_array_equal(mapped.encode[1], a[1][:, perm, :])
    np.testing.assert_array_equal(mapped.query_moment[1], m[1][:, perm][:, :, perm])


def test_put_blocks_counts_and_lengths(client, register_model):
    register_model(client)
    k = rand((KV, 100, D), 1, np.float16)
    appends = [kvq.Append("s", layer, 0, k, k, model="tiny") for layer in (0, 1)]
    r = client.put_blocks(appends)
    assert (r.messages, r.appends, r.tokens_written, r.tokens_duplicate) == (1, 2, 200, 0)
    assert sorted((l.sequence_id, l.layer, l.tokens) for l in r.lengths) == [("s", 0, 100), ("s", 1, 100)]
    # Re-sending the same range is a duplicate; explicit message boundaries are kept.
    r = client.put_blocks(messages=[[appends[0]], [appends[1]]])
    assert (r.messages, r.appends, r.tokens_written, r.tokens_duplicate) == (2, 2, 0, 200)


def test_attend_matches_numpy_attention_on_decoded_kv(client, register_model):
    register_model(client)
    k, v = put(client, "a", 300, seed=3)
    dk, dv = decoded(client, "a")
    assert dk.shape == (KV, 300, D) and dk.dtype == np.float32
    q = rand((QH, 3, D), 7)
    res = client.attend([kvq.AttendItem("a", 0, q, causal_offset=250)])
    assert res[0].ok and res[0].tokens == 300
    out = res[0].outputs
    assert out.shape == (QH, 3, D) and out.dtype == np.float32
    want = attention(q, dk, dv, causal_offset=250)
    err = np.abs(out - want).max()
    assert err < 2e-3, err
    # The tolerance is tight: attention on the K/V as sent (before the codec) is far off it.
    raw_err = np.abs(out - attention(q, k, v, causal_offset=250)).max()
    assert raw_err > 20 * 2e-3, raw_err
    # One query as [q_heads, head_dim], every cached token, an explicit scale.
    res = client.attend([kvq.AttendItem("a", 0, q[:, 0, :], scale=0.05)])
    np.testing.assert_allclose(res[0].outputs[:, 0], attention(q[:, :1], dk, dv, scale=0.05)[:, 0],
                               atol=2e-3)


def test_score_is_q_dot_decoded_keys(client, register_model):
    register_model(client)
    put(client, "s", 130, seed=5)
    dk, _ = decoded(client, "s")
    q = rand((QH, 2, D), 9)
    res = client.score([kvq.ScoreItem("s", 0, q)])
    logits = res[0].outputs
    assert logits.shape == (QH, 2, 130) and res[0].tokens == 130
    want = np.stack([q[h] @ dk[h // 2].T for h in range(QH)]) / np.sqrt(D)
    np.testing.assert_allclose(logits, want, atol=1e-3)


def test_readout_is_weights_times_decoded_values(client, register_model):
    register_model(client)
    put(client, "r", 70, seed=11)
    _, dv = decoded(client, "r")
    w = np.random.default_rng(2).random((QH, 1, 70)).astype(np.float32)
    w /= w.sum(axis=2, keepdims=True)
    res = client.readout([kvq.ReadoutItem("r", 0, w)])
    want = np.stack([w[h] @ dv[h // 2] for h in range(QH)])
    np.testing.assert_allclose(res[0].outputs, want, atol=1e-3)
    # Logits softmaxed server-side give the same as softmaxed weights.
    logits = rand((QH, 1, 70), 4)
    sm = np.exp(logits - logits.max(axis=2, keepdims=True))
    sm /= sm.sum(axis=2, keepdims=True)
    a = client.readout([kvq.ReadoutItem("r", 0, logits, weights_are_logits=True),
                        kvq.ReadoutItem("r", 0, sm.astype(np.float32))])
    np.testing.assert_allclose(a[0].outputs, a[1].outputs, atol=1e-4)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_window_keeps_arrival_values_in_every_dtype(client, register_model, dtype):
    """With a window over every token the server keeps what arrived: GetBlocks in the
    arrival dtype gives the exact bytes back, and attend equals attention on them."""
    register_model(client)
    x = rand((KV, 40, D), 21)
    if dtype == "f32":
        k = x
    elif dtype == "f16":
        k = x.astype(np.float16)
    else:
        k = f32_to_bf16(x)
    client.put_blocks([kvq.Append("w", 0, 0, k, k, model="tiny", codec=kvq.CodecSettings(window=64))])
    blocks = list(client.get_blocks("w", [0], dtype=dtype))
    assert len(blocks) == 1 and blocks[0].start == 0 and blocks[0].layer_tokens == 40
    want_dtype = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}[dtype]
    assert blocks[0].keys.dtype == want_dtype
    np.testing.assert_array_equal(blocks[0].keys, k)
    np.testing.assert_array_equal(blocks[0].values, k)
    exact = k.astype(np.float32) if dtype != "bf16" else bf16_to_f32(k)
    as_f32 = list(client.get_blocks("w", dtype=dtype, bf16="f32"))[0].keys
    np.testing.assert_array_equal(as_f32, exact)
    q = rand((QH, 1, D), 5)
    out = client.attend([kvq.AttendItem("w", 0, q, output_dtype="f32")])[0].outputs
    np.testing.assert_allclose(out, attention(q, exact, exact), atol=1e-4)


def test_output_dtypes_and_query_dtypes(client, register_model):
    register_model(client)
    put(client, "o", 64, seed=1)
    q = rand((QH, 1, D), 3)
    ref = client.attend([kvq.AttendItem("o", 0, q)])[0].outputs
    r16, rbf = client.attend([kvq.AttendItem("o", 0, q, output_dtype="f16"),
                              kvq.AttendItem("o", 0, q, output_dtype="bf16")])
    assert r16.outputs.dtype == np.float16 and rbf.outputs.dtype == np.uint16
    np.testing.assert_allclose(r16.outputs.astype(np.float32), ref, atol=2e-3)
    np.testing.assert_allclose(bf16_to_f32(rbf.outputs), ref, atol=1.6e-2)
    # f16 and bf16 queries (rounded queries: close to the f32 answer, not equal).
    for qq in (q.astype(np.float16), f32_to_bf16(q)):
        out = client.attend([kvq.AttendItem("o", 0, qq)])[0].outputs
        np.testing.assert_allclose(out, ref, atol=3e-2)
    ro = client.readout([kvq.ReadoutItem("o", 0, np.full((QH, 1, 64), 1 / 64, np.float32),
                                         output_dtype="f16")])[0].outputs
    assert ro.dtype == np.float16 and ro.shape == (QH, 1, D)


def test_attend_with_append_is_one_decode_step(client, register_model):
    register_model(client)
    put(client, "d", 32, seed=2)
    k1 = rand((KV, 1, D), 50, np.float16)
    q = rand((QH, 1, D), 51)
    res = client.attend([kvq.AttendItem("d", 0, q, append=kvq.Append("d", 0, 32, k1, k1))])
    assert res[0].tokens == 33
    dk, dv = decoded(client, "d")
    assert dk.shape[1] == 33
    np.testing.assert_allclose(res[0].outputs, attention(q, dk, dv), atol=2e-3)
    # Score with an append too.
    s = client.score([kvq.ScoreItem("d", 0, q, append=kvq.Append("d", 0, 33, k1, k1))])
    assert s[0].outputs.shape == (QH, 1, 34)


def test_get_blocks_chunks_ranges_and_layers(client, register_model):
    register_model(client)
    put(client, "g", 100, layer=0, seed=1)
    put(client, "g", 60, layer=1, seed=2, model="")
    chunks = list(client.get_blocks("g", max_tokens_per_message=40))
    assert [(b.layer, b.start, b.keys.shape[1], b.layer_tokens) for b in chunks] == [
        (0, 0, 40, 100), (0, 40, 40, 100), (0, 80, 20, 100), (1, 0, 40, 60), (1, 40, 20, 60)]
    assert all(b.basis_version == 1 for b in chunks)
    part = list(client.get_blocks("g", [0], from_token=10, to_token=30))
    full = np.concatenate([b.keys for b in chunks[:3]], axis=1)
    assert len(part) == 1 and part[0].start == 10
    np.testing.assert_array_equal(part[0].keys, full[:, 10:30])
    # Stopping early cancels the stream; the client stays usable.
    it = client.get_blocks("g", max_tokens_per_message=10)
    next(it)
    it.close()
    assert client.echo(b"still fine") == b"still fine"


def test_attach_by_token_ids_takes_the_prefix(client, register_model):
    register_model(client)
    k = rand((KV, 64, D), 8, np.float16)
    ids = list(range(1000, 1064))
    client.put_blocks([kvq.Append("p1", 0, 0, k, k, token_ids=ids, model="tiny",
                                  codec=kvq.CodecSettings(key_group=32))])
    r = client.put_blocks([kvq.Append("p2", 0, 0, token_ids=ids, model="tiny",
                                      codec=kvq.CodecSettings(key_group=32))])
    assert r.tokens_shared == 64 and r.tokens_written == 0
    assert [(l.sequence_id, l.tokens) for l in r.lengths] == [("p2", 64)]
    np.testing.assert_array_equal(decoded(client, "p2")[0], decoded(client, "p1")[0])
    assert client.stats().shared_tokens == 64


def test_match_prefix_counts_what_an_attach_would_take_without_changing_anything(client, register_model):
    register_model(client)
    k = rand((KV, 100, D), 9, np.float16)
    ids = list(range(2000, 2100))
    g32 = kvq.CodecSettings(key_group=32)
    client.put_blocks([kvq.Append("{p}.1", layer, 0, k, k, token_ids=ids, model="tiny", codec=g32)
                       for layer in range(2)])
    before = client.stats()
    got = client.match_prefix(ids, sequence_ids=["{p}.1", "{p}.absent"], model="tiny", codec=g32)
    assert got == kvq.PrefixMatch(96, [100, 0])  # three whole groups; the last 4 tokens never attach
    after = client.stats()
    assert (after.sequences, after.stored_bytes, after.shared_tokens) == \
        (before.sequences, before.stored_bytes, before.shared_tokens)
    # A prompt sharing the first group only; the model's default codec (other groups) matches none.
    assert client.match_prefix(ids[:40] + [1] * 60, model="tiny", codec=g32).indexed_tokens == 32
    assert client.match_prefix(ids, model="tiny").indexed_tokens == 0
    with pytest.raises(kvq.KvqError) as e:
        client.match_prefix(ids, model="nope")
    assert e.value.code == grpc.StatusCode.NOT_FOUND and e.value.method == "MatchPrefix"


def test_match_prefix_refuses_names_of_two_shards_before_sending():
    with kvq.Client("127.0.0.1:1,127.0.0.1:2") as c:
        apart = next(f"q{i}" for i in range(1000) if c.shard_of(f"q{i}") != c.shard_of("a"))
        with pytest.raises(kvq.KvqError) as e:
            c.match_prefix(sequence_ids=["a", apart])
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "sequence_ids[1]" in str(e.value)


def test_delete_and_stats(client, register_model):
    register_model(client)
    put(client, "x", 50)
    put(client, "y", 50)
    st = client.stats()
    assert st.tenant == "default" and st.sequences == 2 and st.tokens == 100
    assert st.stored_bytes > 0 and st.memory_pool == "host"
    freed = client.delete_sequence("x")
    assert freed > 0
    assert client.stats().sequences == 1
    with pytest.raises(kvq.KvqError) as e:
        client.delete_sequence("x")
    assert e.value.code == grpc.StatusCode.NOT_FOUND and e.value.method == "DeleteSequence"


def test_tenants_are_separate_namespaces(kvq_server, register_model):
    with kvq.Client(kvq_server.address, tenant="alice") as a, \
            kvq.Client(kvq_server.address, tenant="bob") as b:
        register_model(a)
        put(a, "shared-name", 10)
        assert a.stats().tenant == "alice" and a.stats().sequences == 1
        assert b.stats().tenant == "bob" and b.stats().sequences == 0
        res = b.attend([kvq.AttendItem("shared-name", 0, rand((QH, 1, D), 1))], check=False)
        assert res[0].code == grpc.StatusCode.NOT_FOUND


def test_echo_beyond_grpc_default_message_limit(client):
    payload = np.random.default_rng(0).bytes(9 << 20)  # gRPC's default limit is 4 MiB
    assert client.echo(payload) == payload
    assert client.echo(b"") == b""


def test_item_errors_with_and_without_check(client, register_model):
    register_model(client)
    put(client, "ok", 16)
    q = rand((QH, 1, D), 1)
    items = [kvq.AttendItem("ok", 0, q), kvq.AttendItem("missing", 0, q), kvq.AttendItem("ok", 5, q)]
    res = client.attend(items, check=False)
    assert [r.code for r in res] == [grpc.StatusCode.OK, grpc.StatusCode.NOT_FOUND,
                                     grpc.StatusCode.INVALID_ARGUMENT]
    assert res[0].ok and res[0].outputs is not None and res[1].outputs is None
    assert "layer" in res[2].message
    with pytest.raises(kvq.KvqError) as e:
        res[1].raise_for_status()
    with pytest.raises(kvq.KvqError) as e:
        client.attend(items)
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    assert str(e.value).startswith("Attend: NOT_FOUND: items[1]: ")
    s = client.score([kvq.ScoreItem("missing", 0, q)], check=False)
    assert s[0].code == grpc.StatusCode.NOT_FOUND


def test_health_reports_serving(client, kvq_server):
    assert client.health() == [(kvq_server.address, True)]


def test_torch_tensors_in(client, register_model):
    torch = pytest.importorskip("torch", reason="torch is installed by requirements-test.txt "
                                "(test_requirements_list_torch makes its absence a failure)")
    register_model(client)
    k32 = rand((KV, 20, D), 4)
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        seq = f"t-{dt}".replace("torch.", "")
        kt = torch.from_numpy(k32).to(dt)
        client.put_blocks([kvq.Append(seq, 0, 0, kt, kt, model="tiny",
                                      codec=kvq.CodecSettings(window=64))])
        want = kt.float().numpy()
        got = list(client.get_blocks(seq, dtype="f32"))[0].keys
        np.testing.assert_array_equal(got, want)
        q = torch.from_numpy(rand((QH, 1, D), 6)).to(dt)
        out = client.attend([kvq.AttendItem(seq, 0, q)])[0].outputs
        np.testing.assert_allclose(out, attention(q.float().numpy(), want, want), atol=1e-4)
    # A tensor that needs grad and is not contiguous is taken as its values.
    kt = torch.from_numpy(rand((KV, D, 8), 9)).requires_grad_(True).transpose(1, 2)
    client.put_blocks([kvq.Append("t-nc", 0, 0, kt, kt, model="tiny",
                                  codec=kvq.CodecSettings(window=64))])
    np.testing.assert_array_equal(list(client.get_blocks("t-nc"))[0].keys,
                                  kt.detach().contiguous().numpy())


def test_requirements_list_torch():
    """CI must run test_torch_tensors_in: torch is pinned in requirements-test.txt and imports."""
    from pathlib import Path
    req = (Path(__file__).resolve().parents[1] / "requirements-test.txt").read_text()
    names = [l.split("==")[0].strip().lower() for l in req.splitlines()
             if l.strip() and not l.lstrip().startswith("#")]
    assert "torch" in names, "requirements-test.txt must pin torch"
    import torch  # noqa: F401
